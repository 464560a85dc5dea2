"""The engine on a device, for bench/gpu_check.py: greedy tokens against the no-cache forward, the compiled decode
step against the eager one, output tok/s of a kimi-linear-48b-shaped model of a few layers, and the Triton KDA
prefill against fla's chunk_kda. Each takes its device (and sizes), so the CI test runs the same functions on CPU
with a tiny model; what only a GPU can show (fla's CUDA kernels, figures worth reading) says SKIP elsewhere."""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.gpu_kernel_harness import Draw, ModelShapes, forced, median_ms
from kernels.kda_pool import kda_prefill
from radixk3.config import ModelConfig, every_mla, preset
from radixk3.model import KimiForCausalLM, build_model
from radixk3.tensor_names import public_tensors
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs

GREEDY = {"temperature": 0, "ignore_eos": True}
EXACT_NEW = 6  # new tokens per prompt in the exactness waves (as tests/runtime/test_engine_exactness.py)


@dataclass(frozen=True)
class Outcome:
    status: str  # PASS | FAIL | SKIP
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)


Generate = Callable[[list[list[int]]], list[list[int]]]


def exactness_waves(vocab: int, reference: Generate, per_wave: int | None = None) -> list[list[list[int]]]:
    """The exactness prompt set of tests/runtime/test_engine_exactness.py (seeded the same): few-shot prompts, a
    shared system prompt, unrelated ones and a duplicate; next turns that extend `reference`'s outputs; branches
    inside a cached prefix. `per_wave` keeps the first prompts of each wave (CI's small run)."""
    g = random.Random(5)

    def rand(n: int) -> list[int]:
        return [g.randrange(vocab) for _ in range(n)]

    shots, system = rand(48), rand(20)
    wave1 = [shots + rand(g.randrange(3, 12)) for _ in range(12)]
    wave1 += [system + rand(g.randrange(2, 30)) for _ in range(8)]
    wave1 += [rand(g.randrange(5, 60)) for _ in range(4)]
    wave1.append(list(wave1[0]))
    ref1 = reference(wave1[:per_wave]) + [[] for _ in wave1[len(wave1[:per_wave]):]]
    wave2 = [p + o + rand(g.randrange(1, 9)) for p, o in zip(wave1[:14], ref1[:14], strict=True)]
    wave2 += [p + o for p, o in zip(wave1[14:20], ref1[14:20], strict=True)]
    wave2 += [shots[: g.randrange(10, 48)] + rand(4) for _ in range(6)]
    wave3 = [list(p) for p in wave2[:6]] + [shots + rand(3) for _ in range(4)]
    return [w[:per_wave] for w in (wave1, wave2, wave3)]


@torch.inference_mode()
def no_cache_greedy(model: KimiForCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    """The ground truth: the whole sequence through the no-cache forward for every new token."""
    seq = list(prompt)
    for _ in range(new_tokens):
        seq.append(int(model(torch.tensor(seq, device=model.device))[-1].argmax()))
    return seq[len(prompt):]


@functools.cache
def _tiny_model(device: str) -> KimiForCausalLM:
    return build_model(preset("k3-tiny"), seed=11, device=device)


@functools.cache
def _no_cache_reference(device: str, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    """Kept for the process: the compiled and the eager run compare with the same ground truth, computed once."""
    return no_cache_greedy(_tiny_model(device), list(prompt), new_tokens)


def greedy_equals_no_cache(device: str, per_wave: int | None = None, new_tokens: int = EXACT_NEW,
                           **args: Any) -> Outcome:
    """k3-tiny on `device`, radix cache on: the engine's greedy tokens over the three waves (one engine, so
    later waves hit what earlier ones cached) equal the no-cache forward's, token for token. `args`: more
    ServerArgs fields. Figures: output tokens, prompt tokens the cache served, the engine's seconds."""
    model = _tiny_model(device)

    def reference(prompts: list[list[int]]) -> list[list[int]]:
        return [_no_cache_reference(device, tuple(p), new_tokens) for p in prompts]

    waves = exactness_waves(model.config.vocab_size, reference, per_wave)
    wants = [reference(wave) for wave in waves]
    eng = LocalEngine(ServerArgs(device=device, mem_bytes=16 << 20, **args), model, check=True)
    tokens, seconds = 0, 0.0
    for i, (wave, want) in enumerate(zip(waves, wants, strict=True)):
        t0 = time.perf_counter()
        got = eng.generate(wave, GREEDY | {"max_new_tokens": new_tokens})
        seconds += time.perf_counter() - t0
        bad = [j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        if bad:
            j = bad[0]
            return Outcome("FAIL", f"wave {i + 1}, prompt {j} of {len(wave)}: engine {got[j]} != no-cache {want[j]}")
        tokens += sum(map(len, got))
    cached = eng.scheduler.metrics.cached_tokens
    if cached == 0:
        return Outcome("FAIL", "the radix cache served no prompt token over the waves")
    return Outcome("PASS", f"{sum(map(len, waves))} prompts in 3 waves: engine greedy == no-cache forward on {device}",
                   {"output_tokens": tokens, "cached_prompt_tokens": cached, "engine_s": round(seconds, 3)})


COMPILE_FIELD = "disable_compile"


def compiled_decode(device: str, per_wave: int | None = None, new_tokens: int = EXACT_NEW) -> Outcome:
    """Decode with the compiled step (CUDA graphs on CUDA) and without (`disable_compile`): both give the no-cache
    greedy tokens over the exactness waves; figures: each engine's seconds over the waves (the compiled one's
    includes its compilation: the engine is new)."""
    if COMPILE_FIELD not in {f.name for f in dataclasses.fields(ServerArgs)}:
        return Outcome("SKIP", f"ServerArgs has no {COMPILE_FIELD!r} field here: the compiled decode step "
                               "(issue 24 item 2) is not merged into this tree")
    figures: dict[str, Any] = {}
    for disable in (False, True):
        out = greedy_equals_no_cache(device, per_wave, new_tokens, **{COMPILE_FIELD: disable})
        if out.status != "PASS":
            return Outcome(out.status, f"{COMPILE_FIELD}={disable}: {out.reason}", figures)
        figures["eager_engine_s" if disable else "compiled_engine_s"] = out.figures["engine_s"]
    return Outcome("PASS", f"compiled and eager decode on {device}: both == no-cache forward", figures)


def compiled_mtp(device: str, questions: int = 4, new_tokens: int = 24) -> Outcome:
    """MTP speculation (k = 3) on the built-in k3-gsm8k (fp32), gsm8k questions all at once, with every step
    compiled (decode, verify and the MTP layer's steps; CUDA graphs on CUDA) and with `disable_compile`: both give
    the no-cache greedy tokens and accept the same drafts. Figures: accepted drafts, verify steps, each engine's
    seconds (the compiled one's after its compilation)."""
    from bench.gsm8k import DATA, one_example, read_jsonl
    from radixk3.builtin_model import BUILTIN_MODEL_DIR
    from radixk3.checkpoint import load_model
    from radixk3.tokenizer import load_tokenizer

    model = load_model(BUILTIN_MODEL_DIR, device=device, dtype=torch.float32)
    tok = load_tokenizer()
    prompts = [tok.encode(one_example(e, False)) for e in read_jsonl(DATA / "test.jsonl")[:questions]]
    want = [no_cache_greedy(model, p, new_tokens) for p in prompts]
    figures: dict[str, Any] = {}
    accepted = {}
    for disable in (False, True):
        eng = LocalEngine(ServerArgs(device=device, mem_bytes=64 << 20, max_running_requests=questions,
                                     speculative_algorithm="mtp", speculative_num_draft_tokens=3,
                                     **{COMPILE_FIELD: disable}), model, check=True)
        kind = "eager" if disable else "compiled"
        if not disable and getattr(eng.worker.proposer, "graphs", None) is None:
            return Outcome("FAIL", "the compiled engine built no MTP graphs (see its log)")
        t0 = time.perf_counter()
        got = eng.generate(prompts, GREEDY | {"max_new_tokens": new_tokens})
        figures[f"{kind}_engine_s"] = round(time.perf_counter() - t0, 3)
        bad = [j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        if bad:
            return Outcome("FAIL", f"{kind} MTP on {device}: prompt {bad[0]}: {got[bad[0]]} != no-cache "
                                   f"{want[bad[0]]}", figures)
        m = eng.scheduler.metrics
        accepted[kind] = m.accepted_tokens
        figures |= {f"{kind}_accepted_tokens": m.accepted_tokens, f"{kind}_verify_steps": m.verify_steps}
    if accepted["compiled"] != accepted["eager"]:
        return Outcome("FAIL", f"compiled MTP accepted {accepted['compiled']} drafts, eager {accepted['eager']}",
                       figures)
    return Outcome("PASS", f"compiled and eager MTP speculation on {device}: both == no-cache forward, the same "
                           "drafts accepted", figures)


def few_layers(cfg: ModelConfig, kda_per_mla: int = 3) -> ModelConfig:
    """`cfg` cut to its first MLA period (kda_per_mla KDA layers, then an MLA one; the first one's MLP dense as
    first_k_dense_replace says), as the real model starts."""
    n = kda_per_mla + 1
    kda, mla = every_mla(n, [n])
    return cfg.replace(num_hidden_layers=n, kda_layers=kda, mla_layers=mla, num_nextn_predict_layers=0)


@torch.no_grad()
def random_model(cfg: ModelConfig, device: str, seed: int = 0) -> KimiForCausalLM:
    """Random weights drawn on the device (a 48B MoE layer is 1.8G parameters: minutes through the CPU's
    generator), by `radixk3.model.init_random_`'s rules but not its values: fan-in scaled linears (conv
    weights too), the embedding N(0, 1), norms 1 + N(0, 0.1), A_log log U(1, 16), dt_bias as the gate wants it.
    """
    with torch.device(device):
        model = KimiForCausalLM(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, view in sorted(public_tensors(model, params_only=True).items()):
        if name.endswith("A_log"):
            view.uniform_(1, 16, generator=gen).log_()
        elif name.endswith("dt_bias") and cfg.kda_gate_lower_bound is not None:
            view.uniform_(-3, -1, generator=gen)
        elif name.endswith("dt_bias"):
            dt = torch.empty_like(view).uniform_(-6.9, -2.3, generator=gen).exp()  # logU(1e-3, 1e-1)
            view.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "norm" in name:
            view.normal_(1.0, 0.1, generator=gen)
        else:
            std = 1.0 if name.endswith("embed_tokens.weight") else view.shape[-1] ** -0.5
            view.normal_(0.0, std, generator=gen)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.05, generator=gen)
    return model.cast_(cfg.torch_dtype).eval()


def output_throughput(device: str, cfg: ModelConfig, batches: tuple[int, ...], prompt_len: int,
                      new_tokens: int, mem_bytes: int) -> Outcome:
    """Output tok/s of `cfg` (random weights) at each batch: `batch` prompts of `prompt_len` random ids, greedy,
    `new_tokens` each, wall time of the whole generate (prefill included) after a warm-up that compiles the
    kernels; every request must finish with all its tokens."""
    model = random_model(cfg, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    args = ServerArgs(device=device, mem_bytes=mem_bytes, max_running_requests=max(batches))
    eng = LocalEngine(args, model)
    g = random.Random(0)
    eng.generate([[g.randrange(cfg.vocab_size) for _ in range(prompt_len)]], GREEDY | {"max_new_tokens": 4})
    figures: dict[str, Any] = {"layers": cfg.num_hidden_layers, "weights_gib": round(weights / 2**30, 2),
                               "dtype": cfg.dtype, "prompt_len": prompt_len, "new_tokens": new_tokens}
    for b in batches:
        prompts = [[g.randrange(cfg.vocab_size) for _ in range(prompt_len)] for _ in range(b)]
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, GREEDY | {"max_new_tokens": new_tokens})
        seconds = time.perf_counter() - t0
        if any(len(o) != new_tokens for o in outs):
            return Outcome("FAIL", f"batch {b}: a request ended short of {new_tokens} tokens", figures)
        figures[f"batch{b}_tok_s"] = round(b * new_tokens / seconds, 1)
    rates = ", ".join(f"batch {b}: {figures[f'batch{b}_tok_s']:,.0f}" for b in batches)
    return Outcome("PASS", f"output tok/s ({cfg.num_hidden_layers} layers, {cfg.dtype}) {rates}", figures)


FLA_REL_TOL = 2e-3


def fla_chunk_kda(device: str, shapes: list[tuple[str, ModelConfig]], lens: tuple[int, ...]) -> Outcome:
    """Our KDA prefill (Triton, through the pool) against fla's chunk_kda on the same inputs (varlen, initial
    states): outputs and final states within FLA_REL_TOL in relative L2 norm. fla's chunk kernels take TF32 dots
    (10-bit mantissa, ~3e-4 relative a product); 2e-3 leaves room for the few products compounding in a chunk's
    inverse and the state hand-over, far below what a wrong gate, scale or state layout gives (O(1))."""
    if not device.startswith("cuda"):
        return Outcome("SKIP", "fla's chunk_kda runs on CUDA only (on CPU fla is the tests' naive oracle)")
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001 - any import failure means fla is not usable here
        return Outcome("SKIP", f"fla does not import: {type(e).__name__}: {e}")
    figures = {name: _against_fla(chunk_kda, torch.device(device), name, cfg, lens) for name, cfg in shapes}
    worst = max(max(f["rel_err_output"], f["rel_err_states"]) for f in figures.values())
    ok = worst <= FLA_REL_TOL
    return Outcome("PASS" if ok else "FAIL", f"KDA prefill vs fla chunk_kda: worst relative error {worst:.1e} "
                                             f"(bound {FLA_REL_TOL})", figures)


def _against_fla(chunk_kda: Callable[..., Any], device: torch.device, name: str, cfg: ModelConfig,
                 lens: tuple[int, ...]) -> dict[str, Any]:
    s = ModelShapes.of(name, cfg)
    d = Draw(device, 11)
    q, k, v, g, beta = d.kda_inputs(sum(lens), s)
    n = len(lens)
    init = d.randn(n, s.kda_heads, s.head_dim, s.head_dim) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=device)
    slots = torch.arange(n, device=device)

    def ours(pool: torch.Tensor) -> torch.Tensor:
        return kda_prefill(q, k, v, g, beta, pool, state_slots=slots, cu_seqlens=cu)

    def theirs() -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_kda(q[None], k[None], v[None], g[None], beta[None], initial_state=init.clone(),
                         output_final_state=True, cu_seqlens=cu)

    with forced("triton"):
        pool = init.clone()
        o = ours(pool)
        ours_ms = median_ms(lambda: ours(init.clone()), device)
    o_ref, s_ref = theirs()
    fla_ms = median_ms(theirs, device)
    return {"rel_err_output": float((o - o_ref[0]).norm() / o_ref.norm()),
            "rel_err_states": float((pool - s_ref).norm() / s_ref.norm()), "tokens": sum(lens),
            "ours_ms": round(ours_ms or 0.0, 3), "fla_ms": round(fla_ms or 0.0, 3)}
