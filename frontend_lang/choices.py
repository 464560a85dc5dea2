"""How `select` turns per-choice token logprobs into a decision (SGLang's `sglang.lang.choices` shapes).

Each method gets, per choice, the logprobs of the choice's own tokens given the prompt before it, and
returns the chosen text with the scores in `meta_info` (what `s.get_meta_info(name)` shows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoiceScore:
    """One choice as the backend scored it: its tokens and their input logprobs, in order."""

    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int = 0  # prompt tokens the backend served from its prefix cache for this request

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs) or not self.logprobs:
            raise ValueError("a scored choice needs one logprob per token, and at least one token")

    @property
    def total(self) -> float:
        return math.fsum(self.logprobs)

    @property
    def mean(self) -> float:
        return self.total / len(self.logprobs)


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _meta(scores: list[ChoiceScore]) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": [s.mean for s in scores],
        "unnormalized_prompt_logprobs": [s.total for s in scores],
        "input_token_logprobs": [list(zip(s.logprobs, s.token_ids, strict=True)) for s in scores],
        "cached_tokens": [s.cached_tokens for s in scores],
    }


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # the first of equal maxima, as numpy's argmax


class ChoicesSamplingMethod:
    """Chooses among scored choices."""

    name = "base"

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The highest mean token logprob: no bias towards short choices (SGLang's default)."""

    name = "token_length_normalized"

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        meta = _meta(scores)
        return ChoicesDecision(choices[_argmax(meta["normalized_prompt_logprobs"])], meta)


class Unnormalized(ChoicesSamplingMethod):
    """The highest summed logprob: the most likely continuation as a whole (favours short choices)."""

    name = "unnormalized"

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        meta = _meta(scores)
        return ChoicesDecision(choices[_argmax(meta["unnormalized_prompt_logprobs"])], meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices whose next token has the best logprob; the shortest survivor wins
    (SGLang's greedy_token_selection, where a choice that runs out of tokens is padded with its mean)."""

    name = "greedy_token_selection"

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        longest = max(len(s.logprobs) for s in scores)
        padded = [s.logprobs + [s.mean] * (longest - len(s.logprobs)) for s in scores]
        alive = list(range(len(scores)))
        for j in range(longest):
            best = max(padded[i][j] for i in alive)
            alive = [i for i in alive if padded[i][j] == best]
            if len(alive) == 1:
                break
        pick = min(alive, key=lambda i: len(scores[i].logprobs))
        return ChoicesDecision(choices[pick], _meta(scores))


token_length_normalized = TokenLengthNormalized()
unnormalized = Unnormalized()
greedy_token_selection = GreedyTokenSelection()
