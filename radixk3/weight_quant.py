"""Weight-only int8 / int4 serving (`--quantization`, SGLang's and vLLM's spelling): a loaded, sharded model's
projections and routed experts quantised in place, computed by `kernels.weight_quant`'s CPU kernels.

What is quantised (as llama.cpp's Q8_0 / Q4_0 choose, for a fair race): every `Linear` that runs a GEMM on its
weight (attention / MLA / KDA projections, dense MLPs, shared experts, LatentMoE's down / up, MTP's eh_proj) and
each routed expert's gate|up and down; the LM head too, in int8 under both methods (llama.cpp keeps its output
matrix at 6-8 bits: Q6_K, or Q8_0 where the rows do not split in 256s). int4 needs K % 32 == 0 (whole groups),
int8 K % 16 == 0 (the kernel's vectors): a weight that does not fit int4 is int8, one that fits neither stays in
the model dtype (llama.cpp likewise falls back where a row does not split into its blocks).
Not quantised: the embedding (a row lookup, not a weight read per token), norms, the MoE router and its bias
(fp32 routing), KDA's A_log / dt_bias / short-conv weights (llama.cpp keeps ssm_conv1d, ffn_gate_inp and 1-D
tensors in f32 as well), AttnRes' one-row projections, MLA's kv_b_proj (MLA's attention reads it as a matrix to
absorb it, not through a GEMM), packed routed experts of a quantised checkpoint (they keep their own format), the
MTP shared head (never run) and a draft model.

Tensor parallelism: each rank quantises its shard, and the shard's codes are the whole weight's: int8 scales are
per output row, so a rank holding part of each row (row-parallel linears, the experts' down projections) takes
the row's amax over the group first; int4 groups run along the input dim, so a shard that would cut one (or
give a different choice from the whole weight's) is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from kernels.glu import GLU
from kernels.moe import moe_experts_by
from kernels.moe_route import MoERoute
from kernels.weight_quant import (
    GROUP,
    INT4_ROWS,
    INT8_K,
    METHODS,
    Int4Codes,
    Int4Weight,
    Int8Weight,
    fits,
    int4_mm,
    int8_mm,
    pack_int4,
    quantize_int4,
    quantize_int8,
    row_amax,
)
from radixk3.config import ConfigError
from radixk3.moe_layer import MoE
from radixk3.packed_experts import PackedWeights
from radixk3.parallel import all_reduce_max
from radixk3.parallel_linear import ColumnParallelLinear, Linear, ParallelLMHead, RowParallelLinear

# The buffers of a quantised weight: a model cast leaves them alone (their dtypes are the kernels').
QUANT_ATTRS = ("qweight", "qscales")
# MTP's own head (loaded, never run: the target's lm_head replaces it); MLA's kv_b_proj (read as a matrix).
NOT_QUANTIZED = ("shared_head.head", "kv_b_proj")
FALLBACK = ("int4", "int8")  # where a weight does not fit a method's kernel, the next one


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"--quantization must be one of {', '.join(METHODS)}, got {method!r}")


def weight_method(method: str, local: tuple[int, int], full: tuple[int, int], where: str) -> str | None:
    """int4, int8 or None (dense) for a [N, K] weight of which this rank holds `local` of the `full` one: the
    first of `method` and the methods below it whose kernel takes its K, the same on every rank as unsharded."""
    for how in FALLBACK[FALLBACK.index(method):]:
        if fits(how, full[1]) != fits(how, local[1]):
            raise ConfigError(f"{where}: a tensor-parallel shard {list(local)} of the weight {list(full)} does not "
                              f"split its inputs as {how} needs ({GROUP if how == 'int4' else INT8_K} a block): "
                              "choose another --tp / --ep")
        if fits(how, local[1]):
            return how
    return None


class QuantizedLinear(nn.Module):
    """The GEMM of one [N, K] weight, quantised: int8 (qweight [N, K] int8, qscales [N]) or int4 (qweight the
    packed codes, qscales [K/32, N, 2] scales and zeros)."""

    def __init__(self, method: str, weight: Int8Weight | Int4Weight) -> None:
        super().__init__()
        self.method = method
        self.rows = weight.rows if isinstance(weight, Int4Weight) else weight.q.shape[0]
        self.register_buffer("qweight", weight[0])
        self.register_buffer("qscales", weight[1])

    @classmethod
    def of(cls, method: str, w: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedLinear:
        if method == "int8":
            return cls(method, quantize_int8(w, amax))
        return cls(method, pack_int4(quantize_int4(w)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            return int8_mm(x, Int8Weight(self.qweight, self.qscales))
        return int4_mm(x, Int4Weight(self.qweight, self.qscales, self.rows))


class QuantizedStack(nn.Module):
    """One projection of every held expert, quantised: [E, ...] stacks of `QuantizedLinear`'s buffers."""

    def __init__(self, parts: list[QuantizedLinear]) -> None:
        super().__init__()
        self.method, self.rows = parts[0].method, parts[0].rows
        self.register_buffer("qweight", torch.stack([p.qweight for p in parts]))
        self.register_buffer("qscales", torch.stack([p.qscales for p in parts]))

    @classmethod
    def of(cls, method: str, w: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedStack:
        return cls([QuantizedLinear.of(method, w[e], None if amax is None else amax[e]) for e in range(w.shape[0])])

    def mm(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            return int8_mm(x, Int8Weight(self.qweight[e], self.qscales[e]))
        return int4_mm(x, Int4Weight(self.qweight[e], self.qscales[e], self.rows))


class QuantizedExperts(nn.Module):
    """The held routed experts' gate|up [E, 2I, D] and down [E, D, I], quantised; `forward` is `moe_experts`'
    grouped loop with their kernels."""

    def __init__(self, w13: QuantizedStack, w2: QuantizedStack, inter: int) -> None:
        super().__init__()
        self.w13, self.w2, self.inter = w13, w2, inter

    def forward(self, x: torch.Tensor, route: MoERoute, act: GLU) -> torch.Tensor:
        return moe_experts_by(x, route, self.w13.qweight.shape[0], self.inter, self.w13.mm, self.w2.mm, act)


def _full_shape(m: Linear) -> tuple[int, int]:
    """The unsharded [N, K] of a linear's weight."""
    if isinstance(m, ColumnParallelLinear):
        return sum(m.full_rows), m.in_features
    if isinstance(m, RowParallelLinear):
        return m.out_features, m.full_in
    if isinstance(m, ParallelLMHead):
        return m.padded_vocab, m.in_features
    return m.out_features, m.in_features


class Planned(NamedTuple):
    """One weight to quantise: the parameter's name, its local shape and the method it gets."""

    name: str
    shape: tuple[int, ...]
    method: str


def _linears(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not name.endswith(NOT_QUANTIZED) and m.quantized is None:
            yield name, m


def _moes(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m.experts.quant is None and m.experts.quantized is None:
            yield name, m


def _linear_method(method: str, name: str, m: Linear) -> str | None:
    if isinstance(m, ParallelLMHead):
        method = "int8"
    return weight_method(method, (m.out_features, m.in_features), _full_shape(m), name)


def _expert_methods(method: str, name: str, moe: MoE) -> tuple[str, str] | None:
    """The experts' gate|up and down methods, or None: they stay dense (both are quantised, or neither)."""
    ex = moe.experts
    d, i, full_i = ex.hidden, ex.intermediate, ex.full_intermediate
    m13 = weight_method(method, (2 * i, d), (2 * full_i, d), f"{name}.experts.w13")
    m2 = weight_method(method, (d, i), (d, full_i), f"{name}.experts.w2")
    return None if m13 is None or m2 is None else (m13, m2)


def plan_quantization(model: nn.Module, method: str) -> list[Planned]:
    """Which weights `quantize_model_` quantises and how (also on a meta-device model: nothing is read)."""
    check_method(method)
    out = []
    for n, m in _linears(model):
        how = _linear_method(method, n, m)
        if how is not None:
            out.append(Planned(f"{n}.weight", (m.out_features, m.in_features), how))
    for n, moe in _moes(model):
        both = _expert_methods(method, n, moe)
        if both is None:
            continue
        m13, m2 = both
        out.append(Planned(f"{n}.experts.w13_weight", tuple(moe.experts.w13_weight.shape), m13))
        out.append(Planned(f"{n}.experts.w2_weight", tuple(moe.experts.w2_weight.shape), m2))
    return out


def quantized_bytes(shape: tuple[int, ...], method: str, dtype: torch.dtype) -> int:
    """Bytes a weight of `shape` ([..., N, K]) holds quantised: codes plus scales (and zeros) in `dtype`."""
    scale = dtype.itemsize
    *lead, n, k = shape
    stacks = 1
    for s in lead:
        stacks *= s
    if method == "int8":
        return stacks * (n * k + n * scale)
    n16 = -(-n // INT4_ROWS) * INT4_ROWS  # the packing's padded rows
    return stacks * (n16 * k // 2 + (k // GROUP) * n16 * 2 * scale)


def _drop(module: nn.Module, attr: str) -> None:
    """Replace a dense parameter by an empty one of its dtype and device: the weight is held once, quantised."""
    p = getattr(module, attr)
    setattr(module, attr, nn.Parameter(p.new_empty(0), requires_grad=False))


@torch.no_grad()
def quantize_model_(model: nn.Module, method: str) -> nn.Module:
    """Quantise `model` (loaded, sharded, in its serving dtype) in place; every rank of a TP group calls this
    (row-parallel shards take their rows' amax over the group)."""
    check_method(method)
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"the model is quantised already ({model.quantization})")
    for name, m in list(_linears(model)):
        how = _linear_method(method, name, m)
        if how is None:
            continue
        amax = None
        if how == "int8" and isinstance(m, RowParallelLinear) and m.tp_size > 1:
            amax = all_reduce_max(row_amax(m.weight), m.tp_group)
        m.quantized = QuantizedLinear.of(how, m.weight, amax)
        _drop(m, "weight")
    for name, moe in list(_moes(model)):
        ex = moe.experts
        both = _expert_methods(method, name, moe)
        if both is None:
            continue
        m13, m2 = both
        amax = None
        if m2 == "int8" and moe.tp_size > 1:  # each rank holds part of every down row of its experts
            whole = ex.w2_weight.new_zeros(ex.num_experts, ex.hidden, dtype=torch.float32)
            whole[ex.held.start:ex.held.stop] = row_amax(ex.w2_weight)
            amax = all_reduce_max(whole, moe.tp_group)[ex.held.start:ex.held.stop]
        ex.quantized = QuantizedExperts(QuantizedStack.of(m13, ex.w13_weight),
                                        QuantizedStack.of(m2, ex.w2_weight, amax), ex.intermediate)
        _drop(ex, "w13_weight")
        _drop(ex, "w2_weight")
    dtype = model.lm_head.weight.dtype  # the serving dtype (a cast leaves the config's as loaded)
    for _, moe in list(_packed_int4(model, dtype)):
        ex = moe.experts
        assert ex.w1 is not None and ex.w2 is not None and ex.w3 is not None
        w13 = [QuantizedLinear("int4", pack_int4(_cat_rows(_int4_codes(ex.w1, j, dtype), _int4_codes(ex.w3, j, dtype))))
               for j in range(len(ex.held))]
        w2 = [QuantizedLinear("int4", pack_int4(_int4_codes(ex.w2, j, dtype))) for j in range(len(ex.held))]
        ex.quantized = QuantizedExperts(QuantizedStack(w13), QuantizedStack(w2), ex.intermediate)
        ex.w1 = ex.w2 = ex.w3 = None  # held once: in the kernel's layout
    model.quantization = method
    return model


def _packed_int4(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, MoE]]:
    """The MoEs whose routed experts a checkpoint ships as compressed-tensors INT4 with scales the model dtype
    holds exactly (K2-Thinking's bf16 ones, in a bf16 or fp32 model): the int4 kernel reads the same codes and
    scales (q * scale exact in fp32, where the library's dequantisation rounds it to the scales' dtype), so they
    run on it. Scales the model dtype would round, and MXFP4 / FP8 (no CPU kernel), keep the per-step
    dequantisation."""
    exact = {dtype, torch.bfloat16} if dtype == torch.float32 else {dtype}
    for name, m in model.named_modules():
        q = m.experts.quant if isinstance(m, MoE) else None
        if q is not None and q.kind == "int4" and q.scale_torch_dtype in exact and m.experts.quantized is None:
            yield name, m


def _int4_codes(packed: PackedWeights, j: int, dtype: torch.dtype) -> Int4Codes:
    """Held expert j of a compressed-tensors INT4 projection as the kernel's codes: each nibble holds q + 8 (byte j
    of a little-endian word: element 2j low, 2j + 1 high), which the kernel reads as (code - 8) * scale + zero with
    zero 0: q * scale."""
    if sys.byteorder != "little":
        raise NotImplementedError("INT4 packed weights are read as little-endian bytes")
    data = packed.q_data[j].contiguous().view(torch.uint8)  # [R, C / 2]
    q = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(data.shape[0], -1).to(torch.int32)
    scale = packed.q_scale[j].to(dtype)  # [R, C / 32], exactly (`_packed_int4`)
    scales_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).transpose(0, 1).contiguous()
    return Int4Codes(q, scales_zeros)


def _cat_rows(a: Int4Codes, b: Int4Codes) -> Int4Codes:
    return Int4Codes(torch.cat([a.q, b.q]), torch.cat([a.scales_zeros, b.scales_zeros], dim=1))
