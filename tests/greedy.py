"""Single-sequence greedy generation for the tests: the plain no-cache loop (the ground truth every cached and
served path is compared with) and the cached loop through a HybridCache."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from radixk3.forward_batch import ForwardBatch, HybridCache
from radixk3.model import KimiForCausalLM


@torch.inference_mode()
def greedy_reference(model: KimiForCausalLM, prompt: list[int], max_new_tokens: int,
                     stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """Recompute the whole sequence with the no-cache forward for every new token."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor(seq, device=model.device))
        tok = int(logits[-1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out


@torch.inference_mode()
def stream_greedy(model: KimiForCausalLM, prompt: list[int], max_new_tokens: int,
                  stop_ids: frozenset[int] = frozenset()) -> Iterator[int]:
    """Prefill the prompt once, then decode token by token through a HybridCache."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    cache = HybridCache.allocate(model.config, 1, len(prompt) + max_new_tokens, model.device)
    slots = list(range(len(prompt)))
    batch = ForwardBatch.build([prompt], [0], [0], [slots], device=model.device)
    for _ in range(max_new_tokens):
        tok = int(model.forward_batch(batch, cache)[-1].argmax())
        yield tok
        if tok in stop_ids:
            return
        prefix = len(slots)
        slots.append(prefix)
        batch = ForwardBatch.build([[tok]], [prefix], [0], [slots], device=model.device)


def greedy_cached(model: KimiForCausalLM, prompt: list[int], max_new_tokens: int,
                  stop_ids: frozenset[int] = frozenset()) -> list[int]:
    return list(stream_greedy(model, prompt, max_new_tokens, stop_ids))
