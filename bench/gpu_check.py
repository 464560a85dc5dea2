"""Checks that only a machine with a CUDA device can make, prepared to run when one is lent (a few minutes):

    python bench/gpu_check.py [--only NAME ...]

- backend_choice: the collective backend follows the rank's device on this GPU machine (NCCL for cuda, gloo for
  cpu), whatever `torch.cuda.is_available()` says.
- cpu_ranks_on_gpu_machine: `--device cpu --tp 2` here runs its collectives over gloo (CPU tensors through NCCL
  would fail), greedy == `--tp 1` on CPU.
- cuda_tp2 (2 GPUs): `--device cuda --tp 2` over NCCL, greedy == `--tp 1` on CUDA.
- dp_attention_nccl (2 GPUs): `--device cuda --tp 2 --dp 2 --enable-dp-attention` over NCCL (DP attention's
  gather exchanges its row counts on the GPU), greedy == `--tp 1` on CUDA.
- mem_fraction_cuda: `--mem-fraction` on CUDA: the pool the worker sized after loading its weights is the
  scheduler's (`pool_bytes` in its metrics), greedy == `--tp 1` on CUDA.
- row_fallback_cuda: a row that cannot be sampled fails alone on CUDA, in a decode step and in a verify step
  (n-gram speculation): the sampler's row-by-row fallback builds its placeholders on the logits' device, so its
  batch-mates finish with their `--tp 1` greedy tokens.
- quant_cuda: the compiled Triton dequantisation of packed experts (MXFP4, INT4, FP8 blocks; fp32 and bf16) equals
  compressed-tensors' decompression bit for bit, and a model with MXFP4 experts on CUDA gives its no-cache greedy
  tokens through the engine.

Each check prints PASS, FAIL or SKIP with its reason; the last line is a one-line JSON summary. Exit status 1 if
a check failed. Without a CUDA device it says so, prints the summary and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

MEM = 16 << 20
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
# A shared prefix (the radix cache hits it), prompts of other lengths, and one unrelated prompt.
PROMPTS = [list(range(100, 160)) + [7, 8, 9], list(range(100, 160)) + [11, 12], list(range(100, 140)),
           [5, 900, 33, 2047, 4000, 17, 256, 1024, 3, 3, 3, 61]]


class Outcome(NamedTuple):
    status: str  # PASS | FAIL | SKIP
    reason: str


def _gpus() -> int:
    return torch.cuda.device_count()


@functools.cache
def _reference(device: str) -> tuple[tuple[int, ...], ...]:
    """--tp 1 greedy tokens on `device`, in this process (the runtime's LocalEngine)."""
    from runtime.local_engine import LocalEngine
    from runtime.server_args import ServerArgs

    outs = LocalEngine(ServerArgs(device=device, mem_bytes=MEM)).generate(PROMPTS, GREEDY)
    return tuple(tuple(o) for o in outs)


def _engine_matches(device: str, **kw: Any) -> Outcome:
    """An Engine with `kw` on `device`: its greedy tokens against --tp 1 on the same device."""
    from runtime.tokenizer.engine import Engine

    want = _reference(device)
    with Engine(device=device, **({"mem_bytes": MEM} | kw)) as engine:
        got = tuple(tuple(r["output_ids"]) for r in engine.generate(PROMPTS, GREEDY, timeout=300))
        metrics = engine.get_metrics()
    flags = " ".join(f"{k}={v}" for k, v in kw.items())
    if got != want:
        return Outcome("FAIL", f"{flags} on {device}: greedy {got} != tp 1 {want}")
    return Outcome("PASS", f"{flags} on {device}: greedy == tp 1 ({sum(map(len, got))} tokens, "
                           f"{metrics['cached_tokens']} prompt tokens from the cache)")


def backend_choice() -> Outcome:
    from radixk3.parallel import collective_backend

    got = {d: collective_backend(d) for d in ("cuda", "cuda:0", "cpu")}
    want = {"cuda": "nccl", "cuda:0": "nccl", "cpu": "gloo"}
    return Outcome("PASS" if got == want else "FAIL", f"backends {got} (want {want}) with "
                   f"torch.cuda.is_available() = {torch.cuda.is_available()}")


def cpu_ranks_on_gpu_machine() -> Outcome:
    return _engine_matches("cpu", tp_size=2)


def cuda_tp2() -> Outcome:
    if _gpus() < 2:
        return Outcome("SKIP", f"needs 2 GPUs, {_gpus()} here (backend_choice covers the choice)")
    return _engine_matches("cuda", tp_size=2)


def dp_attention_nccl() -> Outcome:
    if _gpus() < 2:
        return Outcome("SKIP", f"needs 2 GPUs, {_gpus()} here")
    return _engine_matches("cuda", tp_size=2, dp_size=2, enable_dp_attention=True)


def mem_fraction_cuda() -> Outcome:
    from runtime.tokenizer.engine import Engine

    want = _reference("cuda")
    with Engine(device="cuda", mem_fraction=0.02) as engine:
        got = tuple(tuple(r["output_ids"]) for r in engine.generate(PROMPTS, GREEDY, timeout=300))
        scheduler_pool = engine.get_metrics()["pool_bytes"]
        worker_pool = engine.procs.pool_bytes
    free = torch.cuda.mem_get_info()[0]  # once the engine stopped: about what its worker found
    if scheduler_pool != worker_pool:
        return Outcome("FAIL", f"the scheduler's pool is {scheduler_pool} bytes, the worker's {worker_pool}")
    if got != want:
        return Outcome("FAIL", f"greedy {got} != tp 1 {want}")
    return Outcome("PASS", f"pool {worker_pool / 2**30:.2f} GiB on both sides ({worker_pool / free:.3f} of the "
                           f"{free / 2**30:.1f} GiB free once the engine stopped), greedy == tp 1")


def _bad_row_fails_alone(mode: str, want: tuple[tuple[int, ...], ...], **spec: Any) -> str | None:
    """Why a row poisoned after its first token did not fail alone on CUDA (None: it did)."""
    from runtime.local_engine import LocalEngine
    from runtime.server_args import ServerArgs

    rids: list[str] = []
    poisoned: list[int] = []

    def poison(sched: Any) -> None:  # noqa: ANN401
        # Once the row has its first token (the extend step's; later ones come from decode or verify steps),
        # past the door's checks as a bug would be: a stop token outside the vocabulary, which the worker is told
        # to ban on this row while it is below min_new_tokens.
        req = next((r for r in sched.running if r.rid == rids[1] and r.output_ids), None)
        if req is not None and not poisoned:
            req.params.stop_token_ids, req.params.min_new_tokens = [10**6], len(req.output_ids) + 2
            poisoned.append(len(req.output_ids))

    eng = LocalEngine(ServerArgs(device="cuda", mem_bytes=MEM, **spec), check=True, on_step=poison)
    rids += [eng.submit(p, GREEDY) for p in PROMPTS]
    outs = eng.run()
    last = outs[rids[1]][-1]
    if not poisoned or last.finished != "error" or "sampling failed" not in (last.error or ""):
        return f"{mode}: the bad row ended {last.finished!r} ({last.error})"
    for i in (0, 2, 3):
        got = tuple(t for o in outs[rids[i]] for t in o.token_ids)
        if got != want[i]:
            return f"{mode}: batch-mate {i} got {got}, tp 1 alone {want[i]}"
    eng.scheduler.check_integrity()
    return None


def row_fallback_cuda() -> Outcome:
    want = _reference("cuda")
    why = _bad_row_fails_alone("decode", want) or _bad_row_fails_alone(
        "verify", want, speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    if why:
        return Outcome("FAIL", why)
    return Outcome("PASS", "a bad row failed alone in a decode and in a verify step; batch-mates == tp 1")


def quant_cuda() -> Outcome:
    import tempfile

    from kernels.quant import dequant_experts
    from radixk3.checkpoint import load_model
    from radixk3.config import preset
    from radixk3.model import build_model
    from radixk3.quant_checkpoint import (
        compress_weight,
        decompress_weight,
        expert_quant_for,
        write_quantised_checkpoint,
    )
    from runtime.local_engine import LocalEngine
    from runtime.server_args import ServerArgs

    gen = torch.Generator().manual_seed(0)
    for kind in ("mxfp4", "int4", "fp8"):
        for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            quant = expert_quant_for(kind, name)
            experts = [compress_weight((torch.randn(200, 320, generator=gen) * 0.05 * 3.0**e).to(dtype), quant)
                       for e in range(4)]
            data = torch.stack([x[quant.data_suffix] for x in experts]).cuda()
            scale = torch.stack([x["weight_scale"] for x in experts]).cuda()
            refs = [decompress_weight(experts[e], quant) for e in (0, 2, 3)]
            got = dequant_experts(kind, data, scale, torch.tensor([0, 2, 3], device="cuda"), refs[0].dtype).cpu()
            for g, r in zip(got, refs, strict=True):
                if not torch.equal(g.view(torch.int16 if g.element_size() == 2 else torch.int32),
                                   r.view(torch.int16 if r.element_size() == 2 else torch.int32)):
                    return Outcome("FAIL", f"{kind} {name}: the CUDA dequantisation differs from the library's")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_quantised_checkpoint(build_model(preset("k3-tiny"), seed=3), tmp, "mxfp4")
        model = load_model(path, device="cuda")
        want = []
        with torch.inference_mode():
            for prompt in PROMPTS:  # the no-cache forward, token after token
                seq = list(prompt)
                for _ in range(GREEDY["max_new_tokens"]):
                    seq.append(int(model(torch.tensor(seq, device="cuda"))[-1].argmax()))
                want.append(seq[len(prompt):])
        got = LocalEngine(ServerArgs(device="cuda", mem_bytes=MEM), model).generate(PROMPTS, GREEDY)
    if got != want:
        return Outcome("FAIL", f"mxfp4 model on CUDA: engine greedy {got} != no-cache {want}")
    return Outcome("PASS", "CUDA dequantisation == compressed-tensors (3 formats x 2 dtypes); mxfp4 engine greedy "
                           "== no-cache forward on CUDA")


CHECKS: tuple[Callable[[], Outcome], ...] = (backend_choice, cpu_ranks_on_gpu_machine, cuda_tp2, dp_attention_nccl,
                                             mem_fraction_cuda, row_fallback_cuda, quant_cuda)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=[c.__name__ for c in CHECKS], help="run these checks only")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP all: no CUDA device here; run this on a machine with one")
        print(json.dumps({"skipped": "no CUDA device", "checks": {}}))
        return 0
    gpus = _gpus()
    print(f"device: {torch.cuda.get_device_name(0)} x{gpus}, torch {torch.__version__}", flush=True)
    results: dict[str, str] = {}
    start = time.perf_counter()
    for check in CHECKS:
        if a.only and check.__name__ not in a.only:
            continue
        t0 = time.perf_counter()
        try:
            out = check()
        except Exception as e:  # a check that raises fails with why; the others still run
            traceback.print_exc()
            out = Outcome("FAIL", f"{type(e).__name__}: {e}")
        results[check.__name__] = out.status
        print(f"{out.status} {check.__name__}: {out.reason} ({time.perf_counter() - t0:.0f} s)", flush=True)
    failed = [k for k, v in results.items() if v == "FAIL"]
    print(json.dumps({"device": torch.cuda.get_device_name(0), "gpus": gpus, "checks": results, "failed": failed,
                      "seconds": round(time.perf_counter() - start)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
