"""The processes that hold no model import no torch: the scheduler process and the tokenizer side (the offline
Engine, the HTTP server, `radixk3 serve`'s CLI). Importing it only to read a dtype costs hundreds of MiB each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_scheduler_and_tokenizer_side_import_no_torch() -> None:
    code = ("import sys, runtime.scheduler_main, runtime.tokenizer.engine, runtime.engine_processes, "
            "runtime.http.server, radixk3.cli, radixk3.launch_server; print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "False", "a module of the scheduler or tokenizer side imports torch"
