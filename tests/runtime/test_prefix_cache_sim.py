"""The prefix-cache simulator on scaled-down workloads: consistent counts, integrity after every request,
and the JSON it ends with."""

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
BLOCK = LAYOUT.state_equivalent_tokens()


@pytest.mark.parametrize("name", ["gsm8k", "multiturn", "system_prompt", "short_prefix"])
def test_counts_are_consistent(name: str) -> None:
    reqs = workloads()[name]
    r = sim().simulate(reqs, LAYOUT, 24 * 2**30, checkpoint_interval=64, block_tokens=BLOCK, check=True)
    assert r.requests == len(reqs) and r.total_prompt_tokens == sum(len(q.prompt) for q in reqs)
    assert r.ideal <= r.radixk3 < r.total_prompt_tokens  # radixk3 hits, never beats recompute-only-new
    assert r.ideal <= r.block_baseline <= r.total_prompt_tokens
    assert r.peak_state_bytes > 0 and r.peak_kv_bytes > 0
    if name == "short_prefix":
        assert r.block_baseline == r.total_prompt_tokens  # prefixes under one block: nothing to reuse
    if name == "multiturn":
        assert r.radixk3 < r.block_baseline


def test_multiturn_hits_exactly_with_donation() -> None:
    s = sim()
    reqs = workloads()["multiturn"]
    radix, ideal = s.RadixReplay(LAYOUT, 24 * 2**30, 0), s.IdealCache()
    finished: list[tuple[int, ...]] = []
    continued = 0
    for q in reqs:
        a, b = radix.run(q), ideal.run(q)
        if any(q.prompt[: len(f)] == f for f in finished):
            continued += 1
            assert a == b  # donation leaves the exact state of the previous prompt + answer
        finished.append(q.prompt + q.answer)
    assert continued > len(reqs) // 2


def test_a_small_pool_evicts_and_still_hits() -> None:
    reqs = workloads()["gsm8k"]
    big = sim().simulate(reqs, LAYOUT, 24 * 2**30, 64, BLOCK)
    small = sim().simulate(reqs, LAYOUT, 2**30, 64, BLOCK, check=True)  # 24 state blocks
    assert small.evicted_states > 0 and small.peak_state_bytes + small.peak_kv_bytes <= 2**30
    assert big.radixk3 <= small.radixk3 < small.block_baseline


def test_json_summary_is_the_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim().main(["--json", "--scale", "0.03"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(last)
    assert set(out["workloads"]) == {"gsm8k", "multiturn", "system_prompt", "short_prefix"}
    for w in out["workloads"].values():
        assert {"radixk3", "ideal", "block_baseline", "total_prompt_tokens"} <= set(w)
    assert out["block_tokens"] == 1885
