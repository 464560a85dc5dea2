"""Single-sequence greedy generation for the tests: the plain no-cache loop (the ground truth every cached and
served path is compared with) and the cached loop through a HybridCache."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from radixk3.forward_batch import ForwardBatch, HybridCache
from radixk3.model import KimiForCausalLM


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 for the oracle: its ops are test-sized, and with two threads each op pays an
    OpenMP barrier, which on a machine busy with other work costs far more than the op (a k3-tiny forward of 60
    tokens 0.08 s on one thread, 1.2-1.7 s on two on a loaded 2-core machine). The code under test keeps its
    threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@torch.inference_mode()
def greedy_reference(model: KimiForCausalLM, prompt: list[int], max_new_tokens: int,
                     stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """Recompute the whole sequence with the no-cache forward for every new token."""
    seq = list(prompt)
    out: list[int] = []
    with one_thread():
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
