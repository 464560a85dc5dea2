"""bench/gpu_check.py, the checks prepared for a GPU machine: without a CUDA device (hidden here, whatever the
machine has) it runs, says it skipped, exits 0 and ends with its JSON summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_skips_without_cuda() -> None:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("SKIP all: no CUDA device")
    assert json.loads(lines[-1]) == {"skipped": "no CUDA device", "checks": {}}
