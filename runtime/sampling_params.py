"""Per-request sampling parameters, named as SGLang names them, parsed and validated once, at the door.

Everything a request carries is checked here before it is sent anywhere: types (a bool is not an int, a
float is not an int however integral), integers that fit the int64 wire format, finite floats, ranges, and
token ids inside the model's vocabulary. A refusal is an `InvalidRequest` whose `param` names the field.
The parsed `SamplingParams` is what travels (in `GenerateReq`) and what the scheduler keeps: nothing past the
door parses or validates it again. This module imports no model code and no torch: the scheduler process
uses it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import orjson

from runtime.errors import InvalidRequest
from runtime.grammar_schema import schema_too_deep
from runtime.stop_regex import check_stop_regex

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")
TOP_K_ALL = 1 << 30  # SGLang's default top_k: the whole vocabulary (our -1)


class SGLangField(NamedTuple):
    """A field of SGLang's sampling parameters: its default there, and whether radixk3 supports other values."""

    default: Any
    supported: bool


# Every field of SGLang 0.5.23's `SamplingParams` (srt/sampling/sampling_params.py), the one table of the rule:
# null, or (for a field not supported) its default or an empty value, means "not asked for" and is accepted
# silently; a supported field is parsed as ours; an unsupported one asked for is an InvalidRequest naming it.
# Names in no SGLang schema (and not radixk3's own fields, `seed` and `speculative`) stay refused.
SGLANG_FIELDS: dict[str, SGLangField] = {
    "max_new_tokens": SGLangField(128, True),
    "stop": SGLangField(None, True),
    "stop_token_ids": SGLangField(None, True),
    "stop_regex": SGLangField(None, True),
    "temperature": SGLangField(1.0, True),
    "top_p": SGLangField(1.0, True),
    "top_k": SGLangField(TOP_K_ALL, True),
    "min_p": SGLangField(0.0, True),
    "frequency_penalty": SGLangField(0.0, True),
    "presence_penalty": SGLangField(0.0, True),
    "repetition_penalty": SGLangField(1.0, True),
    "min_new_tokens": SGLangField(0, True),
    "n": SGLangField(1, True),
    "beam_width": SGLangField(None, False),  # beam search
    "json_schema": SGLangField(None, True),
    "regex": SGLangField(None, True),
    "ebnf": SGLangField(None, True),
    "structural_tag": SGLangField(None, False),
    "ignore_eos": SGLangField(False, True),
    "skip_special_tokens": SGLangField(True, True),
    "spaces_between_special_tokens": SGLangField(True, True),
    "no_stop_trim": SGLangField(False, True),
    "stream_interval": SGLangField(None, True),
    "logit_bias": SGLangField(None, True),
    "sampling_seed": SGLangField(None, True),  # our `seed`
    "custom_params": SGLangField(None, False),  # custom logit processors' arguments
    "watermark": SGLangField(None, False),
    # SGLang's internal fields (filled by its own normalisation), which its wire format also takes.
    "stop_strs": SGLangField(None, False),
    "stop_regex_strs": SGLangField(None, False),
    "stop_str_max_len": SGLangField(0, False),
    "stop_regex_max_len": SGLangField(0, False),
    "is_normalized": SGLangField(False, False),
    "ebnf_full_assistant": SGLangField(False, False),
}


def at_default(value: Any, default: Any) -> bool:
    """Whether an SGLang field's value asks for nothing: null, its default, or an empty string or collection where
    the default is null (a bool is never a number, nor a number a bool)."""
    if value is None:
        return True
    if default is None:
        return isinstance(value, str | list | tuple | dict) and not value
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    return isinstance(value, int | float) and value == default


def check_int(name: str, value: Any, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """An int (not a bool, not a float) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    return value


def check_float(name: str, value: Any, lo: float = -math.inf, hi: float = math.inf, *,
                lo_open: bool = False) -> float:
    """A finite real number (an int is accepted, a bool is not) in [lo, hi] ((lo, hi] with lo_open)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", param=name)
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise InvalidRequest(f"{name} is out of range, got {value}", param=name)
    v = float(value)
    if not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise InvalidRequest(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}",
                             param=name)
    return v


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def check_token_ids(name: str, ids: Any, vocab_size: int | None, *, allow_empty: bool = True) -> list[int]:
    """A list of ints in [0, vocab_size) (no negative indexing; vocab_size None: int64 only)."""
    if not isinstance(ids, list | tuple):
        raise InvalidRequest(f"{name} must be a list of token ids, got {type(ids).__name__}", param=name)
    if not ids and not allow_empty:
        raise InvalidRequest(f"{name} is empty", param=name)
    hi = INT64_MAX if vocab_size is None else vocab_size - 1
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= hi:
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, 2**63)"
            raise InvalidRequest(f"{name} holds {t!r}: token ids must be integers in {bound}", param=name)
    return list(ids)


def check_prompt_ids(ids: Any, vocab_size: int) -> list[int]:
    """A prompt of token ids: a non-empty list of ids in the vocabulary."""
    if isinstance(ids, list | tuple) and not ids:
        raise InvalidRequest("the prompt is empty", param="input_ids")
    return check_token_ids("input_ids", ids, vocab_size, allow_empty=False)


def check_logit_bias(value: Any, vocab_size: int | None) -> list[tuple[int, float]]:
    """{token id: bias} (ids as JSON's string keys or as ints) as (id, bias) pairs sorted by id; ids in the
    vocabulary, biases finite."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"logit_bias must be an object of token id -> bias, got {type(value).__name__}",
                             param="logit_bias")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        tid = int(key) if isinstance(key, str) and key.isdecimal() else key
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < (vocab_size or INT64_MAX) \
                or tid in pairs:
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, 2**63)"
            raise InvalidRequest(f"logit_bias holds the key {key!r}: keys must be distinct token ids in {bound}",
                                 param="logit_bias")
        pairs[tid] = check_float("logit_bias", bias)
    return sorted(pairs.items())


def check_output_options(return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any, vocab_size: int) -> None:
    """What a request asks to get back beside its tokens: logprobs, from which prompt position, how many top."""
    check_bool("return_logprob", return_logprob)
    check_int("logprob_start_len", logprob_start_len, -1)
    check_int("top_logprobs_num", top_logprobs_num, 0, vocab_size)


@dataclass
class SamplingParams:
    """Made by `from_dict` (validated) at the door; rebuilt as sent on the other side of the wire."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    seed: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    speculative: bool = True  # False: this request never speculates, even when the engine does
    # Structured output (at most one): the output must match the grammar (runtime.grammar).
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None  # a schema (an object is serialised), or "$$ANY$$": any JSON
    ebnf: str | None = None
    # SGLang's: the output also stops where its text matches one of these (trimmed there like a stop string).
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False  # the matched stop string (or regex match) stays in the text
    # Accepted for SGLang's clients: radixk3 decodes as a fast (`tokenizers`) tokenizer does, which puts no
    # spaces around special tokens either way (only HF's slow tokenizers insert them).
    spaces_between_special_tokens: bool = True
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias), added before the draw
    stream_interval: int = 1  # a stream's chunks come every this many tokens (and at the end)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int | None = None) -> SamplingParams:
        """Parse and validate; `vocab_size` (the model's) bounds `stop_token_ids`."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(d).__name__}",
                                 param="sampling_params")
        d = {k: v for k, v in d.items() if v is not None}  # null: not given (SGLang's clients send many)
        unknown = sorted(set(d) - {f.name for f in fields(cls)} - set(SGLANG_FIELDS))
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {unknown}", param=str(unknown[0]))
        for name in sorted(set(d)):
            spec = SGLANG_FIELDS.get(name)
            if spec is None or spec.supported:
                continue
            if not at_default(d.pop(name), spec.default):
                raise InvalidRequest(f"{name} is not supported (only at its default, {spec.default!r})", param=name)
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if "sampling_seed" in d:  # SGLang's name of the seed: the same draw
            seed = d.pop("sampling_seed")
            if "seed" in d and d["seed"] != seed:
                raise InvalidRequest(f"sampling_seed {seed!r} and seed {d['seed']!r} differ", param="sampling_seed")
            d["seed"] = seed
        if "stop_regex" in d:
            d["stop_regex"] = check_stop_regex(d["stop_regex"])
        if "logit_bias" in d:
            d["logit_bias"] = check_logit_bias(d["logit_bias"], vocab_size)
        p = cls(**d)
        p.validate(vocab_size)
        return p

    def validate(self, vocab_size: int | None = None) -> None:
        check_int("max_new_tokens", self.max_new_tokens, 0)
        check_int("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        check_float("temperature", self.temperature, 0.0)
        check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (off) or >= 1, got {self.top_k}", param="top_k")
        if self.top_k >= (TOP_K_ALL if vocab_size is None else min(vocab_size, TOP_K_ALL)):
            self.top_k = -1  # the whole vocabulary: off, as SGLang's default means it
        check_float("min_p", self.min_p, 0.0, 1.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        check_bool("speculative", self.speculative)
        check_int("n", self.n, 1)
        if self.seed is not None:
            # Sample i of n draws with seed + i: every one of them must fit the wire's int64.
            check_int("seed", self.seed, INT64_MIN, INT64_MAX - (self.n - 1))
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(f"stop must be a non-empty string or a list of them, got {self.stop!r}",
                                 param="stop")
        self.stop = list(self.stop)
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_bool("no_stop_trim", self.no_stop_trim)
        check_bool("spaces_between_special_tokens", self.spaces_between_special_tokens)
        check_int("stream_interval", self.stream_interval, 1)
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        """Types and exclusivity only; the grammar itself is parsed by runtime.grammar.check_grammar."""
        if isinstance(self.json_schema, dict):
            try:
                self.json_schema = orjson.dumps(self.json_schema).decode()
            except orjson.JSONEncodeError:  # nested past orjson's 255 levels, far past the schema limit
                raise schema_too_deep() from None
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                what = "a non-empty string or a JSON object" if name == "json_schema" else "a non-empty string"
                raise InvalidRequest(f"{name} must be {what}, got {value!r}", param=name)
        if len(given) > 1:
            raise InvalidRequest(f"at most one of regex, json_schema, ebnf may be given, got {given}", param=given[1])

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, source) of the request's grammar, if it has one."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    def for_sample(self, i: int) -> SamplingParams:
        """The parameters of sample i of the request's n: one sample, drawing with seed + i if seeded."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + i)
