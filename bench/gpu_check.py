"""Checks that only a machine with a CUDA device can make, prepared to run when one is lent (under 10 minutes on one
H100 or H200; the README's GPU section gives the exact run):

    python bench/gpu_check.py [--json] [--only NAME ...] [--cpu]

- backend_choice: the collective backend follows the rank's device on this GPU machine (NCCL for cuda, gloo for
  cpu), whatever `torch.cuda.is_available()` says.
- kernel_* (bench/gpu_kernel_checks.py, on bench/gpu_kernel_harness.py): every Triton kernel of kernels/
  compiled on CUDA against its torch reference at kimi-linear-48b and kimi-k3 shapes (KDA prefill with
  checkpoints, decode, replay, verify; the short conv; paged MLA; the MoE experts in fp32 and bf16; sampling with a
  grammar mask; expert dequantisation), each comparison with its tolerance, and Triton vs torch times.
- greedy_no_cache_cuda: the engine (radix on) gives the no-cache forward's greedy tokens over the exactness
  prompt set, on CUDA.
- compiled_decode_cuda: decode with the compiled step (CUDA graphs) and with `disable_compile`, both == no-cache
  (SKIP while ServerArgs has no such field).
- compiled_mtp_cuda: MTP speculation on the built-in k3-gsm8k with every step compiled (decode, verify and the MTP
  layer's steps under CUDA graphs) and with `disable_compile`: both == no-cache, the same drafts accepted.
- throughput_48b: output tok/s of a kimi-linear-48b-shaped random model (its first 4 layers, bf16) at batch 1, 32
  and 128.
- fla_chunk_kda: our KDA prefill against fla's chunk_kda on CUDA (SKIP if fla does not import).
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

Each check prints PASS, FAIL or SKIP with its reason; `--json` ends with one JSON object (each check's status,
reason, figures and seconds). Exit status 1 if a check failed. Without a CUDA device every check says SKIP and the
exit status is 0. `--cpu` instead runs the checks that CPU tensors allow, at small shapes (Triton under its
interpreter): what the CI test (tests/bench/test_gpu_check.py) runs.
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

from bench.gpu_engine_checks import (  # noqa: E402
    Outcome,
    compiled_decode,
    compiled_mtp,
    few_layers,
    fla_chunk_kda,
    greedy_equals_no_cache,
    output_throughput,
)
from bench.gpu_kernel_checks import CPU_SIZES, GPU_SIZES, KERNEL_CHECKS  # noqa: E402
from bench.gpu_kernel_harness import ModelShapes, Sizes  # noqa: E402
from radixk3.config import TINY_PRESET, ModelConfig, preset  # noqa: E402

MEM = 16 << 20
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
# A shared prefix (the radix cache hits it), prompts of other lengths, and one unrelated prompt.
PROMPTS = [list(range(100, 160)) + [7, 8, 9], list(range(100, 160)) + [11, 12], list(range(100, 140)),
           [5, 900, 33, 2047, 4000, 17, 256, 1024, 3, 3, 3, 61]]
GPU_MODELS = ("kimi-linear-48b", "kimi-k3")  # the kernels' shapes on a GPU
CPU_MODELS = ("k3-tiny-native",)  # ... and in CI: K3's lower-bounded gate, SiTU experts, expert groups


def _gpus() -> int:
    return torch.cuda.device_count()


@functools.cache
def _reference(device: str) -> tuple[tuple[int, ...], ...]:
    """--tp 1 greedy tokens on `device`, in this process (the runtime's LocalEngine)."""
    from runtime.local_engine import LocalEngine
    from runtime.server_args import ServerArgs

    outs = LocalEngine(ServerArgs(model=TINY_PRESET, device=device, mem_bytes=MEM)).generate(PROMPTS, GREEDY)
    return tuple(tuple(o) for o in outs)


def _engine_matches(device: str, **kw: Any) -> Outcome:
    """An Engine with `kw` on `device`: its greedy tokens against --tp 1 on the same device."""
    from runtime.tokenizer.engine import Engine

    want = _reference(device)
    with Engine(TINY_PRESET, device=device, **({"mem_bytes": MEM} | kw)) as engine:
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
    with Engine(TINY_PRESET, device="cuda", mem_fraction=0.02) as engine:
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

    eng = LocalEngine(ServerArgs(model=TINY_PRESET, device="cuda", mem_bytes=MEM, **spec), check=True, on_step=poison)
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


def kernel_outcome(name: str, device: torch.device, sizes: Sizes, models: tuple[str, ...]) -> Outcome:
    """Kernel check `name` at each model's shapes: FAIL if a comparison misses its tolerance, SKIP if none ran."""
    figures: dict[str, Any] = {}
    notes, failed, skipped = [], [], []
    for model in models:
        res = KERNEL_CHECKS[name](ModelShapes.of(model, preset(model)), sizes, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if res.skipped:
            skipped.append(f"{model}: {res.skipped}")
            continue
        figures[model] = res.figures()
        failed += [f"{model} {c.what} err {c.max_err:.3g} > tol {c.tol:.3g}" for c in res.comparisons if not c.ok]
        worst = max(res.comparisons, key=lambda c: c.max_err / c.tol if c.tol else c.max_err)
        speed = "" if res.triton_ms is None or res.torch_ms is None else (
            f", triton {res.triton_ms:.3f} ms vs torch {res.torch_ms:.3f} ms")
        notes.append(f"{model}: worst {worst.what} err {worst.max_err:.2g} (tol {worst.tol:.2g}){speed}")
    if failed:
        return Outcome("FAIL", "; ".join(failed), figures)
    if not notes:
        return Outcome("SKIP", "; ".join(skipped), figures)
    return Outcome("PASS", "; ".join(notes + skipped), figures)


def _kernel_check(name: str) -> Callable[[], Outcome]:
    def check() -> Outcome:
        return kernel_outcome(name, torch.device("cuda"), GPU_SIZES, GPU_MODELS)

    check.__name__ = f"kernel_{name}"
    return check


def greedy_no_cache_cuda() -> Outcome:
    return greedy_equals_no_cache("cuda")


def compiled_decode_cuda() -> Outcome:
    return compiled_decode("cuda")


def compiled_mtp_cuda() -> Outcome:
    return compiled_mtp("cuda")


def throughput_48b() -> Outcome:
    cfg = few_layers(preset("kimi-linear-48b"))
    return output_throughput("cuda", cfg, batches=(1, 32, 128), prompt_len=16, new_tokens=128, mem_bytes=8 << 30)


def _gpu_shapes() -> list[tuple[str, ModelConfig]]:
    return [(m, preset(m)) for m in GPU_MODELS]


def fla_chunk_kda_cuda() -> Outcome:
    return fla_chunk_kda("cuda", _gpu_shapes(), lens=(4096, 1000))


class Check(NamedTuple):
    name: str
    run: Callable[[], Outcome]


def cuda_checks() -> list[Check]:
    checks: list[Callable[[], Outcome]] = [backend_choice, *(_kernel_check(n) for n in KERNEL_CHECKS),
                                           greedy_no_cache_cuda, compiled_decode_cuda, compiled_mtp_cuda,
                                           throughput_48b,
                                           fla_chunk_kda_cuda, cpu_ranks_on_gpu_machine, cuda_tp2, dp_attention_nccl,
                                           mem_fraction_cuda, row_fallback_cuda, quant_cuda]
    return [Check(c.__name__, c) for c in checks]


def cpu_checks() -> list[Check]:
    """The same check functions on CPU tensors at small shapes (Triton under its interpreter): CI's run."""
    cpu = torch.device("cpu")
    kernels = [Check(f"kernel_{n}", functools.partial(kernel_outcome, n, cpu, CPU_SIZES, CPU_MODELS))
               for n in KERNEL_CHECKS]
    tiny = preset("k3-tiny")
    return kernels + [
        Check("greedy_no_cache", functools.partial(greedy_equals_no_cache, "cpu", 1, 2)),
        Check("compiled_decode", functools.partial(compiled_decode, "cpu", 1, 2)),
        Check("compiled_mtp", functools.partial(compiled_mtp, "cpu", 2, 8)),
        Check("throughput", functools.partial(output_throughput, "cpu", few_layers(tiny, 1), (1, 3), 8, 4, MEM)),
        Check("fla_chunk_kda", functools.partial(fla_chunk_kda, "cpu", [("k3-tiny", tiny)], (20,))),
    ]


def run_checks(checks: list[Check], cuda: bool) -> dict[str, dict[str, Any]]:
    """Each check's status, reason, figures and seconds; printed as they finish. A check that raises fails with
    why (the others still run); without CUDA (`cuda` False) each says SKIP."""
    results: dict[str, dict[str, Any]] = {}
    for check in checks:
        t0 = time.perf_counter()
        if not cuda:
            out = Outcome("SKIP", "no CUDA device here; run this on a machine with one")
        else:
            try:
                out = check.run()
            except Exception as e:  # a check that raises fails with why; the others still run
                traceback.print_exc()
                out = Outcome("FAIL", f"{type(e).__name__}: {e}")
        seconds = round(time.perf_counter() - t0, 1)
        results[check.name] = {"status": out.status, "reason": out.reason, "figures": out.figures, "seconds": seconds}
        print(f"{out.status} {check.name}: {out.reason} ({seconds:.0f} s)", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these checks only")
    p.add_argument("--json", action="store_true", help="end with one JSON object of every check and its figures")
    p.add_argument("--cpu", action="store_true", help="run the CPU-runnable checks at small shapes instead")
    a = p.parse_args(argv)
    checks = cpu_checks() if a.cpu else cuda_checks()
    unknown = set(a.only or ()) - {c.name for c in checks}
    if unknown:
        p.error(f"unknown check(s) {sorted(unknown)}; choose from {[c.name for c in checks]}")
    checks = [c for c in checks if not a.only or c.name in a.only]
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "none"
    import triton

    print(f"device: {device} x{torch.cuda.device_count()}, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    start = time.perf_counter()
    results = run_checks(checks, cuda or a.cpu)
    failed = [k for k, v in results.items() if v["status"] == "FAIL"]
    if a.json:
        print(json.dumps({"device": device, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                          "triton": triton.__version__, "mode": "cpu" if a.cpu else "cuda", "checks": results,
                          "failed": failed, "seconds": round(time.perf_counter() - start)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
