"""Greedy generation with llama.cpp (llama-cpp-python's low-level bindings) on token-id prompts, in a process of
its own so that its resident memory and threads are its own.

Parallel sequences go through the batch API as llama.cpp's `batched` example does: one `llama_batch` holding
every sequence's tokens (each with its seq_id), one `llama_decode` per step, the argmax of each sequence's logits
(first index on ties, as torch's). A prompt longer than the batch is fed in several decode calls. The shared
prefix of a burst is decoded once (sequence 0) and copied to every other sequence with `llama_memory_seq_cp`
(the KV cells are shared, the recurrent KDA state copied); the other way prefills every prompt whole.

The context: f32 K and V caches (its default f16 drifts from the fp32 model), flash attention off, one unified
KV cache sized for the largest workload, as many sequences as the widest batch, the caller's thread count for
decode and prefill alike. EOS is never checked: every sequence gets exactly its new tokens.

Nothing here imports torch: the child's peak resident memory (VmHWM) is llama.cpp's plus Python's and numpy's.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

Prompts = list[list[int]]
N_BATCH = 2048  # tokens per llama_decode call


@dataclass(frozen=True)
class Job:
    """One workload: `shared_prefix` decodes the prompts' common prefix once and copies it to every sequence."""

    name: str
    prompts: Prompts
    new_tokens: int
    shared_prefix: bool = False


@dataclass(frozen=True)
class Timed:
    outputs: Prompts
    seconds: float

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds


@dataclass
class Report:
    runs: dict[str, Timed] = field(default_factory=dict)
    peak_rss_mib: float = 0.0
    version: str = ""
    system_info: str = ""
    threads: int = 0
    extra_buffers: bool = True  # llama.cpp's repacked-weight buffers (AMX / CPU_REPACK) in use


def available() -> str | None:
    """None when llama-cpp-python imports, else why not (it is a bench extra)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama_cpp is not importable ({e}): pip install llama-cpp-python (a bench extra)"
    return None


def cells_needed(job: Job) -> int:
    """KV cells the job holds at its end (a copied prefix is held once)."""
    own = sum(len(p) + job.new_tokens for p in job.prompts)
    if job.shared_prefix:
        own -= (len(job.prompts) - 1) * len(os.path.commonprefix(job.prompts))
    return own


class LlamaCpp:
    """A loaded GGUF and one context; `generate` runs a job from an empty memory."""

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int, n_seq_max: int, extra_buffers: bool = True) -> None:
        import llama_cpp as lc

        self.lc = lc
        self._quiet = lc.llama_log_callback(lambda level, text, user: None)  # referenced: C keeps the pointer
        lc.llama_log_set(self._quiet, ctypes.c_void_p())
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = extra_buffers
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = -(-n_ctx // 256) * 256
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.type_k = cparams.type_v = lc.GGML_TYPE_F32
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.kv_unified = True
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.mem = lc.llama_get_memory(self.ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(N_BATCH, 0, n_seq_max)
        self.token = np.ctypeslib.as_array(self.batch.token, shape=(N_BATCH,))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(N_BATCH,))
        self.n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(N_BATCH,))
        self.logits_flag = np.ctypeslib.as_array(self.batch.logits, shape=(N_BATCH,))
        self.n_seq_id[:] = 1

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _decode(self, tokens: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (seq, pos, token, wants_logits) entries in calls of at most N_BATCH; the argmax of each entry
        that wants logits, in order."""
        picks: list[np.ndarray] = []
        for start in range(0, len(tokens), N_BATCH):
            chunk = tokens[start : start + N_BATCH]
            n = len(chunk)
            arr = np.asarray(chunk, dtype=np.int64)
            self.token[:n] = arr[:, 2]
            self.pos[:n] = arr[:, 1]
            self.logits_flag[:n] = arr[:, 3]
            seq_id = self.batch.seq_id
            for i, s in enumerate(arr[:, 0].tolist()):
                seq_id[i][0] = s
            self.batch.n_tokens = n
            rc = self.lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            outputs = int(arr[:, 3].sum())
            if outputs:
                logits = np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(outputs, self.vocab))
                picks.append(logits.argmax(axis=1))
        return np.concatenate(picks) if picks else np.empty(0, dtype=np.int64)

    def generate(self, job: Job) -> Timed:
        self.lc.llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        prompts = job.prompts
        start = 0
        if job.shared_prefix and len(prompts) > 1:
            # The common prefix, less one token so that every sequence has its own last token to read logits at.
            start = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
            self._decode([(0, p, t, False) for p, t in enumerate(prompts[0][:start])])
            for s in range(1, len(prompts)):
                self.lc.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
        entries = [(s, p, prompt[p], p == len(prompt) - 1)
                   for s, prompt in enumerate(prompts) for p in range(start, len(prompt))]
        last = self._decode(entries)
        outputs: Prompts = [[t] for t in last.tolist()]
        pos = [len(p) for p in prompts]
        for _ in range(job.new_tokens - 1):
            last = self._decode([(s, pos[s], out[-1], True) for s, out in enumerate(outputs)])
            for s, t in enumerate(last.tolist()):
                outputs[s].append(t)
                pos[s] += 1
        return Timed(outputs, time.perf_counter() - t0)


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_jobs(gguf: str, threads: int, jobs: list[Job], warm: Job | None = None, extra_buffers: bool = True
             ) -> Report:
    """Load `gguf` once and run every job (after `warm`, untimed); runs in the child process."""
    import llama_cpp as lc

    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort prints its message, not a gdb session
    sized = [*jobs, warm] if warm else jobs
    llm = LlamaCpp(gguf, threads, max(map(cells_needed, sized)), max(len(j.prompts) for j in sized), extra_buffers)
    try:
        if warm is not None:
            llm.generate(warm)
        runs = {j.name: llm.generate(j) for j in jobs}
    finally:
        llm.close()
    info = lc.llama_print_system_info().decode(errors="replace").strip()
    return Report(runs, peak_rss_mib(), lc.__version__, info, threads, extra_buffers)


def run_in_child(gguf: str | Path, threads: int, jobs: list[Job], warm: Job | None = None) -> Report:
    """`run_jobs` in a fresh spawned process: its peak RSS is llama.cpp's alone.

    With this build on an AMX CPU, a Q8_0 / Q4_0 model whose dense weights sit in the repacked-weight buffers
    aborts in the graph scheduler (`GGML_ASSERT(*cur_backend_id != -1)`: an op on such a weight that no
    backend takes); the run is then repeated with those buffers off, and the report says so."""
    for extra_buffers in (True, False):
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            try:
                return pool.submit(run_jobs, str(gguf), threads, jobs, warm, extra_buffers).result()
            except BrokenProcessPool:
                if not extra_buffers:
                    raise
                print("  llama.cpp aborted with its repacked-weight buffers; again without them", flush=True)
    raise AssertionError("unreachable")
