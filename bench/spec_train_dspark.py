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

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from radixk3.dspark import DSparkModel, target_aux_states
from radixk3.dspark_checkpoint import build_dspark
from radixk3.dspark_config import DSparkConfig, k3_tiny_dspark_preset
from radixk3.model import KimiForCausalLM


class TargetData(NamedTuple):
    ids: list[Tensor]  # per text [T_j] int64
    aux: list[Tensor]  # per text [T_j, n_ids * H_t]
    probs: list[Tensor]  # per text [T_j, V] the target's next-token distribution (fp32)


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
        probs.append(target(t, cu).float().softmax(-1).clone())
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
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / steps))
    # The drafter calls the target's embedding and LM head (aliased modules): frozen, they take no gradients.
    trainable = [p for p in target.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        for _ in range(steps):
            loss = dspark_loss(model, data, draw_samples(data, batch_size, gen), distill=distill, hard=hard)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if losses is not None:
                losses.append(float(loss.detach()))
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return model.eval()
