"""Resident memory of a running Engine, per process: what the OS says each holds now (VmRSS) and at its peak
(VmHWM), and what all of them hold beyond the configured pool (the KV / state pool is memory the user asked
for; everything else is the runtime's own cost). Linux (/proc); elsewhere the figures are None.

    python bench/memory.py [--model DIR] [--dtype float32|bfloat16] [--mem-mib 1024] [--json]

starts an Engine (a random k3-small checkpoint unless --model), runs a few requests and prints the table;
`engine_memory(engine)` is the call for other benches (bench/offline_throughput.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 1 << 20


@dataclass(frozen=True)
class ProcessMemory:
    name: str  # as `ps` shows it (radixk3-sched0, radixk3-w0-0, python ...)
    pid: int
    rss_mib: float  # resident now
    peak_mib: float  # the high-water mark of resident memory since the process started


@dataclass(frozen=True)
class EngineMemory:
    processes: list[ProcessMemory]
    pool_mib: float  # the pools the workers allocated, all ranks together

    @property
    def rss_mib(self) -> float:
        return sum(p.rss_mib for p in self.processes)

    @property
    def peak_mib(self) -> float:
        """The processes' peaks summed: an upper bound of what they held at once."""
        return sum(p.peak_mib for p in self.processes)

    @property
    def beyond_pool_mib(self) -> float:
        return self.rss_mib - self.pool_mib

    @property
    def peak_beyond_pool_mib(self) -> float:
        return self.peak_mib - self.pool_mib

    def to_json(self) -> dict[str, Any]:
        return {"processes": [asdict(p) for p in self.processes], "pool_mib": self.pool_mib,
                "resident_mib": self.rss_mib, "resident_peak_mib": self.peak_mib,
                "resident_beyond_pool_mib": self.beyond_pool_mib,
                "resident_peak_beyond_pool_mib": self.peak_beyond_pool_mib}


def process_memory(pid: int) -> ProcessMemory | None:
    """VmRSS and VmHWM of process `pid` from /proc/<pid>/status; None if it is gone (or not Linux)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    if "VmRSS" not in fields:  # a zombie has no memory left
        return None

    def mib(key: str) -> float:
        return int(fields[key].split()[0]) * 1024 / MIB  # "12345 kB"

    return ProcessMemory(fields["Name"].strip(), pid, mib("VmRSS"), mib("VmHWM"))


def engine_memory(engine: Any) -> EngineMemory:  # noqa: ANN401 (radixk3.Engine, imported by the caller)
    """This process (the tokenizer side of `engine`) and every child the engine started: scheduler(s) and
    worker ranks. The pool counted is each worker rank's (`pool_bytes`, the same on every rank)."""
    procs = engine.procs
    pids = [os.getpid()] + [p.pid for p in procs.procs if p.pid is not None]
    found = [m for m in map(process_memory, pids) if m is not None]
    return EngineMemory(found, procs.pool_bytes * len(procs.ranks) / MIB)


def print_memory(mem: EngineMemory, label: str = "") -> None:
    print(f"resident memory {label}".rstrip() + ":")
    for p in mem.processes:
        print(f"  {p.name:<16} pid {p.pid:<8} now {p.rss_mib:8.1f} MiB   peak {p.peak_mib:8.1f} MiB")
    print(f"  all processes: now {mem.rss_mib:.1f} MiB, peak {mem.peak_mib:.1f} MiB; pool {mem.pool_mib:.1f} MiB; "
          f"beyond the pool: now {mem.beyond_pool_mib:.1f} MiB, peak {mem.peak_beyond_pool_mib:.1f} MiB")


def _write_k3_small(out: Path) -> None:
    from radixk3.checkpoint import write_random_checkpoint
    from radixk3.config import preset

    write_random_checkpoint(preset("k3-small"), out, seed=0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: a random k3-small)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mem-mib", type=int, default=1024, help="engine pool per rank, MiB")
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    a = ap.parse_args(argv)
    import radixk3

    with tempfile.TemporaryDirectory(prefix="radixk3-mem-") as tmp:
        ckpt = a.model
        if ckpt is None:  # written by a child process, so that this one holds only what the Engine needs
            ckpt = Path(tmp) / "k3-small"
            writer = mp.get_context("spawn").Process(target=_write_k3_small, args=(ckpt,))
            writer.start()
            writer.join()
        with radixk3.Engine(model=str(ckpt), dtype=a.dtype, mem_bytes=a.mem_mib * MIB) as engine:
            engine.generate([[5 + i] + [17 + j for j in range(30)] for i in range(4)],
                            {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
            mem = engine_memory(engine)
    print_memory(mem, f"({a.dtype})")
    if a.json:
        print(json.dumps(mem.to_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
