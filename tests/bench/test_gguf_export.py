"""The kimi-linear GGUF exporter, read back with gguf's own reader: every tensor llama.cpp's kimi-linear loader
creates is there with the shape it asks for (ggml order, as in llama.cpp's `load_arch_tensors`), the converter's
transforms hold value for value, the metadata is what its `load_arch_hparams` reads, and the tensor types follow
the converter's rules. Runs without llama.cpp."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bench.llamacpp.gguf_export import ExportError, export_model
from radixk3.config import ModelConfig, preset
from radixk3.model import build_model
from radixk3.tensor_names import public_tensors


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """llama.cpp's kimi-linear tensors and their ggml shapes (ne), for `cfg`."""
    n, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.kda_head_dim
    h, p = cfg.num_attention_heads, cfg.kda_num_heads * cfg.kda_head_dim
    lora, rope, nope, vd = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    f, e, w = cfg.moe_intermediate_size, cfg.num_experts, cfg.conv_kernel_size
    out = {"token_embd.weight": (n, v), "output_norm.weight": (n,), "output.weight": (n, v)}
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (n,), b + "ffn_norm.weight": (n,)}
        if cfg.is_kda(i):
            out |= {b + f"ssm_conv1d_{x}.weight": (w, 1, p, 1) for x in "qkv"}
            out |= {b + f"attn_{x}.weight": (n, p) for x in "qkv"}
            out |= {b + "ssm_f_a.weight": (n, hd), b + "ssm_f_b.weight": (hd, p), b + "ssm_beta.weight": (n, h),
                    b + "ssm_a": (1, h, 1, 1), b + "ssm_dt.bias": (p,), b + "ssm_g_a.weight": (n, hd),
                    b + "ssm_g_b.weight": (hd, p), b + "ssm_norm.weight": (hd,), b + "attn_output.weight": (p, n)}
        else:
            out |= {b + "attn_kv_a_norm.weight": (lora,), b + "attn_q.weight": (n, h * (nope + rope)),
                    b + "attn_kv_a_mqa.weight": (n, lora + rope), b + "attn_k_b.weight": (nope, lora, h),
                    b + "attn_v_b.weight": (lora, vd, h), b + "attn_output.weight": (h * vd, n)}
        if i < cfg.first_k_dense_replace:
            ff = cfg.intermediate_size
            out |= {b + "ffn_gate.weight": (n, ff), b + "ffn_up.weight": (n, ff), b + "ffn_down.weight": (ff, n)}
        else:
            sf = f * cfg.num_shared_experts
            out |= {b + "ffn_gate_inp.weight": (n, e), b + "ffn_gate_exps.weight": (n, f, e),
                    b + "ffn_up_exps.weight": (n, f, e), b + "ffn_down_exps.weight": (f, n, e),
                    b + "ffn_gate_shexp.weight": (n, sf), b + "ffn_up_shexp.weight": (n, sf),
                    b + "ffn_down_shexp.weight": (sf, n), b + "exp_probs_b.bias": (e,)}
    return out


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return build_model(preset("k3-tiny"), seed=3)


def read(path: object) -> tuple[gguf.GGUFReader, dict[str, gguf.ReaderTensor]]:
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def field(r: gguf.GGUFReader, key: str) -> object:
    return r.fields[key].contents()


def test_f32_names_shapes_metadata_and_values(tiny: torch.nn.Module, tmp_path: object) -> None:
    cfg = tiny.config
    out = export_model(tiny, tmp_path / "m.gguf", "f32")
    r, tensors = read(out.path)
    want = expected_shapes(cfg)
    assert {k: tuple(int(x) for x in t.shape) for k, t in tensors.items()} == want
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    arch = "kimi-linear"
    assert field(r, "general.architecture") == arch
    assert field(r, f"{arch}.attention.head_count_kv") == [0 if cfg.is_kda(i) else 1 for i in range(4)]
    expect = {"block_count": 4, "embedding_length": 64, "vocab_size": 4096, "expert_count": 8,
              "expert_used_count": 2, "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
              "expert_group_count": 2, "expert_group_used_count": 1, "ssm.conv_kernel": 4, "kda.head_dim": 32,
              "attention.kv_lora_rank": 32, "rope.dimension_count": 8, "attention.key_length": 40,
              "attention.key_length_mla": 24, "attention.value_length_mla": 16, "expert_feed_forward_length": 32,
              "expert_shared_count": 1, "leading_dense_block_count": 1, "feed_forward_length": 128}
    assert {k: field(r, f"{arch}.{k}") for k in expect} == expect
    assert field(r, f"{arch}.expert_weights_scale") == pytest.approx(cfg.routed_scaling_factor)
    assert field(r, "tokenizer.ggml.model") == "none"  # ids one to one

    src = {k: v.detach() for k, v in public_tensors(tiny).items()}

    def data(name: str) -> torch.Tensor:  # numpy order (the reverse of ne)
        t = tensors[name]
        return torch.from_numpy(np.array(t.data)).reshape(tuple(int(x) for x in reversed(t.shape)))

    a_log = src["model.layers.0.self_attn.A_log"]
    torch.testing.assert_close(data("blk.0.ssm_a").flatten(), -torch.exp(a_log).flatten())
    torch.testing.assert_close(data("blk.0.ssm_dt.bias"), src["model.layers.0.self_attn.dt_bias"])
    conv = src["model.layers.0.self_attn.k_conv1d.weight"]  # [P, 1, W]
    torch.testing.assert_close(data("blk.0.ssm_conv1d_k.weight").reshape(conv.shape[0], -1), conv[:, 0])
    # kv_b_proj [H*(nope+v), lora] = per head [k_b^T ; v_b]
    h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
    k_b, v_b = data("blk.1.attn_k_b.weight"), data("blk.1.attn_v_b.weight")  # [H, lora, nope], [H, v, lora]
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, cfg.kv_lora_rank)
    torch.testing.assert_close(kv_b, src["model.layers.1.self_attn.kv_b_proj.weight"])
    assert k_b.shape[0] == h and k_b.shape[2] == nope
    for e in (0, cfg.num_experts - 1):
        torch.testing.assert_close(data("blk.2.ffn_down_exps.weight")[e],
                                   src[f"model.layers.2.block_sparse_moe.experts.{e}.w2.weight"])
        torch.testing.assert_close(data("blk.2.ffn_gate_exps.weight")[e],
                                   src[f"model.layers.2.block_sparse_moe.experts.{e}.w1.weight"])
    torch.testing.assert_close(data("blk.2.exp_probs_b.bias"),
                               src["model.layers.2.block_sparse_moe.gate.e_score_correction_bias"])


@pytest.mark.parametrize("file_type, qtype", [("bf16", gguf.GGMLQuantizationType.BF16),
                                              ("q4_0", gguf.GGMLQuantizationType.Q4_0)])
def test_quantised_types_follow_the_converter(tiny: torch.nn.Module, tmp_path: object, file_type: str,
                                              qtype: gguf.GGMLQuantizationType) -> None:
    out = export_model(tiny, tmp_path / f"m-{file_type}.gguf", file_type)
    _, tensors = read(out.path)
    kept = {name for name, t in tensors.items()
            if len(t.shape) <= 1 or name.endswith(("_norm.weight", ".bias", "ssm_a", "ffn_gate_inp.weight"))
            or "ssm_conv1d" in name}
    for name, t in tensors.items():
        blocks = qtype == gguf.GGMLQuantizationType.BF16 or int(t.shape[0]) % 32 == 0
        fallback = gguf.GGMLQuantizationType.F16  # rows not in whole 32-value blocks, as the converter does
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if name in kept else qtype if blocks else fallback), name
    assert any(t.tensor_type == qtype for t in tensors.values())
    assert set(tensors) == set(expected_shapes(tiny.config))


def test_refuses_what_kimi_linear_cannot_express() -> None:
    model = build_model(preset("k3-tiny-native"), seed=0)
    with pytest.raises(ExportError, match="kda_full_rank_gate"):
        export_model(model, "unused.gguf")
