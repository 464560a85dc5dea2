"""The built-in model (a committed K3 checkpoint trained on gsm8k text) and how a model argument names a preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from greedy import greedy_reference
from safetensors import safe_open

from bench.gsm8k import DATA, one_example, read_jsonl
from radixk3.builtin_model import (
    BUILTIN_MODEL_DIR,
    BUILTIN_MODEL_NAME,
    DEFAULT_MODEL_ENV,
    checkpoint_dir,
    random_preset,
)
from radixk3.checkpoint import load_model
from radixk3.config_formats import load_model_config
from radixk3.tokenizer import load_tokenizer
from runtime.local_engine import LocalEngine
from runtime.model_files import model_config
from runtime.server_args import ServerArgs


def test_a_model_argument_names_a_preset_a_directory_or_the_builtin_model(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert random_preset("k3-tiny") == "k3-tiny" and checkpoint_dir("k3-tiny") is None
    assert random_preset(None) is None and checkpoint_dir(None) == str(BUILTIN_MODEL_DIR)
    assert random_preset(str(tmp_path)) is None and checkpoint_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="kimi-k3: a true-size preset"):
        ServerArgs(model="kimi-k3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "k3-tiny").mkdir()  # a directory of that name is a checkpoint, not the preset
    assert random_preset("k3-tiny") is None and checkpoint_dir("k3-tiny") == "k3-tiny"


def test_the_default_model_is_the_builtin_one_unless_the_environment_names_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    args = ServerArgs()
    assert args.model == args.model_id == BUILTIN_MODEL_NAME and ServerArgs(model=" ").model == BUILTIN_MODEL_NAME
    assert model_config(args) == load_model_config(BUILTIN_MODEL_DIR)
    assert checkpoint_dir(BUILTIN_MODEL_NAME) == str(BUILTIN_MODEL_DIR)
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "k3-tiny-native")
    assert ServerArgs().model == "k3-tiny-native" and ServerArgs(model="k3-tiny").model == "k3-tiny"
    # A random preset has no vision tower, so its config (which the front end reads) claims none.
    assert model_config(ServerArgs()).vision is None


def test_the_builtin_checkpoint_is_a_small_bf16_k3_model_with_its_recipe() -> None:
    cfg = load_model_config(BUILTIN_MODEL_DIR)
    assert cfg.is_k3_format and cfg.dtype == "bfloat16" and cfg.num_nextn_predict_layers == 1
    size = sum(f.stat().st_size for f in BUILTIN_MODEL_DIR.iterdir())
    assert size <= 10.5e6, f"{size / 1e6:.1f} MB"
    with safe_open(BUILTIN_MODEL_DIR / "model.safetensors", "pt") as f:  # KDA's gate and conv vectors stay fp32
        assert {f.get_slice(n).get_dtype() for n in f.keys() if len(f.get_slice(n).get_shape()) == 2} == {"BF16"}
    recipe = json.loads((BUILTIN_MODEL_DIR / "recipe.json").read_text())
    assert "train_spec_pair.py --write-builtin" in recipe["command"]


@torch.inference_mode()
def test_the_builtin_model_is_trained_on_gsm8k_text() -> None:
    """Its next-token loss on held-out gsm8k text is far below a random model's (ln 4096 = 8.3 nats)."""
    model, tok = load_model(BUILTIN_MODEL_DIR, dtype=torch.float32), load_tokenizer()
    text = "".join(one_example(e, True) + "\n\n" for e in read_jsonl(DATA / "test.jsonl")[:8])
    ids = torch.tensor(tok.encode(text, add_bos=True))
    loss = torch.nn.functional.cross_entropy(model(ids)[:-1].float(), ids[1:])
    assert loss < 3.0, float(loss)


def test_an_engine_given_no_model_serves_the_builtin_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    tok = load_tokenizer()
    prompt = tok.encode(one_example(read_jsonl(DATA / "test.jsonl")[0], False), add_bos=True)
    engine = LocalEngine(ServerArgs(mem_bytes=16 << 20, disable_compile=True), check=True)
    got = engine.generate([prompt], {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    assert got == [greedy_reference(load_model(BUILTIN_MODEL_DIR), prompt, 12)]
