"""Prefix-cache workload simulator: replays token-id traces through the hybrid radix cache alone (no model)
and counts the prefill tokens that must be computed.

Workloads: (a) gsm8k 5-shot, (b) multi-turn chat, (c) a shared system prompt with short distinct user
messages, (d) the same with system prompts shorter than 512 tokens. For each it reports computed prefill
tokens for
  radixk3         the radix cache in a unified pool of the given size and layout, with its checkpoint
                  policy (branching point, prefill chunk ends at absolute multiples of the checkpoint
                  interval, prompt end, donation at request end);
  ideal           recompute only tokens never computed before (unbounded memory);
  block_baseline  a state only at fixed block boundaries, block = the KV-equivalent of one state, as
                  vLLM's hybrid manager (unbounded memory, so an upper bound on its hits);
and the radixk3 pool's peak bytes per side. Requests are replayed one after another, in trace order; the
last sampled token of an answer is never fed back, so it is never cached.

    python bench/prefix_cache_sim.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from runtime.pool import UnifiedPool  # noqa: E402
from runtime.pool_layout import PoolLayout  # noqa: E402
from runtime.radix_cache import HybridRadixCache, Node  # noqa: E402

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    answer: tuple[int, ...]  # the tokens the model samples (replayed, not generated)


class WorkloadResult(NamedTuple):
    radixk3: int
    ideal: int
    block_baseline: int
    total_prompt_tokens: int
    requests: int
    peak_state_bytes: int
    peak_kv_bytes: int
    evicted_states: int
    evicted_pages: int


# --- token sources -------------------------------------------------------------------------------------
def gsm8k_dir() -> Path:
    local = REPO / "bench" / "data" / "gsm8k"
    if (local / "test.jsonl").is_file():
        return local
    shared = REPO.parent / "shared" / "data" / "gsm8k"
    print(f"note: {local} is missing; reading gsm8k from {shared}")
    return shared


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_encoder() -> tuple[Encode, str]:
    try:
        from radixk3.tokenizer import load_tokenizer
    except ImportError as err:  # only while the tokenizer is not there yet: bytes stand in for tokens
        print(f"note: radixk3.tokenizer is not importable ({err}); using UTF-8 bytes as tokens")
        return (lambda s: list(s.encode())), "utf-8 bytes"
    tok = load_tokenizer()
    return tok.encode, f"radixk3 built-in sentencepiece ({tok.vocab_size} pieces)"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def chat(role: str, content: str) -> str:
    """One message in the Kimi-style template the built-in tokenizer knows (markers are single ids)."""
    return f"<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>"


ASSISTANT_PREFIX = "<|im_assistant|>assistant<|im_middle|>"


# --- workloads -----------------------------------------------------------------------------------------
def gsm8k_workload(encode: Encode, train: list[dict[str, str]], test: list[dict[str, str]],
                   questions: int = 200, shots: int = 5) -> list[Request]:
    """SGLang's gsm8k harness prompt: `shots` solved train examples, then the question."""
    few_shot = "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in train[:shots])
    return [Request(tuple(encode(few_shot + f"Question: {e['question']}\nAnswer:")), tuple(encode(" " + e["answer"])))
            for e in test[:questions]]


def multiturn_workload(encode: Encode, test: list[dict[str, str]], conversations: int = 24,
                       turns: int = 6, seed: int = 0) -> list[Request]:
    """Chats whose every turn is the previous turn's prompt + answer + a new user message; turns of
    different chats interleave in a random (seeded) order."""
    system = chat("system", "You are a patient math tutor. Answer step by step and end with the result.")
    pending = []
    qa = iter(test)
    for _ in range(conversations):
        msgs = [next(qa) for _ in range(turns)]
        pending.append([(tuple(encode(chat("user", m["question"]) + ASSISTANT_PREFIX)),
                         tuple(encode(m["answer"] + "<|im_end|>"))) for m in msgs])
    rng = random.Random(seed)
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    history: list[tuple[int, ...]] = [tuple(encode(system))] * conversations
    step = [0] * conversations
    out: list[Request] = []
    for c in order:
        user, answer = pending[c][step[c]]
        prompt = history[c] + user
        out.append(Request(prompt, answer))
        history[c] = prompt + answer
        step[c] += 1
    return out


def system_prompt_workload(encode: Encode, train: list[dict[str, str]], test: list[dict[str, str]],
                           prompts: int, min_tokens: int, max_tokens: int, users: int,
                           seed: int = 0) -> list[Request]:
    """`prompts` system prompts of min..max tokens (instructions plus worked examples), each serving its
    share of `users` short distinct user messages, all interleaved in a random (seeded) order."""
    rng = random.Random(seed)
    examples = iter(train[5:])
    systems: list[str] = []
    for i in range(prompts):
        target = rng.randint(min_tokens, max_tokens)
        text = f"You are tutor #{i}. Solve the user's problem; worked examples follow.\n\n"
        while True:
            e = next(examples)
            more = text + f"Q: {e['question']}\nA: {e['answer']}\n\n"
            if len(encode(chat("system", more))) > target:
                break
            text = more
        systems.append(chat("system", text))
    out = []
    for j, e in enumerate(test[:users]):
        system = systems[j % prompts]
        out.append(Request(tuple(encode(system + chat("user", e["question"]) + ASSISTANT_PREFIX)),
                           tuple(encode(e["answer"] + "<|im_end|>"))))
    rng.shuffle(out)
    return out


# --- the caches ----------------------------------------------------------------------------------------
class _Trie:
    """Every token sequence computed so far, for the ideal and block-baseline caches."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        node, n = self.root, 0
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n

    def add(self, tokens: Sequence[int]) -> None:
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})


class IdealCache:
    def __init__(self) -> None:
        self.trie = _Trie()

    def run(self, req: Request) -> int:
        hit = min(self.trie.longest_prefix(req.prompt), len(req.prompt) - 1)  # the last token's logits
        self.trie.add(req.prompt + req.answer[:-1])
        return len(req.prompt) - hit


class BlockBaseline:
    def __init__(self, block_tokens: int) -> None:
        self.block = block_tokens
        self.trie = _Trie()

    def run(self, req: Request) -> int:
        hit = min(self.trie.longest_prefix(req.prompt), len(req.prompt) - 1)
        self.trie.add(req.prompt + req.answer[:-1])
        return len(req.prompt) - hit // self.block * self.block


class RadixReplay:
    """The scheduler's use of the cache, one request at a time: match, copy on hit, prefill with
    checkpoints at the branching point, at chunk ends and at the prompt end, decode, donate."""

    def __init__(self, layout: PoolLayout, pool_bytes: int, checkpoint_interval: int) -> None:
        self.pool = UnifiedPool(layout, pool_bytes)
        self.cache = HybridRadixCache(self.pool)
        self.ps = layout.page_size
        self.interval = checkpoint_interval

    def _checkpoint(self, tokens: tuple[int, ...], pages: list[int], node: Node) -> Node:
        r = self.cache.insert(tokens, pages[: len(tokens) // self.ps], self.pool.alloc_state())
        pages[: len(tokens) // self.ps] = r.pages
        self.cache.lock(r.node)
        self.cache.unlock(node)
        return r.node

    def run(self, req: Request) -> int:
        cache, pool, ps = self.cache, self.pool, self.ps
        prompt = req.prompt
        m = cache.match_prefix(prompt)
        cache.lock(m.node)
        live = cache.alloc_live_state(m)
        node, pages = m.node, list(m.pages)
        stops = {m.branch_len, len(prompt)}
        if self.interval:
            first = (m.prefix_len // self.interval + 1) * self.interval
            stops.update(range(first, len(prompt), self.interval))
        for stop in sorted(s - s % ps for s in stops):
            if stop > node.depth:
                pages += pool.alloc_pages(stop // ps - len(pages))
                node = self._checkpoint(prompt[:stop], pages, node)
        seq = prompt + req.answer[:-1]  # what the forward passes consumed
        # With pages of several tokens only whole pages enter the tree, so decode keeps a copy of the live
        # state at the last page boundary it crossed (one block, overwritten at each crossing).
        boundary = pool.alloc_state() if ps > 1 and len(seq) % ps else None
        pages += pool.alloc_pages(-(-len(seq) // ps) - len(pages))
        pool.drain_copies()  # no buffer here: the copies are what a worker would do
        end = len(seq) - len(seq) % ps
        if end > node.depth:
            donated = live if boundary is None else boundary
            cache.insert(seq[:end], pages[: end // ps], donated)  # the block becomes the checkpoint
            pages = pages[end // ps :]
            for spare in {live, boundary} - {donated, None}:
                pool.free_state(spare)  # type: ignore[arg-type]
        else:
            pages = pages[node.depth // ps :]
            for spare in {live, boundary} - {None}:
                pool.free_state(spare)  # type: ignore[arg-type]
        pool.free_pages(pages)
        cache.unlock(node)
        return len(prompt) - m.prefix_len


def simulate(requests: Sequence[Request], layout: PoolLayout, pool_bytes: int, checkpoint_interval: int,
             block_tokens: int, check: bool = False) -> WorkloadResult:
    radix = RadixReplay(layout, pool_bytes, checkpoint_interval)
    ideal, block = IdealCache(), BlockBaseline(block_tokens)
    totals = [0, 0, 0]
    for req in requests:
        totals[0] += radix.run(req)
        totals[1] += ideal.run(req)
        totals[2] += block.run(req)
        if check:
            radix.cache.check_integrity(held_pages=[], held_states=[])
    u, s = radix.pool.usage(), radix.cache.stats()
    return WorkloadResult(*totals, sum(len(r.prompt) for r in requests), len(requests), u.peak_state_bytes,
                          u.peak_kv_bytes, s.evicted_states, s.evicted_pages)


def build_workloads(encode: Encode, data: Path, scale: float = 1.0) -> dict[str, list[Request]]:
    train, test = read_jsonl(data / "train.jsonl"), read_jsonl(data / "test.jsonl")

    def n(x: int) -> int:
        return max(2, int(x * scale))

    return {
        "gsm8k": gsm8k_workload(encode, train, test, questions=n(200)),
        "multiturn": multiturn_workload(encode, test, conversations=n(16), turns=10),
        "system_prompt": system_prompt_workload(encode, train, test, prompts=1, min_tokens=2400,
                                                max_tokens=2400, users=n(256)),
        "short_prefix": system_prompt_workload(encode, train, test, prompts=4, min_tokens=200,
                                               max_tokens=500, users=n(256)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-linear-48b", help="model whose layout sizes the pool")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--pool-gib", type=float, default=24.0, help="per-rank pool bytes, GiB")
    ap.add_argument("--checkpoint-interval", type=int, default=64,
                    help="prefill emits a checkpoint at every multiple of this many tokens (the KDA chunk size: "
                         "its kernel has those states anyway); 0 = branching point and prompt end only")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    ap.add_argument("--check", action="store_true", help="run check_integrity() after every request")
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    args = ap.parse_args(argv)

    from radixk3.config import preset

    layout = PoolLayout.from_config(preset(args.preset), tp=args.tp, page_size=args.page_size)
    block = PoolLayout.from_config(preset("kimi-linear-48b")).state_equivalent_tokens()
    encode, enc_name = load_encoder()
    data = gsm8k_dir()
    pool_bytes = int(args.pool_gib * 2**30)
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {platform.system()}, python {platform.python_version()} "
          "(allocator metadata only: no model, no buffer, no device)")
    print(f"tokens: {enc_name}; data: gsm8k from {data.relative_to(REPO) if data.is_relative_to(REPO) else data}")
    print(f"layout: {args.preset} tp={args.tp} page_size={args.page_size}: state block "
          f"{layout.state_block_bytes / 2**20:.1f} MiB, KV {layout.kv_token_bytes} B/token; pool {args.pool_gib} GiB")
    print(f"block baseline: {block} tokens per block (one kimi-linear-48b KDA layer's state in MLA-layer KV; "
          f"a whole state is {layout.state_block_bytes / layout.kv_token_bytes:.0f} tokens of all-layer KV)")
    print(f"radixk3 checkpoint interval: {args.checkpoint_interval} tokens\n")

    results: dict[str, WorkloadResult] = {}
    head = (f"{'workload':<14}{'requests':>9}{'prompt tok':>11}{'radixk3':>9}{'ideal':>8}{'block':>8}"
            f"{'radix/ideal':>12}{'block/ideal':>12}{'radix hit':>10}{'block hit':>10}{'peak state':>11}"
            f"{'peak KV':>9}")
    print(head)
    for name, reqs in build_workloads(encode, data, args.scale).items():
        r = simulate(reqs, layout, pool_bytes, args.checkpoint_interval, block, check=args.check)
        results[name] = r
        t = r.total_prompt_tokens
        print(f"{name:<14}{r.requests:>9}{t:>11}{r.radixk3:>9}{r.ideal:>8}{r.block_baseline:>8}"
              f"{r.radixk3 / r.ideal:>12.4f}{r.block_baseline / r.ideal:>12.3f}{1 - r.radixk3 / t:>10.1%}"
              f"{1 - r.block_baseline / t:>10.1%}{r.peak_state_bytes / 2**30:>9.2f}Gi"
              f"{r.peak_kv_bytes / 2**30:>7.2f}Gi")
    print("\nratios are computed prefill tokens over the ideal cache's, measured in this run; hit = share of "
          "prompt tokens not computed")
    if args.json:
        print(json.dumps({
            "workloads": {k: {"radixk3": v.radixk3, "ideal": v.ideal, "block_baseline": v.block_baseline,
                              "total_prompt_tokens": v.total_prompt_tokens, "requests": v.requests,
                              "peak_state_bytes": v.peak_state_bytes, "peak_kv_bytes": v.peak_kv_bytes,
                              "evicted_states": v.evicted_states, "evicted_pages": v.evicted_pages}
                          for k, v in results.items()},
            "block_tokens": block,
            "checkpoint_interval": args.checkpoint_interval,
            "layout": {"preset": args.preset, "tp": args.tp, "page_size": args.page_size,
                       "state_block_bytes": layout.state_block_bytes, "kv_token_bytes": layout.kv_token_bytes},
            "pool_bytes": pool_bytes,
            "tokens": enc_name,
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
