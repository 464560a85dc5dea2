"""Weight-only `--quantization int8 / int4` against the unquantised model: accuracy (max logit error of the no-cache
forward over a few prompts, top-1 agreement per position, and greedy agreement of the served outputs) and output
tok/s, as columns of `bench/offline_throughput.py --quantization int8,int4` or alone:

    python bench/weight_quant.py [--checkpoint DIR] [--dtypes bfloat16,float32] [--methods int8,int4] [--quick]

Accuracy is reported, never asserted: random weights give near-flat logits, where small errors flip the argmax.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/kernels.py must not shadow the kernels package

import torch  # noqa: E402

Prompts = list[list[int]]


def greedy_agreement(ours: Prompts, ref: Prompts) -> dict[str, float]:
    """Share of the reference's tokens reproduced before the first divergence, and of identical sequences."""
    from bench.offline_throughput import agreement

    tokens, sequences = agreement(ours, ref)
    return {"greedy_agreement": tokens, "greedy_sequences_equal": sequences}


@torch.inference_mode()
def logit_error(ckpt: Path, dtype: str, method: str, prompts: Prompts) -> dict[str, float]:
    """The quantised model's no-cache logits against the unquantised one's (same dtype) over `prompts`: the
    largest absolute error, that error over the largest |logit|, and the top-1 agreement per position."""
    from radixk3.checkpoint import load_model
    from radixk3.weight_quant import quantize_model_

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)  # "auto": the checkpoint's
    dense = load_model(ckpt, dtype=torch_dtype)
    refs = [dense(torch.tensor(p)).float() for p in prompts]
    quant = quantize_model_(dense, method)  # in place: the dense logits are taken already
    err = top = agree = rows = 0.0
    for p, ref in zip(prompts, refs, strict=True):
        out = quant(torch.tensor(p)).float()
        err = max(err, float((out - ref).abs().max()))
        top = max(top, float(ref.abs().max()))
        agree += float((out.argmax(-1) == ref.argmax(-1)).sum())
        rows += ref.shape[0]
    return {"max_logit_error": err, "max_logit_error_rel": err / top, "top1_agreement": agree / rows}


def run_engine(ckpt: Path, method: str | None, workloads: list[tuple[str, Prompts, int]], kwargs: dict[str, Any]
               ) -> dict[str, tuple[float, Prompts]]:
    """{workload: (output tok/s, greedy outputs)} of one engine (radix on), `quantization=method`."""
    import radixk3

    out: dict[str, tuple[float, Prompts]] = {}
    with radixk3.Engine(model=str(ckpt), quantization=method, **kwargs) as engine:
        engine.generate([[5] * 16], {"max_new_tokens": 2, "temperature": 0})  # first-call costs before timing
        for name, prompts, new in workloads:
            t0 = time.perf_counter()
            res = engine.generate(prompts, {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0,
                                            "ignore_eos": True})
            dt = time.perf_counter() - t0
            outs = [r["output_ids"] for r in res]
            out[name] = (sum(map(len, outs)) / dt, outs)
            print(f"  radixk3 {method or 'dense':<5} {name:<10} {out[name][0]:9.1f} tok/s ({dt:6.1f} s)", flush=True)
    return out


def quantization_column(ckpt: Path, dtype: str, method: str, workloads: list[tuple[str, Prompts, int]],
                        dense: dict[str, tuple[float, Prompts]], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One quantisation's JSON entry: tok/s per workload, ratios to the dense run of the same run, accuracy."""
    runs = run_engine(ckpt, method, workloads, kwargs)
    ours = [o for name, _, _ in workloads for o in runs[name][1]]
    ref = [o for name, _, _ in workloads for o in dense[name][1]]
    probe = [p[:64] for _, prompts, _ in workloads for p in prompts[:2]]
    return {"method": method, "dtype": dtype, "tok_s": {k: v[0] for k, v in runs.items()},
            "ratio_to_dense": {k: v[0] / dense[k][0] for k, v in runs.items() if k in dense},
            **greedy_agreement(ours, ref), **logit_error(ckpt, dtype, method, probe)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: a random k3-small")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--methods", default="int8,int4")
    ap.add_argument("--quick", action="store_true", help="tiny workloads, for a smoke test")
    a = ap.parse_args(argv)
    from radixk3.checkpoint import write_random_checkpoint
    from radixk3.config import preset

    with tempfile.TemporaryDirectory(prefix="radixk3-quant-") as tmp:
        ckpt = a.checkpoint or write_random_checkpoint(preset("k3-tiny" if a.quick else "k3-small"),
                                                       Path(tmp) / "model", seed=0)
        vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
        g = random.Random(0)
        new = 4 if a.quick else 64
        workloads = [(f"b{b}", [[g.randrange(16, vocab) for _ in range(24)] for _ in range(b)], new)
                     for b in ((1, 4) if a.quick else (1, 32))]
        cols = []
        for dtype in a.dtypes.split(","):
            kwargs = {"dtype": dtype, "mem_bytes": (64 if a.quick else 512) << 20}
            dense = run_engine(Path(ckpt), None, workloads, kwargs)
            for method in a.methods.split(","):
                cols.append(quantization_column(Path(ckpt), dtype, method, workloads, dense, kwargs)
                            | {"dense_tok_s": {k: v[0] for k, v in dense.items()}})
    print(json.dumps({"quantization": cols}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
