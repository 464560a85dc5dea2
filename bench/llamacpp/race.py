"""The llama.cpp side of `bench/offline_throughput.py`: the checkpoint written as GGUF in each precision column,
the bench's workloads as llama.cpp jobs (the gsm8k burst both ways), run in a child process, and the GGUF's own
bytes per batch-1 decode token for the weight-bandwidth floor.

Precision columns: radixk3 fp32 / bf16 against a GGUF of f32 / bf16 weights, radixk3's weight-only int8 / int4
(`Engine(quantization=...)`) against Q8_0 / Q4_0. The KV cache is f32 in every column (see `runner`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.llamacpp.gguf_export import Exported, export_checkpoint
from bench.llamacpp.runner import Job, Report, run_in_child

GGUF_TYPES = {"auto": "f32", "float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}
PREFILL_ALL = "_prefill_all"  # suffix of the burst run that prefills every prompt whole


class Workload(Protocol):
    name: str
    prompts: list[list[int]]
    new_tokens: int


def jobs(workloads: list[Workload], burst: Workload) -> list[Job]:
    """Every workload as is; the burst twice: its shared prefix decoded once and copied to every sequence (under
    the burst's own name), and every prompt prefilled whole (`<burst>_prefill_all`)."""
    out = [Job(w.name, w.prompts, w.new_tokens, shared_prefix=w.name == burst.name) for w in workloads]
    if any(w.name == burst.name for w in workloads):
        out.append(Job(burst.name + PREFILL_ALL, burst.prompts, burst.new_tokens))
    return out


def warm_job(vocab: int) -> Job:
    g = random.Random(54321)
    return Job("warm", [[7 + i] + [g.randrange(16, vocab) for _ in range(15)] for i in range(2)], 4)


@dataclass(frozen=True)
class Column:
    gguf: Exported
    report: Report
    bytes_per_token: int


def gguf_token_bytes(path: Path, experts_used: int) -> int:
    """Weight bytes one batch-1 decode token reads from this GGUF: every tensor, but of each stacked routed-expert
    tensor only the `experts_used` experts and of the embedding one row."""
    import gguf

    total = 0
    for t in gguf.GGUFReader(path).tensors:
        nbytes = int(t.n_bytes)
        if t.name.endswith("_exps.weight"):
            nbytes = nbytes // int(t.shape[-1]) * experts_used
        elif t.name == "token_embd.weight":
            nbytes //= int(t.shape[-1])
        total += nbytes
    return total


def run_column(ckpt: Path, column: str, workloads: list[Workload], burst: Workload, vocab: int, threads: int,
               tmp: Path, experts_used: int) -> Column:
    """Export `ckpt` as the column's GGUF type and run the workloads on it with llama.cpp."""
    gguf_type = GGUF_TYPES[column]
    exported = export_checkpoint(ckpt, tmp / f"model-{gguf_type}.gguf", gguf_type)
    report = run_in_child(exported.path, threads, jobs(workloads, burst), warm_job(vocab))
    for name, run in report.runs.items():
        print(f"  llama.cpp    {gguf_type:<9} {name:<18} {run.tok_s:9.1f} tok/s  ({run.seconds:6.1f} s)", flush=True)
    return Column(exported, report, gguf_token_bytes(exported.path, experts_used))
