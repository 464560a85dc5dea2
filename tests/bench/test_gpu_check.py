"""bench/gpu_check.py, the checks prepared for a GPU machine: without a CUDA device (hidden here, whatever the
machine has) every check says SKIP, the exit status is 0 and `--json` ends with the summary; its CPU-runnable
checks (the same functions on CPU tensors at small shapes, Triton under its interpreter) pass; a kernel whose
Triton path is wrong makes its check FAIL."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.gpu_engine_checks import compiled_decode
from bench.gpu_kernel_checks import CPU_SIZES
from runtime.server_args import ServerArgs

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_skips_without_cuda() -> None:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("device: none")
    summary = json.loads(lines[-1])
    names = [c.name for c in gpu_check.cuda_checks()]
    assert list(summary["checks"]) == names and summary["failed"] == []
    assert all(c["status"] == "SKIP" and "no CUDA device" in c["reason"] for c in summary["checks"].values())
    assert {"kernel_kda_prefill", "kernel_mla_paged", "kernel_sampling_grammar_mask", "greedy_no_cache_cuda",
            "compiled_decode_cuda", "compiled_mtp_cuda", "throughput_48b", "fla_chunk_kda_cuda"} <= set(names)


def test_cpu_runnable_checks_pass() -> None:
    """What may SKIP on CPU: bf16 expert kernels (the interpreter's bf16 dot) and fla (CUDA only). The compiled
    decode step and the compiled MTP steps are left to their own tests here (compiling on this CPU takes minutes:
    tests/runtime/test_decode_graph.py, test_verify_graph.py): the decode check only says SKIP while ServerArgs has
    no disable_compile field."""
    may_skip = {"kernel_moe_bf16", "fla_chunk_kda"}
    checks = [c for c in gpu_check.cpu_checks() if c.name not in ("compiled_decode", "compiled_mtp")]
    results = gpu_check.run_checks(checks, cuda=True)
    for name, r in results.items():
        assert r["status"] == "PASS" or (r["status"] == "SKIP" and name in may_skip), (name, r)
    assert results["greedy_no_cache"]["figures"]["cached_prompt_tokens"] > 0
    assert results["throughput"]["figures"]["batch3_tok_s"] > 0
    if "disable_compile" not in {f.name for f in dataclasses.fields(ServerArgs)}:
        skipped = compiled_decode("cpu")
        assert skipped.status == "SKIP" and "disable_compile" in skipped.reason


def test_a_wrong_triton_kernel_fails_its_check(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import kernels.conv1d_triton as conv_triton

    right = conv_triton.conv1d_decode_triton

    def off_by_a_little(*args: object, **kw: object) -> torch.Tensor:
        return right(*args, **kw) + 1e-3

    monkeypatch.setattr(conv_triton, "conv1d_decode_triton", off_by_a_little)
    out = gpu_check.kernel_outcome("conv1d", torch.device("cpu"), CPU_SIZES, gpu_check.CPU_MODELS)
    assert out.status == "FAIL" and "decode_output" in out.reason, out
    # and through the script's entry point: exit status 1, the JSON names the failed check
    assert gpu_check.main(["--cpu", "--only", "kernel_conv1d", "kernel_kda_decode", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["failed"] == ["kernel_conv1d"] and summary["checks"]["kernel_kda_decode"]["status"] == "PASS"
