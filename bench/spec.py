"""Speculative decoding: draft-window memory (ReplaySSM vs snapshot) and, on the trained model pair, mean
accepted length and output tok/s per proposer, with and without speculation, at batch 1 and batch 16.

(a) Memory: the draft window's scratch per request for `kimi-k3` at TP 8, from the pool plan
    (`PoolLayout.spec_window_bytes`); and the bytes the window really allocates for the trained target.
(b) Speed: the real engine (`runtime.tokenizer.engine.Engine`: tokenizer, scheduler and worker processes) on gsm8k test
    questions with the trained pair (`bench/train_spec_pair.py`): the built-in target `radixk3/assets/k3-gsm8k/`
    (bf16, with its MTP layer), and (when asked for) a draft model and a DSpark drafter trained against it into
    the cache directory when missing,
    greedy, one plain run and one run per proposer per batch size, all in this run.
    Batch 1 sends one question at a time; batch B sends B at once. Each engine is warmed up on the first
    question, then flushed: the timed run starts with an empty radix cache and n-gram corpus.

    python bench/spec.py [--json] [--dtype float32|bfloat16] [--proposers ngram,mtp,draft,dspark] [--k 3]
        [--ngram-k 8] [--questions 16]

The n-gram proposer drafts up to --ngram-k tokens, fewer after a short match (`runtime.spec.ngram.draft_budget`);
the model proposers draft --k.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/kernels.py would shadow the kernels package

from bench.gsm8k import DATA, STOPS, few_shot_prefix, one_example, read_jsonl  # noqa: E402
from bench.machine_info import cpu_name  # noqa: E402

PROPOSERS = ("ngram", "mtp", "draft", "dspark")


def memory_figures(k: int) -> dict[str, Any]:
    from radixk3.config import preset
    from runtime.pool_layout import PoolLayout

    lay = PoolLayout.from_config(preset("kimi-k3"), tp=8)  # bf16 model dtype, fp32 recurrent state
    width = k + 1
    replay, snap = lay.spec_window_bytes("replay", 1, width), lay.spec_window_bytes("snapshot", 1, width)
    return {"k3_tp8_window": width, "k3_tp8_replay_bytes_per_request": replay,
            "k3_tp8_snapshot_bytes_per_request": snap, "replay_vs_snapshot_memory_ratio": snap / replay}


def measured_memory(target: Path, k: int, rows: int) -> dict[str, Any]:
    from radixk3.checkpoint import load_model
    from radixk3.spec_window import SpecWindow

    cfg = load_model(target).config
    got = {mode: SpecWindow.allocate(cfg, mode, rows, k + 1, cfg.torch_dtype).nbytes for mode in ("replay", "snapshot")}
    return {"trained_rows": rows, "trained_replay_bytes": got["replay"], "trained_snapshot_bytes": got["snapshot"],
            "trained_memory_ratio": got["snapshot"] / got["replay"]}


def prompts(num: int, shots: int) -> list[str]:
    train = read_jsonl(DATA / "train.jsonl")
    prefix = few_shot_prefix(train, shots)
    return [prefix + one_example(e, False) for e in read_jsonl(DATA / "test.jsonl")[:num]]


@contextmanager
def warmed_engine(target: Path, warm_up: str | list[int], batch: int, **spec: Any) -> Iterator[Any]:  # noqa: ANN401
    """An engine past its first-call costs (a short greedy run of `warm_up`), then flushed: the warm-up's
    tokens are neither a radix hit nor n-gram drafts (the corpus holds finished requests) of the timed run."""
    from runtime.tokenizer.engine import Engine

    with Engine(str(target), max_running_requests=max(batch, 1), mem_bytes=256 << 20, **spec) as eng:
        eng.generate(warm_up, {"max_new_tokens": 4, "temperature": 0})
        if not eng.flush_cache():
            raise RuntimeError("the cache could not be flushed after the warm-up")
        yield eng


def run_engine(target: Path, texts: list[str], batch: int, max_new: int, dtype: str, **spec: Any  # noqa: ANN401
               ) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new, "temperature": 0, "stop": STOPS}
    with warmed_engine(target, texts[0], batch, dtype=dtype, **spec) as eng:
        base = eng.get_metrics()
        t0 = time.perf_counter()
        outs: list[dict[str, Any]] = []
        for i in range(0, len(texts), batch):
            got = eng.generate(texts[i : i + batch], sampling)
            outs += got if isinstance(got, list) else [got]
        wall = time.perf_counter() - t0
        m = eng.get_metrics()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    windows = m["spec_windows"] - base["spec_windows"]
    accepted = m["accepted_tokens"] - base["accepted_tokens"]
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "texts": [o["text"] for o in outs],
            "accept_length": 1 + accepted / windows if windows else 1.0,
            "verify_steps": m["verify_steps"] - base["verify_steps"]}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proposers", default=",".join(PROPOSERS), help=f"comma-separated, of {', '.join(PROPOSERS)}")
    p.add_argument("--k", type=int, default=3, help="draft tokens per verify step (model proposers)")
    p.add_argument("--ngram-k", type=int, default=8, help="most draft tokens per verify step (n-gram)")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--shots", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the serving dtype (float32: the bf16 target widened; a CPU's bf16 GEMMs round by the row "
                        "count, so a verify window and a decode step would break near-ties differently)")
    p.add_argument("--memory-only", action="store_true", help="only part (a), from the plan")
    p.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    proposers = [x for x in a.proposers.split(",") if x]
    bad = [x for x in proposers if x not in PROPOSERS]
    if bad:
        raise SystemExit(f"unknown proposer(s) {bad}; choose from {PROPOSERS}")
    print(f"machine: {cpu_name()}")
    fig: dict[str, Any] = memory_figures(a.k) | {"dtype": a.dtype}
    print(f"(a) draft window of {a.k + 1} tokens, kimi-k3 at TP 8, per request: ReplaySSM "
          f"{fig['k3_tp8_replay_bytes_per_request'] / 2**20:.1f} MiB, snapshot "
          f"{fig['k3_tp8_snapshot_bytes_per_request'] / 2**20:.1f} MiB: "
          f"{fig['replay_vs_snapshot_memory_ratio']:.1f}x less")
    if a.memory_only:
        if a.json:
            print(json.dumps(fig))
        return 0
    from bench.train_spec_pair import BUILTIN, ensure_spec_pair

    # The draft model and DSpark are trained (into the cache) only when asked for: n-gram and MTP need the
    # built-in target alone.
    trained = {"draft", "dspark"} & set(proposers)
    pair = ensure_spec_pair(target=BUILTIN, log=True) if trained else None
    target = BUILTIN if pair is None else pair.target
    fig |= measured_memory(target, a.k, 64)
    print(f"    measured on the trained target, 64 rows: ReplaySSM {fig['trained_replay_bytes'] / 2**20:.2f} MiB, "
          f"snapshot {fig['trained_snapshot_bytes'] / 2**20:.2f} MiB: {fig['trained_memory_ratio']:.1f}x")
    texts = prompts(a.questions, a.shots)
    paths = {} if pair is None else {"draft": pair.draft, "dspark": pair.dspark}
    for batch in (int(b) for b in a.batches.split(",")):
        plain = run_engine(target, texts, batch, a.max_new_tokens, a.dtype)
        print(f"(b) batch {batch}: plain {plain['tok_s']:.1f} tok/s ({plain['tokens']} tokens)")
        fig[f"plain_tok_s_b{batch}"] = plain["tok_s"]
        for name in proposers:
            k = a.ngram_k if name == "ngram" else a.k
            spec: dict[str, Any] = {"speculative_algorithm": name, "speculative_num_draft_tokens": k}
            if name in paths:
                spec["speculative_draft_model"] = str(paths[name])
            got = run_engine(target, texts, batch, a.max_new_tokens, a.dtype, **spec)
            same = got["texts"] == plain["texts"]
            speedup = got["tok_s"] / plain["tok_s"]
            print(f"    {name:7s} k {k}  accept length {got['accept_length']:.2f}  {got['tok_s']:.1f} tok/s  "
                  f"speedup {speedup:.2f}x  outputs identical to plain: {same}")
            fig.setdefault(name, {})[f"b{batch}"] = {
                "accept_length": got["accept_length"], "spec_tok_s": got["tok_s"], "plain_tok_s": plain["tok_s"],
                "speedup": speedup, "identical": same, "k": k}
    for name in proposers:  # the keys per proposer: batch 1 figures at the top level of each
        if name in fig and "b1" in fig[name]:
            fig[name] |= {key: fig[name]["b1"][key] for key in ("accept_length", "spec_tok_s", "plain_tok_s",
                                                                 "speedup")}
    if a.json:
        print(json.dumps(fig))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
