"""Probe: every field of the installed SGLang's sampling parameters, enumerated from its `SamplingParams`
signature (a field added upstream is not missed), is known to radixk3: at its default (or null) accepted and
changing nothing; at a non-default value supported or an InvalidRequest naming it."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

from runtime.errors import InvalidRequest
from runtime.sampling_params import SGLANG_FIELDS, SamplingParams

VOCAB = 4096
SGLANG = {name: p.default for name, p in inspect.signature(SGLangSamplingParams).parameters.items()}

# A value other than the default for every field: what a client asking for the feature would send.
ASKED: dict[str, Any] = {
    "max_new_tokens": 7, "stop": ["x"], "stop_token_ids": [3], "stop_regex": r"\d+", "temperature": 0.5,
    "top_p": 0.9, "top_k": 5, "min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "repetition_penalty": 1.2, "min_new_tokens": 2, "n": 2, "beam_width": 2, "json_schema": '{"type": "object"}',
    "regex": "a+", "ebnf": 'root ::= "a"', "structural_tag": '{"type": "structural_tag"}', "ignore_eos": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True,
    "stream_interval": 4, "logit_bias": {"5": 2.0}, "sampling_seed": 11, "custom_params": {"k": 1},
    "watermark": {"enabled": True}, "stop_strs": ["x"], "stop_regex_strs": ["x"], "stop_str_max_len": 3,
    "stop_regex_max_len": 3, "is_normalized": True, "ebnf_full_assistant": True,
}


def test_the_table_is_sglangs_fields_with_their_defaults() -> None:
    assert set(SGLANG_FIELDS) == set(SGLANG), "a field of SGLang's SamplingParams is missing from the table"
    assert {name: spec.default for name, spec in SGLANG_FIELDS.items()} == SGLANG
    assert set(ASKED) == set(SGLANG)


@pytest.mark.parametrize("name", sorted(SGLANG))
def test_a_field_at_its_default_or_null_is_accepted_and_changes_nothing(name: str) -> None:
    plain = SamplingParams.from_dict({}, VOCAB)
    assert SamplingParams.from_dict({name: None}, VOCAB) == plain
    assert SamplingParams.from_dict({name: SGLANG[name]}, VOCAB) == plain


@pytest.mark.parametrize("name", sorted(SGLANG))
def test_a_field_asked_for_is_supported_or_refused_by_name(name: str) -> None:
    if SGLANG_FIELDS[name].supported:
        assert SamplingParams.from_dict({name: ASKED[name]}, VOCAB) != SamplingParams.from_dict({}, VOCAB)
        return
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({name: ASKED[name]}, VOCAB)
    assert e.value.param == name and name in e.value.message


def test_empty_values_of_unsupported_fields_ask_for_nothing() -> None:
    unset = {name: {} if name in ("logit_bias", "custom_params", "watermark") else ""
             for name, spec in SGLANG_FIELDS.items() if not spec.supported and spec.default is None}
    assert SamplingParams.from_dict(unset, VOCAB) == SamplingParams.from_dict({}, VOCAB)


def test_a_number_is_not_a_bool_default() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({"is_normalized": 0}, VOCAB)
    assert e.value.param == "is_normalized"


def test_names_in_no_sglang_schema_stay_refused() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict({"beam_search": True}, VOCAB)
    assert e.value.param == "beam_search"
