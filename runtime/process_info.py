"""What the OS says about the engine's processes: whether one is stopped (a hang the watchdogs name), and the
short names the engine's children show in `ps` and `top` (`radixk3-sched0` for replica 0's scheduler,
`radixk3-w0-1` for its worker rank 1), so that a stuck one can be found and told apart."""

from __future__ import annotations

import ctypes
from pathlib import Path

_PR_SET_NAME = 15
_COMM_LEN = 15  # the kernel keeps this many bytes of a process's name


def proc_state(pid: int) -> str | None:
    """A process's state letter from /proc (R, S, T: stopped, Z, ...); None if unknown (gone, or not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def is_stopped(pid: int | None) -> bool:
    """Whether the process is stopped (SIGSTOP, or held by a tracer): alive, and doing nothing at all."""
    return pid is not None and proc_state(pid) in ("T", "t")


def scheduler_process_name(replica: int) -> str:
    return f"radixk3-sched{replica}"


def worker_process_name(replica: int, rank: int) -> str:
    return f"radixk3-w{replica}-{rank}"


def set_process_name(name: str) -> None:
    """Name the calling process as `ps` and `top` show it (Linux; elsewhere nothing happens)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:_COMM_LEN], 0, 0, 0)
    except (OSError, AttributeError):
        pass
