"""A checkpoint's generation_config.json through the engine: its sampling fields are every request's defaults
(`--sampling-defaults model`, the default; a request's own values win; `openai` ignores them), its eos ids end
generation, and values out of range stop the engine at startup naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixk3.checkpoint import load_model, write_random_checkpoint
from radixk3.config import preset
from runtime.errors import EngineError
from runtime.tokenizer.engine import Engine
from tests.greedy import greedy_reference

PROMPT = list(range(100, 124))
MEM = 64 << 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(preset("k3-tiny"), tmp_path_factory.mktemp("gencfg") / "k3-tiny", seed=3)


def with_generation_config(ckpt: Path, content: dict[str, object]) -> Path:
    (ckpt / "generation_config.json").write_text(json.dumps(content))
    return ckpt


def test_defaults_eos_ids_and_the_openai_mode(ckpt: Path) -> None:
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    greedy = greedy_reference(load_model(ckpt), PROMPT, 6)  # the no-cache ground truth, no engine to start
    # An eos id that greedy decoding reaches at its 4th token, greedy and 5 new tokens by default.
    eos = greedy[3]
    assert eos not in greedy[:3]
    with_generation_config(ckpt, {"temperature": 0, "max_new_tokens": 5, "eos_token_id": [eos]})
    with Engine(str(ckpt), mem_bytes=MEM) as eng:
        out = eng.generate(PROMPT)
        assert out["output_ids"] == greedy[:4] and out["meta_info"]["finish_reason"]["type"] == "stop"
        own = eng.generate(PROMPT, {"max_new_tokens": 2})  # the request's own value wins, the rest defaults
        assert own["output_ids"] == greedy[:2] and own["meta_info"]["finish_reason"]["type"] == "length"
        free = eng.generate(PROMPT, {"ignore_eos": True})
        assert free["output_ids"] == greedy[:5]
        # A null field is not given (SGLang's clients send many): the model's default stays beneath it.
        nulls = eng.generate(PROMPT, {"ignore_eos": True, "temperature": None, "max_new_tokens": None})
        assert nulls["output_ids"] == greedy[:5]
    with Engine(str(ckpt), mem_bytes=MEM, sampling_defaults="openai") as eng:
        # The engine's own defaults: 128 new tokens, temperature 1 (seeded, so not the greedy run), eos still ends.
        out = eng.generate(PROMPT, {"ignore_eos": True, "seed": 1})
        assert out["meta_info"]["completion_tokens"] == 128


def test_out_of_range_defaults_stop_the_engine_naming_the_file(ckpt: Path) -> None:
    with_generation_config(ckpt, {"temperature": -1})
    with pytest.raises(EngineError, match="generation_config.json: temperature"):
        Engine(str(ckpt), mem_bytes=MEM)
    (ckpt / "generation_config.json").unlink()
