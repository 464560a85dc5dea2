"""Training a DSpark drafter on a frozen target (`train_dspark`), seeded and deterministic, CPU minutes at small
sizes. `bench/train_spec_pair.py` imports it for the trained pair.

Data: each text's target aux states and logits, from the target's no-cache forward, once. A training sample is
(text, L): context positions [0, L), anchor = token L, the block at L..L+N-1. Loss per block position i: the
cross-entropy of the draft distribution softmax(l_i + markov(prev_i)) against the target's distribution at
position L+i (distillation: the target's prediction for L+1+i, which is what verification accepts), weighted
`distill`, plus `hard` times the cross-entropy against the text's token L+1+i. The Markov head is teacher
forced: prev_i is the text's token L+i (the anchor for i = 0). The target's weights are never updated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from radixk3.dspark import DSparkModel, aux_request, concat_aux, target_aux_states
from radixk3.dspark_checkpoint import build_dspark
from radixk3.dspark_config import DSparkConfig, k3_tiny_dspark_preset
from radixk3.model import KimiForCausalLM


class TargetData(NamedTuple):
    ids: list[Tensor]  # per text [T_j] int64
    aux: list[Tensor]  # per text [T_j, n_ids * H_t]
    probs: list[Tensor]  # per text [T_j, V] the target's next-token distribution (bf16: held for every token)


class Sample(NamedTuple):
    text: int
    anchor_pos: int  # L


def target_data(target: KimiForCausalLM, cfg: DSparkConfig, texts_ids: list[list[int]], max_len: int) -> TargetData:
    """The frozen target's aux states and distributions of every text (cut to max_len, at least 3 tokens)."""
    ids, aux, probs = [], [], []
    dev = target.device
    for text in texts_ids:
        if len(text) < 3:
            continue
        t = torch.tensor(text[:max_len], dtype=torch.int64, device=dev)
        cu = torch.tensor([0, t.numel()], device=dev)
        # Cloned: inference-mode tensors cannot enter autograd.
        aux.append(target_aux_states(target, cfg, t, cu).clone().float())
        probs.append(target(t, cu).float().softmax(-1).to(torch.bfloat16))
        ids.append(t)
    if not ids:
        raise ValueError("train_dspark needs at least one text of 3 or more tokens")
    return TargetData(ids, aux, probs)


def draw_samples(data: TargetData, n: int, gen: torch.Generator) -> list[Sample]:
    out = []
    for _ in range(n):
        j = int(torch.randint(len(data.ids), (1,), generator=gen))
        length = data.ids[j].numel()
        out.append(Sample(j, int(torch.randint(1, length - 1, (1,), generator=gen))))
    return out


def dspark_loss(model: DSparkModel, data: TargetData, samples: list[Sample], *, distill: float = 1.0,
                hard: float = 0.0) -> Tensor:
    """The mean per-position loss of a batch of samples (see the module doc)."""
    b = model.config.block_size
    dev = data.ids[0].device
    texts = sorted({s.text for s in samples})
    lat = {j: model.context_latents(data.aux[j], torch.arange(data.ids[j].numel(), device=dev)) for j in texts}
    context = [torch.cat([lat[s.text][i][: s.anchor_pos] for s in samples]) for i in range(len(model.layers))]
    lens = torch.tensor([s.anchor_pos for s in samples], device=dev)
    cu = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    anchors = torch.stack([data.ids[s.text][s.anchor_pos] for s in samples])
    base = model.draft_block(context, cu, anchors).logits  # [S, B, V]
    # prev_i = text token L+i, teacher p_i = target at L+i, hard y_i = text token L+1+i (where they exist).
    v = base.shape[-1]
    prev = torch.zeros(len(samples), b, dtype=torch.int64, device=dev)
    teacher = torch.zeros(len(samples), b, v, device=dev)
    hard_y = torch.full((len(samples), b), -100, dtype=torch.int64, device=dev)
    valid = torch.zeros(len(samples), b, dtype=torch.bool, device=dev)
    for k, s in enumerate(samples):
        ids, length = data.ids[s.text], data.ids[s.text].numel()
        m = min(b, length - s.anchor_pos)
        prev[k, :m] = ids[s.anchor_pos: s.anchor_pos + m]
        teacher[k, :m] = data.probs[s.text][s.anchor_pos: s.anchor_pos + m]
        valid[k, :m] = True
        mh = min(b, length - s.anchor_pos - 1)
        hard_y[k, :mh] = ids[s.anchor_pos + 1: s.anchor_pos + 1 + mh]
    logq = model.markov_logits(base, prev).log_softmax(-1)
    loss = distill * -(teacher * logq).sum(-1)[valid].mean()
    if hard:
        loss = loss + hard * F.nll_loss(logq.reshape(-1, v), hard_y.reshape(-1), ignore_index=-100)
    return loss


def train_dspark(
    target: KimiForCausalLM,
    texts_ids: list[list[int]],
    *,
    seed: int,
    steps: int,
    cfg: DSparkConfig | None = None,
    batch_size: int = 16,
    lr: float = 3e-3,
    max_len: int = 128,
    distill: float = 1.0,
    hard: float = 0.0,
    losses: list[float] | None = None,
) -> DSparkModel:
    """A drafter of `cfg` (default `k3-tiny-dspark`) trained `steps` AdamW steps on the frozen target; `losses`
    (optional) receives each step's training loss."""
    cfg = cfg or k3_tiny_dspark_preset()
    torch.manual_seed(seed)  # nothing below draws from the global generator, but keep the run sealed
    model = build_dspark(cfg.replace(dtype="float32"), target, seed=seed).train()
    data = target_data(target, cfg, texts_ids, max_len)
    gen = torch.Generator().manual_seed(seed + 1)
    return fit(model, target, steps, lr, losses,
               lambda: dspark_loss(model, data, draw_samples(data, batch_size, gen), distill=distill, hard=hard))


def fit(model: DSparkModel, target: KimiForCausalLM, steps: int, lr: float, losses: list[float] | None,
        step_loss: Callable[[], Tensor], log: str = "") -> DSparkModel:
    """`steps` AdamW steps on `step_loss()` (warm-up over 10 steps, then linear decay to 10%), the target frozen:
    the drafter calls its embedding and LM head (aliased modules), which take no gradients. `log`: a name to print
    the loss under every 50 steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / steps))
    trainable = [p for p in target.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            loss = step_loss()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if losses is not None:
                losses.append(float(loss.detach()))
            if log and (step % 50 == 0 or step == steps - 1):
                print(f"  {log} step {step}/{steps} loss {float(loss.detach()):.3f} "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return model.eval()


# --- every anchor of a window in one pass -------------------------------------------------------------------
def every_anchor_logits(model: DSparkModel, context: list[Tensor], ids: Tensor, anchors: Tensor) -> Tensor:
    """Base logits [A, B, V] of the block at each anchor L in `anchors` of one text `ids`, all in one pass:
    `context` holds the text's context latents per draft layer (`context_latents` at positions 0..T-1), and the
    block at L sees context rows [0, L) and itself, non-causally, exactly as `draft_block` on that prefix: each
    query row's scores against the context rows (masked) and against its own block's B rows, one softmax over
    both (a block never scores another block's rows)."""
    b, n, t = model.config.block_size, anchors.numel(), context[0].shape[0]
    x, positions = model.block_inputs(ids[anchors], anchors, b)
    hidden = torch.arange(t, device=ids.device)[None, None, None, :] >= anchors[:, None, None, None]  # [A,1,1,t]

    def attend(i: int, attn: Any, q_nope: Tensor, q_pe: Tensor, lat: Tensor) -> Tensor:  # noqa: ANN401
        r = attn.kv_lora_rank
        ctx = context[i].to(lat.dtype)
        c, k_pe = ctx[:, :r], ctx[:, r:]  # the context rows
        c_blk, k_pe_blk = lat[:, :r].view(n, b, r), lat[:, r:].view(n, b, -1)  # each block's own rows
        w = attn.kv_b_proj.weight.view(attn.num_heads, -1, r)  # per head: k rows, then v rows
        w_uk, w_uv = w[:, :attn.nope], w[:, attn.nope:]
        q_lat = torch.einsum("jhd,hdr->jhr", q_nope, w_uk).view(n, b, attn.num_heads, r)  # absorbed queries
        q_pe = q_pe.view(n, b, attn.num_heads, -1)
        s_ctx = torch.einsum("nihr,sr->nihs", q_lat, c) + torch.einsum("nihe,se->nihs", q_pe, k_pe)
        s_blk = torch.einsum("nihr,nkr->nihk", q_lat, c_blk) + torch.einsum("nihe,nke->nihk", q_pe, k_pe_blk)
        scores = torch.cat([(s_ctx.float() * attn.scale).masked_fill(hidden, float("-inf")),
                            s_blk.float() * attn.scale], dim=-1)  # [A, B, H, t + B]
        probs = scores.softmax(-1).to(q_nope.dtype)
        o_lat = torch.einsum("nihs,sr->nihr", probs[..., :t], c) + torch.einsum("nihk,nkr->nihr", probs[..., t:],
                                                                               c_blk)
        return torch.einsum("nihr,hvr->nihv", o_lat, w_uv).reshape(n * b, attn.num_heads, -1)

    return model._finish(model._run_layers(x, positions, attend), n).logits


def window_anchors(t: int, anchors: int | None, gen: torch.Generator | None) -> Tensor:
    """The anchors of a window of `t` tokens: every L in [1, t-1), or `anchors` of them drawn without repeats
    (sorted) when fewer."""
    if anchors is None or anchors >= t - 2:
        return torch.arange(1, t - 1)
    return (torch.randperm(t - 2, generator=gen)[:anchors] + 1).sort().values


def window_loss(model: DSparkModel, target: KimiForCausalLM, windows: Tensor, anchors: int | None = None,
                gen: torch.Generator | None = None) -> Tensor:
    """The mean per-position distillation loss of the blocks at the anchors L of each window [W, T] (every L in
    [1, T-1), or `anchors` of them drawn by `gen`): block position i (prev_i = token L+i, teacher forced) against
    the target's distribution at L+i."""
    cfg = model.config
    b = cfg.block_size
    losses = []
    for ids in windows:
        t = ids.numel()
        with torch.no_grad():  # one target forward: its aux states and its logits
            aux = aux_request(cfg)
            h = target.prenorm_hidden(ids, torch.tensor([0, t], device=ids.device), None, aux)
            aux = concat_aux(cfg, aux).float().clone()  # inference tensors: no autograd
            teacher = target.lm_head(target.model.norm(h)).float().log_softmax(-1).clone()
        at = window_anchors(t, anchors, gen).to(ids.device)
        base = every_anchor_logits(model, model.context_latents(aux, torch.arange(t, device=ids.device)), ids, at)
        pos = (at[:, None] + torch.arange(b, device=ids.device)).clamp(max=t - 1)  # [A, B]: L + i
        valid = at[:, None] + torch.arange(b, device=ids.device) < t
        logq = model.markov_logits(base, ids[pos]).log_softmax(-1)
        p = teacher[pos]
        losses.append((p.exp() * (p - logq)).sum(-1)[valid].mean())  # KL(target || draft)
    return torch.stack(losses).mean()


def train_dspark_windows(target: KimiForCausalLM, windows: Tensor, *, seed: int, steps: int, cfg: DSparkConfig,
                         windows_per_step: int = 2, lr: float = 3e-3, anchors: int | None = None,
                         losses: list[float] | None = None, log: str = "") -> DSparkModel:
    """A drafter of `cfg` trained `steps` AdamW steps on the frozen target, each on `windows_per_step` windows
    [W, T] (a seeded order, epoch after epoch) with the blocks at every anchor, or at `anchors` per window drawn
    afresh each time (`window_loss`)."""
    torch.manual_seed(seed)
    model = build_dspark(cfg.replace(dtype="float32"), target, seed=seed).train()
    gen = torch.Generator().manual_seed(seed + 1)
    anchor_gen = torch.Generator().manual_seed(seed + 2)
    order, pos = torch.randperm(windows.shape[0], generator=gen), 0

    def step_loss() -> Tensor:
        nonlocal order, pos
        if pos + windows_per_step > order.numel():
            order, pos = torch.randperm(windows.shape[0], generator=gen), 0
        pos += windows_per_step
        return window_loss(model, target, windows[order[pos - windows_per_step: pos]], anchors, anchor_gen)

    return fit(model, target, steps, lr, losses, step_loss, log)
