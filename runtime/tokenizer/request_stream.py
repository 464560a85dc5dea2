"""The tokenizer side of one sample's output: TokenOut chunks from the scheduler become `StreamChunk`s with
incremental text (`SampleStream`), which accumulate into a `Sample`: the one result type every API returns, with
the one `meta_info` builder.

A stream of results sends only what is new: a `StreamCursor` remembers how much of a sample's output its
stream has sent, and `Sample.result(..., cursor=)` returns the rest (the native API's incremental streaming).

Text is produced by the tokenizer's incremental decoder. Stop strings and stop regexes are trimmed where the
scheduler matched them (the last TokenOut's `stop_from_end`), never searched for again here: an earlier
occurrence that the output completed below min_new_tokens stays. While streaming, text that could be the start
of a stop string (or that a stop regex has begun to match) is held back until later tokens show whether it is,
so no streamed chunk ever holds a part of the matched text. With `no_stop_trim` nothing is trimmed or held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from radixk3.tokenizer import IncrementalDecoder, Tokenizer
from runtime.messages import TokenOut
from runtime.sampling_params import SamplingParams
from runtime.stop_regex import partial_start


@dataclass
class StreamChunk:
    """New output of one sample since its previous chunk; the sample's last chunk has `finished` set."""

    rid: str
    index: int  # sample index, 0..n-1
    text: str  # detokenized delta, stop strings trimmed
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finished: str | None = None  # None | "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far, this chunk included
    cached_tokens: int = 0
    error: str | None = None
    invalid: bool = False  # the error is the request's fault (HTTP 400), naming `error_param`
    error_param: str | None = None


def _held_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Incremental text of one sample, with stop strings and stop regexes trimmed (unless `no_stop_trim`)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._decoder: IncrementalDecoder = tokenizer.incremental_decoder(params.skip_special_tokens)
        self._trim = not params.no_stop_trim
        self._stops = params.stop if self._trim else []
        self._regexes = params.stop_regex if self._trim else []
        self._held = ""

    def push(self, ids: list[int], finished: str | None, stop_from_end: int | None = None) -> str:
        """The new text of `ids`; on the last chunk, cut where the scheduler's stop match begins
        (`TokenOut.stop_from_end`: characters from there to the end of the text)."""
        text = self._held + self._decoder.push(ids)
        self._held = ""
        if finished is None:
            keep = len(text) - (_held_suffix(text, self._stops) if self._stops else 0)
            if self._regexes:
                keep = min(keep, partial_start(text, self._regexes))
            text, self._held = text[:keep], text[keep:]
            return text
        text += self._decoder.flush()
        if stop_from_end is None or not self._trim:
            return text
        # The scheduler's match ends in the text of this chunk, so it starts in it or in what was held back (a
        # stop's beginning): never in text already sent, which could not be taken back.
        return text[: max(0, len(text) - stop_from_end)]


class SampleStream:
    """One sample: turns its TokenOuts into StreamChunks (incremental text, stop strings trimmed)."""

    def __init__(self, rid: str, index: int, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.rid, self.index = rid, index
        self._text = TextStream(tokenizer, params)
        self._completion_tokens = 0

    def chunk(self, out: TokenOut) -> StreamChunk:
        text = self._text.push(out.token_ids, out.finished, out.stop_from_end)
        self._completion_tokens += len(out.token_ids)
        top = [[(int(i), float(v)) for i, v in row] for row in out.top_logprobs]  # converted once per chunk
        input_top = [None if row is None else [(int(i), float(v)) for i, v in row] for row in out.input_top_logprobs]
        return StreamChunk(
            rid=self.rid, index=self.index, text=text, token_ids=list(out.token_ids), logprobs=list(out.logprobs),
            top_logprobs=top, input_logprobs=list(out.input_logprobs), input_top_logprobs=input_top,
            finished=out.finished,
            matched_stop=out.matched_stop, prompt_tokens=out.prompt_tokens, completion_tokens=self._completion_tokens,
            cached_tokens=out.cached_tokens, error=out.error, invalid=out.invalid, error_param=out.error_param,
        )


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text, special tokens included (what logprobs name a token by)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class StreamCursor:
    """How much of one sample's output ids and logprobs its stream has sent; the next event carries the rest."""

    output_ids: int = 0
    output_logprobs: int = 0
    top_logprobs: int = 0
    input_logprobs: int = 0


@dataclass
class Sample:
    """Everything one sample produced so far, accumulated from its chunks: the one result type of the engine API,
    the native API and the OpenAI API (streamed or not)."""

    index: int
    rid: str = ""
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finished: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    invalid: bool = False
    error_param: str | None = None

    def add(self, c: StreamChunk) -> None:
        self.rid = c.rid
        self.text += c.text
        self.output_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs)
        self.top_logprobs.extend(c.top_logprobs)
        self.input_logprobs.extend(c.input_logprobs)
        self.input_top_logprobs.extend(c.input_top_logprobs)
        self.prompt_tokens = c.prompt_tokens or self.prompt_tokens
        self.cached_tokens = c.cached_tokens or self.cached_tokens
        if c.finished is not None:
            self.finished, self.matched_stop, self.error = c.finished, c.matched_stop, c.error
            self.invalid, self.error_param = c.invalid, c.error_param

    def meta_info(self, prompt_ids: list[int], tokenizer: Tokenizer, *, return_logprob: bool,
                  text_in_logprobs: bool = False, cursor: StreamCursor | None = None) -> dict[str, Any]:
        """SGLang's `meta_info`; with `return_logprob`, the logprobs as SGLang's (logprob, token id, text) triples
        (text None unless `text_in_logprobs`), the input ones for the prompt positions from the first asked.
        With a `cursor`, the logprob lists hold only what follows it (advanced past them); the counts are the
        sample's so far."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": None if self.finished is None else {"type": self.finished, "matched": self.matched_stop},
            "prompt_tokens": self.prompt_tokens or len(prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "error": self.error,
        }
        if return_logprob:
            meta |= self._logprobs(prompt_ids, tokenizer, text_in_logprobs, cursor)
        return meta

    def _logprobs(self, prompt_ids: list[int], tokenizer: Tokenizer, text_in_logprobs: bool,
                  cursor: StreamCursor | None) -> dict[str, Any]:
        def triples(pairs: Iterable[tuple[float | None, int]]) -> list[tuple[float | None, int, str | None]]:
            return [(lp, t, token_text(tokenizer, t) if text_in_logprobs else None) for lp, t in pairs]

        c = cursor or StreamCursor()
        # The prompt's logprobs have all come by the first output token (or the end): sent then, as they are
        # placed from the prompt's end.
        n_in = len(self.input_logprobs) if cursor is None or self.output_ids or self.finished else c.input_logprobs
        first = len(prompt_ids) - len(self.input_logprobs)
        out = {
            "input_token_logprobs": triples(zip(self.input_logprobs[c.input_logprobs:n_in],
                                                prompt_ids[first + c.input_logprobs:first + n_in], strict=True)),
            # SGLang's shape: None for the first prompt token (no context), else the position's top rows.
            "input_top_logprobs": [None if row is None else triples((lp, t) for t, lp in row)
                                   for row in self.input_top_logprobs[c.input_logprobs:n_in]],
            "output_token_logprobs": triples(zip(self.logprobs[c.output_logprobs:],
                                                 self.output_ids[c.output_logprobs:], strict=False)),
            "output_top_logprobs": [triples((lp, t) for t, lp in row) for row in self.top_logprobs[c.top_logprobs:]],
        }
        if cursor is not None:
            cursor.input_logprobs = n_in
            cursor.output_logprobs += len(out["output_token_logprobs"])
            cursor.top_logprobs = len(self.top_logprobs)
        return out

    def result(self, prompt_ids: list[int], tokenizer: Tokenizer, *, return_logprob: bool,
               text_in_logprobs: bool = False, cursor: StreamCursor | None = None) -> dict[str, Any]:
        """The sample as `/generate` and `Engine.generate` return it: text, output ids and meta_info. With a
        `cursor` (a stream's event): the text so far, but only the output ids and logprobs that follow it."""
        if cursor is None:
            ids = list(self.output_ids)
        else:
            ids, cursor.output_ids = self.output_ids[cursor.output_ids:], len(self.output_ids)
        return {"text": self.text, "output_ids": ids,
                "meta_info": self.meta_info(prompt_ids, tokenizer, return_logprob=return_logprob,
                                            text_in_logprobs=text_in_logprobs, cursor=cursor)}
