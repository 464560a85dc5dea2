"""bench/gsm8k.py: SGLang's workload and answer extraction, and end-to-end runs on k3-tiny (the script as a
subprocess, parsing what it prints; radix on and off in process; the transformers baseline)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_bench_smoke import bench, last_json

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("accuracy", "invalid", "latency", "output_throughput", "cache_hit_rate")


def test_workload_and_answer_extraction() -> None:
    m = bench("gsm8k")
    assert m.answer_value("so 3 + 4 = 7\n#### 1,234") == 1234
    assert m.answer_value("no digits here") == m.INVALID
    w = m.workload(m.DATA / "test.jsonl", m.DATA / "train.jsonl", 5, 3)
    blocks = w.prefix.split("\n\n")
    assert len(blocks) == 6 and blocks[-1] == "" and all(b.startswith("Question: ") for b in blocks[:5])
    train = m.read_jsonl(m.DATA / "train.jsonl")
    assert blocks[0] == f"Question: {train[0]['question']}\nAnswer: {train[0]['answer']}"
    assert all(q.startswith("Question: ") and q.endswith("\nAnswer:") for q in w.questions) and len(w.labels) == 3
    assert m.ideal_cached([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == 0 + 2 + 2  # the last token is always computed


def test_twenty_questions_end_to_end(tmp_path: Path) -> None:
    result = tmp_path / "result.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gsm8k.py"), "--backend", "engine",
                           "--num-questions", "20", "--max-new-tokens", "16", "--mem-mib", "128", "--json",
                           "--no-progress", "--result-file", str(result)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    printed = {ln.split(":", 1)[0]: ln.split(":", 1)[1] for ln in lines[:-1] if ":" in ln}
    for label in ("Accuracy", "Invalid", "Latency", "Output throughput", "Cache hit rate"):
        assert label in printed, label
    assert any("random weights" in ln for ln in lines)
    out = json.loads(lines[-1])
    assert all(isinstance(out[k], float) for k in KEYS)
    assert out["num_questions"] == 20 and 0 < out["output_tokens"] <= 20 * 16
    assert abs(float(printed["Accuracy"]) - out["accuracy"]) < 1e-3
    # Nearly everything an ideal prefix cache would serve (the shared 5-shot prefix, ~86% here).
    assert out["cache_hit_rate"] >= 0.97 * out["ideal_cache_hit_rate"]
    record = json.loads(result.read_text().splitlines()[-1])
    assert record["task"] == "gsm8k" and record["num_requests"] == 20


def test_cache_hit_rate_with_radix_on_and_off(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    m = bench("gsm8k")
    common = ["--backend", "engine", "--max-new-tokens", "2", "--mem-mib", "128", "--json", "--no-progress",
              "--result-file", str(tmp_path / "r.jsonl")]
    assert m.main([*common, "--num-questions", "48"]) == 0
    on = last_json(capsys)
    assert on["cache_hit_rate"] > 0.85  # 48 prompts sharing the 5-shot prefix
    assert m.main([*common, "--num-questions", "6", "--disable-radix-cache"]) == 0
    off = last_json(capsys)
    assert off["cache_hit_rate"] == 0.0 and off["ideal_cache_hit_rate"] > 0.5


def test_transformers_baseline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    m = bench("gsm8k")
    assert m.main(["--backend", "transformers", "--num-questions", "2", "--parallel", "2", "--max-new-tokens", "3",
                   "--json", "--no-progress", "--result-file", str(tmp_path / "r.jsonl")]) == 0
    out = last_json(capsys)
    assert all(out[k] is not None for k in KEYS) and out["cache_hit_rate"] == 0.0
    assert 2 <= out["output_tokens"] <= 6 and out["backend"] == "transformers"


def test_finish_cuts_at_a_stop_string() -> None:
    from radixk3.tokenizer import load_tokenizer

    m = bench("gsm8k")
    tok = load_tokenizer()
    ids = tok.encode("The answer is 12.\nQuestion: next one")
    text, n = m.finish(tok, ids)
    assert text == "The answer is 12.\n" and n < len(ids)
    assert "Question" in tok.decode(ids[:n]) and "Question" not in tok.decode(ids[: n - 1])
    assert m.finish(tok, tok.encode("no stop at all")) == ("no stop at all", len(tok.encode("no stop at all")))
    assert m.finish(tok, [*tok.encode("4"), tok.eos_id, *tok.encode("more")]) == ("4", len(tok.encode("4")) + 1)


def test_compare_runs_the_three_backends_in_one_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    m = bench("gsm8k")
    assert m.main(["--compare", "--num-questions", "4", "--parallel", "4", "--max-new-tokens", "2", "--mem-mib",
                   "128", "--json", "--no-progress", "--result-file", str(tmp_path / "r.jsonl")]) == 0
    out = last_json(capsys)
    assert set(out["runs"]) == {"radix_on", "radix_off", "transformers"}
    assert all(isinstance(out[k], float) for k in KEYS)
    assert out["runs"]["radix_on"]["cache_hit_rate"] > 0.5 and out["runs"]["radix_off"]["cache_hit_rate"] == 0
    assert out["ratio_radix_on_vs_off"] == pytest.approx(
        out["runs"]["radix_on"]["output_throughput"] / out["runs"]["radix_off"]["output_throughput"])
