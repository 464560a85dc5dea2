"""A burst submitted at once through the multi-process Engine computes its shared prefix once, even though its
requests reach the scheduler one message at a time (the idle scheduler gathers the burst before planning)."""

from __future__ import annotations

import random

import radixk3


def test_burst_through_the_engine_computes_the_shared_prefix_once() -> None:
    g = random.Random(3)
    shared = [g.randrange(16, 4000) for _ in range(300)]
    prompts = [shared + [g.randrange(16, 4000) for _ in range(20)] for _ in range(8)]
    ideal = len(shared) + sum(len(p) - len(shared) for p in prompts)
    with radixk3.Engine(mem_bytes=64 << 20, chunked_prefill_size=2048) as engine:
        before = engine.get_metrics()["prefill_tokens_computed"]
        engine.generate(prompts, {"max_new_tokens": 2, "temperature": 0})
        computed = engine.get_metrics()["prefill_tokens_computed"] - before
    # A follower that missed the leader would compute the 300 shared tokens again (+1.6x).
    assert computed <= 1.05 * ideal, (computed, ideal)
