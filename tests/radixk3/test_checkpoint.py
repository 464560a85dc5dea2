from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixk3.checkpoint import SINGLE_FILE, CheckpointError, load_model, write_random_checkpoint
from radixk3.config import preset
from radixk3.model import build_model


def test_public_tensor_names(tiny_checkpoint: Path) -> None:
    names = set(load_file(tiny_checkpoint / SINGLE_FILE))
    for n in [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.f_b_proj.weight", "model.layers.0.self_attn.o_norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.kv_a_layernorm.weight",
        "model.layers.1.block_sparse_moe.experts.0.w1.weight",
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
        "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
    ]:
        assert n in names, n


def test_write_is_seeded_and_load_round_trips(tmp_path: Path, tiny_checkpoint: Path) -> None:
    again = write_random_checkpoint(preset("k3-tiny"), tmp_path / "again", seed=1)
    assert (again / SINGLE_FILE).read_bytes() == (tiny_checkpoint / SINGLE_FILE).read_bytes()
    model = load_model(tiny_checkpoint)
    ref = build_model(preset("k3-tiny"), seed=1)
    ids = torch.arange(30)
    assert torch.equal(model(ids), ref(ids))


def test_sharded_checkpoint_loads_identically(tmp_path: Path, tiny_checkpoint: Path) -> None:
    sharded = write_random_checkpoint(preset("k3-tiny"), tmp_path / "sharded", seed=1, num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / SINGLE_FILE).exists()
    ids = torch.arange(25)
    assert torch.equal(load_model(sharded)(ids), load_model(tiny_checkpoint)(ids))


def _copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, dst / SINGLE_FILE)
    return dst


def test_missing_unexpected_and_misshaped_tensors(tmp_path: Path, tiny_checkpoint: Path) -> None:
    good = load_file(tiny_checkpoint / SINGLE_FILE)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    missing = {k: v for k, v in good.items() if k != name}
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_model(_copy(tiny_checkpoint, tmp_path / "a", missing))
    extra = dict(good) | {"model.layers.9.self_attn.q_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.9.self_attn.q_proj.weight'"):
        load_model(_copy(tiny_checkpoint, tmp_path / "b", extra))
    bad = dict(good) | {name: good[name][:-1].clone()}
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has shape"):
        load_model(_copy(tiny_checkpoint, tmp_path / "c", bad))
    ok = dict(good) | {"model.rotary_emb.inv_freq": torch.ones(4)}  # harmless, skipped like vLLM does
    load_model(_copy(tiny_checkpoint, tmp_path / "d", ok))


def test_missing_weights_and_broken_index(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = tmp_path / "e"
    d.mkdir()
    (d / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-1.safetensors"):
        load_model(d)


def test_legacy_and_flat_a_log_shapes(tmp_path: Path, tiny_checkpoint: Path) -> None:
    good = load_file(tiny_checkpoint / SINGLE_FILE)
    flat = {k: (v.flatten() if k.endswith("A_log") else v) for k, v in good.items()}
    ids = torch.arange(10)
    assert torch.equal(load_model(_copy(tiny_checkpoint, tmp_path / "f", flat))(ids), load_model(tiny_checkpoint)(ids))


def test_load_holds_no_meta_init_machinery(tiny_checkpoint: Path) -> None:
    """Loading imports nothing a worker keeps for good without using it: initialising meta-device tensors runs
    torch's Python reference ops, which import torch._dynamo and sympy (~150 MiB resident per worker)."""
    code = ("import sys, torch; from radixk3.checkpoint import load_model; "
            f"load_model({str(tiny_checkpoint)!r}); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_load_in_another_dtype_converts_as_read(tiny_checkpoint: Path) -> None:
    """An fp32 checkpoint loaded for bf16 serving holds each weight once, in bf16 (the gates the references
    keep in fp32 excepted), and equals the fp32 model cast."""
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    ref = load_model(tiny_checkpoint).cast_(torch.bfloat16)
    assert model.config.dtype == "bfloat16"
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k, t in got.items():
        assert t.dtype == want[k].dtype and torch.equal(t, want[k]), k
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert held == sum(t.numel() * t.element_size() for t in [*ref.parameters(), *ref.buffers()])
