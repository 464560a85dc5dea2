"""bench/distributed.py at a tiny size: every configuration runs (tp 1, tp 2, dp 2 cache-aware and round
robin, tp 2 dp 2 DP attention), the tp 2 ranks measure their collectives, and the JSON it ends with holds the
promised keys. The greedy tokens of every configuration equal tp 1's; no timing is asserted."""

from __future__ import annotations

import os

import pytest

from bench import distributed
from tests.bench.test_bench_smoke import last_json


def test_distributed_bench_tiny_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert distributed.main(["--num-questions", "2", "--num-shots", "1", "--max-new-tokens", "2", "--mem-mib", "32",
                             "--json"]) == 0
    out = last_json(capsys)
    for key in ("hit_rate_dp1", "hit_rate_dp2_cache_aware", "hit_rate_dp2_round_robin", "tok_s", "comm_share",
                "machine"):
        assert out[key] is not None, key
    assert set(out["tok_s"]) == set(distributed.CONFIGS) and all(v > 0 for v in out["tok_s"].values())
    assert 0 < out["comm_share"] < 1 and out["comm"]["steps"] > 0
    # The tp 2 ranks share the cores, as the engine's ranks do: no oversubscription in the communication share.
    assert out["comm"]["rank_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert all(out["outputs_equal_tp1"].values()), out["outputs_equal_tp1"]
    # The two prompts share the one-shot prefix: cache-aware keeps them together, round robin splits them.
    assert out["runs"]["dp2_cache_aware"]["replica_prompt_tokens"][1] == 0
    assert min(out["runs"]["dp2_round_robin"]["replica_prompt_tokens"]) > 0
    assert out["hit_rate_dp2_cache_aware"] == out["hit_rate_dp1"]
    # DP attention routes inside its one replica, per DP rank, the same way.
    assert out["runs"]["tp2_dp2_attention"]["replica_prompt_tokens"][1] == 0
    assert out["hit_rate_dp2_cache_aware"] == out["runs"]["tp2_dp2_attention"]["hit_rate"]


def test_distributed_bench_spreads_the_burst_once_decode_outweighs_the_prefix(
        capsys: pytest.CaptureFixture[str]) -> None:
    """64 new tokens each: the cache-aware router sends the burst to both replicas once the decode tokens the
    first owes outweigh its prefix, with tp 1's tokens."""
    assert distributed.main(["--num-questions", "4", "--num-shots", "1", "--max-new-tokens", "64", "--mem-mib", "32",
                             "--configs", "tp1,dp2_cache_aware", "--no-comm-share", "--json"]) == 0
    out = last_json(capsys)
    assert min(out["runs"]["dp2_cache_aware"]["replica_prompt_tokens"]) > 0
    assert out["hit_rate_dp2_cache_aware"] is not None and out["tok_s"]["dp2_cache_aware"] > 0
    assert out["outputs_equal_tp1"] == {"dp2_cache_aware": True}
