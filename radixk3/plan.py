"""Per-rank memory plan: what one request's KDA state and one token's MLA KV weigh.

The figures are the target model's, the ones the unified pool holds. MTP layers (native K3) are MLA layers with
their own latent KV when they run as a draft; that is reported apart and not added in.
"""

from __future__ import annotations

from typing import NamedTuple

from radixk3.config import ConfigError, ModelConfig


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
