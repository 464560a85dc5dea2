"""Per-rank memory plan: what one request's KDA state and one token's MLA KV weigh, what the weights of one
rank weigh under a parallel layout, and what the unified pool left beside them holds.

The figures are the target model's, the ones the unified pool holds. MTP layers (native K3) are MLA layers with
their own latent KV when they run as a draft; that is reported apart and not added in.

Parallel layouts (`parallel_plan`):
- `--tp N [--ep M]`: one group of N ranks. Attention heads, the shared experts, the dense MLPs, the embedding
  and the LM head are split N ways; the routed experts are spread over all N ranks (E/M experts per EP rank,
  each expert's intermediate dim split over the N/M ranks inside it: E*I/N of the routed weights on every
  rank, whatever M); the router, LatentMoE's down/up projections, norms and the low-rank attention
  projections are replicated. Every request has a KDA state shard (H/N heads) on every rank; the MLA latent
  KV is not sharded (one 576-wide latent shared by all heads), so every rank holds every token's latent.
- `--dp D` replicas: D independent engines of `--tp N` each (N*D devices); each rank's figures are the tp N
  ones, and the system holds D times the requests and tokens.
- `--dp D --enable-dp-attention` (D divides N): N devices; attention is data-parallel, D groups of N/D ranks
  each serving its own requests with attention split N/D ways (each rank holds H*D/N KDA heads of its group's
  states: D times the state bytes of plain tp N, and attention weights D times larger), while the MoE, dense
  MLPs, embedding and head stay split over all N. The latent KV of a token lives only in its group, so the
  system holds D times the tokens of plain tp N for about the same memory.

The pool figures mirror `runtime.pool_layout` (state regions aligned to ALIGN bytes, KV pages of page_size
tokens); `radixk3` does not import `runtime`, and a test checks that the two agree.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import NamedTuple

from radixk3.config import ConfigError, ModelConfig
from radixk3.quant_format import DATA, SCALE, SHAPE, ExpertQuant

# runtime.pool_layout.ALIGN: every state region starts on this many bytes (checked equal in a test).
ALIGN = 256
# Bytes per routed-expert weight as stored: the model dtype, or a quantised checkpoint's format with its scales
# (`--expert-format` without a checkpoint; with `--model` the checkpoint's own format is counted exactly).
EXPERT_FORMATS = {
    "fp8": ExpertQuant("fp8", "float32").bytes_per_weight(),  # e4m3 + one fp32 scale per 128x128 block
    "mxfp4": ExpertQuant("mxfp4", "uint8").bytes_per_weight(),  # e2m1 + one e8m0 scale per 32 values
    "int4": ExpertQuant("int4", "bfloat16").bytes_per_weight(),  # 4 bits + one bf16 scale per 32 (K2-Thinking)
}


class MemoryPlan(NamedTuple):
    tp: int
    recurrent_bytes_per_layer: int
    conv_bytes_per_layer: int
    state_bytes_per_request: int  # all KDA layers on this rank
    kv_bytes_per_token: int  # all MLA layers on this rank (the latent is replicated across TP ranks)
    tokens_per_state: float  # how many tokens of KV one state weighs
    mtp_kv_bytes_per_token: int = 0  # all MTP layers, when they run as a draft


def memory_plan(cfg: ModelConfig, tp: int = 1) -> MemoryPlan:
    if tp < 1 or cfg.kda_num_heads % tp:
        raise ConfigError(f"--tp {tp} must divide the KDA head count {cfg.kda_num_heads}")
    heads = cfg.kda_num_heads // tp
    d = cfg.kda_head_dim
    elt = cfg.torch_dtype.itemsize
    recurrent = heads * d * d * 4  # fp32 state
    conv = (cfg.conv_kernel_size - 1) * 3 * heads * d * elt
    state = cfg.num_kda_layers * (recurrent + conv)
    kv = cfg.num_mla_layers * cfg.kv_dim * elt
    mtp_kv = cfg.num_nextn_predict_layers * cfg.kv_dim * elt
    return MemoryPlan(tp, recurrent, conv, state, kv, state / kv if kv else float("inf"), mtp_kv)


class WeightBytes(NamedTuple):
    """One rank's weights (rank 0; every rank holds the same amount up to vocabulary padding)."""

    routed_experts: int  # this rank's part of the routed experts
    sharded: int  # its part of every other split tensor (attention, shared experts, dense MLP, embedding, head)
    replicated: int  # tensors every rank holds whole (router, LatentMoE projections, norms, low-rank projections)

    @property
    def total(self) -> int:
        return self.routed_experts + self.sharded + self.replicated


class _Held(NamedTuple):
    numel: int
    routed_expert: bool
    packed_bytes: int | None  # a packed expert tensor's bytes (stored in the checkpoint's dtype), else None


@functools.lru_cache(maxsize=8)  # one `radixk3 plan` builds each layout once
def _meta_params(cfg: ModelConfig, tp: int, ep: int) -> dict[str, _Held]:
    """name -> what rank 0 holds of each parameter (and each packed expert tensor of a quantised checkpoint),
    from the model itself built on the meta device under that layout (no memory: the true-size presets too)."""
    import torch  # here: the CLI (and `serve`'s tokenizer process) imports this module without needing torch

    from radixk3.model import KimiForCausalLM
    from radixk3.parallel import ParallelState, parallel_state, set_parallel_state

    saved = parallel_state()
    set_parallel_state(ParallelState(tp_rank=0, tp_size=tp, ep_rank=0, ep_size=ep))
    try:
        with torch.device("meta"):
            model = KimiForCausalLM(cfg)
    finally:
        set_parallel_state(saved)
    held = {n: _Held(p.numel(), n.endswith(("experts.w13_weight", "experts.w2_weight")) and "shared" not in n, None)
            for n, p in model.named_parameters()}
    for n, b in model.named_buffers():
        if n.rsplit(".", 1)[-1] in (DATA, SCALE, SHAPE):
            held[n] = _Held(b.numel(), True, b.numel() * b.element_size())
    return held


@functools.lru_cache(maxsize=8)
def _quantized_bytes(cfg: ModelConfig, tp: int, ep: int, quantization: str) -> dict[str, int]:
    """name -> bytes rank 0 holds of each weight `--quantization` quantises (codes, scales, zeros), from the meta
    model under that layout and the quantiser's own plan (`weight_quant.plan_quantization`)."""
    import torch

    from radixk3.model import KimiForCausalLM
    from radixk3.parallel import ParallelState, parallel_state, set_parallel_state
    from radixk3.weight_quant import plan_quantization, quantized_bytes

    saved = parallel_state()
    set_parallel_state(ParallelState(tp_rank=0, tp_size=tp, ep_rank=0, ep_size=ep))
    try:
        with torch.device("meta"):
            model = KimiForCausalLM(cfg)
        planned = plan_quantization(model, quantization)
    finally:
        set_parallel_state(saved)
    return {w.name: quantized_bytes(w.shape, w.method, cfg.torch_dtype) for w in planned}


def weight_bytes(cfg: ModelConfig, tp: int = 1, ep: int = 1, attn_tp: int | None = None,
                 expert_format: str | None = None, quantization: str | None = None) -> WeightBytes:
    """Rank 0's weight bytes under `--tp tp --ep ep`; `attn_tp` (DP attention: tp / dp) splits the attention
    layers that many ways instead; `expert_format` stores the routed experts as fp8, mxfp4 or int4 (a model whose
    config has the checkpoint's own format, `expert_quant`, counts its packed tensors exactly); `quantization`
    (int8 / int4, weight-only at load) counts the weights it quantises as their codes and scales (the routed
    experts stay in `expert_format` when one is given)."""
    if expert_format is not None and expert_format not in EXPERT_FORMATS:
        raise ConfigError(f"unknown expert format {expert_format!r}; choose one of {sorted(EXPERT_FORMATS)}")
    if expert_format is not None and cfg.expert_quant is not None:
        raise ConfigError(f"--expert-format {expert_format}: the checkpoint's experts are {cfg.expert_quant.kind} "
                          "already (its quantization_config)")
    elt = cfg.torch_dtype.itemsize
    expert_elt = EXPERT_FORMATS[expert_format] if expert_format else Fraction(elt)
    whole = _meta_params(cfg, 1, 1)
    main = _meta_params(cfg, tp, ep)
    attn = main if attn_tp in (None, tp) else _meta_params(cfg, attn_tp, 1)
    quantized: dict[str, int] = {}
    if quantization is not None:
        quantized = _quantized_bytes(cfg, tp, ep, quantization)
        if attn_tp not in (None, tp):
            attn_q = _quantized_bytes(cfg, attn_tp, 1, quantization)
            quantized |= {n: b for n, b in attn_q.items() if ".self_attn." in n}
        if expert_format is not None:
            quantized = {n: b for n, b in quantized.items() if not main[n].routed_expert}
    routed = packed = sharded = replicated = 0  # elements (packed: bytes)
    q_routed = q_sharded = q_replicated = 0  # bytes of quantised weights
    for name, held in main.items():
        n = attn[name].numel if ".self_attn." in name else held.numel
        q = quantized.get(name)
        if held.packed_bytes is not None:
            packed += held.packed_bytes
        elif held.routed_expert:
            routed, q_routed = (routed + n, q_routed) if q is None else (routed, q_routed + q)
        elif n == whole[name].numel:
            replicated, q_replicated = (replicated + n, q_replicated) if q is None else (replicated, q_replicated + q)
        else:
            sharded, q_sharded = (sharded + n, q_sharded) if q is None else (sharded, q_sharded + q)
    return WeightBytes(int(-(-routed * expert_elt // 1)) + packed + q_routed, sharded * elt + q_sharded,
                       replicated * elt + q_replicated)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ParallelPlan(NamedTuple):
    tp: int
    ep: int
    dp: int
    dp_attention: bool
    attn_tp: int  # ways the attention (and a request's KDA state) is split
    devices: int
    weights: WeightBytes
    state_block_bytes: int  # one request's KDA state on one rank, aligned as in the pool
    kv_token_bytes: int  # one token's latent KV on one rank
    mem_bytes: int | None  # device memory per rank
    pool_bytes: int | None  # mem_bytes less the weights (negative: the weights do not fit; None: no mem_bytes)
    states_fit: int  # per rank, with the pool all states
    tokens_fit: int  # per rank, with the pool all KV
    groups: int  # independent request groups in the system (replicas or DP attention groups)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = self._asdict()
        out["weights"] = self.weights._asdict() | {"total": self.weights.total}
        out |= {"system_states_fit": self.states_fit * self.groups, "system_tokens_fit": self.tokens_fit * self.groups}
        return out


def pool_counts(state_block_bytes: int, kv_token_bytes: int, pool_bytes: int, page_size: int = 1) -> tuple[int, int]:
    """(state slots, token slots) of a pool of pool_bytes, as `runtime.pool_layout.PoolLayout.geometry`."""
    total = pool_bytes - pool_bytes % ALIGN
    return total // state_block_bytes, total // (page_size * kv_token_bytes) * page_size


def state_block_bytes(cfg: ModelConfig, tp: int) -> int:
    """One request's KDA state block on one rank, each region ALIGN-aligned (`PoolLayout.state_block_bytes`)."""
    mp = memory_plan(cfg, tp)
    return cfg.num_kda_layers * (round_up(mp.recurrent_bytes_per_layer, ALIGN)
                                 + round_up(mp.conv_bytes_per_layer, ALIGN))


def parallel_plan(cfg: ModelConfig, tp: int = 1, ep: int = 1, dp: int = 1, dp_attention: bool = False,
                  mem_bytes: int | None = None, expert_format: str | None = None,
                  quantization: str | None = None) -> ParallelPlan:
    for flag, v in (("--tp", tp), ("--ep", ep), ("--dp", dp)):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    if tp % ep:
        raise ConfigError(f"--ep {ep} must divide --tp {tp}")
    if dp_attention and tp % dp:
        raise ConfigError(f"--dp {dp} must divide --tp {tp} with DP attention")
    attn_tp = tp // dp if dp_attention else tp
    mp = memory_plan(cfg, attn_tp)
    weights = weight_bytes(cfg, tp, ep, attn_tp, expert_format, quantization)
    sb = state_block_bytes(cfg, attn_tp)
    pool = None if mem_bytes is None else mem_bytes - weights.total
    states, tokens = pool_counts(sb, mp.kv_bytes_per_token, pool) if pool is not None and pool > 0 else (0, 0)
    return ParallelPlan(tp, ep, dp, dp_attention, attn_tp, tp if dp_attention else tp * dp, weights, sb,
                        mp.kv_bytes_per_token, mem_bytes, pool, states, tokens, dp)


def parse_bytes(text: str) -> int:
    """'141e9', '141GB', '141G' (10^9), '128GiB' (2^30), or plain bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    s = text.strip().lower()
    for suffix, mult in units.items():
        if s.endswith(suffix) and s[: -len(suffix)].strip():
            return int(float(s[: -len(suffix)]) * mult)
    try:
        return int(float(s))
    except ValueError:
        raise ConfigError(f"--mem-bytes {text!r}: expected bytes, e.g. 141e9, 141GB or 128GiB") from None
