"""What bench/gpu_kernel_checks.py builds its checks from: a model's shapes as the kernels see them, the token
counts of a run (a GPU's and CI's), seeded inputs drawn on the device, the backend switch, the comparison of two
runs of an op (largest difference against a tolerance, or bit for bit) and its CUDA-event timing."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kernels.backend import ENV_VAR
from kernels.glu import GLU
from kernels.kda import kda_gate, l2norm
from radixk3.config import ModelConfig

TIMING_REPEATS = 10


class ModelShapes(NamedTuple):
    """What the kernels see of a model: one layer's heads and dims, the experts, the vocabulary."""

    name: str
    kda_heads: int
    head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    mla_heads: int
    kv_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    expert_dim: int  # the routed experts' input dim (LatentMoE's, else the hidden size)
    expert_inter: int
    num_experts: int
    top_k: int
    expert_groups: int
    topk_group: int
    scaling: float
    act: GLU
    vocab: int

    @staticmethod
    def of(name: str, cfg: ModelConfig) -> ModelShapes:
        return ModelShapes(
            name, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size, cfg.kda_gate_lower_bound,
            cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
            cfg.routed_expert_hidden_size or cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
            cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group, cfg.routed_scaling_factor,
            GLU(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta), cfg.vocab_size,
        )  # fmt: skip


class Sizes(NamedTuple):
    """Token counts of one run of the kernel checks."""

    prefill_lens: tuple[int, ...]  # KDA / conv prefill: packed sequences (the first starts from a zero state)
    decode_batch: int  # KDA and MLA decode rows (the conv decodes its prefill sequences)
    window: int  # replay / verify window width
    mla_prefix: tuple[int, ...]  # MLA prefill: cached tokens before each sequence's new ones
    mla_new: tuple[int, ...]  # ... and its new tokens
    mla_decode_kv: int  # MLA decode: the longest cached sequence (lengths spread over [1, this])
    page_size: int
    moe_tokens: int
    expert_bytes: int  # fp32 bytes of routed experts held at once (K3's 896 do not fit one GPU)
    sample_rows: int
    dequant_rows: int  # dequantised experts' [rows, cols] = [2 * moe_inter, expert_dim] cut to this many rows


@dataclass(frozen=True)
class Comparison:
    """One output of an op under two runs: the largest difference and the bound it must stay within."""

    what: str
    max_err: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol


@dataclass(frozen=True)
class KernelResult:
    """A kernel at one model's shapes: its comparisons, and on CUDA the median ms of one call per backend."""

    shapes: str
    comparisons: tuple[Comparison, ...]
    triton_ms: float | None = None
    torch_ms: float | None = None
    skipped: str = ""  # why it did not run here (then no comparisons)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    def figures(self) -> dict[str, Any]:
        # inf (shapes or NaNs differ) as a string: JSON has no infinity
        out: dict[str, Any] = {c.what: {"max_err": c.max_err if math.isfinite(c.max_err) else str(c.max_err),
                                        "tol": c.tol} for c in self.comparisons}
        if self.triton_ms is not None and self.torch_ms is not None:
            out |= {"triton_ms": round(self.triton_ms, 4), "torch_ms": round(self.torch_ms, 4),
                    "torch_over_triton": round(self.torch_ms / self.triton_ms, 2)}
        return out


@contextmanager
def forced(backend: str) -> Iterator[None]:
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = backend
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


def max_error(got: Tensor, want: Tensor) -> float:
    """max |got - want| in fp32; inf when the shapes differ or NaNs do not sit at the same places."""
    if got.shape != want.shape:
        return float("inf")
    g, w = got.float(), want.float()
    if not torch.equal(g.isnan(), w.isnan()):
        return float("inf")
    both = ~g.isnan()
    return float((g[both] - w[both]).abs().max()) if bool(both.any()) else 0.0


def bits_differ(got: Tensor, want: Tensor) -> float:
    """0.0 when the two hold the same bits (NaN payloads and signed zeros included), else 1.0."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return 1.0
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return 0.0 if torch.equal(got.contiguous().view(ints), want.contiguous().view(ints)) else 1.0


def median_ms(fn: Callable[[], object], device: torch.device) -> float | None:
    """Median device time of one call (CUDA events, after a warm-up call); None off CUDA: CI takes no timings."""
    if device.type != "cuda":
        return None
    fn()
    times = []
    for _ in range(TIMING_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


Run = Callable[[bool], tuple[Tensor, ...]]


def both_backends(shapes: ModelShapes, device: torch.device, run: Run, names: tuple[str, ...],
                  tols: tuple[float, ...]) -> KernelResult:
    """`run(True)` (from a fresh copy of the state) under torch and under Triton: each named output within its
    tolerance (0: bit for bit); then `run(False)` timed for each on CUDA (on one working copy of the state, not
    copied per call: the same work, other values)."""
    with forced("torch"):
        want = run(True)
    with forced("triton"):
        got = run(True)
    comps = tuple(Comparison(n, bits_differ(g, w) if t == 0 else max_error(g, w), t)
                  for n, g, w, t in zip(names, got, want, tols, strict=True))
    with forced("triton"):
        tri = median_ms(lambda: run(False), device)
    with forced("torch"):
        ref = median_ms(lambda: run(False), device)
    return KernelResult(shapes.name, comps, tri, ref)


class Draw:
    """Seeded inputs drawn on the device itself (the largest, a 48B layer's experts, are gigabytes)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device, self.gen = device, torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int) -> Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device)

    def rand(self, *shape: int) -> Tensor:
        return torch.rand(*shape, generator=self.gen, device=self.device)

    def uniform(self, low: float, high: float, *shape: int) -> Tensor:
        return torch.empty(*shape, device=self.device).uniform_(low, high, generator=self.gen)

    def ints(self, high: int, *shape: int) -> Tensor:
        return torch.randint(0, high, shape, generator=self.gen, device=self.device)

    def perm(self, n: int) -> Tensor:
        return torch.randperm(n, generator=self.gen, device=self.device)

    def kda_gate(self, t: int, s: ModelShapes) -> Tensor:
        """Log-decays as the model's gate makes them from its initialisation (lower-bounded for K3)."""
        h, d = s.kda_heads, s.head_dim
        a_log = self.uniform(1, 16, h).log()
        if s.gate_lower_bound is not None:
            dt_bias = self.uniform(-3, -1, h * d)
        else:
            dt = self.uniform(math.log(1e-3), math.log(1e-1), h * d).exp()
            dt_bias = dt + torch.log(-torch.expm1(-dt))
        return kda_gate(self.randn(t, h, d), a_log, dt_bias, s.gate_lower_bound)

    def kda_inputs(self, t: int, s: ModelShapes) -> tuple[Tensor, ...]:
        h, d = s.kda_heads, s.head_dim
        q, k = (l2norm(self.randn(t, h, d)) for _ in range(2))
        return q, k, self.randn(t, h, d), self.kda_gate(t, s), self.rand(t, h)


