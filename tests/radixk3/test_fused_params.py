"""Fused projections and stacked experts against the per-tensor checkpoint format: every public tensor is one
exact part of one parameter, loading merges the public tensors into the fused parameters (both formats, MTP
layers included), writing splits them back byte for byte, and errors name the public tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixk3.checkpoint import SINGLE_FILE, CheckpointError, load_model, write_checkpoint, write_random_checkpoint
from radixk3.config import preset
from radixk3.model import KimiForCausalLM
from radixk3.tensor_names import public_layout

FUSED_NAMES = ("qkv_proj", "qkv_conv1d", "gate_up_proj", "w13_weight", "w2_weight")


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(preset("k3-tiny-native"), tmp_path_factory.mktemp("native"), seed=5)


@pytest.mark.parametrize("name", ["k3-tiny", "k3-tiny-native"])
def test_public_tensors_tile_every_parameter_exactly_once(name: str) -> None:
    with torch.device("meta"):
        skeleton = KimiForCausalLM(preset(name))
    state = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in skeleton.state_dict().items()}
    layout = public_layout(skeleton)
    for param, index in layout.values():
        state[param][index] += 1
    for n, count in state.items():
        assert bool((count == 1).all()), n
    assert len(layout) > len(state)  # some parameters do hold several public tensors


def test_disk_holds_public_names_only(tiny_checkpoint: Path, native: Path) -> None:
    for ck in (tiny_checkpoint, native):
        names = set(load_file(ck / SINGLE_FILE))
        assert not any(f".{f}." in n or n.endswith(f".{f}") for n in names for f in FUSED_NAMES)


def test_loading_merges_into_the_fused_parameters(native: Path) -> None:
    cfg = preset("k3-tiny-native")
    disk = load_file(native / SINGLE_FILE)
    model = load_model(native)
    p, i, mtp = cfg.kda_proj_dim, cfg.moe_intermediate_size, cfg.num_hidden_layers
    pre = "language_model.model.layers."
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.qkv_proj.weight[p : 2 * p], disk[pre + "0.self_attn.k_proj.weight"])
    assert torch.equal(attn.qkv_conv1d.weight[2 * p :], disk[pre + "0.self_attn.v_conv1d.weight"])
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight[cfg.intermediate_size :],
                       disk[pre + "0.mlp.up_proj.weight"])  # fmt: skip
    experts = model.model.layers[1].block_sparse_moe.experts
    assert torch.equal(experts.w13_weight[3, i:], disk[pre + "1.block_sparse_moe.experts.3.w3.weight"])
    assert torch.equal(experts.w2_weight[5], disk[pre + "1.block_sparse_moe.experts.5.w2.weight"])
    mtp_experts = model.model.mtp_layers[0].block_sparse_moe.experts  # checkpoint layer num_hidden_layers
    assert torch.equal(mtp_experts.w13_weight[0, :i], disk[pre + f"{mtp}.block_sparse_moe.experts.0.w1.weight"])


def test_write_splits_back_byte_for_byte(tmp_path: Path, tiny_checkpoint: Path, native: Path) -> None:
    for ck in (tiny_checkpoint, native):
        again = write_checkpoint(load_model(ck), tmp_path / ck.name)
        assert (again / SINGLE_FILE).read_bytes() == (ck / SINGLE_FILE).read_bytes()


def _copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, dst / SINGLE_FILE)
    return dst


def test_errors_name_the_public_tensor(tmp_path: Path, tiny_checkpoint: Path) -> None:
    good = load_file(tiny_checkpoint / SINGLE_FILE)
    w3 = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    with pytest.raises(CheckpointError, match=f"missing tensor '{w3}'"):
        load_model(_copy(tiny_checkpoint, tmp_path / "a", {k: v for k, v in good.items() if k != w3}))
    with pytest.raises(CheckpointError, match=f"tensor '{w3}' has shape"):
        load_model(_copy(tiny_checkpoint, tmp_path / "b", good | {w3: good[w3][:-1].clone()}))
    v = "model.layers.0.self_attn.v_proj.weight"
    with pytest.raises(CheckpointError, match=f"missing tensor '{v}'"):
        load_model(_copy(tiny_checkpoint, tmp_path / "c", {k: t for k, t in good.items() if k != v}))
    fused = "model.layers.0.self_attn.qkv_proj.weight"  # our parameter name is not a checkpoint name
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{fused}'"):
        load_model(_copy(tiny_checkpoint, tmp_path / "d", good | {fused: torch.zeros(3, 3)}))
