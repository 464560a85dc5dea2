"""The prefix-cache simulator (the real Scheduler with a scripted no-op worker) on scaled-down workloads:
consistent counts, integrity after every step, exact hits after donation, eviction, the JSON it ends with."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from radixk3.config import preset
from runtime.pool_layout import PoolLayout
from runtime.server_args import ServerArgs

SIM_PATH = Path(__file__).resolve().parents[2] / "bench" / "prefix_cache_sim.py"


@cache
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prefix_cache_sim", SIM_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@cache
def workloads() -> dict[str, list]:
    s = sim()
    encode, _ = s.load_encoder()
    return s.build_workloads(encode, s.gsm8k_dir(), scale=0.08)


LAYOUT = PoolLayout.from_config(preset("kimi-linear-48b"))
VOCAB = preset("kimi-linear-48b").vocab_size
BLOCK = LAYOUT.state_equivalent_tokens()
BIG = ServerArgs(mem_bytes=24 * 2**30)


@pytest.mark.parametrize("name", ["gsm8k", "multiturn", "system_prompt", "short_prefix"])
def test_counts_are_consistent(name: str) -> None:
    reqs = workloads()[name]
    r = sim().simulate(reqs, LAYOUT, BIG, BLOCK, VOCAB, check=True)
    assert r.requests == len(reqs) and r.total_prompt_tokens == sum(len(q.prompt) for q in reqs)
    assert r.ideal <= r.radixk3 < r.total_prompt_tokens  # radixk3 hits, never beats recompute-only-new
    assert r.ideal <= r.block_baseline <= r.total_prompt_tokens
    assert r.radixk3 + r.cached_tokens == r.total_prompt_tokens  # what is not matched is computed, once
    assert r.peak_state_bytes > 0 and r.peak_kv_bytes > 0
    assert r.steps >= sum(len(q.answer) for q in reqs)  # one decode step per sampled token at least
    if name == "short_prefix":
        assert r.block_baseline == r.total_prompt_tokens  # prefixes under one block: nothing to reuse
    if name == "multiturn":
        assert r.radixk3 < r.block_baseline


def test_wire_encoding_changes_nothing() -> None:
    reqs = workloads()["multiturn"][:6]
    assert sim().simulate(reqs, LAYOUT, BIG, BLOCK, VOCAB, wire=True) == sim().simulate(reqs, LAYOUT, BIG, BLOCK,
                                                                                       VOCAB)


def test_multiturn_hits_exactly_with_donation() -> None:
    s = sim()
    reqs = workloads()["multiturn"]
    radix, ideal = s.SchedulerReplay(LAYOUT, BIG, VOCAB), s.IdealCache()
    finished: list[tuple[int, ...]] = []
    continued = 0
    for q in reqs:
        a, b = radix.run(q), ideal.run(q)
        if any(q.prompt[: len(f)] == f for f in finished):
            continued += 1
            assert a == b  # donation leaves the exact state of the previous prompt + answer
        finished.append(q.prompt + q.answer)
    assert continued > len(reqs) // 2


def test_radix_cache_off_computes_every_prompt_token() -> None:
    reqs = workloads()["gsm8k"]
    r = sim().simulate(reqs, LAYOUT, ServerArgs(mem_bytes=24 * 2**30, disable_radix_cache=True), BLOCK, VOCAB)
    assert r.radixk3 == r.total_prompt_tokens and r.cached_tokens == 0


def test_a_small_pool_evicts_and_still_hits() -> None:
    reqs = workloads()["gsm8k"]
    big = sim().simulate(reqs, LAYOUT, BIG, BLOCK, VOCAB)
    small = sim().simulate(reqs, LAYOUT, ServerArgs(mem_bytes=2**30), BLOCK, VOCAB, check=True)  # 24 state blocks
    assert small.evictions > 0 and small.peak_state_bytes + small.peak_kv_bytes <= 2**30
    assert big.radixk3 <= small.radixk3 < small.block_baseline


def test_json_summary_is_the_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim().main(["--json", "--scale", "0.03", "--chunked-prefill-size", "256"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(last)
    assert set(out["workloads"]) == {"gsm8k", "multiturn", "system_prompt", "short_prefix"}
    for w in out["workloads"].values():
        assert {"radixk3", "ideal", "block_baseline", "total_prompt_tokens", "steps"} <= set(w)
    assert out["block_tokens"] == 1885
    assert out["server_args"]["chunked_prefill_size"] == 256 and out["pool_bytes"] == 24 * 2**30
