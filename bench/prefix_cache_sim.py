"""Prefix-cache workload simulator: replays token-id traces through the real `Scheduler`
(runtime/scheduler/scheduler.py) with a scripted no-op worker (no model, no pool buffer: the scheduler holds
allocator metadata only) and counts the prefill tokens the engine computes.

Workloads: (a) gsm8k 5-shot, (b) multi-turn chat, (c) a shared system prompt with short distinct user
messages, (d) the same with system prompts shorter than 512 tokens. For each it reports computed prefill
tokens for
  radixk3         the engine's scheduler: its radix cache, admission, chunked prefill and checkpoint policy
                  in a unified pool of the given size and layout (ServerArgs flags set them);
  ideal           recompute only tokens never computed before (unbounded memory);
  block_baseline  a state only at fixed block boundaries, block = the KV-equivalent of one state, as
                  vLLM's hybrid manager (unbounded memory, so an upper bound on its hits);
and the pool's peak bytes per side. Requests are replayed one after another, in trace order: each is added,
then steps run until it finishes. The worker samples the recorded answer token by token (max_new_tokens =
the answer's length, EOS ignored), so the last sampled token is never fed back and never cached, as in the
engine.

    python bench/prefix_cache_sim.py [--json] [ServerArgs flags, e.g. --page-size 16 --chunked-prefill-size 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine_info import cpu_name  # noqa: E402
from runtime.messages import GenerateReq, StepPlan, StepResult, TokenOut, decode, encode  # noqa: E402
from runtime.pool_layout import PoolLayout  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.scheduler.scheduler import Scheduler  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402

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
    evictions: int  # pages + state blocks the radix cache evicted
    checkpoints: int
    cached_tokens: int  # prompt tokens the scheduler matched in the cache at admission
    steps: int


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


class ScriptedWorker:
    """Stands in for the model worker: samples, for the one running request, the next token of its script.
    With `wire`, each plan and result goes through the wire encoding as between the processes."""

    def __init__(self, wire: bool = False) -> None:
        self.script: list[int] = []
        self.wire = wire

    def execute(self, plan: StepPlan) -> StepResult:
        if self.wire:
            plan = decode(encode(plan))
        n = plan.num_sampled
        if n > 1:
            raise RuntimeError("the replay runs one request at a time, yet a step sampled several rows")
        tokens = [self.script.pop(0) for _ in range(n)]
        result = StepResult(plan.step, tokens, [0.0] * n, [[] for _ in range(n)], [[] for _ in range(n)],
                            [0.0] * (len(plan.logits_index) - n))
        return decode(encode(result)) if self.wire else result


class SchedulerReplay:
    """The engine's scheduler, driven step by step; one request at a time."""

    def __init__(self, layout: PoolLayout, args: ServerArgs, vocab_size: int, wire: bool = False) -> None:
        self.sched = Scheduler(args, layout, frozenset(), lambda ids: "")
        self.vocab_size = vocab_size
        self.worker = ScriptedWorker(wire)
        self.steps = 0
        self._rid = 0

    def run(self, req: Request, check: bool = False) -> int:
        s = self.sched
        before = s.metrics.prefill_tokens_computed
        self._rid += 1
        rid = f"q{self._rid}"
        self.worker.script = list(req.answer)
        params = {"max_new_tokens": len(req.answer), "temperature": 0, "ignore_eos": True}
        s.add(GenerateReq(rid, list(req.prompt), SamplingParams.from_dict(params, self.vocab_size)))
        done: TokenOut | None = None
        outs = s.take_outputs()
        while True:
            for o in outs:
                if o.rid == rid and o.finished is not None:
                    done = o
            if done is not None:
                break
            plan = s.schedule()
            if plan is None:
                outs = s.take_outputs()
                if not outs and not s.has_work:
                    raise RuntimeError(f"request {rid} vanished without finishing")
                continue
            outs = s.process(self.worker.execute(plan))
            self.steps += 1
            if check:
                s.check_integrity()
        if done.finished != "length" or self.worker.script:
            raise RuntimeError(f"request {rid} ended with {done.finished!r} ({done.error}), "
                               f"{len(self.worker.script)} scripted tokens left")
        return s.metrics.prefill_tokens_computed - before


def simulate(requests: Sequence[Request], layout: PoolLayout, args: ServerArgs, block_tokens: int,
             vocab_size: int, check: bool = False, wire: bool = False) -> WorkloadResult:
    radix = SchedulerReplay(layout, args, vocab_size, wire)
    ideal, block = IdealCache(), BlockBaseline(block_tokens)
    totals = [0, 0, 0]
    for req in requests:
        totals[0] += radix.run(req, check=check)
        totals[1] += ideal.run(req)
        totals[2] += block.run(req)
    m = radix.sched.metrics
    u = radix.sched.pool.usage()
    return WorkloadResult(*totals, sum(len(r.prompt) for r in requests), len(requests), u.peak_state_bytes,
                          u.peak_kv_bytes, m.evictions, m.checkpoints, m.cached_tokens, radix.steps)


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
    ap.add_argument("--pool-gib", type=float, default=24.0, help="per-rank pool bytes, GiB (sets --mem-bytes)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    ap.add_argument("--check", action="store_true", help="run the scheduler's check_integrity() after every step")
    ap.add_argument("--wire", action="store_true", help="send plans and results through the wire encoding")
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    ServerArgs.add_cli_args(ap)  # the scheduler's own settings: --page-size, --chunked-prefill-size, ...
    args = ap.parse_args(argv)
    args.mem_bytes = int(args.pool_gib * 2**30)
    server_args = ServerArgs.from_cli_args(args)

    from radixk3.config import preset

    cfg = preset(args.preset)
    layout = PoolLayout.from_config(cfg, tp=server_args.tp_size, page_size=server_args.page_size)
    block = PoolLayout.from_config(preset("kimi-linear-48b")).state_equivalent_tokens()
    encode, enc_name = load_encoder()
    data = gsm8k_dir()
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {platform.system()}, python {platform.python_version()} "
          "(scheduler with a scripted no-op worker: allocator metadata only, no model, no buffer, no device)")
    print(f"tokens: {enc_name}; data: gsm8k from {data.relative_to(REPO) if data.is_relative_to(REPO) else data}")
    print(f"layout: {args.preset} tp={server_args.tp_size} page_size={server_args.page_size}: state block "
          f"{layout.state_block_bytes / 2**20:.1f} MiB, KV {layout.kv_token_bytes} B/token; pool {args.pool_gib} GiB")
    print(f"block baseline: {block} tokens per block (one kimi-linear-48b KDA layer's state in MLA-layer KV; "
          f"a whole state is {layout.state_block_bytes / layout.kv_token_bytes:.0f} tokens of all-layer KV)")
    print(f"scheduler: chunked_prefill_size {server_args.chunked_prefill_size}, decode_checkpoint_interval "
          f"{server_args.decode_checkpoint_interval}, schedule_policy {server_args.schedule_policy}, radix cache "
          f"{'off' if server_args.disable_radix_cache else 'on'}\n")

    results: dict[str, WorkloadResult] = {}
    head = (f"{'workload':<14}{'requests':>9}{'prompt tok':>11}{'radixk3':>9}{'ideal':>8}{'block':>8}"
            f"{'radix/ideal':>12}{'block/ideal':>12}{'radix hit':>10}{'block hit':>10}{'peak state':>11}"
            f"{'peak KV':>9}{'steps':>8}")
    print(head)
    t0 = time.perf_counter()
    for name, reqs in build_workloads(encode, data, args.scale).items():
        r = simulate(reqs, layout, server_args, block, cfg.vocab_size, check=args.check, wire=args.wire)
        results[name] = r
        t = r.total_prompt_tokens
        print(f"{name:<14}{r.requests:>9}{t:>11}{r.radixk3:>9}{r.ideal:>8}{r.block_baseline:>8}"
              f"{r.radixk3 / r.ideal:>12.4f}{r.block_baseline / r.ideal:>12.3f}{1 - r.radixk3 / t:>10.1%}"
              f"{1 - r.block_baseline / t:>10.1%}{r.peak_state_bytes / 2**30:>9.2f}Gi"
              f"{r.peak_kv_bytes / 2**30:>7.2f}Gi{r.steps:>8}")
    elapsed = time.perf_counter() - t0
    print(f"\nratios are computed prefill tokens over the ideal cache's, measured in this run; hit = share of "
          f"prompt tokens not computed; {sum(r.steps for r in results.values())} scheduler steps in {elapsed:.1f} s")
    if args.json:
        print(json.dumps({
            "workloads": {k: v._asdict() for k, v in results.items()},
            "block_tokens": block,
            "server_args": dataclasses.asdict(server_args),
            "layout": {"preset": args.preset, "tp": server_args.tp_size, "page_size": server_args.page_size,
                       "state_block_bytes": layout.state_block_bytes, "kv_token_bytes": layout.kv_token_bytes},
            "pool_bytes": server_args.mem_bytes,
            "tokens": enc_name,
            "seconds": elapsed,
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
