"""The Triton kernels of kernels/ against their torch references at a model's shapes, for bench/gpu_check.py.

Each kernel check runs one op the way the engine calls it, once with RADIXK3_KERNELS=torch and once with =triton
on the same inputs (on CUDA: Triton compiled, the torch reference on the GPU too; on CPU tensors: Triton under its
interpreter, which is how the CI test runs these very functions at small shapes), compares every output and every
state it writes, and on CUDA times both. Shapes come from a preset (`ModelShapes.of`: heads, head dims, latent rank,
experts, vocabulary); token counts from `Sizes` (realistic ones on a GPU, a few tokens in CI). Tolerances are the
kernel tests' own (tests/kernels: 1e-4 between the Triton kernel and torch in fp32, bit for bit where the tests
say so), written next to each comparison with the reason; inputs are drawn O(1) as the model's layers make them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from bench.gpu_kernel_harness import (
    Comparison,
    Draw,
    KernelResult,
    ModelShapes,
    Sizes,
    bits_differ,
    both_backends,
    forced,
    max_error,
    median_ms,
)
from kernels.conv1d_pool import conv1d_decode, conv1d_prefill, conv1d_replay
from kernels.kda_pool import kda_decode, kda_prefill, kda_replay, kda_verify_padded
from kernels.mla_paged import mla_paged_decode, mla_paged_prefill, mla_store
from kernels.moe import moe_experts
from kernels.moe_route import moe_route
from kernels.paged_kv import PagedKV, paged_slots
from kernels.quant import dequant_experts
from kernels.sampling import LogitBias, TokenMask, sample
from kernels.sampling_columns import NEUTRAL, SamplingColumns
from kernels.sampling_tensors import SamplingTensors
from kernels.state_checkpoints import StateCheckpoints

FP32_TOL = 1e-4  # tests/kernels: Triton vs torch (and vs the references) in fp32
GPU_SIZES = Sizes(prefill_lens=(1024, 496, 37), decode_batch=64, window=4, mla_prefix=(0, 1024, 2000),
                  mla_new=(512, 64, 1), mla_decode_kv=4096, page_size=16, moe_tokens=256, expert_bytes=8 << 30,
                  sample_rows=64, dequant_rows=1024)
CPU_SIZES = Sizes(prefill_lens=(17, 3), decode_batch=3, window=3, mla_prefix=(0, 9), mla_new=(4, 1),
                  mla_decode_kv=20, page_size=4, moe_tokens=6, expert_bytes=1 << 30, sample_rows=6, dequant_rows=16)


def _cu(lens: tuple[int, ...] | list[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=device)


def _checkpoints(lens: tuple[int, ...], first_slot: int, device: torch.device) -> StateCheckpoints:
    """Checkpoints inside and at the ends of 16-token segments, the start and the end of each sequence."""
    pairs = sorted({(i, o) for i, n in enumerate(lens) for o in (0, 1, 16, 17, n // 2, n) if 0 <= o <= n})
    seq, off = zip(*pairs, strict=True)
    return StateCheckpoints(*(torch.tensor(x, dtype=torch.int64, device=device)
                              for x in (seq, off, range(first_slot, first_slot + len(pairs)))))


def kda_prefill_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """Chunked varlen KDA prefill from pool slots, with checkpoints: outputs and the whole pool."""
    d = Draw(device, 1)
    n, t = len(z.prefill_lens), sum(z.prefill_lens)
    x = d.kda_inputs(t, s)
    ck = _checkpoints(z.prefill_lens, n, device)
    pool0 = d.randn(n + len(ck.slot), s.kda_heads, s.head_dim, s.head_dim) * 0.1
    slots = torch.arange(n, device=device).flip(0)
    init = torch.arange(n, device=device) > 0  # the first sequence is fresh: its slot must not be read
    cu = _cu(z.prefill_lens, device)
    work = pool0.clone()

    def run(fresh: bool) -> tuple[Tensor, ...]:
        pool = pool0.clone() if fresh else work
        o = kda_prefill(*x, pool, state_slots=slots, cu_seqlens=cu, has_initial_state=init, checkpoints=ck)
        return o, pool

    return both_backends(s, device, run, ("output", "states"), (FP32_TOL, FP32_TOL))


def kda_decode_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """One decode token per sequence on its pool slot (the model's finished inputs): outputs and states."""
    d = Draw(device, 2)
    n = z.decode_batch
    x = d.kda_inputs(n, s)
    pool0 = d.randn(2 * n, s.kda_heads, s.head_dim, s.head_dim) * 0.1
    slots = d.perm(2 * n)[:n]
    work = pool0.clone()

    def run(fresh: bool) -> tuple[Tensor, ...]:
        pool = pool0.clone() if fresh else work
        return kda_decode(*x, pool, slots), pool

    return both_backends(s, device, run, ("output", "states"), (FP32_TOL, FP32_TOL))


def _window(d: Draw, s: ModelShapes, z: Sizes) -> tuple[tuple[Tensor, ...], Tensor, Tensor, Tensor]:
    """A verify window per sequence: inputs [N, W, ...], a pool, the slots, and tokens accepted per row."""
    n, w = z.decode_batch, z.window
    q, k, v, g, beta = d.kda_inputs(n * w, s)
    x = tuple(a.view(n, w, *a.shape[1:]) for a in (q, k, v, g, beta))
    pool = d.randn(2 * n, s.kda_heads, s.head_dim, s.head_dim) * 0.1
    slots = d.perm(2 * n)[:n]
    accepted = d.ints(w + 1, n)
    return x, pool, slots, accepted


def kda_replay_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """ReplaySSM's advance of each slot over its first accepted tokens: torch vs Triton, and on the Triton
    path replay == decode of those tokens bit for bit (one kernel serves both; the engine relies on it)."""
    d = Draw(device, 3)
    (q, k, v, g, beta), pool0, slots, accepted = _window(d, s, z)
    work = pool0.clone()

    def run(fresh: bool) -> tuple[Tensor, ...]:
        pool = pool0.clone() if fresh else work
        kda_replay(k, v, g, beta, pool, slots, accepted)
        return (pool,)

    res = both_backends(s, device, run, ("states",), (FP32_TOL,))
    with forced("triton"):
        replayed, decoded = run(True)[0], pool0.clone()
        for t in range(z.window):  # decode the rows that accepted more than t tokens, batch shrinking
            live = (accepted > t).nonzero().squeeze(1)
            if live.numel():
                kda_decode(q[live, t], k[live, t], v[live, t], g[live, t], beta[live, t], decoded, slots[live])
    same = Comparison("replay_vs_triton_decode", bits_differ(replayed, decoded), 0.0)
    return KernelResult(res.shapes, (*res.comparisons, same), res.triton_ms, res.torch_ms)


def kda_verify_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """A verify window (torch on every backend, as the engine runs it) against decode of the same tokens: bit
    for bit with torch decode (kda_verify's contract), within fp32 rounding of Triton decode (what a CUDA
    engine mixes: verify in torch, decode and replay in Triton). Timed: verify vs W Triton decode steps."""
    d = Draw(device, 4)
    (q, k, v, g, beta), pool0, slots, _ = _window(d, s, z)

    def verify() -> Tensor:
        return kda_verify_padded(q, k, v, g, beta, pool0, slots)

    def decode_steps() -> Tensor:
        pool = pool0.clone()
        return torch.stack([kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, slots)
                            for t in range(z.window)], dim=1)

    with forced("torch"):
        ref_torch = decode_steps()
    with forced("triton"):
        ref_triton = decode_steps()
        got = verify()
    comps = (Comparison("vs_torch_decode", bits_differ(got, ref_torch), 0.0),
             Comparison("vs_triton_decode", max_error(got, ref_triton), FP32_TOL))
    with forced("triton"):
        return KernelResult(s.name, comps, median_ms(decode_steps, device), median_ms(verify, device))


def conv_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """The short conv of a KDA layer (q|k|v channels): prefill with checkpoints, then a decode step, then a
    replay of accepted window tokens; outputs within fp32 rounding, conv states bit for bit (copied inputs)."""
    d = Draw(device, 5)
    c, width = 3 * s.kda_heads * s.head_dim, s.conv_kernel
    n, t = len(z.prefill_lens), sum(z.prefill_lens)
    x = d.randn(t, c)
    weight = d.randn(c, width) / width**0.5
    ck = _checkpoints(z.prefill_lens, n, device)
    pool0 = d.randn(n + len(ck.slot), c, width - 1)
    slots = torch.arange(n, device=device)
    init = torch.arange(n, device=device) > 0
    cu = _cu(z.prefill_lens, device)
    step = d.randn(n, c)
    window = d.randn(n, z.window, c)
    accepted = d.ints(z.window + 1, n)
    work = pool0.clone()

    def run(fresh: bool) -> tuple[Tensor, ...]:
        pool = pool0.clone() if fresh else work
        y = conv1d_prefill(x, weight, pool, state_slots=slots, cu_seqlens=cu, has_initial_state=init,
                           checkpoints=ck)
        after_prefill = pool.clone() if fresh else pool
        y_step = conv1d_decode(step, weight, pool, slots)
        after_decode = pool.clone() if fresh else pool
        conv1d_replay(window, pool, slots, accepted)
        return y, after_prefill, y_step, after_decode, pool

    return both_backends(s, device, run, ("prefill_output", "prefill_states", "decode_output", "decode_states",
                                          "replay_states"), (FP32_TOL, 0.0, FP32_TOL, 0.0, 0.0))


def _paged(d: Draw, kv_lens: list[int], page_size: int, width: int) -> tuple[PagedKV, Tensor]:
    """A page table over shuffled pages of a latent buffer, every cached row filled (RMS-normalised c_kv
    scale: O(1) values), spare rows NaN (a kernel that reads one shows it)."""
    pages = [-(-n // page_size) for n in kv_lens]
    order = d.perm(sum(pages) + 2).cpu()
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int64)
    for i, used in enumerate(torch.tensor([0, *pages]).cumsum(0)[:-1].tolist()):
        table[i, : pages[i]] = order[used : used + pages[i]]
    kv = PagedKV(table.to(d.device), torch.tensor(kv_lens, device=d.device), page_size)
    buf = torch.full(((sum(pages) + 2) * page_size, width), float("nan"), device=d.device)
    return kv, buf


def _latent_rows(d: Draw, kv: PagedKV, lens: list[int], starts: list[int], width: int) -> tuple[Tensor, Tensor]:
    """Slots and latent rows of positions [starts[i], lens[i]) of each sequence."""
    seq = torch.cat([torch.full((n - a,), i) for i, (a, n) in enumerate(zip(starts, lens, strict=True))])
    pos = torch.cat([torch.arange(a, n) for a, n in zip(starts, lens, strict=True)])
    slots = paged_slots(kv.block_table, seq.to(d.device), pos.to(d.device), kv.page_size)
    return slots, d.randn(len(seq), width)


def mla_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """Paged MLA: the latent store (bit for bit), prefill over a cached prefix (causal), and absorbed decode over
    sequences of spread lengths; timed: one store, prefill and decode call."""
    d = Draw(device, 6)
    width = s.kv_rank + s.rope_dim
    scale = (s.nope_dim + s.rope_dim) ** -0.5
    w_kv = d.randn(s.mla_heads * (s.nope_dim + s.v_dim), s.kv_rank) / s.kv_rank**0.5
    lens = [a + b for a, b in zip(z.mla_prefix, z.mla_new, strict=True)]
    kv, buf0 = _paged(d, lens, z.page_size, width)
    cached = _latent_rows(d, kv, lens, [0] * len(lens), width)
    buf0[cached[0]] = cached[1]
    new_slots, new_rows = _latent_rows(d, kv, lens, list(z.mla_prefix), width)
    t = sum(z.mla_new)
    qn, qp = d.randn(t, s.mla_heads, s.nope_dim), d.randn(t, s.mla_heads, s.rope_dim)
    cu_q = _cu(z.mla_new, device)
    dec_lens = (d.ints(z.mla_decode_kv, z.decode_batch) + 1).tolist()
    dkv, dbuf = _paged(d, dec_lens, z.page_size, width)
    drows = _latent_rows(d, dkv, dec_lens, [0] * len(dec_lens), width)
    dbuf[drows[0]] = drows[1]
    dqn, dqp = d.randn(z.decode_batch, s.mla_heads, s.nope_dim), d.randn(z.decode_batch, s.mla_heads, s.rope_dim)

    def prefill(buf: Tensor) -> Tensor:
        return mla_paged_prefill(qn, qp, buf, w_kv, kv, cu_q=cu_q, scale=scale)

    def decode() -> Tensor:
        return mla_paged_decode(dqn, dqp, dbuf, w_kv, dkv, scale=scale)

    work = buf0.clone()

    def run(fresh: bool) -> tuple[Tensor, ...]:
        buf = buf0.clone() if fresh else work
        mla_store(buf, new_slots, new_rows)
        return buf, prefill(buf), decode()

    return both_backends(s, device, run, ("store", "prefill_output", "decode_output"), (0.0, FP32_TOL, FP32_TOL))


def held_experts(s: ModelShapes, z: Sizes) -> int:
    """All the model's experts, or as many as `expert_bytes` holds (at least top_k)."""
    per_expert = 3 * s.expert_inter * s.expert_dim * 4
    return min(s.num_experts, max(s.top_k, z.expert_bytes // per_expert))


def moe_check(s: ModelShapes, z: Sizes, device: torch.device, dtype: torch.dtype) -> KernelResult:
    """The routed experts of one MoE layer (noaux_tc routing with a correction bias, groups as the model's, its
    GLU). fp32: Triton vs torch within fp32 rounding. bf16: Triton's bf16 result against torch in fp32 on the
    same bf16 values, within 4 * 2^-8 * max|ref| (inputs, weights, h and the output each rounded to 8 mantissa
    bits: the bound of tests/kernels/test_moe.py)."""
    if dtype == torch.bfloat16 and device.type != "cuda":
        return KernelResult(s.name, (), skipped="Triton's interpreter gets bf16 tl.dot wrong (numpy has no bf16): "
                                                "the bf16 expert kernels are checked compiled, on CUDA")
    d = Draw(device, 7)
    e = held_experts(s, z)
    groups = s.expert_groups if e % s.expert_groups == 0 else 1
    x = d.randn(z.moe_tokens, s.expert_dim)
    w13 = d.randn(e, 2 * s.expert_inter, s.expert_dim) / s.expert_dim**0.5
    w2 = d.randn(e, s.expert_dim, s.expert_inter) / s.expert_inter**0.5
    route = moe_route(d.randn(z.moe_tokens, e), top_k=min(s.top_k, e), correction_bias=0.05 * d.randn(e),
                      num_expert_group=groups, topk_group=min(s.topk_group, groups), routed_scaling_factor=s.scaling)
    xs, w13s, w2s = (a.to(dtype) for a in (x, w13, w2))

    def run() -> Tensor:
        return moe_experts(xs, route, w13s, w2s, s.act)

    with forced("torch"):
        want = moe_experts(xs.float(), route, w13s.float(), w2s.float(), s.act)
        ref_ms = median_ms(run, device)
    with forced("triton"):
        got = run()
        tri_ms = median_ms(run, device)
    tol = FP32_TOL if dtype == torch.float32 else 4 * 2**-8 * float(want.abs().max())
    return KernelResult(s.name, (Comparison(f"output_{str(dtype)[6:]}", max_error(got, want), tol),), tri_ms, ref_ms)


def sampling_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """The sampler over the full vocabulary with a grammar mask (xgrammar's packed bitmask) on half the rows,
    banned ids, logit biases, penalties, greedy and seeded rows with top-k / top-p / min-p: the same tokens on
    both backends (exact), and every masked row's token one its mask allows."""
    d = Draw(device, 8)
    n, vocab = z.sample_rows, s.vocab
    logits = d.randn(n, vocab) * 3
    kinds = [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 50}, {"temperature": 1.0, "top_p": 0.9},
             {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.2},
             {"temperature": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3}]
    rows = [NEUTRAL | kinds[i % len(kinds)] | {"seed": 1000 + i, "step": i} for i in range(n)]
    params = SamplingTensors.from_columns(SamplingColumns.from_rows(rows), device)
    history = [d.ints(vocab, i % 7).tolist() for i in range(n)]
    masked = torch.arange(0, n, 2)
    allowed = d.rand(len(masked), vocab).cpu() < 0.1
    bits = torch.nn.functional.pad(allowed, (0, -vocab % 32)).view(len(masked), -1, 32).long()
    words = (bits << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    mask = TokenMask(masked.to(device), bitmask.to(device))
    banned = [[int(h[0])] if h else [] for h in history]
    bias = LogitBias.of([(i, (7 * i) % vocab, 2.0) for i in range(1, n, 3)], device)

    def run() -> Tensor:
        return sample(logits, params, history, banned=banned, mask=mask, bias=bias).tokens

    with forced("torch"):
        want = run()
        ref_ms = median_ms(run, device)
    with forced("triton"):
        got = run()
        tri_ms = median_ms(run, device)
    drawn = got[masked.to(device)].cpu()
    obeys = bool(allowed[torch.arange(len(masked)), drawn].all())
    comps = (Comparison("tokens", bits_differ(got, want), 0.0),
             Comparison("masked_rows_draw_allowed_tokens", 0.0 if obeys else 1.0, 0.0))
    return KernelResult(s.name, comps, tri_ms, ref_ms)


def _packed(d: Draw, kind: str, e: int, r: int, c: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Random packed experts in a compressed-tensors format (`kernels.quant` states them)."""
    if kind == "mxfp4":
        return d.ints(256, e, r, c // 2).to(torch.uint8), (d.ints(16, e, r, c // 32) + 118).to(torch.uint8)
    if kind == "int4":
        words = (d.ints(2**32, e, r, c // 8) - 2**31).to(torch.int32)  # every nibble of a word drawn
        return words, (d.rand(e, r, c // 32) * 0.02).to(scale_dtype)
    codes = d.ints(256, e, r, c).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN codes: their payloads are the kernel's
    scale = (d.rand(e, -(-r // 128), -(-c // 128)) * 0.01).to(scale_dtype)
    return codes.view(torch.float8_e4m3fn), scale


def dequant_check(s: ModelShapes, z: Sizes, device: torch.device) -> KernelResult:
    """Dequantisation of routed experts (gate|up weights, `dequant_rows` rows of them) in MXFP4, INT4 and FP8
    blocks, to bf16 and fp32: bit for bit (the torch path is compressed-tensors' decompression bit for bit);
    timed: the top-k experts of a token in MXFP4 to bf16."""
    d = Draw(device, 9)
    e = min(s.num_experts, 2 * s.top_k)
    r, c = min(z.dequant_rows, 2 * s.expert_inter), s.expert_dim
    ids = d.perm(e)[: min(s.top_k, e)]
    comps, runs = [], {}
    for kind in ("mxfp4", "int4", "fp8"):
        for dtype in (torch.bfloat16, torch.float32):
            data, scale = _packed(d, kind, e, r, c, dtype)
            runs[(kind, dtype)] = lambda data=data, scale=scale, kind=kind, dtype=dtype: dequant_experts(
                kind, data, scale, ids, dtype)
            with forced("torch"):
                want = runs[(kind, dtype)]()
            with forced("triton"):
                got = runs[(kind, dtype)]()
            comps.append(Comparison(f"{kind}_{str(dtype)[6:]}", bits_differ(got, want), 0.0))
    timed = runs[("mxfp4", torch.bfloat16)]
    with forced("triton"):
        tri = median_ms(timed, device)
    with forced("torch"):
        ref = median_ms(timed, device)
    return KernelResult(s.name, tuple(comps), tri, ref)


KernelCheck = Callable[[ModelShapes, Sizes, torch.device], KernelResult]
KERNEL_CHECKS: dict[str, KernelCheck] = {
    "kda_prefill": kda_prefill_check,
    "kda_decode": kda_decode_check,
    "kda_replay": kda_replay_check,
    "kda_verify": kda_verify_check,
    "conv1d": conv_check,
    "mla_paged": mla_check,
    "moe_fp32": lambda s, z, dev: moe_check(s, z, dev, torch.float32),
    "moe_bf16": lambda s, z, dev: moe_check(s, z, dev, torch.bfloat16),
    "sampling_grammar_mask": sampling_check,
    "quant_dequant": dequant_check,
}
