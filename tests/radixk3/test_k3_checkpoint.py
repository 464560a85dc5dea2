"""Native K3 checkpoints on disk: the random k3-tiny-native writer under the real tensor names, and the loader's
mapping (prefix, alias, MTP layers, `.g_proj` in both layer types, fp32 tensors, skipped and refused tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from radixk3.checkpoint import SINGLE_FILE, CheckpointError, load_model, write_random_checkpoint
from radixk3.cli import main
from radixk3.config import preset
from radixk3.model import build_model
from radixk3.tensor_names import public_tensors

P = "language_model.model."


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(preset("k3-tiny-native"), tmp_path_factory.mktemp("k3n"), seed=2)


def _copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, dst / SINGLE_FILE)
    return dst


def test_real_tensor_names_and_shapes(native: Path) -> None:
    cfg = preset("k3-tiny-native")
    t = load_file(native / SINGLE_FILE)
    hid, mtp = cfg.hidden_size, cfg.num_hidden_layers  # the MTP layer is checkpoint layer num_hidden_layers
    kda, mla = cfg.kda_layers[0], cfg.mla_layers[0]
    shapes = {
        "language_model.lm_head.weight": (cfg.vocab_size, hid),
        P + "embed_tokens.weight": (cfg.vocab_size, hid),
        P + "norm.weight": (hid,),
        P + "output_attn_res_norm.weight": (hid,),
        P + "output_attn_res_proj.weight": (1, hid),
        P + f"layers.{kda}.self_attention_res_norm.weight": (hid,),
        P + f"layers.{kda}.self_attention_res_proj.weight": (1, hid),
        P + f"layers.{kda}.mlp_res_norm.weight": (hid,),
        P + f"layers.{kda}.mlp_res_proj.weight": (1, hid),
        # `.g_proj`: KDA's full-rank output gate and Gated MLA's gate, different tensors under one name
        P + f"layers.{kda}.self_attn.g_proj.weight": (cfg.kda_proj_dim, hid),
        P + f"layers.{mla}.self_attn.g_proj.weight": (cfg.num_attention_heads * cfg.v_head_dim, hid),
        P + f"layers.{kda}.self_attn.A_log": (cfg.kda_num_heads,),
        P + f"layers.{kda}.self_attn.dt_bias": (cfg.kda_proj_dim,),
        P + f"layers.{kda}.self_attn.q_conv1d.weight": (cfg.kda_proj_dim, 1, cfg.conv_kernel_size),
        P + f"layers.{kda}.self_attn.f_a_proj.weight": (cfg.kda_head_dim, hid),
        P + f"layers.{mla}.self_attn.q_a_proj.weight": (cfg.q_lora_rank, hid),
        P + f"layers.{mla}.self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
        P + f"layers.{mla}.block_sparse_moe.routed_expert_down_proj.weight": (cfg.routed_expert_hidden_size, hid),
        P + f"layers.{mla}.block_sparse_moe.routed_expert_norm.weight": (cfg.routed_expert_hidden_size,),
        P + f"layers.{mla}.block_sparse_moe.routed_expert_up_proj.weight": (hid, cfg.routed_expert_hidden_size),
        P + f"layers.{mla}.block_sparse_moe.experts.0.w1.weight": (cfg.moe_intermediate_size,
                                                                     cfg.routed_expert_hidden_size),
        P + f"layers.{mla}.block_sparse_moe.shared_experts.gate_proj.weight": (cfg.moe_intermediate_size, hid),
        P + "layers.0.mlp.gate_proj.weight": (cfg.intermediate_size, hid),
        P + f"layers.{mtp}.enorm.weight": (hid,),
        P + f"layers.{mtp}.hnorm.weight": (hid,),
        P + f"layers.{mtp}.eh_proj.weight": (hid, 2 * hid),
        P + f"layers.{mtp}.shared_head.norm.weight": (hid,),
        P + f"layers.{mtp}.shared_head.head.weight": (cfg.vocab_size, hid),
        P + f"layers.{mtp}.embed_tokens.weight": (cfg.vocab_size, hid),
        P + f"layers.{mtp}.self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_dim, hid),
        P + f"layers.{mtp}.block_sparse_moe.gate.weight": (cfg.num_experts, hid),
    }
    for name, shape in shapes.items():
        assert name in t, name
        assert tuple(t[name].shape) == shape, name
    assert not any(".g_a_proj." in n or "mtp_layers" in n or not n.startswith("language_model.") for n in t)
    assert not any(f"layers.{mtp}." in n and "_res_" in n for n in t)  # MTP layers use the additive residual
    raw = json.loads((native / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert raw["text_config"]["model_type"] == "kimi_linear" and "vision_config" in raw


def test_write_is_seeded_and_load_round_trips(native: Path, tmp_path: Path) -> None:
    again = write_random_checkpoint(preset("k3-tiny-native"), tmp_path / "again", seed=2)
    assert (again / SINGLE_FILE).read_bytes() == (native / SINGLE_FILE).read_bytes()
    model, ref = load_model(native), build_model(preset("k3-tiny-native"), seed=2)
    ids = torch.arange(40)
    assert torch.equal(model(ids), ref(ids))
    h = model.prenorm_hidden(ids, torch.tensor([0, 40]))
    assert torch.equal(model.forward_mtp(0, ids + 1, h).logits, ref.forward_mtp(0, ids + 1, h).logits)


def test_bf16_checkpoint_keeps_the_reference_fp32_tensors(tmp_path: Path) -> None:
    ck = write_random_checkpoint(preset("k3-tiny-native").replace(dtype="bfloat16"), tmp_path / "bf", seed=1)
    fp32 = ("A_log", "dt_bias", "conv1d.weight", "gate.weight", "gate.e_score_correction_bias")
    with safe_open(ck / SINGLE_FILE, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            assert f.get_slice(name).get_dtype() == ("F32" if name.endswith(fp32) else "BF16"), name
    model = load_model(ck)
    sd = public_tensors(model)  # views of the fused parameters, under the checkpoint's names
    assert sd["model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32
    assert sd["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["model.layers.1.self_attn.g_proj.weight"].dtype == torch.bfloat16
    assert torch.isfinite(model(torch.arange(20)).float()).all()


def test_aliases_and_skipped_tensors_load_identically(native: Path, tmp_path: Path) -> None:
    good = load_file(native / SINGLE_FILE)
    cfg = preset("k3-tiny-native")
    mtp = cfg.num_hidden_layers
    odd = {}
    for name, t in good.items():
        if name.startswith(P + "layers.0."):
            name = "language_model." + name[len(P):]  # vLLM's `language_model.layers.` alias
        if name.endswith("A_log"):
            t = t.view(1, 1, -1, 1)  # the legacy Kimi-Linear shape
        if name.endswith("conv1d.weight"):
            t = t.squeeze(1)  # [C, K]
        odd[name] = t
    odd |= {
        "vision_tower.encoder.blocks.0.wqkv.weight": torch.zeros(3, 2),
        "mm_projector.linear_1.weight": torch.zeros(2, 2),
        P + "rotary_emb.inv_freq": torch.ones(4),
        P + f"layers.{mtp}.self_attention_res_norm.weight": torch.ones(cfg.hidden_size),  # ignored, as in vLLM
        P + f"layers.{mtp}.mlp_res_proj.weight": torch.ones(1, cfg.hidden_size),
    }
    ids = torch.arange(30)
    assert torch.equal(load_model(_copy(native, tmp_path / "odd", odd))(ids), load_model(native)(ids))


def test_missing_unexpected_misshaped_and_duplicate(native: Path, tmp_path: Path) -> None:
    good = load_file(native / SINGLE_FILE)
    name = P + "layers.1.self_attn.g_proj.weight"
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_model(_copy(native, tmp_path / "a", {k: v for k, v in good.items() if k != name}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.norm.weight'"):  # no language_model.
        load_model(_copy(native, tmp_path / "b", good | {"model.norm.weight": torch.ones(64)}))
    kda_gate = P + "layers.0.self_attn.g_proj.weight"  # MLA's gate shape in a KDA layer
    with pytest.raises(CheckpointError, match=f"tensor '{kda_gate}' has shape \\(32, 64\\), expected \\(64, 64\\)"):
        load_model(_copy(native, tmp_path / "c", good | {kda_gate: good[name].clone()}))
    alias = "language_model.layers.0.input_layernorm.weight"
    with pytest.raises(CheckpointError, match="both fill 'model.layers.0.input_layernorm.weight'"):
        load_model(_copy(native, tmp_path / "d", good | {alias: good[P + "layers.0.input_layernorm.weight"].clone()}))
    extra_mtp = P + f"layers.{preset('k3-tiny-native').num_hidden_layers + 1}.enorm.weight"
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{extra_mtp}'"):
        load_model(_copy(native, tmp_path / "e", good | {extra_mtp: torch.ones(64)}))


def test_mxfp4_experts_are_refused_naming_the_tensor(native: Path, tmp_path: Path) -> None:
    good = load_file(native / SINGLE_FILE)
    w1 = P + "layers.1.block_sparse_moe.experts.3.w1.weight"
    quant = {k: v for k, v in good.items() if k != w1}
    quant[w1 + "_packed"] = torch.zeros(32, 16, dtype=torch.uint8)
    quant[w1 + "_scale"] = torch.zeros(32, 1, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=f"tensor '{w1}_packed' holds MXFP4 packed weights"):
        load_model(_copy(native, tmp_path / "q", quant))
    raw = good | {w1: torch.zeros(32, 32, dtype=torch.uint8)}  # quantised bytes under the plain name
    with pytest.raises(CheckpointError, match=f"tensor '{w1}' has torch.uint8 storage"):
        load_model(_copy(native, tmp_path / "r", raw))


def test_cli_make_checkpoint_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-checkpoint", "--preset", "k3-tiny-native", str(tmp_path / "ck"), "--shards", "2"]) == 0
    assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
    capsys.readouterr()
    assert main(["generate", "Natalia sold clips", "--model", str(tmp_path / "ck"), "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Natalia sold clips")
    assert main(["make-checkpoint", "--preset", "kimi-k3", str(tmp_path / "big")]) == 2
