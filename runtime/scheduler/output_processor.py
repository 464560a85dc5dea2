"""Output processing: apply a sampled token to its request (logprobs, stop tokens, stop strings, length),
collect input logprobs, and emit `TokenOut`s.

Stop strings are detected incrementally: each new token detokenises only the tail of the output that could
hold a stop string ending in it (one token per UTF-8 byte of the longest stop string, plus one so that the
first token's leading-space handling cannot hide a match), never the whole output again; stop regexes likewise
read the tail that can hold their longest match (`runtime.stop_regex`; all of it for an unbounded pattern).
The tail is decoded as the request's text is (`skip_special_tokens`), so the match's place, counted from the
end, is its place in that text: the finishing TokenOut carries it (`stop_from_end`) and the tokenizer side cuts
there. A match must end in a checked token: one the output completed below min_new_tokens never stops it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from runtime.errors import InvalidRequest
from runtime.messages import TokenOut
from runtime.scheduler.request import Req
from runtime.stop_regex import first_match, window_tokens

# Tokens a request that is read only whole (`GenerateReq.stream` False) gathers before they are sent, after its
# first (SGLang's DEFAULT_FORCE_STREAM_INTERVAL): a TokenOut per token cost the scheduler and the tokenizer process
# CPU on the cores the worker computes on (k3-small on 2 cores: 1.05-1.16x the output tok/s at batch 1, 8 and 32,
# `bench/whole_results.py`). The first token still goes at once, as a stream's does: the HTTP server's
# time-to-first-token metric reads it.
NON_STREAM_INTERVAL = 50


class OutputProcessor:
    def __init__(self, stop_ids: frozenset[int], detokenize: Callable[[list[int], bool], str]) -> None:
        self.stop_ids = stop_ids
        self.detokenize = detokenize
        self.outbox: list[TokenOut] = []

    def stop_tokens(self, req: Req) -> set[int]:
        return set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(self.stop_ids))

    def banned_at(self, req: Req, index: int) -> list[int]:
        """Token ids that output `index` of `req` may not take: its stops while below min_new_tokens."""
        return sorted(self.stop_tokens(req)) if index < req.params.min_new_tokens else []

    def on_token(self, req: Req, tok: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> str | None:
        """Append a sampled token; return the finish reason if the request is done."""
        p = req.params
        if p.max_new_tokens == 0:
            return "length"
        req.output_ids.append(tok)
        if req.return_logprob:
            req.new_token_logprobs.append(logprob)
            req.new_top_logprobs.append(list(zip(top_ids, top_lps, strict=True))[: req.top_logprobs_num])
        n_out = len(req.output_ids)
        if tok in self.stop_tokens(req):  # masked while below min_new_tokens (see banned_at)
            req.matched_stop = tok
            return "stop"
        if n_out >= p.min_new_tokens and p.stop and (hit := self._stop_string(req)) is not None:
            req.matched_stop, req.stop_from_end = hit
            return "stop"
        if n_out >= p.min_new_tokens and p.stop_regex and (hit := self._stop_regex(req)) is not None:
            req.matched_stop, req.stop_from_end = hit  # the pattern, as SGLang reports it
            return "stop"
        if n_out >= p.max_new_tokens:
            return "length"
        return None

    def _stop_string(self, req: Req) -> tuple[str, int] | None:
        """The stop string that occurs first in the output's tail and ends in checked text, if any, and the
        characters from its start to the end of the text."""
        stops = req.params.stop
        text, fresh = self._tail(req, max(len(s.encode()) for s in stops) + 1)
        # An occurrence starting at fresh - len(s) + 1 or later ends past `fresh`, in checked text.
        hits = [(i, s) for s in stops if (i := text.find(s, max(0, fresh - len(s) + 1))) >= 0]
        if not hits:
            return None
        start, stop = min(hits)
        return stop, len(text) - start

    def _stop_regex(self, req: Req) -> tuple[str, int] | None:
        """The stop regex whose match starts first in the output's tail and ends in checked text, if any, and
        the characters from the match's start to the end of the text."""
        text, fresh = self._tail(req, window_tokens(req.params.stop_regex))
        hit = first_match(text, req.params.stop_regex, ends_past=fresh)
        return None if hit is None else (hit[1], len(text) - hit[0])

    def _tail(self, req: Req, window: int | None) -> tuple[str, int]:
        """The text of the output's last `window` tokens (None: all of them), and where in it the text of
        checked tokens begins: the tokens below min_new_tokens - 1 were never checked, and a stop they complete
        must not match. (A match ending in an older checked token would have stopped the output there.)"""
        ids = req.output_ids[-window:] if window else req.output_ids
        skip = req.params.skip_special_tokens
        text = self.detokenize(ids, skip)
        unchecked = req.params.min_new_tokens - 1 - (len(req.output_ids) - len(ids))  # in the window
        if unchecked <= 0:
            return text, 0
        return text, len(os.path.commonprefix([self.detokenize(ids[:unchecked], skip), text]))

    def collect_input_logprobs(self, req: Req, first_none: bool, positions: list[int], values: list[float],
                               top_ids: list[list[int]], top_lps: list[list[float]]) -> None:
        """The input logprobs of `positions` (and of position 0 when `first_none`) and, parallel to them, each
        position's top `req.top_logprobs_num` (the step computed the widest any request of it asked for)."""
        if first_none:
            req.input_logprobs.append(None)  # the first token has no context
            req.input_top_logprobs.append(None)
            req.input_logprob_next = 1
        for pos, v, ids, lps in zip(positions, values, top_ids, top_lps, strict=True):
            req.input_logprobs.append(v)
            req.input_top_logprobs.append(list(zip(ids, lps, strict=True))[: req.top_logprobs_num])
            req.input_logprob_next = pos + 1

    def finish(self, req: Req, reason: str, error: str | None = None) -> None:
        req.finished = reason
        self.emit(req, error)

    def refuse(self, req: Req, e: InvalidRequest) -> None:
        """Finish a request whose input the scheduler found invalid (its grammar): an HTTP 400."""
        req.finished = "error"
        self.emit(req, e.message)
        self.outbox[-1].invalid, self.outbox[-1].error_param = True, e.param

    def emit(self, req: Req, error: str | None = None) -> None:
        new = req.output_ids[req.sent_tokens :]
        # Tokens may be held past the first chunk (the time to first token) until the last: the tokenizer side
        # cuts a stop at the place the last TokenOut names, whatever the chunk holds before it.
        holdable = req.finished is None and req.sent_tokens
        if holdable and not req.stream and len(new) < NON_STREAM_INTERVAL:
            return  # read whole: its tokens go in chunks of NON_STREAM_INTERVAL
        if not new and req.finished is None and not req.input_logprobs:
            return
        if holdable and len(new) < req.params.stream_interval:
            return  # the request's stream_interval
        out = TokenOut(req.rid, new, finished=req.finished, matched_stop=req.matched_stop,
                       stop_from_end=req.stop_from_end, prompt_tokens=len(req.prompt_ids),
                       cached_tokens=req.cached_tokens, error=error)
        if req.return_logprob:
            out.logprobs, out.top_logprobs = req.new_token_logprobs, req.new_top_logprobs
            out.input_logprobs, req.input_logprobs = req.input_logprobs, []
            out.input_top_logprobs, req.input_top_logprobs = req.input_top_logprobs, []
            req.new_token_logprobs, req.new_top_logprobs = [], []
        req.sent_tokens = len(req.output_ids)
        self.outbox.append(out)

    def take(self) -> list[TokenOut]:
        out, self.outbox = self.outbox, []
        return out
