"""`Runtime`: the in-process backend over `radixk3.Engine` (SGLang's `sgl.Runtime`, without a server).

Prompts are tokenised here with the engine's own tokenizer (with BOS, as the engine would, but for a chat
whose encoding has none) and sent as token
ids, so `select` knows exactly which tokens belong to each choice, even where a choice's first token merges with
the end of the prefix. The role markup's markers get their special ids; the program's text (its strings,
generated text, choices) is encoded as text, so a marker written in it stays text (`ChatPrompt.ids`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from frontend_lang.backend import Backend, BackendError, check_result, logprob_of
from frontend_lang.chat_template import K3, KIMI
from frontend_lang.choices import ChoiceScore
from radixk3.chat_prompt import ChatPrompt
from radixk3.vision.prompt import expand_images
from runtime.tokenizer.chat_format import K3 as K3_FAMILY
from runtime.tokenizer.image_input import ImageLimits, load_images

T = TypeVar("T")
# What the engine raises for a request it refuses (InvalidRequest is a ValueError; EngineError a RuntimeError).
_REFUSALS = (ValueError, TypeError, RuntimeError, TimeoutError)


class Runtime(Backend):
    def __init__(self, model_path: str | os.PathLike[str] | None = None, *, engine: Any = None,  # noqa: ANN401
                 **server_args: Any) -> None:
        """Start an Engine on `model_path` (None: the default model, `radixk3.builtin_model`) with `server_args`, or
        wrap `engine`."""
        if engine is None:
            from radixk3 import Engine

            engine = Engine(model=None if model_path is None else str(model_path), **server_args)
            self._owns = True
        else:
            self._owns = False
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # The roles as the server renders this model's chats: K3's encoding for a K3 model, else Kimi's framing
        # (a Jinja template of the checkpoint is not followed here).
        self.chat_template = K3 if engine.procs.chat_format.family == K3_FAMILY else KIMI

    def _ids(self, prompt: ChatPrompt) -> list[int]:
        """A prompt that opens with the role markup is a chat, with BOS where the chat encoding has one (K3's has
        none); any other text gets BOS, as the engine's raw prompts do."""
        chat = bool(prompt.segments) and prompt.segments[0].special
        return prompt.ids(self.tokenizer, add_bos=self.chat_template.add_bos or not chat)

    def marker_ids(self, markers: tuple[str, ...]) -> list[int]:
        return [self.tokenizer.piece_to_id(m) for m in markers]

    @staticmethod
    def _call(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except _REFUSALS as e:
            raise BackendError(str(e)) from e

    def _with_images(self, prompt: ChatPrompt, options: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """The prompt's ids, its image placeholders expanded for the options' `image_data` (decoded and processed
        here, as the tokenizer side does), and the options with the processed images."""
        if not options.get("image_data"):
            return self._ids(prompt), options
        images = self._call(lambda: load_images(options["image_data"], ImageLimits.of(self.engine.args)))
        expanded = self._call(lambda: expand_images(prompt, [im.slot for im in images]))
        return self._ids(expanded), options | {"image_data": images}

    def _one(self, ids: list[int], sampling: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        out = self._call(lambda: self.engine.generate(ids, sampling, **options))
        if isinstance(out, list):
            raise BackendError("n > 1 is not supported in a program's gen; fork the state instead")
        check_result(out["meta_info"])
        return out

    def generate(self, prompt: ChatPrompt, sampling: dict[str, Any], options: dict[str, Any]
                 ) -> tuple[str, dict[str, Any]]:
        ids, options = self._with_images(prompt, options)
        out = self._one(ids, sampling, options)
        return out["text"], out["meta_info"]

    def generate_stream(self, prompt: ChatPrompt, sampling: dict[str, Any], options: dict[str, Any]
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
        ids, options = self._with_images(prompt, options)
        chunks = self._call(lambda: self.engine.stream(ids, sampling, **options))
        completion = 0
        it = iter(chunks)
        while (chunk := self._call(lambda: next(it, None))) is not None:
            completion += len(chunk.token_ids)
            meta = {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": completion,
                    "cached_tokens": chunk.cached_tokens, "error": chunk.error,
                    "finish_reason": None if chunk.finished is None else {"type": chunk.finished,
                                                                          "matched": chunk.matched_stop}}
            check_result(meta)
            yield chunk.text, meta

    def cache_prefix(self, prompt: ChatPrompt) -> dict[str, Any]:
        return self._one(self._ids(prompt), {"max_new_tokens": 0}, {})["meta_info"]

    def score_choices(self, prefix: ChatPrompt, choices: list[str]) -> list[ChoiceScore]:
        prefix_ids = self._ids(prefix)
        self._one(prefix_ids, {"max_new_tokens": 0}, {})
        fulls = [self._ids(prefix + c) for c in choices]
        # A choice's own tokens begin where its tokenisation leaves the prefix's (earlier if they merge).
        starts = [_common_len(prefix_ids, f) for f in fulls]
        for c, f, s in zip(choices, fulls, starts, strict=True):
            if s >= len(f):
                raise BackendError(f"choice {c!r} adds no token after the prefix")
        first = min(starts)
        outs = self._call(lambda: self.engine.generate(fulls, [{"max_new_tokens": 0}] * len(fulls),
                                                       return_logprob=True, logprob_start_len=first))
        scores = []
        for out, f, s in zip(outs, fulls, starts, strict=True):
            meta = out["meta_info"]
            check_result(meta)
            lps = [logprob_of(x) for x in meta["input_token_logprobs"]]
            if len(lps) != len(f) - first:
                raise BackendError(f"expected {len(f) - first} input logprobs from position {first}, got {len(lps)}")
            scores.append(ChoiceScore(f[s:], [float(x) for x in lps[s - first:]], meta.get("cached_tokens", 0)))
        return scores

    def get_server_info(self) -> dict[str, Any]:
        """The engine's counters (cached tokens, prefill tokens computed, ...)."""
        return self.engine.get_metrics()

    def shutdown(self) -> None:
        if self._owns:
            self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
