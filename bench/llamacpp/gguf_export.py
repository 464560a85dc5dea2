"""Write a radixk3 Kimi-Linear checkpoint as a GGUF file of llama.cpp's `kimi-linear` architecture.

The file is what llama.cpp's own converter (`convert_hf_to_gguf.py`, `KimiLinearModel`) would write for the same
checkpoint, built with `gguf`'s writer and its tensor-name map; what the converter changes on the way:
- `A_log` is stored as `-exp(A_log)` (llama.cpp multiplies the decay by it directly), `dt_bias` as
  `ssm_dt.bias`;
- the short-conv weights [P, 1, W] become numpy (1, P, 1, W), i.e. ggml ne = [W, 1, P, 1];
- the routed experts are stacked per layer into `ffn_{gate,up,down}_exps` [E, out, in];
- `kv_b_proj` [H * (nope + v), kv_lora] is split per head into `attn_k_b` (transposed: [H, kv_lora, nope]) and
  `attn_v_b` [H, v, kv_lora], so that llama.cpp caches the latent (MLA as MQA: `head_count_kv` 1);
- `head_count_kv` is per layer: 0 marks a KDA (recurrent) layer, 1 an MLA layer;
- the router is sigmoid-gated with the correction bias as `exp_probs_b.bias`.
The vocabulary is llama.cpp's `none` model with `vocab_size` dummy tokens: ids map one to one, prompts go in as
token ids and nothing is tokenised.

Tensor types follow the converter's rules: 1-D tensors, norms, the router, the conv weights and every tensor that
is not a `.weight` stay f32; the rest take the file type (f32, bf16, or Q8_0 / Q4_0 through gguf's quants; a
tensor whose rows do not split into 32-value blocks falls back to f16, as the converter does).

    python bench/llamacpp/gguf_export.py CHECKPOINT OUT.gguf [--type f32|bf16|q8_0|q4_0]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from radixk3.config import ModelConfig  # noqa: E402

ARCH = gguf.MODEL_ARCH.KIMI_LINEAR
FILE_TYPES = {
    "f32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, gguf.GGMLQuantizationType.Q4_0),
}
# Tensors llama.cpp (and its converter) keep in f32 whatever the file type.
F32_ALWAYS = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.SSM_CONV1D_Q, gguf.MODEL_TENSOR.SSM_CONV1D_K,
              gguf.MODEL_TENSOR.SSM_CONV1D_V)
# llama.cpp reads no context length from the model's math (MLA here has no rotary embedding): a bound only.
CONTEXT_LENGTH = 32768


class ExportError(ValueError):
    """The checkpoint uses something llama.cpp's `kimi-linear` cannot express; the message says what."""


@dataclass(frozen=True)
class Exported:
    path: Path
    file_type: str
    tensors: int
    weight_bytes: int  # bytes of tensor data in the file


def check_supported(cfg: ModelConfig) -> None:
    """Refuse what `kimi-linear` has no place for (the K3 switches, MoE every other layer, KDA head counts that
    differ from MLA's: llama.cpp has one head count for both)."""
    problems = []
    k3 = {"kda_full_rank_gate": False, "kda_gate_lower_bound": None, "mla_use_output_gate": False,
          "attn_res_block_size": None, "routed_expert_hidden_size": None, "hidden_act": "silu"}
    problems += [f"{k}={getattr(cfg, k)!r}" for k, off in k3.items() if getattr(cfg, k) != off]
    if cfg.moe_layer_freq != 1:
        problems.append(f"moe_layer_freq={cfg.moe_layer_freq} (llama.cpp: every layer after the dense lead is MoE)")
    if cfg.kda_num_heads != cfg.num_attention_heads:
        problems.append(f"kda_num_heads={cfg.kda_num_heads} != num_attention_heads={cfg.num_attention_heads}")
    if cfg.num_shared_experts < 1:
        problems.append("no shared expert (llama.cpp's kimi-linear graph always adds one)")
    if not cfg.moe_renormalize:
        problems.append("moe_renormalize=False (llama.cpp's kimi-linear graph always renormalises)")
    if cfg.expert_quant is not None:
        problems.append("packed experts (export the dense checkpoint)")
    if problems:
        raise ExportError("llama.cpp's kimi-linear cannot express: " + ", ".join(problems))


def write_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, file_type: gguf.LlamaFileType) -> None:
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([0 if cfg.is_kda(i) else 1 for i in range(cfg.num_hidden_layers)])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_token)
    if cfg.num_expert_group > 1:
        w.add_expert_group_count(cfg.num_expert_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_file_type(file_type)
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.conv_kernel_size)
    w.add_kda_head_dim(cfg.kda_head_dim)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # the cached latent row: MLA as MQA
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.num_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_tokenizer_model("none")  # ids one to one: `vocab_size` dummy tokens
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)


def gguf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor in the GGUF's numpy layout) for every public (Kimi-Linear) tensor of the checkpoint."""
    names = gguf.get_tensor_name_map(ARCH, cfg.num_hidden_layers)
    h = cfg.num_attention_heads
    for layer in range(cfg.num_hidden_layers):  # the experts, stacked
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        if f"{pre}.0.w1.weight" not in tensors:
            continue
        for wid, kind in (("w1", gguf.MODEL_TENSOR.FFN_GATE_EXP), ("w2", gguf.MODEL_TENSOR.FFN_DOWN_EXP),
                          ("w3", gguf.MODEL_TENSOR.FFN_UP_EXP)):
            stacked = torch.stack([tensors[f"{pre}.{e}.{wid}.weight"] for e in range(cfg.num_experts)])
            yield gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight", stacked
    for name, t in tensors.items():
        if ".block_sparse_moe.experts." in name:
            continue
        if name.endswith(".block_sparse_moe.gate.e_score_correction_bias"):
            layer = int(name.split(".")[2])
            yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B].format(bid=layer) + ".bias", t
            continue
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            t = t.reshape(1, t.shape[0], 1, t.shape[-1])
        elif name.endswith("kv_b_proj.weight"):
            nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
            k_b, v_b = t.view(h, nope + v, cfg.kv_lora_rank).split([nope, v], dim=1)
            yield _mapped(names, name.replace("kv_b_proj", "k_b_proj")), k_b.transpose(1, 2)
            yield _mapped(names, name.replace("kv_b_proj", "v_b_proj")), v_b
            continue
        yield _mapped(names, name), t


def _mapped(names: gguf.TensorNameMap, name: str) -> str:
    new = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if new is None:
        raise ExportError(f"no kimi-linear GGUF name for checkpoint tensor {name!r}")
    return new


def tensor_type(name: str, ndim: int, wanted: gguf.GGMLQuantizationType, layer: int | None
                ) -> gguf.GGMLQuantizationType:
    """The converter's rule: 1-D, norms, non-`.weight` tensors and the always-f32 kinds stay f32."""
    if ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    if layer is not None and any(name == gguf.TENSOR_NAMES[k].format(bid=layer) + ".weight" for k in F32_ALWAYS):
        return gguf.GGMLQuantizationType.F32
    return wanted


def encode(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # rows that are not whole 32-value blocks: the converter's fallback
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def export_model(model: torch.nn.Module, out: str | Path, file_type: str = "f32") -> Exported:
    """Write `model` (a radixk3 `KimiForCausalLM`, unsharded) as a `kimi-linear` GGUF of `file_type`."""
    from radixk3.tensor_names import public_tensors

    cfg: ModelConfig = model.config  # type: ignore[assignment]
    check_supported(cfg)
    if file_type not in FILE_TYPES:
        raise ExportError(f"file type {file_type!r} is not one of {sorted(FILE_TYPES)}")
    ftype, wanted = FILE_TYPES[file_type]
    tensors = {k: v.detach().to("cpu", torch.float32) for k, v in public_tensors(model).items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[ARCH])
    write_metadata(w, cfg, ftype)
    count = nbytes = 0
    for name, t in gguf_tensors(cfg, tensors):
        parts = name.split(".")
        layer = int(parts[1]) if parts[0] == "blk" else None
        data = t.contiguous().numpy()
        encoded, qtype = encode(data, tensor_type(name, data.ndim, wanted, layer))
        w.add_tensor(name, encoded, raw_dtype=qtype)
        count += 1
        nbytes += encoded.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Exported(out, file_type, count, nbytes)


def export_checkpoint(ckpt: str | Path, out: str | Path, file_type: str = "f32") -> Exported:
    from radixk3.checkpoint import load_model

    return export_model(load_model(ckpt, dtype=torch.float32), out, file_type)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", choices=sorted(FILE_TYPES), default="f32")
    a = ap.parse_args(argv)
    e = export_checkpoint(a.checkpoint, a.out, a.type)
    print(f"{e.path}: kimi-linear, {e.file_type}, {e.tensors} tensors, {e.weight_bytes / 1e6:.1f} MB of weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
