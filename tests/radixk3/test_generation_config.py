"""generation_config.json read as vLLM and SGLang read it: the sampling defaults and the eos ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixk3.generation_config import GenerationConfig, load_generation_config


def write(tmp_path: Path, content: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    return tmp_path


def test_no_file_or_no_directory_is_empty(tmp_path: Path) -> None:
    assert load_generation_config(tmp_path) == GenerationConfig() == load_generation_config(None)


def test_sampling_fields_and_eos_ids(tmp_path: Path) -> None:
    got = load_generation_config(write(tmp_path, {
        "temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.01, "repetition_penalty": 1.1,
        "max_new_tokens": 512, "do_sample": True, "max_length": 4096, "eos_token_id": [163586, 163585],
        "bos_token_id": 163584, "transformers_version": "4.57.1"}))
    # transformers' top_k 0 (no cut-off) is SGLang's -1; generate-only settings are not sampling defaults.
    assert got.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": -1, "min_p": 0.01,
                            "repetition_penalty": 1.1, "max_new_tokens": 512}
    assert got.eos_token_ids == (163586, 163585)
    assert load_generation_config(write(tmp_path, {"eos_token_id": 7})).eos_token_ids == (7,)


@pytest.mark.parametrize("content, says", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 1.5}, "top_k must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, -2]}, "eos_token_id"),
    ([1, 2], "expected a JSON object"),
])
def test_wrong_types_name_the_file_and_field(tmp_path: Path, content: object, says: str) -> None:
    with pytest.raises(ValueError, match="generation_config.json") as e:
        load_generation_config(write(tmp_path, content))
    assert says in str(e.value)
