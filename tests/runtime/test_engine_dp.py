"""`--dp 2` engine replicas behind one tokenizer manager: greedy tokens identical to `--dp 1` over the
exactness prompt set with every dispatch method; aborts reach the request's replica; metrics add up; and on
the gsm8k 5-shot workload the cache-aware router keeps the hit rate of one replica where round robin loses
one shared-prefix computation per extra replica."""

from __future__ import annotations

import pytest

from bench.gsm8k import DATA, workload
from radixk3.config import preset
from radixk3.model import build_model
from runtime.dp_router import CacheAwareConfig, DPRouter
from runtime.tokenizer.engine import Engine
from tests.runtime.test_engine_exactness import GREEDY, _waves

MEM = 32 << 20


@pytest.fixture(scope="module")
def dp1():  # noqa: ANN201
    with Engine(mem_bytes=MEM) as e:
        yield e


@pytest.fixture(scope="module")
def dp2():  # noqa: ANN201
    with Engine(mem_bytes=MEM, dp_size=2, load_balance_method="round_robin") as e:
        assert e.tm.num_replicas == 2 and e.tm.router.method == "round_robin"  # the flag builds the router
        yield e


@pytest.fixture(scope="module")
def exactness(dp1: Engine) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    def run(prompts: list[list[int]]) -> list[list[int]]:  # --dp 1 equals the plain greedy loop (exactness tests)
        return [o["output_ids"] for o in dp1.generate(prompts, GREEDY)]

    waves = _waves(build_model(preset("k3-tiny"), seed=dp1.args.seed), run)  # the engines' built-in model
    refs = [run(wave) for wave in waves]
    assert dp1.flush_cache()
    return waves, refs


def _use(eng: Engine, method: str, config: CacheAwareConfig | None = None) -> DPRouter:
    """A fresh router of `method` (the engine is idle: nothing is outstanding) and empty replica caches."""
    assert eng.get_metrics()["pending_requests"] == 0 and eng.flush_cache()
    eng.tm.router = DPRouter(eng.tm.num_replicas, method, config or CacheAwareConfig())
    return eng.tm.router


def _replica_prompt_tokens(eng: Engine) -> list[int]:
    return [r["prompt_tokens"] for r in eng.get_metrics()["replicas"]]


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue", "cache_aware"])
def test_dp2_greedy_equals_dp1(method: str, dp2: Engine, exactness) -> None:  # noqa: ANN001
    waves, refs = exactness
    router = _use(dp2, method)
    before = _replica_prompt_tokens(dp2)
    for wave, ref in zip(waves, refs, strict=True):
        assert [o["output_ids"] for o in dp2.generate(wave, GREEDY)] == ref
    served = [a - b for a, b in zip(_replica_prompt_tokens(dp2), before, strict=True)]
    assert all(s > 0 for s in served), f"{method} left a replica idle: {served}"
    assert router.loads == [0, 0] and router.replica_of("anything") is None
    router.check_integrity()


def test_metrics_add_up_and_abort_reaches_its_replica(dp2: Engine) -> None:
    router = _use(dp2, "round_robin")
    long = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}
    streams = [dp2.stream([31, 32, 33, 34 + i], long, rid=f"long{i}", timeout=60) for i in range(2)]
    assert [router.replica_of(f"long{i}") for i in range(2)] == [0, 1]
    finished = {}
    for i, chunks in enumerate(streams):
        for n, c in enumerate(chunks):
            if n == 2:
                dp2.abort(f"long{i}")  # it runs on replica i: only replica i can stop it
            if c.finished is not None:
                finished[i] = c.finished
    assert finished == {0: "abort", 1: "abort"}
    assert router.loads == [0, 0]
    m = dp2.get_metrics()
    for key in ("prompt_tokens", "cached_tokens", "decode_tokens", "steps", "kv_pool_bytes"):
        assert m[key] == sum(r[key] for r in m["replicas"]), key
    assert m["replicas"][0]["prompt_tokens"] > 0 and m["replicas"][1]["prompt_tokens"] > 0


def _hit_rate(eng: Engine, prompts: list[str]) -> float:
    assert eng.get_metrics()["pending_requests"] == 0 and eng.flush_cache()
    outs = eng.generate(prompts, {"max_new_tokens": 1, "temperature": 0})
    meta = [o["meta_info"] for o in outs]
    return sum(m["cached_tokens"] for m in meta) / sum(m["prompt_tokens"] for m in meta)


def test_gsm8k_cache_aware_hit_rate_matches_one_replica(dp1: Engine, dp2: Engine) -> None:
    w = workload(DATA / "test.jsonl", DATA / "train.jsonl", 5, 16)
    prompts = [w.prefix + q for q in w.questions]
    one = _hit_rate(dp1, prompts)
    _use(dp2, "cache_aware")
    aware = _hit_rate(dp2, prompts)
    _use(dp2, "round_robin")
    rr = _hit_rate(dp2, prompts)
    print(f"gsm8k 5-shot, {len(prompts)} questions: hit rate dp1 {one:.3f}, dp2 cache_aware {aware:.3f}, "
          f"dp2 round_robin {rr:.3f}")
    assert one > 0.5  # the shared prefix is most of every prompt
    assert aware >= one - 0.02
    # Round robin computes the few-shot prefix once on each replica: robustly below one replica's rate.
    assert rr < aware - 0.01


def test_gsm8k_one_prefix_burst_spreads_once_its_decode_work_outweighs_the_prefix(dp1: Engine, dp2: Engine) -> None:
    """16 prompts sharing a 1-shot prefix, 32 new tokens each: the replica that caches the prefix takes requests
    until the decode tokens it owes outweigh computing the prefix again, then both replicas share the burst,
    with the tokens of one replica."""
    w = workload(DATA / "test.jsonl", DATA / "train.jsonl", 1, 16)
    prompts = [w.prefix + q for q in w.questions]
    greedy = GREEDY | {"max_new_tokens": 32}
    ref = [o["output_ids"] for o in dp1.generate(prompts, greedy)]
    router = _use(dp2, "cache_aware")
    before = _replica_prompt_tokens(dp2)
    assert [o["output_ids"] for o in dp2.generate(prompts, greedy)] == ref
    served = [a - b for a, b in zip(_replica_prompt_tokens(dp2), before, strict=True)]
    assert min(served) >= sum(served) // 3, served  # a share in proportion, not a straggler or two
    assert router.stats.by_work > 0 and router.loads == [0, 0]
    router.check_integrity()


def test_dp2_with_ngram_speculation_equals_dp1(exactness) -> None:  # noqa: ANN001
    """Speculation inside each replica: every replica verifies and replays its own requests' windows."""
    waves, refs = exactness
    with Engine(mem_bytes=MEM, dp_size=2, speculative_algorithm="ngram", load_balance_method="shortest_queue") as e:
        for wave, ref in zip(waves, refs, strict=True):
            assert [o["output_ids"] for o in e.generate(wave, GREEDY)] == ref
        per = e.get_metrics()["replicas"]
        assert all(r["verify_steps"] > 0 and r["draft_tokens"] > 0 for r in per)
