"""Weight-only --quantization of a model (radixk3.weight_quant): what is quantised and what stays dense (the dense
copies dropped: weights held once), `radixk3 plan` counting exactly the bytes the quantised model holds, the
choice of kernel per weight (int4, int8 where int4 does not fit, dense where neither does; a shard that would
choose otherwise than the whole refused), a quantised model never cast or served under another flag, and a
checkpoint's packed INT4 experts moved onto the int4 kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.weight_quant import dequant_int4
from radixk3.checkpoint import load_model
from radixk3.cli import main
from radixk3.config import ConfigError, preset
from radixk3.model import build_model
from radixk3.packed_experts import PackedWeights
from radixk3.plan import weight_bytes
from radixk3.quant_checkpoint import decompress_weight, read_tensors, write_quantised_checkpoint
from radixk3.weight_quant import QuantizedExperts, QuantizedLinear, quantize_model_, weight_method
from runtime.local_engine import LocalEngine
from runtime.server_args import QUANTIZATIONS, ServerArgs
from runtime.worker.model_worker import ModelWorker
from tests.greedy import greedy_reference


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module]:
    return request.param, quantize_model_(build_model(preset("k3-tiny-native"), seed=3), request.param)


def test_projections_and_experts_are_quantised_the_rest_stays_dense(quantized: tuple) -> None:
    method, model = quantized
    mods = dict(model.named_modules())
    linears = {n: m.quantized for n, m in mods.items() if isinstance(getattr(m, "quantized", None), QuantizedLinear)}
    assert linears["lm_head"].method == "int8"  # the output matrix in int8 under both (llama.cpp: Q6_K / Q8_0)
    assert linears["model.layers.0.self_attn.qkv_proj"].method == method
    assert linears["model.mtp_layers.0.eh_proj"].method == method
    assert "model.layers.1.self_attn.kv_b_proj" not in linears  # read as a matrix by MLA's absorbed attention
    assert "model.mtp_layers.0.shared_head.head" not in linears  # never run
    experts = [m.quantized for n, m in mods.items() if n.endswith(".experts")]
    assert experts and all(isinstance(e, QuantizedExperts) and e.w13.method == method for e in experts)
    for name, p in model.named_parameters():
        quantized_weight = name.rpartition(".")[0] in linears or name.endswith(("w13_weight", "w2_weight"))
        assert (p.numel() == 0) == quantized_weight, name  # dense copies dropped, everything else kept
    kept = ("embed_tokens.weight", "gate.weight", "A_log", "dt_bias", "conv1d.weight", "norm.weight",
            "kv_b_proj.weight", "res_proj.weight")
    assert all(p.numel() > 0 for n, p in model.named_parameters() if n.endswith(kept))


def test_plan_counts_the_bytes_the_quantised_model_holds(quantized: tuple, capsys: pytest.CaptureFixture) -> None:
    method, model = quantized
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("qweight", "qscales")))
    assert weight_bytes(model.config, quantization=method).total == held
    assert main(["plan", "--preset", "k3-tiny-native", "--quantization", method, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights"]["total"] == held and out["quantization"] == method


def test_each_weight_gets_the_kernel_its_input_dim_fits() -> None:
    assert QUANTIZATIONS == ("int8", "int4")
    assert weight_method("int4", (64, 64), (64, 64), "w") == "int4"
    assert weight_method("int4", (64, 48), (64, 48), "w") == "int8"  # no whole groups of 32: int8
    assert weight_method("int8", (64, 24), (64, 24), "w") is None  # not in vectors of 16: stays dense
    assert weight_method("int8", (32, 64), (64, 64), "w") == "int8"  # a column-parallel shard: rows split
    with pytest.raises(ConfigError, match="does not split its inputs as int4"):
        weight_method("int4", (64, 16), (64, 32), "o_proj")  # a row-parallel shard through a group


def test_a_quantised_model_is_neither_cast_nor_served_under_another_flag(quantized: tuple) -> None:
    method, model = quantized
    with pytest.raises(ValueError, match="cast the model before quantising it"):
        model.cast_(torch.bfloat16)
    with pytest.raises(ValueError, match="the model given is quantised as"):
        ModelWorker(ServerArgs(), model)
    other = "int4" if method == "int8" else "int8"
    with pytest.raises(ValueError, match="the model given is quantised as"):
        ModelWorker(ServerArgs(quantization=other), model)
    with pytest.raises(ValueError, match="--device cpu"):
        ServerArgs(quantization=method, device="cuda")


def test_packed_int4_experts_run_on_the_int4_kernel(tmp_path: Path) -> None:
    """A checkpoint's compressed-tensors INT4 experts with bf16 scales (K2-Thinking's) move to the int4 kernel's
    layout under --quantization: the same codes and scales (the kernel's dequantisation, rounded to bf16 as the
    library rounds, equals the library's bit for bit), held once, and served equal to the no-cache forward."""
    from radixk3.weight_quant import _int4_codes

    cfg = preset("k3-tiny").replace(dtype="bfloat16", moe_intermediate_size=64)
    path = write_quantised_checkpoint(build_model(cfg, seed=4), tmp_path / "int4", "int4")
    # Served in fp32 (bf16 greedy has near-ties that any rounding order flips): the experts keep their bf16 scales.
    model = load_model(path, dtype=torch.float32)
    assert model.config.expert_quant is not None and model.config.expert_quant.scale_dtype == "bfloat16"
    tensors = read_tensors(path)
    w2 = model.model.layers[1].block_sparse_moe.experts.w2
    for j in (0, 5):
        lib = decompress_weight({k.rpartition(".")[2]: v for k, v in tensors.items()
                                 if k.rpartition(".")[0] == f"model.layers.1.block_sparse_moe.experts.{j}.w2"},
                                cfg.expert_quant or w2.quant)
        assert torch.equal(dequant_int4(_int4_codes(w2, j, torch.float32)).to(torch.bfloat16), lib)
    quantize_model_(model, "int4")
    assert not any(isinstance(m, PackedWeights) for m in model.modules())
    experts = [m.quantized for n, m in model.named_modules() if n.endswith(".experts")]
    assert experts and all(e.w13.method == e.w2.method == "int4" for e in experts)
    prompts = [[7, 300, 12, 9, 4000, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    eng = LocalEngine(ServerArgs(quantization="int4"), model, check=True)
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert eng.generate(prompts, greedy) == [greedy_reference(model, p, 5) for p in prompts]


def test_int8_model_equals_the_dense_model_holding_its_dequantised_weights() -> None:
    """The model-level oracle: every quantised GEMM is its dequantised weight's (within fp32 accumulation order),
    so the logit error against the unquantised model is the quantisation's, not the wiring's."""
    import copy

    from kernels.weight_quant import Int8Weight, dequant_int8

    dense = build_model(preset("k3-tiny-native"), seed=3)
    model = quantize_model_(copy.deepcopy(dense), "int8")
    held = dict(model.named_modules())
    with torch.no_grad():
        for name, m in dense.named_modules():
            q = getattr(held.get(name), "quantized", None)
            if isinstance(q, QuantizedLinear):
                m.weight.copy_(dequant_int8(Int8Weight(q.qweight, q.qscales)))
            elif isinstance(q, QuantizedExperts):
                m.w13_weight.copy_(dequant_int8(Int8Weight(q.w13.qweight, q.w13.qscales)))
                m.w2_weight.copy_(dequant_int8(Int8Weight(q.w2.qweight, q.w2.qscales)))
    ids = torch.randint(0, 4096, (29,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), dense(ids), rtol=0, atol=1e-4)
