"""The ideal prefix cache the benchmarks compare against: unbounded, never evicts, never recomputes a token."""

from __future__ import annotations

from collections.abc import Sequence


def ideal_prefill(prompts: Sequence[Sequence[int]]) -> int:
    """Prefill tokens an unbounded cache that never recomputes a token would compute, in submission order
    (the last prompt token is always computed: its logits are sampled)."""
    trie: dict[int, dict] = {}
    total = 0
    for p in prompts:
        node, hit = trie, 0
        for t in p:
            if t not in node:
                break
            node, hit = node[t], hit + 1
        total += len(p) - min(hit, len(p) - 1)
        node = trie
        for t in p:
            node = node.setdefault(t, {})
    return total


def ideal_cached(prompts: Sequence[Sequence[int]]) -> int:
    """Prompt tokens that cache serves: each prompt's longest common prefix with an earlier one."""
    return sum(map(len, prompts)) - ideal_prefill(prompts)
