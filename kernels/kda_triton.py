"""Triton KDA over pool-resident states: chunked varlen prefill with checkpoints, and the fused recurrence
that serves both decode and replay (one kernel, so the two agree bit for bit).

Prefill: one program per (sequence, head, block of V). It walks its sequence in segments of at most BT = 16
tokens (cut at every 16 tokens and at every checkpoint offset, planned on the host), keeping the state
[K, V-block] in registers, and per segment forms the WY/UT terms exactly: pairwise decays are running sums
of log-decays over the tokens between j and i (never differences of cumulative sums), the unit-lower
triangular inverse is a forward substitution. No autotuning: block sizes are fixed by the shapes, so the
kernels also run under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.kda import KDAGate, seq_bounds
from kernels.state_checkpoints import StateCheckpoints
from kernels.triton_launch import kernel, outer_stride

BT = 16  # segment length of the Triton prefill (tl.dot needs >= 16)


@kernel
def _kda_prefill_kernel(
    q, k, v, g, beta, o, pool,
    seg_start, seg_len, seg_ckpt, seq_seg_lo, seq_seg_hi, seq_slot, seq_init,
    scale, slot_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, COMMIT: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    state_off = i_h * K * V + offs_k[:, None] * V + offs_v[None, :]
    slot = tl.load(seq_slot + i_n).to(tl.int64)
    has_init = tl.load(seq_init + i_n)
    s = tl.load(pool + slot * slot_stride + state_off, mask=mkv & (has_init != 0), other=0.0).to(tl.float32)
    rows = offs_t[:, None]
    cols = offs_t[None, :]
    lo = tl.load(seq_seg_lo + i_n)
    hi = tl.load(seq_seg_hi + i_n)
    for seg in range(lo, hi):
        start = tl.load(seg_start + seg).to(tl.int64)
        length = tl.load(seg_len + seg)
        mt = offs_t < length
        tok = start + offs_t
        mtk = mt[:, None] & mk[None, :]
        qv = tl.load(q + tok[:, None] * H * K + i_h * K + offs_k[None, :], mask=mtk, other=0.0) * scale
        kv = tl.load(k + tok[:, None] * H * K + i_h * K + offs_k[None, :], mask=mtk, other=0.0)
        gv = tl.load(g + tok[:, None] * H * K + i_h * K + offs_k[None, :], mask=mtk, other=0.0)
        # g of the next token within the segment, for suffix sums that never subtract
        nxt = (offs_t + 1 < length)[:, None] & mk[None, :]
        gn = tl.load(g + (tok + 1)[:, None] * H * K + i_h * K + offs_k[None, :], mask=nxt, other=0.0)
        vv = tl.load(v + tok[:, None] * H * V + i_h * V + offs_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        bv = tl.load(beta + tok * H + i_h, mask=mt, other=0.0)
        a_qk = tl.zeros([BT, BT], dtype=tl.float32)
        a_kk = tl.zeros([BT, BT], dtype=tl.float32)
        for j in tl.static_range(BT):
            # D[i] = sum_{j < t <= i} g_t (0 for i <= j): a running sum from j on
            dj = tl.cumsum(tl.where(rows > j, gv, 0.0), axis=0)
            kj = tl.sum(tl.where(rows == j, kv, 0.0), axis=0)
            ekj = tl.exp(dj) * kj[None, :]
            a_qk = tl.where(cols == j, tl.sum(qv * ekj, axis=1)[:, None], a_qk)
            a_kk = tl.where(cols == j, tl.sum(kv * ekj, axis=1)[:, None], a_kk)
        a_qk = tl.where(rows >= cols, a_qk, 0.0)
        a_kk = tl.where(rows > cols, a_kk * bv[:, None], 0.0)
        # X = (I + A_kk)^-1 by forward substitution, row by row
        x = tl.where(rows == cols, 1.0, 0.0)
        for i in tl.static_range(1, BT):
            a_row = tl.sum(tl.where(rows == i, a_kk, 0.0), axis=0)
            new = tl.where(offs_t == i, 1.0, 0.0) - tl.sum(a_row[:, None] * x, axis=0)
            x = tl.where(rows == i, new[None, :], x)
        cum = tl.cumsum(gv, axis=0)
        eg = tl.exp(cum)
        w = tl.dot(x, bv[:, None] * eg * kv, input_precision="ieee")
        u = tl.dot(x, bv[:, None] * vv, input_precision="ieee")
        v_new = u - tl.dot(w, s, input_precision="ieee")
        out = tl.dot(qv * eg, s, input_precision="ieee") + tl.dot(a_qk, v_new, input_precision="ieee")
        tl.store(o + tok[:, None] * H * V + i_h * V + offs_v[None, :], out, mask=mt[:, None] & mv[None, :])
        to_last = tl.exp(tl.cumsum(gn, axis=0, reverse=True))  # exp(sum_{t > i} g_t)
        total = tl.sum(gv, axis=0)
        s = tl.exp(total)[:, None] * s + tl.dot(tl.trans(kv * to_last), v_new, input_precision="ieee")
        ck = tl.load(seg_ckpt + seg).to(tl.int64)
        tl.store(pool + ck * slot_stride + state_off, s, mask=mkv & (ck >= 0))
    if COMMIT:
        tl.store(pool + slot * slot_stride + state_off, s, mask=mkv)


def _pool_stride(state_pool: Tensor, h: int, kdim: int, vdim: int) -> int:
    """The slot stride of a [num_slots, H, K, V] fp32 pool (a pool-buffer view: slots strided, each contiguous)."""
    if state_pool.dtype != torch.float32 or tuple(state_pool.shape[1:]) != (h, kdim, vdim):
        raise ValueError(
            f"the Triton KDA kernels want an fp32 [num_slots, {h}, {kdim}, {vdim}] state pool, got "
            f"{state_pool.dtype} {tuple(state_pool.shape)}"
        )
    return outer_stride(state_pool, "KDA state pool")


def _blocks(kdim: int, vdim: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(kdim)), min(64, max(16, triton.next_power_of_2(vdim)))


def _segments(
    bounds: list[int], checkpoints: StateCheckpoints | None, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Host plan: segments of <= BT tokens per sequence, cut at checkpoint offsets (all > 0 here); the slot
    each segment's end state goes to (-1: none). Returns (start, len, ckpt slot, per-sequence segment range)."""
    n = len(bounds) - 1
    want: list[dict[int, int]] = [{} for _ in range(n)]
    if checkpoints is not None:
        for (seq, off), slot in zip(checkpoints.pairs(), checkpoints.slot.tolist(), strict=True):
            if not 0 < off <= bounds[seq + 1] - bounds[seq]:
                raise ValueError(f"checkpoint offset {off} outside (0, len] of sequence {seq}")
            want[seq][off] = slot
    starts: list[int] = []
    lens: list[int] = []
    cks: list[int] = []
    lo: list[int] = []
    hi: list[int] = []
    for i in range(n):
        length = bounds[i + 1] - bounds[i]
        edges = sorted(set(range(0, length, BT)) | set(want[i]) | {length})
        lo.append(len(starts))
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            starts.append(bounds[i] + a)
            lens.append(b - a)
            cks.append(want[i].get(b, -1))
        hi.append(len(starts))

    def as_t(x: list[int]) -> Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    return as_t(starts), as_t(lens), as_t(cks), as_t(lo), as_t(hi)


def kda_prefill_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_slots: Tensor,
    cu_seqlens: Tensor | None,
    has_initial_state: Tensor | None,
    checkpoints: StateCheckpoints | None,
    scale: float,
    commit: bool,
) -> Tensor:
    t, h, kdim = q.shape
    vdim = v.shape[-1]
    stride = _pool_stride(state_pool, h, kdim, vdim)
    bounds = seq_bounds(cu_seqlens, t)
    n = len(bounds) - 1
    # offset-0 checkpoints are the initial states themselves: copy them before the kernel overwrites slots
    if checkpoints is not None and bool((checkpoints.offset == 0).any()):
        zero = checkpoints.offset == 0
        src = state_slots[checkpoints.seq[zero]]
        init = state_pool[src]
        if has_initial_state is not None:
            init = torch.where(has_initial_state[checkpoints.seq[zero]].view(-1, 1, 1, 1).bool(), init, 0.0)
        state_pool[checkpoints.slot[zero]] = init
        checkpoints = StateCheckpoints(*(x[~zero] for x in checkpoints))
    starts, lens, cks, lo, hi = _segments(bounds, checkpoints, q.device)
    init_flags = (
        torch.ones(n, dtype=torch.int32, device=q.device)
        if has_initial_state is None
        else has_initial_state.to(device=q.device, dtype=torch.int32)
    )
    qf, kf, vf, gf, bf = (x.float().contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(t, h, vdim, dtype=torch.float32, device=q.device)
    bk, bv = _blocks(kdim, vdim)
    _kda_prefill_kernel[(n, h, triton.cdiv(vdim, bv))](
        qf, kf, vf, gf, bf, o, state_pool, starts, lens, cks, lo, hi, state_slots.contiguous(), init_flags,
        scale, stride, H=h, K=kdim, V=vdim, BT=BT, BK=bk, BV=bv, COMMIT=commit,
    )  # fmt: skip
    return o.to(v.dtype)


@kernel
def _kda_recurrent_kernel(
    q, k, v, g, beta, o, pool, slots, ntok, a_log, dt_bias,
    L, scale, lower_bound, slot_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_Q: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BETA_LOGITS: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    """State in registers over the first ntok[n] of L tokens; GATE 0: g is the log-decay, 1: softplus gate
    from raw g, 2: lower-bounded sigmoid gate from raw g."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    slot = tl.load(slots + i_n).to(tl.int64)
    ptr_s = pool + slot * slot_stride + i_h * K * V + offs_k[:, None] * V + offs_v[None, :]
    s = tl.load(ptr_s, mask=mkv, other=0.0).to(tl.float32)
    n_tok = tl.load(ntok + i_n)
    if GATE != 0:
        a = tl.exp(tl.load(a_log + i_h).to(tl.float32))
        if HAS_DT_BIAS:
            bias = tl.load(dt_bias + i_h * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros([BK], dtype=tl.float32)
    for t in range(0, n_tok):
        row = i_n * L + t
        kt = tl.load(k + (row * H + i_h) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + (row * H + i_h) * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g + (row * H + i_h) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        bt = tl.load(beta + row * H + i_h).to(tl.float32)
        if GATE == 1:
            x = gt + bias
            gt = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        if GATE == 2:
            gt = lower_bound / (1.0 + tl.exp(-(a * (gt + bias))))
        if BETA_LOGITS:
            bt = 1.0 / (1.0 + tl.exp(-bt))
        if L2NORM:
            kt = kt / tl.sqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        s = s * tl.exp(gt)[:, None]
        ks = tl.sum(kt[:, None] * s, axis=0)
        s = s + (bt * kt)[:, None] * (vt - ks)[None, :]
        if HAS_Q:
            qt = tl.load(q + (row * H + i_h) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
            if L2NORM:
                qt = qt / tl.sqrt(tl.sum(qt * qt, axis=0) + 1e-6)
            ot = tl.sum((qt * scale)[:, None] * s, axis=0)
            tl.store(o + (row * H + i_h) * V + offs_v, ot, mask=mv)
    tl.store(ptr_s, s, mask=mkv)


def kda_recurrent_pool_triton(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_slots: Tensor,
    num_tokens: Tensor,
    scale: float,
    gate: KDAGate | None,
    beta_logits: bool,
    qk_l2norm: bool,
) -> Tensor | None:
    """k, g [N, L, H, K], v [N, L, H, V], beta [N, L, H], q like k or None; returns o [N, L, H, V] fp32 (rows
    past num_tokens unset) when q is given."""
    n, length, h, kdim = k.shape
    vdim = v.shape[-1]
    stride = _pool_stride(state_pool, h, kdim, vdim)
    bk, bv = _blocks(kdim, vdim)
    kc, vc, gc, bc = (x.contiguous() for x in (k, v, g, beta))
    qc = q.contiguous() if q is not None else kc
    o = torch.empty(n, length, h, vdim, dtype=torch.float32, device=k.device) if q is not None else vc
    gate_kind = 0 if gate is None else (1 if gate.lower_bound is None else 2)
    a_log = gate.A_log.reshape(-1).float().contiguous() if gate is not None else kc
    dt_bias = gate.dt_bias.float().contiguous() if gate is not None and gate.dt_bias is not None else kc
    lb = float(gate.lower_bound) if gate is not None and gate.lower_bound is not None else 0.0
    _kda_recurrent_kernel[(n, h, triton.cdiv(vdim, bv))](
        qc, kc, vc, gc, bc, o, state_pool, state_slots.contiguous(), num_tokens.contiguous(), a_log, dt_bias,
        length, scale, lb, stride, H=h, K=kdim, V=vdim, BK=bk, BV=bv, HAS_Q=q is not None, GATE=gate_kind,
        HAS_DT_BIAS=gate is not None and gate.dt_bias is not None, BETA_LOGITS=beta_logits, L2NORM=qk_l2norm,
    )  # fmt: skip
    return o if q is not None else None
