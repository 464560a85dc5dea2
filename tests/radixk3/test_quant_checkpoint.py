"""Quantised checkpoints (compressed-tensors MXFP4 / INT4 / FP8-block routed experts): written by the library's
compressors, loaded packed (the held bytes are the packed ones), dequantised bit for bit as the library
decompresses, and the packed model's logits equal a dense model holding the dequantised weights within 1e-5
(fp32); the config is read and its unsupported variants refused; a shard that would cut a scale group and a
malformed packed tensor are refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixk3.checkpoint import SINGLE_FILE, CheckpointError, load_model
from radixk3.config import ConfigError, preset
from radixk3.config_formats import load_model_config
from radixk3.model import build_model
from radixk3.moe_layer import MoE
from radixk3.packed_experts import PackedWeights
from radixk3.parallel import ParallelState, set_parallel_state
from radixk3.quant_checkpoint import (
    decompress_weight,
    read_tensors,
    write_dequantised_checkpoint,
    write_quantised_checkpoint,
)
from radixk3.quant_format import ExpertQuant, parse_quantization_config

KINDS = ("mxfp4", "int4", "fp8")
PRESETS = ("k3-tiny", "k3-tiny-native")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("quant")
    return {(p, k): write_quantised_checkpoint(build_model(preset(p), seed=4), root / f"{p}-{k}", k, num_shards=2)
            for p in PRESETS for k in KINDS}


def _experts(model: torch.nn.Module) -> dict[str, PackedWeights]:
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedWeights)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", PRESETS)
def test_loaded_experts_dequantise_as_the_library(name: str, kind: str, checkpoints: dict) -> None:
    path = checkpoints[name, kind]
    cfg = load_model_config(path)
    assert cfg.expert_quant is not None and cfg.expert_quant.kind == kind
    model = load_model(path)
    tensors = read_tensors(path)
    packed = _experts(model)
    # Every routed expert's linears are packed, the MTP layers' too; nothing else is.
    assert len(packed) == 3 * (sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
                               + cfg.num_nextn_predict_layers)
    for mname, mod in packed.items():
        assert mod.q_data.dtype == cfg.expert_quant.data_dtype
        got = mod.dequant(torch.arange(cfg.num_experts), torch.float32)
        ckpt = mname.replace(".experts.", ".experts.{e}.").replace("model.mtp_layers.0.", "model.layers.4.")
        if cfg.is_k3_format:
            ckpt = "language_model." + ckpt
        for e in range(cfg.num_experts):
            prefix = ckpt.format(e=e)
            ref = decompress_weight({k.rpartition(".")[2]: v for k, v in tensors.items()
                                     if k.rpartition(".")[0] == prefix}, cfg.expert_quant)
            assert torch.equal(got[e].view(torch.int32), ref.float().view(torch.int32)), (prefix, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", PRESETS)
def test_packed_logits_equal_the_dequantised_dense_model(name: str, kind: str, checkpoints: dict,
                                                         tmp_path: Path) -> None:
    packed = load_model(checkpoints[name, kind])
    dense = load_model(write_dequantised_checkpoint(checkpoints[name, kind], tmp_path / "dense"))
    assert not _experts(dense)
    ids = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for n in (37, 1):
            torch.testing.assert_close(packed(ids[:n]), dense(ids[:n]), rtol=0, atol=1e-5)
    # The packed model holds the packed bytes: well under the dense experts' fp32 bytes.
    held = sum(b.numel() * b.element_size() for m in _experts(packed).values() for b in m.buffers())
    dense_experts = sum(p.numel() * p.element_size() for n, p in dense.named_parameters()
                        if n.endswith(("experts.w13_weight", "experts.w2_weight")) and "shared" not in n)
    assert held <= dense_experts * {"mxfp4": 0.14, "int4": 0.2, "fp8": 0.26}[kind]


def _quant_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def test_config_round_trips_and_refuses_what_it_cannot_load(checkpoints: dict) -> None:
    for kind in KINDS:
        raw = _quant_config(checkpoints["k3-tiny", kind])
        assert raw["quant_method"] == "compressed-tensors"
        assert parse_quantization_config(raw, "float32") == ExpertQuant(kind, "uint8" if kind == "mxfp4" else
                                                                         "float32")
    assert parse_quantization_config(None, "bfloat16") is None
    # MXFP4's format alone fixes its scheme; pack-quantized needs its group's bits.
    mxfp4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    assert parse_quantization_config(mxfp4, "bfloat16") == ExpertQuant("mxfp4", "uint8")
    with pytest.raises(ConfigError, match="expected one group"):
        parse_quantization_config(mxfp4 | {"format": "pack-quantized"}, "bfloat16")
    int4 = _quant_config(checkpoints["k3-tiny", "int4"])
    assert parse_quantization_config(int4, "bfloat16").scale_dtype == "bfloat16"  # K2-Thinking's bf16 scales
    group = int4["config_groups"]["group_0"]
    bad = [
        ({**int4, "quant_method": "fp8"}, "quant_method 'fp8'"),
        ({**int4, "config_groups": {"group_0": {**group, "weights": {**group["weights"], "symmetric": False}}}},
         "asymmetric"),
        ({**int4, "config_groups": {"group_0": {**group, "weights": {**group["weights"], "group_size": 128}}}},
         "not supported"),
        ({**int4, "config_groups": {"group_0": {**group, "input_activations": {"num_bits": 8}}}},
         "activation quantisation"),
        ({**int4, "config_groups": {"a": group, "b": group}}, "expected one group"),
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            parse_quantization_config(raw, "float32")


def test_a_shard_through_a_scale_group_is_refused() -> None:
    cfg = preset("k3-tiny").replace(expert_quant=ExpertQuant("mxfp4", "uint8"))  # intermediate 32: one group
    set_parallel_state(ParallelState(tp_rank=0, tp_size=2))
    try:
        with torch.device("meta"), pytest.raises(ConfigError, match="would split a quantisation group of 32"):
            MoE(cfg)
        wide = cfg.replace(moe_intermediate_size=64)  # two groups: each rank holds one
        moe = MoE(wide)
        assert moe.experts.w2.q_data.shape == (8, 64, 16) and moe.experts.w2.q_scale.shape == (8, 64, 1)
        assert moe.experts.w1.q_data.shape == (8, 32, 32)
    finally:
        set_parallel_state(ParallelState())


def test_malformed_packed_tensors_are_refused(checkpoints: dict, tmp_path: Path) -> None:
    src = checkpoints["k3-tiny", "int4"]
    good = read_tensors(src)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight_"

    def load_with(changes: dict[str, torch.Tensor], sub: str) -> None:
        d = tmp_path / sub
        d.mkdir()
        (d / "config.json").write_text((src / "config.json").read_text())
        save_file(good | changes, d / SINGLE_FILE)
        load_model(d)

    with pytest.raises(CheckpointError, match=f"tensor '{name}packed' has dtype torch.uint8"):
        load_with({name + "packed": good[name + "packed"].view(torch.uint8)[:, ::4].contiguous()}, "a")
    with pytest.raises(CheckpointError, match="expert 2 has weight_shape \\[64, 31\\]"):
        load_with({name + "shape": torch.tensor([64, 31])}, "b")
    dense = good | {name + "packed": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="has shape"):
        load_with(dense, "c")


def test_plan_reads_the_checkpoints_format(checkpoints: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """`radixk3 plan --model DIR` counts the packed experts the loaded model holds (exactly), and its whole weight
    bytes are the loaded model's within 2%."""
    from radixk3.cli import main

    path = checkpoints["k3-tiny-native", "mxfp4"]
    assert main(["plan", "--model", str(path), "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    model = load_model(path)
    packed = sum(b.numel() * b.element_size() for m in _experts(model).values() for b in m.buffers())
    assert weights["routed_experts"] == packed
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert abs(weights["total"] - held) <= 0.02 * held
    # The flag's estimate for the same format agrees (int4 has a weight_shape per expert besides).
    assert main(["plan", "--preset", "k3-tiny-native", "--expert-format", "mxfp4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"]["routed_experts"] == packed
    assert main(["plan", "--model", str(path), "--expert-format", "fp8"]) == 2
    assert "the checkpoint's experts are mxfp4 already" in capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_tp_and_ep_shards_of_packed_experts_sum_to_the_whole(kind: str) -> None:
    """Each rank of --tp 2 (w1 / w3 rows and w2 input columns cut, with their scales) and of --tp 2 --ep 2 (whole
    experts) holds its part of the packed tensors as the loader reads it (`Shard.index` into the checkpoint
    tensor); the ranks' partial routed outputs add up to the unsharded packed experts' output."""
    from radixk3.quant_checkpoint import compress_weight, expert_quant_for
    from radixk3.tensor_names import public_shards, public_tensors

    inter = 256 if kind == "fp8" else 64  # two fp8 blocks / two groups: one per rank
    cfg = preset("k3-tiny").replace(moe_intermediate_size=inter, expert_quant=expert_quant_for(kind, "float32"))
    full = MoE(cfg).eval()
    whole = public_tensors(full)
    gen = torch.Generator().manual_seed(3)
    for e in range(cfg.num_experts):
        for w, shape in (("w1", (inter, 64)), ("w2", (64, inter)), ("w3", (inter, 64))):
            packed = compress_weight(torch.randn(shape, generator=gen) / 8, cfg.expert_quant)
            for suffix, t in packed.items():
                whole[f"experts.{e}.{w}.{suffix}"].copy_(t)
    x = torch.randn(9, 64, generator=gen)
    weights, ids = full.gate(x)
    with torch.no_grad():
        ref = full.experts(x, weights, ids)
    for ep in (1, 2):
        total = torch.zeros_like(ref)
        for rank in range(2):
            set_parallel_state(ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank if ep == 2 else 0, ep_size=ep))
            try:
                shard = MoE(cfg).eval()
            finally:
                set_parallel_state(ParallelState())
            shards = public_shards(shard)
            for name, view in public_tensors(shard).items():
                s = shards.get(name)
                view.copy_(whole[name] if s is None else whole[name][s.index])
            with torch.no_grad():
                total += shard.experts(x, weights, ids)
        torch.testing.assert_close(total, ref, rtol=0, atol=1e-5, msg=f"{kind} ep {ep}")
