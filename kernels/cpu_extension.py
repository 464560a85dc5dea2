"""Building the C++/OpenMP CPU ops (`*_cpu.cpp` beside their torch references) with torch's extension loader:
compiled once per machine on first use (a few seconds; torch caches the library under its extensions directory
and rebuilds when the source changes), loaded through ctypes (plain C entry points, no Python module) or as torch
ops (TORCH_LIBRARY: `pool_ops_cpu.cpp`, where Python's per-call work would cost more than the op)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def _ensure_ninja() -> None:
    """torch's loader runs `ninja` from PATH: the `ninja` package's binary serves when the system has none."""
    if shutil.which("ninja") is None:
        import ninja  # type: ignore[import-untyped]

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _headers_flag(source: Path) -> str:
    """A define naming the contents of the headers beside `source`: torch's loader decides to rebuild from the
    sources and the build flags only, so a changed header changes a flag."""
    digest = hashlib.sha256()
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.name.encode() + header.read_bytes())
    return f"-DRADIXK3_HEADERS={digest.hexdigest()[:16]}"


def _build(name: str, source: Path, cflags: list[str]) -> Path | None:
    """Build (or find cached) `source` as library `name` and load it into torch (`torch.ops.load_library`, so the
    ops it registers with TORCH_LIBRARY exist); None on a machine that is not x86 or cannot build it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        from torch.utils.cpp_extension import load

        _ensure_ninja()
        path = load(name=name, sources=[str(source)], is_python_module=False,
                    extra_cflags=["-O3", "-march=native", "-fopenmp", _headers_flag(source), *cflags],
                    extra_ldflags=["-fopenmp"])
    except Exception as exc:
        log.warning("%s unavailable, the torch path serves: %s", name, exc)
        return None
    return Path(path)


def load_cpu_library(name: str, source: Path, cflags: list[str]) -> ctypes.CDLL | None:
    """Build (or find cached) and load `source` as library `name` with plain C entry points, for ctypes; None on a
    machine that is not x86 or cannot build it (no compiler, no ninja): the caller's torch path serves."""
    path = _build(name, source, cflags)
    return None if path is None else ctypes.CDLL(str(path))


def load_torch_ops(name: str, source: Path, cflags: list[str]) -> bool:
    """Build (or find cached) and load `source`, whose ops register themselves with TORCH_LIBRARY (reached as
    `torch.ops.<namespace>`); False where it cannot be built here."""
    return _build(name, source, cflags) is not None
