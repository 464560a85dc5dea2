"""Whether a process the tests started (or its engine's children) is still running, read from /proc."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running, not a zombie awaiting a reaper that is not us. A process reaped while its stat is read (the open
    finds it, the read does not: ESRCH) is gone too."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
