"""The weight-bandwidth floor of a batch-1 decode step on this machine.

A batch-1 decode token must read every weight it uses once: the dense weights (attention, dense MLPs, shared
experts, routers, norms), the routed experts it is sent to (`num_experts_per_token` of them per MoE layer), the
lm_head, and one row of the embedding. Their bytes in the served dtype, over this machine's streaming read rate
(the best of a few reductions of an fp32 tensor of that many bytes: a model small enough to stay in the last-level
cache between steps is read at the cache's rate, a larger one at DRAM's), is the floor: no decode step at batch 1
can be faster. The bench reports each backend's step as a multiple of it (the issue's target: within 1.3x), and
the DRAM rate (a tensor far larger than the caches) beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import torch

from radixk3.config import ModelConfig

DRAM_BYTES = 1 << 30  # far beyond any last-level cache


@dataclass(frozen=True)
class TokenBytes:
    dense: int  # every weight but the routed experts and the embedding
    routed_used: int  # the routed experts one token is sent to
    embedding_row: int

    @property
    def total(self) -> int:
        return self.dense + self.routed_used + self.embedding_row


def token_bytes(cfg: ModelConfig, bytes_per_value: Fraction | float) -> TokenBytes:
    """Weight bytes one batch-1 decode token reads, the model's weights stored at `bytes_per_value`."""
    from radixk3.model import KimiForCausalLM

    with torch.device("meta"):
        model = KimiForCausalLM(cfg)
    dense = used = 0
    for name, p in model.named_parameters():
        if "mtp_layers" in name:  # plain decode never runs the MTP layers
            continue
        if name.endswith(("experts.w13_weight", "experts.w2_weight")) and "shared" not in name:
            used += p.numel() // p.shape[0] * cfg.num_experts_per_token  # [E, ...]: k of the E experts
        elif "embed_tokens" not in name:
            dense += p.numel()
    b = Fraction(bytes_per_value)
    return TokenBytes(int(dense * b), int(used * b), int(cfg.hidden_size * b))


def read_rate(nbytes: int, threads: int | None = None, repeats: int = 5) -> float:
    """This machine's streaming read rate over `nbytes`, bytes/s: the best of `repeats` sums of an fp32 tensor."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        x = torch.ones(max(nbytes // 4, 1))
        x.sum()  # pages touched, code warm
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
    return x.numel() * 4 / best


@dataclass(frozen=True)
class Floor:
    bytes_per_token: int
    read_bytes_per_s: float

    @property
    def seconds(self) -> float:
        return self.bytes_per_token / self.read_bytes_per_s

    def multiple(self, step_seconds: float | None) -> float | None:
        return None if step_seconds is None else step_seconds / self.seconds

    def as_dict(self) -> dict[str, float]:
        return {"bytes_per_token": self.bytes_per_token, "read_gb_s": self.read_bytes_per_s / 1e9,
                "floor_ms": self.seconds * 1e3}
