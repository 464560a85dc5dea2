"""SGLang's own benchmark client (`python -m sglang.bench_serving`, from PyPI) against a live radixk3 server, with
`--backend sglang` (/generate) and `--backend sglang-oai` (/v1/completions) on a local ShareGPT-format file: every
request completes, with the tokenizer bench_serving loads from /model_info's `tokenizer_path`."""

from __future__ import annotations

import json
import runpy
import sys
import types
from pathlib import Path

import httpx
import pytest

from radixk3.tokenizer import load_tokenizer
from tests.radixk3.test_tokenizer import gsm8k_test_texts
from tests.runtime.http_server_proc import Server

NUM_PROMPTS, OUTPUT_LEN = 3, 4  # bench_serving's least output length


def sharegpt_file(path: Path) -> Path:
    """gsm8k's questions and answers as ShareGPT conversations (human, gpt), bench_serving's default format: as
    many as the run sends, so that it sends each once."""
    texts = gsm8k_test_texts()[: 2 * NUM_PROMPTS]
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            for i, (q, a) in enumerate(zip(texts[::2], texts[1::2], strict=True))]
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharegpt_file(tmp_path_factory.mktemp("bench_serving") / "sharegpt.json")


@pytest.fixture
def bench_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    # sglang.benchmark.serving imports FAKE_BOOTSTRAP_HOST (its only name from there) from
    # sglang.srt.disaggregation.utils, whose imports need torchvision, which cannot be installed beside the CPU
    # torch: a module of that name holding only that constant stands in for it.
    fake = types.ModuleType("sglang.srt.disaggregation.utils")
    fake.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fake.__name__, fake)


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
@pytest.mark.usefixtures("bench_serving")
def test_bench_serving_completes_every_request(server: Server, dataset: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    info = httpx.get(f"{server.url}/model_info").json()
    out = tmp_path / "result.jsonl"
    # --model is only where bench_serving looks for a chat template (the tokenizer files: offline); the requests
    # name the served model.
    monkeypatch.setattr(sys, "argv", [
        "bench_serving", "--backend", backend, "--base-url", server.url, "--dataset-name", "sharegpt",
        "--dataset-path", str(dataset), "--num-prompts", str(NUM_PROMPTS), "--sharegpt-output-len", str(OUTPUT_LEN),
        "--model", info["tokenizer_path"], "--served-model-name", info["served_model_name"], "--seed", "1",
        "--output-file", str(out), "--disable-tqdm"])
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
    result = json.loads(out.read_text())
    assert result["completed"] == NUM_PROMPTS and result["backend"] == backend
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # bench_serving sends ignore_eos
    # bench_serving counted the prompts' tokens with the files at tokenizer_path: radixk3's ids.
    tok = load_tokenizer()
    questions = gsm8k_test_texts()[: 2 * NUM_PROMPTS : 2]
    assert result["total_input_tokens"] == sum(len(tok.encode(q)) for q in questions)
