"""Per-request sampling parameters, named as SGLang names them, validated once at the door."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kernels.sampling import SamplingRow


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says which field is wrong (HTTP 400)."""


@dataclass
class SamplingParams:
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

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {sorted(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        for name, kind in (("max_new_tokens", int), ("top_k", int), ("min_new_tokens", int), ("n", int),
                           ("temperature", float), ("top_p", float), ("min_p", float), ("frequency_penalty", float),
                           ("presence_penalty", float), ("repetition_penalty", float), ("ignore_eos", bool),
                           ("skip_special_tokens", bool), ("seed", int | None), ("stop", list),
                           ("stop_token_ids", list)):
            value = getattr(self, name)
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if kind is float:
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok:
                raise InvalidRequest(f"{name} must be of type {getattr(kind, '__name__', kind)}, got {value!r}")
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0, "max_new_tokens must be an int >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty must be in (0, 2]"),
            (0 <= self.min_new_tokens <= max(self.max_new_tokens, 0), "min_new_tokens must be in [0, max_new_tokens]"),
            (self.n >= 1, "n must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be ints"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)

    def row(self, step: int) -> SamplingRow:
        return SamplingRow(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, step=step,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
