"""The dense layers' GEMMs of a decode step on their own: every dense weight of a model (its `Linear` layers but
MLA's absorbed kv_b_proj), in turn, times a few token rows, through the GEMM library (`F.linear`, MKL on x86) and
through the few-row op the compiled steps use (`kernels/linear_cpu.py`), alternating in one process; the best of
`--repeats` passes over all the weights (the two in turns), as the weights' read rate (bytes / seconds), per row count.

    python bench/linear_gemm.py [--model k3-small|k3-gsm8k|DIR] [--rows 1 2 4 8 16 32 64] [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compiled_steps import bench_model, best  # noqa: E402
from bench.machine_info import cpu_name  # noqa: E402
from kernels import linear_cpu  # noqa: E402
from radixk3.parallel_linear import Linear  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-small", help="a test preset (random weights), k3-gsm8k or a directory")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not linear_cpu.available():
        raise SystemExit("the few-row GEMM op does not build here (x86 and a C++ compiler needed)")
    torch.set_grad_enabled(False)
    model = bench_model(a.model)
    weights = [m.weight.detach().contiguous() for name, m in model.named_modules()
               if isinstance(m, Linear) and not name.endswith("kv_b_proj")]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; {a.model}: {len(weights)} dense weights, "
          f"{nbytes / 1e6:.1f} MB")
    per_rows: dict[int, dict[str, float]] = {}
    out: dict[str, object] = {"model": a.model, "weights": len(weights), "bytes": nbytes,
                              "threads": torch.get_num_threads(), "rows": per_rows}
    gen = torch.Generator().manual_seed(0)
    for m in a.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in weights}}

        def library(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        def op(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in weights:
                linear_cpu.linear(xs[w.shape[1]], w)

        t = best({"library": library, "op": op}, a.repeats)  # in turns: a phase of the machine meets both
        lib, fused = t["library"], t["op"]
        print(f"rows {m:3d}: F.linear {lib * 1e3:7.2f} ms ({nbytes / lib / 1e9:5.1f} GB/s), op {fused * 1e3:7.2f} ms "
              f"({nbytes / fused / 1e9:5.1f} GB/s): {lib / fused:.2f}x")
        per_rows[m] = {"library_ms": lib * 1e3, "op_ms": fused * 1e3, "library_gb_s": nbytes / lib / 1e9,
                          "op_gb_s": nbytes / fused / 1e9, "speedup": lib / fused}
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
