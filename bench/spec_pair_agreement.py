"""How well the trained spec pair's proposers agree with its target: top-1 agreement on held-out gsm8k text, each
proposer's guess against the target's greedy choice at the same position, both on the true prefix (the rate a
greedy verify step accepts a proposer's first draft). Also the target's greedy reply, to read.

- MTP: the MTP layer's argmax for t+2, from (the target's pre-norm hidden state at t, token t+1), against the
  target's argmax at t+1;
- draft model: its argmax at t against the target's at t;
- DSpark: the first token of the block the proposer drafts (`runtime/spec/dspark.py`): context latents of
  positions [0, L) from the target's aux states, anchor = token L, a block of `block_size` positions, then the
  Markov head on the anchor; against the target's argmax at L.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bench.gsm8k import one_example
from radixk3.dspark import DSparkModel, target_aux_states
from radixk3.model import KimiForCausalLM
from radixk3.tokenizer import Tokenizer


class Agreement(NamedTuple):
    mtp_top1: float  # MTP's argmax for t+2 equals the target's argmax at t+1 (both on the true prefix)
    draft_top1: float  # the draft's argmax equals the target's at the same position
    dspark_top1: float | None  # DSpark's first draft from anchor L equals the target's argmax at L; None: no drafter


def held_out_ids(tok: Tokenizer, test: list[dict[str, str]]) -> torch.Tensor:
    """Ten gsm8k test examples as one stream, "Question: ...\\nAnswer: ..." joined by blank lines."""
    return torch.tensor(tok.encode("".join(one_example(e, True) + "\n\n" for e in test[100:110])))


@torch.inference_mode()
def dspark_first_drafts(target: KimiForCausalLM, drafter: DSparkModel, ids: torch.Tensor, anchors: torch.Tensor,
                        chunk: int = 64) -> torch.Tensor:
    """DSpark's first drafted token from each anchor position L in `anchors` (L >= 1) of the text `ids`, as the
    proposer drafts it greedily: context [0, L), anchor ids[L], a block of the drafter's `block_size`."""
    cfg = drafter.config
    aux = target_aux_states(target, cfg, ids, torch.tensor([0, ids.numel()]))
    latents = drafter.context_latents(aux, torch.arange(ids.numel()))
    out = []
    for part in anchors.split(chunk):
        lens = part
        context = [torch.cat([lat[:n] for n in lens.tolist()]) for lat in latents]
        cu = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
        base = drafter.draft_block(context, cu, ids[part], cfg.block_size).logits[:, 0]
        out.append(drafter.markov_logits(base, ids[part]).argmax(-1))
    return torch.cat(out)


@torch.inference_mode()
def mtp_agreement(target: KimiForCausalLM, ids: torch.Tensor, t_arg: torch.Tensor | None = None) -> float:
    """The MTP layer's top-1 agreement with the target on `ids` (see `Agreement.mtp_top1`); `t_arg`: the target's
    argmax at every position of `ids`, when the caller has it."""
    t_arg = target(ids).argmax(-1) if t_arg is None else t_arg
    h = target.prenorm_hidden(ids, torch.tensor([0, ids.numel()]))
    mtp = target.forward_mtp(0, ids[1:], h[:-1]).logits.argmax(-1)  # position t predicts t+2
    return float((mtp[:-1] == t_arg[1:-1]).float().mean())


@torch.inference_mode()
def dspark_agreement(target: KimiForCausalLM, drafter: DSparkModel, ids: torch.Tensor,
                     t_arg: torch.Tensor | None = None) -> float:
    """DSpark's top-1 agreement with the target on `ids` (see `Agreement.dspark_top1`), from every anchor
    L >= 1; `t_arg` as for `mtp_agreement`."""
    t_arg = target(ids).argmax(-1) if t_arg is None else t_arg
    anchors = torch.arange(1, ids.numel())
    return float((dspark_first_drafts(target, drafter, ids, anchors) == t_arg[anchors]).float().mean())


@torch.inference_mode()
def agreement(target: KimiForCausalLM, draft: KimiForCausalLM, ids: torch.Tensor,
              drafter: DSparkModel | None = None) -> Agreement:
    t_arg = target(ids).argmax(-1)
    d_arg = draft(ids).argmax(-1)
    dspark = None if drafter is None else dspark_agreement(target, drafter, ids, t_arg)
    return Agreement(mtp_agreement(target, ids, t_arg), float((d_arg == t_arg).float().mean()), dspark)


@torch.inference_mode()
def greedy(model: KimiForCausalLM, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    """The no-cache greedy continuation of `prompt`, up to `max_new` tokens or a stop token."""
    ids = list(prompt)
    for _ in range(max_new):
        nxt = int(model(torch.tensor(ids))[-1].argmax())
        if nxt in stop:
            break
        ids.append(nxt)
    return ids[len(prompt):]


def sample_replies(target: KimiForCausalLM, tok: Tokenizer, questions: list[dict[str, str]],
                   max_new: int = 128) -> list[str]:
    """The target's greedy answer to each zero-shot question, up to the blank line that ends an example."""
    return [tok.decode(greedy(target, tok.encode(one_example(e, False)), max_new, set(tok.stop_ids)))
            .split("\n\n")[0] for e in questions]
