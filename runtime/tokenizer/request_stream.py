"""The tokenizer side of one sample's output: TokenOut chunks from the scheduler become `StreamChunk`s with
incremental text, and are accumulated into the result dict `Engine.generate` returns.

Text is produced by the tokenizer's incremental decoder. Stop strings are trimmed as they are found: text
that could be the start of a stop string is held back until the next token shows whether it is, so no
streamed chunk ever holds a part of the matched stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixk3.tokenizer import IncrementalDecoder, Tokenizer
from runtime.messages import TokenOut


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
    finished: str | None = None  # None | "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far, this chunk included
    cached_tokens: int = 0
    error: str | None = None


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
    """Incremental text of one sample, with stop strings trimmed."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], skip_special_tokens: bool) -> None:
        self._decoder: IncrementalDecoder = tokenizer.incremental_decoder(skip_special_tokens)
        self._stops = stops
        self._held = ""

    def push(self, ids: list[int], finished: str | None, matched_stop: int | str | None) -> str:
        text = self._held + self._decoder.push(ids)
        self._held = ""
        if finished is None:
            if self._stops:
                k = _held_suffix(text, self._stops)
                if k:
                    text, self._held = text[:-k], text[-k:]
            return text
        text += self._decoder.flush()
        if isinstance(matched_stop, str) and matched_stop in text:
            text = text[: text.index(matched_stop)]
        return text


class SampleStream:
    """One sample: turns its TokenOuts into StreamChunks and keeps what `result()` returns."""

    def __init__(self, rid: str, index: int, tokenizer: Tokenizer, stops: list[str], skip_special_tokens: bool,
                 return_text_in_logprobs: bool = False) -> None:
        self.rid, self.index = rid, index
        self._tok = tokenizer
        self._text = TextStream(tokenizer, stops, skip_special_tokens)
        self._text_in_logprobs = return_text_in_logprobs
        self.pieces: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.input_logprobs: list[float | None] = []
        self.last: StreamChunk | None = None

    def chunk(self, out: TokenOut) -> StreamChunk:
        text = self._text.push(out.token_ids, out.finished, out.matched_stop)
        self.pieces.append(text)
        self.ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        top = [[(int(i), float(v)) for i, v in row] for row in out.top_logprobs]  # converted once per chunk
        self.top_logprobs.extend(top)
        self.input_logprobs.extend(out.input_logprobs)
        self.last = StreamChunk(
            rid=self.rid, index=self.index, text=text, token_ids=list(out.token_ids), logprobs=list(out.logprobs),
            top_logprobs=top,
            input_logprobs=list(out.input_logprobs), finished=out.finished, matched_stop=out.matched_stop,
            prompt_tokens=out.prompt_tokens, completion_tokens=len(self.ids), cached_tokens=out.cached_tokens,
            error=out.error,
        )
        return self.last

    def result(self, prompt_ids: list[int] | None = None) -> dict[str, Any]:
        """The sample in the shape `Engine.generate` returns. With `return_text_in_logprobs` the logprob
        lists hold SGLang's (logprob, token id, token text) triples instead of bare logprobs."""
        last = self.last
        assert last is not None and last.finished is not None, "result() of an unfinished sample"
        out_lp: list[Any] = list(self.logprobs)
        top: list[Any] = list(self.top_logprobs)
        in_lp: list[Any] = list(self.input_logprobs)
        if self._text_in_logprobs:
            out_lp = [(lp, t, self._piece(t)) for lp, t in zip(self.logprobs, self.ids, strict=False)]
            top = [[(lp, t, self._piece(t)) for t, lp in row] for row in self.top_logprobs]
            if prompt_ids is not None:
                first = len(prompt_ids) - len(in_lp)
                in_lp = [(lp, t, self._piece(t)) for lp, t in zip(in_lp, prompt_ids[first:], strict=True)]
        return {
            "text": "".join(self.pieces),
            "output_ids": list(self.ids),
            "meta_info": {
                "id": self.rid,
                "finish_reason": {"type": last.finished, "matched": last.matched_stop},
                "prompt_tokens": last.prompt_tokens,
                "completion_tokens": len(self.ids),
                "cached_tokens": last.cached_tokens,
                "error": last.error,
                "output_token_logprobs": out_lp,
                "input_token_logprobs": in_lp,
                "output_top_logprobs": top,
            },
        }

    def _piece(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)
