"""Smoke tests of the benchmarks at tiny sizes: they run, their workloads have the promised shapes, and the
JSON they end with holds the promised keys. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@cache
def bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# --- offline_throughput --------------------------------------------------------------------------------
def test_gsm8k_burst_shapes() -> None:
    from radixk3.tokenizer import load_tokenizer

    m = bench("offline_throughput")
    w = m.gsm8k_burst(load_tokenizer(), 32, 800, 70, 64)
    assert len(w.prompts) == 32 and len({len(p) for p in w.prompts}) == 1  # one length: no padding
    shared = len(w.prompts[0]) - 70
    assert 700 <= shared <= 900
    assert all(p[:shared] == w.prompts[0][:shared] for p in w.prompts)
    assert len({tuple(p[shared:]) for p in w.prompts}) == 32
    assert shared + 32 * 60 <= m.ideal_prefill(w.prompts) <= shared + 32 * 70  # own parts open alike


def test_ideal_prefill_and_agreement() -> None:
    m = bench("offline_throughput")
    assert m.ideal_prefill([[1, 2, 3], [1, 2, 3], [1, 2, 4]]) == 3 + 1 + 1  # the last token is always computed
    assert m.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == (4 / 5, 1 / 2)


def test_offline_throughput_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    m = bench("offline_throughput")
    assert m.main(["--quick", "--dtypes", "float32", "--json"]) == 0
    out = last_json(capsys)
    for key in ("ratio_gsm8k", "ratio_b1", "ratio_b32", "ratio_b64", "radix_on_off", "prefill_vs_ideal",
                "agreement", "tok_s", "machine", "resident_mib", "resident_beyond_pool_mib"):
        assert out[key] is not None, key
    mem = out["columns"]["float32"]["resident_memory"]  # every process of the engine, the pool counted once
    assert {p["name"] for p in mem["processes"]} >= {"radixk3-sched0", "radixk3-w0-0"}
    assert 0 < out["resident_beyond_pool_mib"] < out["resident_mib"] <= mem["resident_peak_mib"]
    assert set(out["tok_s"]["radixk3"]) == {"gsm8k", "b1", "b8", "b32", "b64", "gsm8k_radix_off"}
    assert set(out["tok_s"]["transformers"]) == {"gsm8k", "b1", "b8", "b32", "b64"}
    col = out["columns"]["float32"]
    assert isinstance(col["radix_off_equal"], bool) and 0 <= col["radix_on_off_agreement"] <= 1
    assert col["prefill_tokens_ideal"] <= col["prefill_tokens_on"] <= col["prefill_tokens_off"]
    assert 0 <= out["agreement"] <= 1


def test_offline_throughput_expert_format_json(capsys: pytest.CaptureFixture[str]) -> None:
    m = bench("offline_throughput")
    assert m.main(["--quick", "--dtypes", "float32", "--backend", "radixk3", "--expert-format", "mxfp4", "--json"]) == 0
    q = last_json(capsys)["expert_format"]
    assert q["format"] == "mxfp4"
    assert set(q["decode_tok_s"]) == set(q["dense_decode_tok_s"]) == set(q["ratio"]) == {"b1", "b8", "b32", "b64"}
    assert all(v > 0 for v in q["decode_tok_s"].values())
    # e2m1 + an e8m0 scale per 32 values against fp32: 17/128 of the bytes.
    assert q["expert_bytes"] * 128 == q["dense_expert_bytes"] * 17


# --- engine_throughput ---------------------------------------------------------------------------------
def test_engine_throughput_scheduler_only_json(capsys: pytest.CaptureFixture[str]) -> None:
    m = bench("engine_throughput")
    assert m.main(["--scheduler-only", "--steps", "3", "--batches", "1,4", "--json"]) == 0
    out = last_json(capsys)
    assert set(out["scheduler"]) == {"1", "4"}
    for r in out["scheduler"].values():
        assert r["seconds_per_step"] > 0 and r["plan_bytes"] > 0
    assert out["machine"]["cores"] >= 1


def test_engine_throughput_end_to_end_json(capsys: pytest.CaptureFixture[str]) -> None:
    m = bench("engine_throughput")
    assert m.main(["--steps", "3", "--batches", "1", "--engine-batch", "4", "--engine-new", "2", "--json"]) == 0
    out = last_json(capsys)
    assert out["engine"]["batch"] == 4 and isinstance(out["engine"]["seconds_per_step"], float)  # no timing asserted
    assert isinstance(out["scheduler_share"], float) and "4" in out["scheduler"]


# --- decode_gap ----------------------------------------------------------------------------------------
def test_decode_gap_json(capsys: pytest.CaptureFixture[str]) -> None:
    m = bench("decode_gap")
    assert m.main(["--long-tokens", "400", "--chunked-prefill-size", "64", "--shorts", "2", "--short-window", "0.05",
                   "--before", "4", "--mem-bytes", str(32 << 20), "--json"]) == 0
    out = last_json(capsys)
    for key in ("stream_median_gap_before_s", "stream_worst_gap_during_s", "long_ttft_s", "short_ttft_worst_s",
                "prefill_tokens_per_extend_step", "machine", "settings"):
        assert out[key] is not None, key
    assert out["settings"]["enable_mixed_chunk"] is True
    assert out["extend_steps_during"] >= 400 // 64 and out["mixed_steps_during"] > 0  # the stream rode along
    assert 0 < out["prefill_tokens_per_extend_step"] <= 64


# --- pd (its servers and router take longer than a smoke test: its figures from timings and counters) -------
def test_pd_figures() -> None:
    m = bench("pd")
    a = m.parse(["--quick"])
    jobs = m.workload(a, 4096)
    assert [j.kind for j in jobs] == ["short"] * a.shorts + ["long"] * a.longs
    assert [j.delay_s for j in jobs if j.kind == "long"] == [a.long_interval * (i + 1) for i in range(a.longs)]
    timings = [m.Timing("short", 16, 0.0, [0.1, 0.2, 0.4]), m.Timing("short", 16, 0.0, [0.3, 0.4, 0.5]),
               m.Timing("long", 1100, 1.0, [2.0])]
    lat = m.latencies(timings, 2.0)
    assert lat.ttft_p50_s == pytest.approx(0.3) and lat.long_ttft_p50_s == pytest.approx(1.0)
    assert lat.short_gap_p90_s == pytest.approx(0.17) and lat.output_tok_s == pytest.approx(3.5)
    keys = ("pd_transfers", "pd_kv_bytes", "pd_state_bytes", "pd_timed_bytes", "pd_timed_seconds")
    before = dict.fromkeys(keys, 10)
    after = dict(zip(keys, (16, 10 + 4 * 512, 10 + 2 * 100, 10 + 2_000_000, 10.5), strict=True))
    mv = m.moved(before, after, 2, (100.0, 2048.0))
    assert (mv.transfers_per_request, mv.state_bytes_per_request, mv.kv_bytes_per_request) == (3, 100, 1024)
    assert mv.ms_per_mb == pytest.approx(250.0)


def test_decode_gap_slow_grammar_json(capsys: pytest.CaptureFixture[str]) -> None:
    """The slow-grammar disturbance: its outcome (a token, or the refusal of a compile past the budget) ends the
    window; the stream's gaps are measured around it. The short request is sent 5 ms in: the compile workers are
    up (the bench's warm-up starts them), so the grammar's outcome comes within tens of milliseconds."""
    m = bench("decode_gap")
    assert m.main(["--grammar-properties", "50", "--grammar-compile-timeout", "1", "--shorts", "1",
                   "--short-window", "0.01", "--before", "4", "--mem-bytes", str(32 << 20), "--json"]) == 0
    out = last_json(capsys)
    assert out["settings"]["grammar_properties"] == 50 and out["settings"]["grammar_compile_timeout"] == 1
    assert isinstance(out["grammar_refused"], bool) and out["long_ttft_s"] > 0
    assert out["stream_worst_gap_during_s"] is not None and len(out["short_ttft_s"]) == 1

# --- spec ----------------------------------------------------------------------------------------------
def test_spec_warm_up_leaves_no_trace(tmp_path: Path) -> None:
    """The timed run after the warm-up (on its own first prompt) sees what a cold engine sees: no radix hit
    and no n-gram drafts from the warm-up's tokens (the corpus holds finished requests)."""
    from radixk3.checkpoint import write_random_checkpoint
    from radixk3.config import preset
    from runtime.tokenizer.engine import Engine

    m = bench("spec")
    ckpt = write_random_checkpoint(preset("k3-tiny"), tmp_path / "k3-tiny", seed=0)
    prompt = list(range(100, 124))  # distinct ids: no n-gram of its own repeats
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}
    keys = ("spec_windows", "draft_tokens", "accepted_tokens")

    def timed(eng: Any) -> tuple[Any, ...]:  # noqa: ANN401
        before = eng.get_metrics()
        out = eng.generate(prompt, sampling)
        after = eng.get_metrics()
        return out["output_ids"], out["meta_info"]["cached_tokens"], *(after[k] - before[k] for k in keys)

    with Engine(str(ckpt), mem_bytes=256 << 20, **spec) as cold:
        want = timed(cold)
    with m.warmed_engine(ckpt, prompt, 1, **spec) as warm:
        assert timed(warm) == want


# --- the llama.cpp race's columns ------------------------------------------------------------------------
def test_llamacpp_jobs_and_column(tmp_path: Path) -> None:
    """The burst runs both ways; ratios are radixk3 / llama.cpp (the prefill-all run against radixk3's burst);
    agreement counts llama.cpp's tokens against radixk3's."""
    from bench.llamacpp.gguf_export import Exported
    from bench.llamacpp.race import Column, jobs
    from bench.llamacpp.runner import Report, Timed

    m = bench("offline_throughput")
    burst = m.Workload("gsm8k", [[1, 2, 3, 4], [1, 2, 3, 5]], 2, "")
    b1 = m.Workload("b1", [[9, 8]], 2, "")
    js = jobs([burst, b1], burst)
    assert [(j.name, j.shared_prefix) for j in js] == [("gsm8k", True), ("b1", False), ("gsm8k_prefill_all", False)]
    rk = {"gsm8k": m.Run(40.0, [[7, 7], [6, 6]], 0.1), "b1": m.Run(10.0, [[5, 4]], 0.2)}
    runs = {"gsm8k": Timed([[7, 7], [6, 6]], 0.2), "b1": Timed([[5, 3]], 0.1),
            "gsm8k_prefill_all": Timed([[7, 7], [6, 6]], 0.8)}
    col = m.llamacpp_column(rk, Column(Exported(tmp_path / "x.gguf", "f32", 1, 1), Report(runs), 1), burst)
    assert col["ratio_llamacpp_gsm8k"] == pytest.approx(40.0 / 20.0)
    assert col["ratio_llamacpp_gsm8k_prefill_all"] == pytest.approx(40.0 / 5.0)
    assert col["ratio_llamacpp_b1"] == pytest.approx(10.0 / 20.0)
    assert col["agreement_llamacpp"] == pytest.approx(9 / 10)  # b1 diverges at its second token
    assert col["llamacpp"]["agreement_sequences"] == pytest.approx(4 / 5)


def test_weight_floor_bytes_per_token() -> None:
    from bench.weight_floor import Floor, token_bytes
    from radixk3.config import preset

    cfg = preset("k3-small")
    fp32, bf16 = token_bytes(cfg, 4), token_bytes(cfg, 2)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size  # gate, up, down
    assert fp32.routed_used == 4 * moe_layers * cfg.num_experts_per_token * expert
    assert fp32.embedding_row == 4 * cfg.hidden_size
    assert 2 * bf16.total == fp32.total
    assert fp32.dense > 4 * cfg.vocab_size * cfg.hidden_size  # lm_head and more
    f = Floor(fp32.total, 1e10)
    assert f.multiple(2 * f.seconds) == pytest.approx(2.0) and f.multiple(None) is None


# --- weight_quant ----------------------------------------------------------------------------------------
def test_weight_quant_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    m = bench("weight_quant")
    assert m.main(["--quick", "--dtypes", "bfloat16", "--methods", "int4"]) == 0
    (col,) = last_json(capsys)["quantization"]
    assert col["method"] == "int4" and set(col["tok_s"]) == set(col["ratio_to_dense"]) == {"b1", "b4"}
    assert 0 <= col["greedy_agreement"] <= 1 and 0 <= col["top1_agreement"] <= 1 and col["max_logit_error"] >= 0


# --- vision_prefill ------------------------------------------------------------------------------------
def test_vision_prefill_runs(capsys: pytest.CaptureFixture[str]) -> None:
    m = bench("vision_prefill")
    assert m.main(["--preset", "k3-tiny", "--requests", "2", "--image", "56x56", "--head", "4", "--tail", "4",
                   "--json"]) == 0
    out = last_json(capsys)
    assert out["prefill_tok_s_images"] > 0 and out["prefill_tok_s_text"] > 0 and out["image_tokens"] == 4
    # The repeated image is encoded once with the encoder cache, once per request without it.
    assert (out["repeated_images_encoded_cache"], out["repeated_images_encoded_no_cache"]) == (1, 2)
