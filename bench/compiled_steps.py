"""The worker's step alone, compiled against eager, from one process (ratios only: on a shared machine only
timings taken side by side mean anything): decode at batch 1 and 32, the verify of k drafts at batch 1 against
a decode step (issue 24's target: within 1.1x compiled), inductor's C++ wrapper (the engine's default) against its
Python one (`--disable-cpp-wrapper`), the dense layers' few-row GEMM op (`kernels/linear_cpu.py`) against the
GEMM library's `F.linear`, the pool ops registered in C++ against the Python ops
(`kernels/pool_ops_cpu.py`) and the fused KDA decode against its torch path inside the compiled step, the compile
seconds per graph, and a profile of the compiled steps (the biggest remaining costs).

Sequences are prefilled eagerly on the worker's real pool buffer (with its scratch slot and row), then steps
alternate between the variants over the same sequences; each figure is the best of the runs.

    python bench/compiled_steps.py [--model k3-small|k3-gsm8k|DIR] [--batches 1 32] [--drafts 3] [--repeats 20]
        [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import kda_decode_cpu as fused_kda  # noqa: E402
from kernels import linear_cpu, pool_ops_cpu  # noqa: E402
from radixk3.builtin_model import checkpoint_dir, random_preset  # noqa: E402
from radixk3.checkpoint import load_model  # noqa: E402
from radixk3.config import preset  # noqa: E402
from radixk3.decode_graph import DecodeGraphs, Scratch  # noqa: E402
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache  # noqa: E402
from radixk3.model import KimiForCausalLM, build_model  # noqa: E402
from radixk3.spec_window import SpecWindow, WindowRows  # noqa: E402
from radixk3.verify_graph import VerifyGraphs  # noqa: E402
from runtime.pool_layout import pool_layout  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from runtime.worker.pool_buffer import PoolBuffer  # noqa: E402

PROMPT = 16
PAGE = 16


def best(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best-of-N seconds of each function, run in turns (a shared machine only ever slows a run down)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def with_env(var: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn with `var`=0 (a fused op's switch)."""
    def run() -> object:
        os.environ[var] = "0"
        try:
            return fn()
        finally:
            os.environ.pop(var)

    return run


def bench_model(name: str) -> KimiForCausalLM:
    """A test preset's random weights (seed 0), the built-in model or a checkpoint directory; in fp32."""
    if random_preset(name) is not None:
        return build_model(preset(name), seed=0)
    return load_model(checkpoint_dir(name), dtype=torch.float32)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="k3-small", help="a test preset (random weights), k3-gsm8k (the built-in "
                    "model) or a checkpoint directory; in fp32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 gives steadier ratios on a loaded machine: no OpenMP barrier waits)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    model = bench_model(a.model)
    cfg = model.config
    n_max, width = max(a.batches), a.drafts + 1
    pages = -(-(PROMPT + 4 * a.repeats * width + 64) // PAGE)
    layout = pool_layout(cfg, ServerArgs(page_size=PAGE))
    buf = PoolBuffer(layout, (n_max + 2) * (layout.state_block_bytes + pages * PAGE * layout.kv_token_bytes),
                     scratch=True)
    cache = HybridCache(recurrent=[buf.recurrent_state(i) for i in range(cfg.num_kda_layers)],
                        conv=[buf.conv_state(i) for i in range(cfg.num_kda_layers)],
                        latent=[buf.kv(i) for i in range(cfg.num_mla_layers)])
    scratch = Scratch(buf.scratch_state_slot, buf.scratch_kv_row)  # type: ignore[arg-type]
    window = SpecWindow.allocate(cfg, "replay", n_max + 1, width, torch.float32)
    fused_kda.available()
    t0 = time.perf_counter()
    graphs = DecodeGraphs(model, cache, scratch, a.batches)
    graphs.capture()
    python_ops = with_env(pool_ops_cpu.ENV_VAR, lambda: DecodeGraphs(model, cache, scratch, a.batches))()
    assert isinstance(python_ops, DecodeGraphs) and not python_ops.cpp_ops
    python_ops.capture()
    cpp_wrapper = DecodeGraphs(model, cache, scratch, a.batches, cpp_wrapper=True)
    cpp_wrapper.capture()
    # the engine's graphs (C++ wrapper) with the dense layers' GEMMs in the GEMM library (F.linear), not linear_cpu
    library_gemms = with_env(linear_cpu.ENV_VAR, lambda: DecodeGraphs(model, cache, scratch, a.batches,
                                                                     cpp_wrapper=True))()
    assert isinstance(library_gemms, DecodeGraphs) and not library_gemms.fused_linear
    library_gemms.capture()
    verify = VerifyGraphs(model, cache, scratch, [1], window, n_max)
    verify.capture()
    verify_cpp = VerifyGraphs(model, cache, scratch, [1], window, n_max, cpp_wrapper=True)
    verify_cpp.capture()
    verify_library = with_env(linear_cpu.ENV_VAR, lambda: VerifyGraphs(model, cache, scratch, [1], window, n_max,
                                                                      cpp_wrapper=True))()
    assert isinstance(verify_library, VerifyGraphs) and not verify_library.fused_linear
    verify_library.capture()
    print(f"compile: decode {graphs.report.seconds} (C++ pool ops: {graphs.cpp_ops}; with the Python ops "
          f"{python_ops.report.seconds}; with the C++ wrapper {cpp_wrapper.report.seconds}), verify (k={a.drafts}) "
          f"{verify.report.seconds} (with the C++ wrapper {verify_cpp.report.seconds}) "
          f"({time.perf_counter() - t0:.0f} s in all)")
    out: dict[str, object] = {"model": a.model, "threads": torch.get_num_threads(),
                              "compile_seconds_decode": graphs.report.seconds,
                              "compile_seconds_decode_cpp_wrapper": cpp_wrapper.report.seconds,
                              "compile_seconds_verify": verify.report.seconds}
    gen = torch.Generator().manual_seed(0)
    table = torch.arange(n_max * pages).view(n_max, pages)
    slots = torch.arange(n_max)
    prompts = torch.randint(16, cfg.vocab_size, (n_max, PROMPT), generator=gen)
    cu = torch.arange(0, n_max * PROMPT + 1, PROMPT)
    model.forward_batch(ForwardBatch.from_table(ForwardMode.EXTEND, prompts.reshape(-1), cu,
                                                torch.zeros(n_max, dtype=torch.int64), slots, table, PAGE), cache)
    length = torch.full((n_max,), PROMPT)

    def decode(n: int, compiled: bool, steps: DecodeGraphs = graphs) -> Callable[[], object]:
        def step() -> object:
            ids = torch.randint(16, cfg.vocab_size, (n,), generator=gen)
            batch = ForwardBatch.from_table(ForwardMode.DECODE, ids, torch.arange(n + 1), length[:n].clone(),
                                            slots[:n], table[:n], PAGE)
            logits = steps.run(batch) if compiled else model.forward_batch(batch, cache).float()
            length[:n] += 1
            return logits

        return step

    def verify_step(compiled: bool, steps: VerifyGraphs = verify) -> Callable[[], object]:
        def step() -> object:
            ids = torch.randint(16, cfg.vocab_size, (width,), generator=gen)
            batch = ForwardBatch.from_table(ForwardMode.VERIFY, ids, torch.tensor([0, width]), length[:1].clone(),
                                            slots[:1], table[:1], PAGE, logits_index=torch.arange(width))
            batch.spec = WindowRows(window, torch.zeros(1, dtype=torch.int64))
            return steps.run(batch) if compiled else model.forward_batch(batch, cache).float()

        return step

    for n in a.batches:
        t = best({"eager": decode(n, False), "compiled": decode(n, True),
                  "compiled_cpp_wrapper": decode(n, True, cpp_wrapper),
                  "compiled_cpp_wrapper_library_gemms": decode(n, True, library_gemms),
                  "compiled_python_pool_ops": decode(n, True, python_ops),
                  "compiled_torch_kda": with_env(fused_kda.ENV_VAR, decode(n, True, python_ops))}, a.repeats)
        print(f"decode batch {n}: eager {t['eager'] * 1e3:.2f} ms, compiled {t['compiled'] * 1e3:.2f} ms "
              f"({t['compiled'] / t['eager']:.2f}x eager); with the C++ wrapper {t['compiled_cpp_wrapper'] * 1e3:.2f} "
              f"ms (the engine's step; with the dense layers in the GEMM library, not linear_cpu, "
              f"{t['compiled_cpp_wrapper_library_gemms'] * 1e3:.2f} ms: "
              f"{t['compiled_cpp_wrapper_library_gemms'] / t['compiled_cpp_wrapper']:.2f}x); with the Python pool ops "
              f"{t['compiled_python_pool_ops'] * 1e3:.2f} ms, and the torch KDA step "
              f"{t['compiled_torch_kda'] * 1e3:.2f} ms")
        out[f"decode_b{n}_ms"] = {k: round(v * 1e3, 3) for k, v in t.items()}
    t = best({"decode_eager": decode(1, False), "decode_compiled": decode(1, True),
              "verify_eager": verify_step(False), "verify_compiled": verify_step(True),
              "decode_cpp_wrapper": decode(1, True, cpp_wrapper), "verify_cpp_wrapper": verify_step(True, verify_cpp),
              "verify_cpp_wrapper_library_gemms": verify_step(True, verify_library)},
             a.repeats)
    ratio = t["verify_compiled"] / t["decode_compiled"]
    ratio_cpp = t["verify_cpp_wrapper"] / t["decode_cpp_wrapper"]
    print(f"verify of {a.drafts} drafts at batch 1: compiled {t['verify_compiled'] * 1e3:.2f} ms = {ratio:.2f}x a "
          f"compiled decode step ({t['decode_compiled'] * 1e3:.2f} ms); with the C++ wrapper "
          f"{t['verify_cpp_wrapper'] * 1e3:.2f} ms = {ratio_cpp:.2f}x ({t['decode_cpp_wrapper'] * 1e3:.2f} ms; the "
          f"dense layers in the GEMM library {t['verify_cpp_wrapper_library_gemms'] * 1e3:.2f} ms); "
          f"eager {t['verify_eager'] * 1e3:.2f} ms = {t['verify_eager'] / t['decode_eager']:.2f}x an eager one")
    out["verify_b1_ms"] = {k: round(v * 1e3, 3) for k, v in t.items()}
    out["verify_over_decode_compiled_b1"] = round(ratio, 3)
    out["verify_over_decode_cpp_wrapper_b1"] = round(ratio_cpp, 3)
    for name, fn in (("decode_b1", decode(1, True)), (f"decode_b{n_max}", decode(n_max, True)),
                     ("verify_b1", verify_step(True))):
        with torch.profiler.profile() as prof:
            for _ in range(5):
                fn()
        print(f"profile, compiled {name} (5 steps), top self CPU time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
