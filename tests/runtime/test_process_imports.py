"""The processes that hold no model import no torch: the scheduler process and the tokenizer side (the offline
Engine, the HTTP server, `radixk3 serve`'s CLI). Importing it only to read a dtype costs hundreds of MiB each. A
worker imports it only after setting how its OpenMP threads wait."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _loads_torch(modules: str) -> bool:
    """Whether importing `modules` (comma-separated) in a fresh interpreter loads torch."""
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip() == "True"


def test_scheduler_and_tokenizer_side_import_no_torch() -> None:
    assert not _loads_torch("runtime.scheduler_main, runtime.tokenizer.engine, runtime.engine_processes, "
                            "runtime.http.server, radixk3.cli, radixk3.launch_server"), \
        "a module of the scheduler or tokenizer side imports torch"


def test_a_worker_sets_its_openmp_spin_count_before_torch_loads() -> None:
    """What a spawned worker has imported when `worker_main` starts (its module, and what unpickling its
    arguments loads) must not load torch: torch loads libgomp, which reads GOMP_SPINCOUNT once
    (`runtime.worker_main.openmp_waits`)."""
    assert not _loads_torch("runtime.worker_main, runtime.server_args, runtime.topology"), \
        "the worker's own imports load torch before its spin count is set"
