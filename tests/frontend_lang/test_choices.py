"""Choice-selection methods and how gen's settings merge with the program's defaults (no engine)."""

from __future__ import annotations

import pytest

import frontend_lang as sgl
from frontend_lang.choices import ChoiceScore
from frontend_lang.ir import Gen, SamplingParams, defaults


def scores() -> list[ChoiceScore]:
    return [ChoiceScore([1], [-2.0]), ChoiceScore([2, 3, 4], [-1.0, -1.5, -0.5]), ChoiceScore([5, 6], [-1.0, -4.0])]


def test_methods_choose_by_mean_sum_or_greedy_tokens() -> None:
    choices = ["a", "bcd", "ef"]
    norm = sgl.token_length_normalized(choices, scores())
    assert norm.decision == "bcd" and norm.meta_info["normalized_prompt_logprobs"] == [-2.0, -1.0, -2.5]
    assert norm.meta_info["input_token_logprobs"][2] == [(-1.0, 5), (-4.0, 6)]
    summed = sgl.unnormalized(choices, scores())
    assert summed.decision == "a" and summed.meta_info["unnormalized_prompt_logprobs"] == [-2.0, -3.0, -5.0]
    # First tokens tie at -1.0 for "bcd" and "ef"; the second token decides.
    assert sgl.greedy_token_selection(choices, scores()).decision == "bcd"
    with pytest.raises(ValueError):
        ChoiceScore([], [])


def test_gen_overrides_the_run_defaults_and_sends_only_what_is_set() -> None:
    g = sgl.gen("x", max_tokens=7, stop="\n", regex="[0-9]+", return_logprob=True)
    assert isinstance(g, Gen)
    sampling, options = defaults(temperature=0.5, stop=["Q"]).merged(g.params).to_request()
    assert sampling["max_new_tokens"] == 7 and sampling["temperature"] == 0.5 and sampling["stop"] == "\n"
    assert sampling["regex"] == "[0-9]+" and options == {"return_logprob": True}
    plain, _ = defaults().merged(SamplingParams()).to_request()
    assert "regex" not in plain and "json_schema" not in plain and plain["max_new_tokens"] == 128
    assert isinstance(sgl.gen("y", choices=["a", "b"]), type(sgl.select("y", ["a"])))
    with pytest.raises(ValueError, match="non-empty"):
        sgl.select("z", choices=["a", ""])
