"""Offline throughput: radixk3's `Engine` against transformers' `KimiLinearForCausalLM.generate` on the same
random k3-small checkpoint (written by radixk3 into a temp dir; k3-tiny with --quick), same token-id prompts,
greedy, EOS ignored.

Workloads (token ids; every batch has prompts of one length, so transformers never pads):
  gsm8k      a burst of 32 requests submitted at once: the 5-shot prefix of SGLang's gsm8k harness (5
             consecutive train examples, chosen so the prefix is about 800 tokens) + each test question
             truncated to 70 tokens ("Question: ..." then "\\nAnswer:"), encoded with the built-in
             tokenizer; 64 new tokens each. transformers runs the 32 as one batch.
  b1..b64    plain decode: batch 1, 8, 32, 64 of 24-token random prompts, 128 new tokens each.
  radix off  the gsm8k burst again on an engine with `disable_radix_cache=True`.

Why equal lengths: transformers' KimiLinear zeroes padded positions before every KDA layer
(`apply_mask_to_padding_states`), which keeps a left-padded row's recurrent state at zero, but the
chunked KDA then runs over shifted chunk boundaries and the MLA layers see a padding mask, so a padded row
is not bit-identical to the same row alone. Equal lengths keep the comparison exact up to batching.

transformers 5.24.0 loads the checkpoint with `use_kernels=False` and its defaults otherwise (sdpa attention,
grouped_mm experts; fla hidden on CPU, so KDA and the short conv take its torch fallbacks), EOS disabled in
its generation config and min_new_tokens = max_new_tokens. The engine gets `ignore_eos`.

For each dtype (fp32 and bf16 columns by default) it prints output tok/s per backend and radixk3 /
transformers ratios, the radix cache on/off ratio, the prefill tokens the engine computed on the burst
against an ideal cache, and how far radixk3's tokens agree with transformers' (share of tokens before the
first divergence, and share of identical sequences). Ratios are measured in this run.

`--expert-format mxfp4|int4|fp8` also writes the same model with its routed experts quantised through
compressed-tensors and runs radixk3 on it over the decode workloads (b1..b64): the CPU cost of dequantising the
routed experts each step against what it saves in bytes. Each column's JSON then has `expert_format`:
{"format", "decode_tok_s" {bN: packed tok/s}, "dense_decode_tok_s" {bN: the dense run's, same run},
"ratio" {bN: packed / dense}, "expert_bytes" (the packed routed experts, from `radixk3 plan --model`),
"dense_expert_bytes" (the same experts in the model dtype)}.

`--quantization int8,int4` also serves the same checkpoint with weight-only quantisation at load over the decode
workloads (`bench/weight_quant.py`): each column's JSON then has `quantization` {method: {"tok_s", "ratio_to_dense"
(the dense run of this run), "greedy_agreement", "greedy_sequences_equal", "max_logit_error", "max_logit_error_rel",
"top1_agreement" (no-cache logits of a few prompts)}}.

`--llamacpp` races llama.cpp (llama-cpp-python, a bench extra) on the same checkpoint written as GGUF
(`bench/llamacpp/`): same token-id prompts, greedy, radixk3's thread count, f32 KV cache, flash attention off; each
dtype column against a GGUF of that precision (fp32 - f32, bf16 - bf16), and `--quant-columns int8,int4` radixk3's
weight-only int8 / int4 against Q8_0 / Q4_0. The decodes run as parallel sequences through the batch API; the
gsm8k burst twice: the shared prefix decoded once and copied to every sequence (`gsm8k`), and every prompt
prefilled whole (`gsm8k_prefill_all`). Each column's JSON then has `llamacpp` {"gguf_type", "tok_s" {workload},
"peak_rss_mib" (its process), "agreement" / "agreement_sequences" (against radixk3's tokens in that column)} and
`ratio_llamacpp_<workload>` = radixk3 / llama.cpp output tok/s (the prefill-all ratio against radixk3's burst).
The summary has `ratio_llamacpp_b1`, `_b32`, `_gsm8k`, `_gsm8k_prefill_all`, `agreement_llamacpp` (f32: must
be 1.0, a conversion that disagrees is a bug), `llamacpp_divergences` (f32: each sequence where the two differ,
judged at its first differing token by the no-cache forward in fp32 and float64, `bench/llamacpp/near_ties.py`:
a near tie fp32 cannot order, or not, with its workload; the bug warning is printed unless every differing
sequence is such a near tie) and `llamacpp`
{"version", "system_info", "threads", ...}.

The weight-bandwidth floor (`bench/weight_floor.py`, every run): the weight bytes a batch-1 decode token reads
over this machine's measured read rate, and each backend's batch-1 step (b1 seconds / new tokens, its 24-token
prefill included) as a multiple of it; JSON `weight_floor`.

    python bench/offline_throughput.py [--backend radixk3|transformers|both] [--dtypes float32,bfloat16]
                                       [--expert-format none|mxfp4|int4|fp8] [--llamacpp]
                                       [--quant-columns int8,int4] [--quantization int8,int4]
                                       [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.ideal_cache import ideal_prefill  # noqa: E402
from bench.llamacpp import near_ties  # noqa: E402
from bench.llamacpp.race import PREFILL_ALL, Column, run_column  # noqa: E402
from bench.llamacpp.runner import available as llamacpp_available  # noqa: E402
from bench.machine_info import cpu_name  # noqa: E402
from bench.memory import engine_memory, print_memory  # noqa: E402
from bench.transformers_cpu import hide_fla  # noqa: E402
from bench.weight_floor import DRAM_BYTES, Floor, read_rate, token_bytes  # noqa: E402

hide_fla(torch.cuda.is_available())

Prompts = list[list[int]]
DTYPES = ("auto", "float32", "bfloat16")


# --- machine -------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    try:
        import transformers

        tf_version = transformers.__version__  # the import is cheap until a model class is touched
    except ImportError:
        tf_version = None
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": tf_version, "python": platform.python_version(),
            "system": platform.system()}


# --- workloads -----------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: Prompts
    new_tokens: int
    shape: str


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_burst(tokenizer: Any, requests: int, prefix_target: int, own: int, new_tokens: int,  # noqa: ANN401
                shots_n: int = 5) -> Workload:
    data = REPO / "bench" / "data" / "gsm8k"
    train, test = read_jsonl(data / "train.jsonl"), read_jsonl(data / "test.jsonl")

    def shots(i: int) -> list[int]:
        text = "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in train[i : i + shots_n])
        return tokenizer.encode(text, add_bos=True)

    # The first window of `shots_n` consecutive train examples (of the first 200) whose prefix is closest
    # to the target.
    prefix = min((shots(i) for i in range(200)), key=lambda p: abs(len(p) - prefix_target))
    tail = tokenizer.encode("\nAnswer:")
    prompts: Prompts = []
    for e in test:
        q = tokenizer.encode(f"Question: {e['question']}")
        if len(q) + len(tail) >= own:
            prompts.append(prefix + q[: own - len(tail)] + tail)
        if len(prompts) == requests:
            break
    common = len(os.path.commonprefix(prompts))  # the few-shot prefix and the "Question:" that follows it
    shape = (f"{requests} requests at once: {len(prefix)}-token shared {shots_n}-shot prefix + {own} own tokens "
             f"(gsm8k text, built-in tokenizer; {common} tokens common to all), {new_tokens} new each")
    return Workload("gsm8k", prompts, new_tokens, shape)


def decode_batch(batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> Workload:
    g = random.Random(seed)
    # Ids from 16 up: no special tokens; a different first token per batch size keeps workloads from
    # sharing cached prefixes.
    prompts = [[g.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    return Workload(f"b{batch}", prompts, new_tokens,
                    f"batch {batch}: {prompt_len}-token random prompts, {new_tokens} new each")


# --- backends ------------------------------------------------------------------------------------------
@dataclass
class Run:
    tok_s: float
    outputs: Prompts
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def params(new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}


def engine_kwargs(dtype: str, a: argparse.Namespace, radix: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"mem_bytes": a.mem_mib << 20, "max_running_requests": a.max_running_requests,
                          "chunked_prefill_size": a.chunked_prefill_size, "disable_radix_cache": not radix,
                          "disable_compile": a.disable_compile, "num_scheduler_steps": a.num_scheduler_steps}
    if dtype != "auto":
        kw["dtype"] = dtype
    return kw


def warm_prompts(vocab: int) -> Prompts:
    """Two 64-token prompts that share no first token with the workloads (ids below 16 start them), so that
    first-call costs (allocations, lazy imports) are paid before timing and nothing is cached for later."""
    g = random.Random(12345)
    return [[5 + i] + [g.randrange(16, vocab) for _ in range(63)] for i in range(2)]


def run_radixk3(ckpt: Path, dtype: str, workloads: list[Workload], burst: Workload, vocab: int,
                a: argparse.Namespace, quantization: str | None = None) -> dict[str, Run]:
    """Radix cache on over every workload, then off over the burst (not for a quantised column)."""
    import radixk3

    out: dict[str, Run] = {}
    extra = {"quantization": quantization} if quantization else {}
    for radix in (True, False) if quantization is None else (True,):
        with radixk3.Engine(model=str(ckpt), **engine_kwargs(dtype, a, radix), **extra) as engine:
            built = engine.procs.compile_seconds  # the compiled decode step: seconds per batch-size bucket
            if built:
                print(f"  radixk3      {quantization or dtype:<9} compiled decode step: " +
                      ", ".join(f"batch {b} {s:.1f} s" for b, s in built.items()), flush=True)
            engine.generate(warm_prompts(vocab), params(4))
            todo = workloads if radix else [burst]
            for w in todo:
                before = engine.get_metrics()["prefill_tokens_computed"]
                t0 = time.perf_counter()
                res = engine.generate(w.prompts, params(w.new_tokens))
                dt = time.perf_counter() - t0
                computed = engine.get_metrics()["prefill_tokens_computed"] - before
                outs = [r["output_ids"] for r in res]
                name = w.name if radix else f"{w.name}_radix_off"
                out[name] = Run(sum(map(len, outs)) / dt, outs, dt, {"prefill_tokens_computed": computed,
                                                                     "compile_seconds": built})
                label = quantization or dtype
                print(f"  radixk3      {label:<9} {name:<18} {out[name].tok_s:9.1f} tok/s  ({dt:6.1f} s, "
                      f"{computed} prefill tokens computed)", flush=True)
            if radix:  # after every workload: the peaks cover them all (this process also holds the bench's own)
                mem = engine_memory(engine)
                print_memory(mem, f"radixk3 {dtype}")
                out[burst.name].extra["memory"] = mem.to_json()
    return out


def run_packed(ckpt: Path, dtype: str, decodes: list[Workload], vocab: int, a: argparse.Namespace) -> dict[str, Run]:
    """radixk3 on the checkpoint with packed experts, over the decode workloads (radix on)."""
    import radixk3

    out: dict[str, Run] = {}
    with radixk3.Engine(model=str(ckpt), **engine_kwargs(dtype, a, True)) as engine:
        engine.generate(warm_prompts(vocab), params(4))
        for w in decodes:
            t0 = time.perf_counter()
            outs = [r["output_ids"] for r in engine.generate(w.prompts, params(w.new_tokens))]
            dt = time.perf_counter() - t0
            out[w.name] = Run(sum(map(len, outs)) / dt, outs, dt)
            print(f"  radixk3 {a.expert_format:<5}{dtype:<9} {w.name:<18} {out[w.name].tok_s:9.1f} tok/s  "
                  f"({dt:6.1f} s)", flush=True)
    return out


def expert_bytes(ckpt: Path, dtype: str) -> int:
    """The routed experts' bytes a loaded model holds on one rank (`radixk3 plan --model`)."""
    from radixk3.config_formats import load_model_config
    from radixk3.plan import weight_bytes

    cfg = load_model_config(ckpt)
    return weight_bytes(cfg if dtype == "auto" else cfg.replace(dtype=dtype)).routed_experts


def packed_column(rk: dict[str, Run], packed: dict[str, Run], dense_ckpt: Path, packed_ckpt: Path, dtype: str,
                  fmt_name: str) -> dict[str, Any]:
    dense = {k: rk[k].tok_s for k in packed if k in rk}
    return {"format": fmt_name, "decode_tok_s": {k: v.tok_s for k, v in packed.items()}, "dense_decode_tok_s": dense,
            "ratio": {k: ratio(v.tok_s, dense.get(k)) for k, v in packed.items()},
            "expert_bytes": expert_bytes(packed_ckpt, dtype), "dense_expert_bytes": expert_bytes(dense_ckpt, dtype)}


def load_transformers(ckpt: Path, dtype: str) -> Any:  # noqa: ANN401
    import transformers

    tdtype = torch.float32 if dtype in ("auto", "float32") else torch.bfloat16
    model = transformers.KimiLinearForCausalLM.from_pretrained(ckpt, use_kernels=False, dtype=tdtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as the engine does with ignore_eos
    return model


@torch.inference_mode()
def tf_generate(model: Any, prompts: Prompts, new_tokens: int, batch: int) -> Prompts:  # noqa: ANN401
    outs: Prompts = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        assert len({len(p) for p in chunk}) == 1, "a transformers batch must not need padding"
        ids = torch.tensor(chunk)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        outs.extend(gen[:, ids.shape[1] :].tolist())
    return outs


def run_transformers(ckpt: Path, dtype: str, workloads: list[Workload], vocab: int, a: argparse.Namespace
                     ) -> dict[str, Run]:
    model = load_transformers(ckpt, dtype)
    tf_generate(model, warm_prompts(vocab), 4, 2)
    out: dict[str, Run] = {}
    for w in workloads:
        t0 = time.perf_counter()
        outs = tf_generate(model, w.prompts, w.new_tokens, a.tf_batch or len(w.prompts))
        dt = time.perf_counter() - t0
        out[w.name] = Run(sum(map(len, outs)) / dt, outs, dt)
        print(f"  transformers {dtype:<9} {w.name:<18} {out[w.name].tok_s:9.1f} tok/s  ({dt:6.1f} s)", flush=True)
    del model
    return out


# --- figures -------------------------------------------------------------------------------------------
def agreement(ours: Prompts, ref: Prompts) -> tuple[float, float]:
    """(share of reference tokens before the first divergence, share of identical sequences)."""
    same = total = exact = 0
    for a, b in zip(ours, ref, strict=True):
        k = near_ties.first_difference(a, b)
        same += len(a) if k is None else k
        total += len(b)
        exact += a == b
    return same / max(total, 1), exact / max(len(ref), 1)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def column(rk: dict[str, Run], tf: dict[str, Run], workloads: list[Workload], burst: Workload) -> dict[str, Any]:
    def tps(runs: dict[str, Run], name: str) -> float | None:
        return runs[name].tok_s if name in runs else None

    col: dict[str, Any] = {
        "tok_s": {"radixk3": {k: v.tok_s for k, v in rk.items()}, "transformers": {k: v.tok_s for k, v in tf.items()}},
    }
    for w in workloads:
        col[f"ratio_{w.name}"] = ratio(tps(rk, w.name), tps(tf, w.name))
    col["radix_on_off"] = ratio(tps(rk, burst.name), tps(rk, f"{burst.name}_radix_off"))
    ideal = ideal_prefill(burst.prompts)
    if burst.name in rk:
        on = rk[burst.name].extra["prefill_tokens_computed"]
        off = rk[f"{burst.name}_radix_off"].extra["prefill_tokens_computed"]
        col |= {"prefill_tokens_on": on, "prefill_tokens_off": off, "prefill_tokens_ideal": ideal,
                "prefill_vs_ideal": on / ideal}
    else:
        col |= {"prefill_tokens_ideal": ideal, "prefill_vs_ideal": None}
    if burst.name in rk:  # per batch-size bucket; empty with --disable-compile
        col["compile_seconds"] = rk[burst.name].extra["compile_seconds"]
    if burst.name in rk and "memory" in rk[burst.name].extra:
        mem = rk[burst.name].extra["memory"]
        col |= {"resident_mib": mem["resident_mib"], "resident_beyond_pool_mib": mem["resident_beyond_pool_mib"],
                "resident_memory": mem}
    if rk and tf:
        per = {w.name: agreement(rk[w.name].outputs, tf[w.name].outputs) for w in workloads}
        ours = [o for w in workloads for o in rk[w.name].outputs]
        ref = [o for w in workloads for o in tf[w.name].outputs]
        tokens, seqs = agreement(ours, ref)
        col |= {"agreement": tokens, "agreement_sequences": seqs,
                "agreement_by_workload": {k: {"tokens": t, "sequences": s} for k, (t, s) in per.items()}}
    else:
        col |= {"agreement": None, "agreement_sequences": None}
    if burst.name in rk:  # the radix cache should not change greedy output (beyond fp ties: prefill splits differ)
        on_off = rk[burst.name].outputs, rk[f"{burst.name}_radix_off"].outputs
        col["radix_off_equal"] = on_off[0] == on_off[1]
        col["radix_on_off_agreement"] = agreement(*on_off)[0]
    return col

# --- llama.cpp race and the weight-bandwidth floor -------------------------------------------------------
QUANT_COLUMNS = ("int8", "int4")
NEEDS_QUANTIZATION = "needs --quantization (radixk3's weight-only int8/int4 serving) in this build"


def quantization_supported() -> bool:
    import dataclasses

    from runtime.server_args import ServerArgs

    return "quantization" in {f.name for f in dataclasses.fields(ServerArgs)}


def llamacpp_column(rk: dict[str, Run], lc: Column, burst: Workload, prompts: dict[str, Prompts] | None = None,
                    checkpoint: Path | None = None) -> dict[str, Any]:
    """llama.cpp's figures for one precision column, radixk3 / llama.cpp ratios and how far its greedy tokens
    agree with radixk3's (radixk3's are the reference; the prefill-all burst is compared with radixk3's burst).
    With `checkpoint` (an f32 column) and each workload's `prompts`, every sequence where the two differ is judged
    at its first differing token: a near tie fp32 cannot order, or not (`bench/llamacpp/near_ties.py`)."""
    runs = lc.report.runs
    col: dict[str, Any] = {"llamacpp": {
        "gguf_type": lc.gguf.file_type, "tok_s": {k: v.tok_s for k, v in runs.items()},
        "seconds": {k: v.seconds for k, v in runs.items()}, "peak_rss_mib": lc.report.peak_rss_mib,
        "gguf_weight_bytes": lc.gguf.weight_bytes, "extra_buffers": lc.report.extra_buffers}}
    ours: Prompts = []
    theirs: Prompts = []
    streams: dict[str, near_ties.Streams] = {}
    for name, run in runs.items():
        workload = burst.name if name == burst.name + PREFILL_ALL else name
        mine = rk.get(workload)
        col[f"ratio_llamacpp_{name}"] = ratio(mine.tok_s if mine else None, run.tok_s)
        if mine is not None:
            ours += mine.outputs
            theirs += run.outputs
            asked = (prompts or {}).get(workload)
            if asked is not None:
                streams[name] = near_ties.Streams(asked, mine.outputs, run.outputs)
    tokens, seqs = agreement(theirs, ours) if ours else (None, None)
    col["llamacpp"] |= {"agreement": tokens, "agreement_sequences": seqs}
    col["agreement_llamacpp"] = tokens
    if checkpoint is not None:
        col["llamacpp_divergences"] = [d._asdict() for d in near_ties.judge(checkpoint, streams)]
        col["llamacpp_differing_sequences"] = sum(near_ties.differing(w.ours, w.theirs) for w in streams.values())
    return col


def b1_step(runs: dict[str, Any], new_tokens: int | None) -> float | None:
    """Seconds per output token of the batch-1 workload (its short prefill included)."""
    run = runs.get("b1")
    return run.seconds / new_tokens if run is not None and new_tokens else None


def floor_column(bytes_per_token: int | None, threads: int, rk_step: float | None,
                 lc_bytes: int | None = None, lc_step: float | None = None) -> dict[str, Any]:
    """Each backend's batch-1 step against the floor of its own weight bytes, read at the rate this machine
    reads that many bytes."""
    out: dict[str, Any] = {}
    for who, nbytes, step in (("radixk3", bytes_per_token, rk_step), ("llamacpp", lc_bytes, lc_step)):
        if nbytes is None:
            continue
        f = Floor(nbytes, read_rate(nbytes, threads))
        out[who] = f.as_dict() | {"step_ms": None if step is None else step * 1e3, "floor_multiple": f.multiple(step)}
    return out


def print_race(cols: dict[str, dict[str, Any]]) -> None:
    names = [n for n in cols if "llamacpp" in cols[n]]
    if not names:
        return
    print(f"\n{'llama.cpp race':<28}" + "".join(f"{n + ' (' + cols[n]['llamacpp']['gguf_type'] + ')':>30}"
                                                for n in names))
    runs = list(cols[names[0]]["llamacpp"]["tok_s"])
    for w in runs:
        cells = []
        for n in names:
            c = cols[n]
            base = w.removesuffix(PREFILL_ALL)
            r = c.get("tok_s", {}).get("radixk3", {}).get(base)
            cells.append(f"{fmt(r, '.1f')} / {fmt(c['llamacpp']['tok_s'].get(w), '.1f')} = "
                         f"{fmt(c.get(f'ratio_llamacpp_{w}'), '.2f', 'x')}")
        print(f"{w + ' rk3 / llama.cpp':<28}" + "".join(f"{x:>30}" for x in cells))
    print(f"{'llama.cpp peak RSS':<28}" + "".join(f"{fmt(cols[n]['llamacpp']['peak_rss_mib'], '.0f', ' MiB'):>30}"
                                                 for n in names))
    print(f"{'agreement with radixk3':<28}" + "".join(f"{fmt(cols[n]['agreement_llamacpp'], '.1%'):>30}"
                                                     for n in names))
    for n in names:
        if cols[n].get("note"):
            print(f"{n}: {cols[n]['note']}")
        if not cols[n]["llamacpp"]["extra_buffers"]:
            print(f"{n}: llama.cpp ran without its repacked-weight buffers (it aborted with them on this CPU)")


def print_floor(cols: dict[str, dict[str, Any]]) -> None:
    for n, c in cols.items():
        for who, f in c.get("weight_floor", {}).items():
            print(f"weight floor {n} {who}: {f['bytes_per_token'] / 1e6:.1f} MB per batch-1 token at "
                  f"{f['read_gb_s']:.1f} GB/s = {f['floor_ms']:.2f} ms; b1 step {fmt(f['step_ms'], '.2f', ' ms')} = "
                  f"{fmt(f['floor_multiple'], '.2f', 'x')} the floor (target <= 1.3x)")


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_table(cols: dict[str, dict[str, Any]], workloads: list[Workload]) -> None:
    names = list(cols)
    print(f"\n{'':<28}" + "".join(f"{n:>30}" for n in names))
    for w in workloads:
        cells = []
        for n in names:
            c = cols[n]
            r, t = c["tok_s"]["radixk3"].get(w.name), c["tok_s"]["transformers"].get(w.name)
            cells.append(f"{fmt(r, '.1f')} / {fmt(t, '.1f')} = {fmt(c[f'ratio_{w.name}'], '.2f', 'x')}")
        print(f"{w.name + ' tok/s rk3 / tf':<28}" + "".join(f"{s:>30}" for s in cells))
    rows = [("radix on / off (burst)", "radix_on_off", ".2f", "x"), ("prefill computed / ideal", "prefill_vs_ideal",
            ".3f", ""), ("agreement (tokens)", "agreement", ".1%", ""), ("identical sequences", "agreement_sequences",
            ".1%", "")]
    for label, key, spec, suf in rows:
        print(f"{label:<28}" + "".join(f"{fmt(cols[n].get(key), spec, suf):>30}" for n in names))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("radixk3", "transformers", "both"), default="both")
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--quick", action="store_true", help="tiny workloads on a random k3-tiny, for a smoke test")
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    ap.add_argument("--checkpoint", type=Path, default=None, help="use this checkpoint instead of a random k3-small")
    ap.add_argument("--mem-mib", type=int, default=512, help="engine pool per rank, MiB")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--disable-compile", action="store_true", help="radixk3 decodes eagerly (no compiled step)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="radixk3's decode windows (the engine's flag): decode steps per plan when only decodes run")
    ap.add_argument("--tf-batch", type=int, default=0, help="transformers batch size (0: the whole workload)")
    ap.add_argument("--expert-format", choices=("none", "mxfp4", "int4", "fp8"), default="none",
                    help="also run radixk3 with the routed experts quantised (compressed-tensors) over the decodes")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also race llama.cpp on the same checkpoint as GGUF (needs llama-cpp-python)")
    ap.add_argument("--quant-columns", default=",".join(QUANT_COLUMNS),
                    help="with --llamacpp: radixk3 int8/int4 against llama.cpp Q8_0/Q4_0 ('' for none)")
    ap.add_argument("--quantization", default="", help="comma-separated of int8, int4: also serve the checkpoint "
                    "quantised at load (weight-only) over the decodes, with accuracy against the dense run")
    a = ap.parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if bad := [d for d in dtypes if d not in DTYPES]:
        ap.error(f"unknown dtype {bad[0]!r}")
    quants = [q.strip() for q in a.quant_columns.split(",") if q.strip()] if a.llamacpp else []
    if bad := [q for q in quants if q not in QUANT_COLUMNS]:
        ap.error(f"unknown quant column {bad[0]!r}")
    if a.llamacpp and (why := llamacpp_available()) is not None:
        ap.error(why)
    if a.quick:
        a.mem_mib = min(a.mem_mib, 128)

    from radixk3.checkpoint import write_random_checkpoint
    from radixk3.config import preset
    from radixk3.config_formats import load_model_config
    from radixk3.tokenizer import checkpoint_tokenizer

    mach = machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, {mach['torch_threads']} torch threads, torch "
          f"{mach['torch']}, transformers {mach['transformers']}, python {mach['python']}")
    with tempfile.TemporaryDirectory(prefix="radixk3-bench-") as tmp:
        ckpt = a.checkpoint
        if ckpt is None:
            name = "k3-tiny" if a.quick else "k3-small"  # a smoke test runs the same code on less compute
            ckpt = write_random_checkpoint(preset(name), Path(tmp) / name, seed=0)
            print(f"checkpoint: random {name} (seed 0) written by radixk3 into a temp dir")
        tok = checkpoint_tokenizer(ckpt)
        vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
        if a.quick:
            burst = gsm8k_burst(tok, 4, 100, 16, 4, shots_n=1)
            decodes = [decode_batch(b, 4, 2, vocab, seed=b) for b in (1, 8, 32, 64)]
        else:
            burst = gsm8k_burst(tok, 32, 800, 70, 64)
            decodes = [decode_batch(b, 24, 128, vocab, seed=b) for b in (1, 8, 32, 64)]
        workloads = [burst, *decodes]
        for w in workloads:
            print(f"workload {w.name}: {w.shape}")
        packed_ckpt = None
        if a.expert_format != "none":
            from radixk3.checkpoint import load_model
            from radixk3.quant_checkpoint import write_quantised_checkpoint

            packed_ckpt = write_quantised_checkpoint(load_model(ckpt), Path(tmp) / a.expert_format, a.expert_format)
            print(f"checkpoint: the same model with {a.expert_format} routed experts (compressed-tensors)")
        cols: dict[str, dict[str, Any]] = {}
        threads, b1_new = mach["torch_threads"], next((w.new_tokens for w in decodes if w.name == "b1"), None)
        cfg = load_model_config(Path(ckpt))
        lc_build: dict[str, str] = {}  # llama-cpp-python's version and llama.cpp's build flags
        for dtype in dtypes:
            rk = run_radixk3(Path(ckpt), dtype, workloads, burst, vocab, a) if a.backend != "transformers" else {}
            tf = run_transformers(Path(ckpt), dtype, workloads, vocab, a) if a.backend != "radixk3" else {}
            cols[dtype] = column(rk, tf, workloads, burst)
            if packed_ckpt is not None:
                packed = run_packed(packed_ckpt, dtype, decodes, vocab, a)
                cols[dtype]["expert_format"] = packed_column(rk, packed, Path(ckpt), packed_ckpt, dtype,
                                                             a.expert_format)
            if a.quantization and rk:
                from bench.weight_quant import quantization_column

                todo = [(w.name, w.prompts, w.new_tokens) for w in decodes]
                dense = {w.name: (rk[w.name].tok_s, rk[w.name].outputs) for w in decodes}
                cols[dtype]["quantization"] = {
                    m: quantization_column(Path(ckpt), dtype, m, todo, dense, engine_kwargs(dtype, a, True))
                    for m in a.quantization.split(",")}
            served = cfg if dtype == "auto" else cfg.replace(dtype=dtype)
            lc = None
            if a.llamacpp:
                lc = run_column(Path(ckpt), dtype, workloads, burst, vocab, threads, Path(tmp),
                                cfg.num_experts_per_token)
                f32 = dtype in ("auto", "float32") and served.torch_dtype == torch.float32
                cols[dtype] |= llamacpp_column(rk, lc, burst, {w.name: w.prompts for w in workloads},
                                               Path(ckpt) if f32 else None)
                lc_build = {"version": lc.report.version, "system_info": lc.report.system_info}
            cols[dtype]["weight_floor"] = floor_column(
                token_bytes(served, served.torch_dtype.itemsize).total if rk else None, threads, b1_step(rk, b1_new),
                lc.bytes_per_token if lc else None, b1_step(lc.report.runs, b1_new) if lc else None)
        quant_cols: dict[str, dict[str, Any]] = {}
        for q in quants:
            rk = {}
            if a.backend != "transformers" and quantization_supported():
                rk = run_radixk3(Path(ckpt), dtypes[0], workloads, burst, vocab, a, quantization=q)
            lc = run_column(Path(ckpt), q, workloads, burst, vocab, threads, Path(tmp), cfg.num_experts_per_token)
            lc_build = {"version": lc.report.version, "system_info": lc.report.system_info}
            quant_cols[q] = {"tok_s": {"radixk3": {k: v.tok_s for k, v in rk.items()}}} | llamacpp_column(rk, lc, burst)
            quant_cols[q]["weight_floor"] = floor_column(None, threads, None, lc.bytes_per_token,
                                                         b1_step(lc.report.runs, b1_new))
            if not quantization_supported():
                quant_cols[q]["note"] = f"radixk3 {q}: {NEEDS_QUANTIZATION}"
            elif a.backend == "transformers":
                quant_cols[q]["note"] = f"radixk3 {q}: not run (--backend transformers)"
        dram_bytes = DRAM_BYTES if not a.quick else DRAM_BYTES >> 4  # a smoke test holds less
        dram_gb_s = read_rate(dram_bytes, threads, repeats=3) / 1e9
    print_table(cols, workloads)
    print_race(cols | quant_cols)
    print_floor(cols | quant_cols)
    print(f"DRAM read rate ({dram_bytes >> 20} MiB, {threads} threads): {dram_gb_s:.1f} GB/s; radixk3 "
          f"--num-scheduler-steps {a.num_scheduler_steps}")
    if lc_build:
        print(f"llama.cpp: llama-cpp-python {lc_build['version']}, {threads} threads; {lc_build['system_info']}")
    for name, c in cols.items():
        if "expert_format" in c:
            q = c["expert_format"]
            ratios = ", ".join(f"{k} {fmt(v, '.2f', 'x')}" for k, v in q["ratio"].items())
            print(f"{name}: {q['format']} experts {q['expert_bytes'] / 1e6:.1f} MB vs "
                  f"{q['dense_expert_bytes'] / 1e6:.1f} MB dense; decode tok/s packed / dense: {ratios}")
    for name, c in cols.items():
        for m, q in c.get("quantization", {}).items():
            ratios = ", ".join(f"{k} {fmt(v, '.2f', 'x')}" for k, v in q["ratio_to_dense"].items())
            print(f"{name}: --quantization {m}: decode tok/s / dense: {ratios}; greedy agreement "
                  f"{q['greedy_agreement']:.1%}, max logit error {q['max_logit_error']:.3g} "
                  f"({q['max_logit_error_rel']:.1%} of the largest), top-1 {q['top1_agreement']:.1%}")
    print("ratios: radixk3 / transformers output tok/s, measured in this run; agreement: share of transformers' "
          "tokens that radixk3 reproduces before the first divergence")
    for name, c in cols.items():
        if c.get("agreement_llamacpp") is not None and c["agreement_llamacpp"] < 1 and name in ("auto", "float32"):
            judged = c.get("llamacpp_divergences", [])
            ties = [d for d in judged if d["near_tie"]]
            for d in judged:
                print(f"{name}: radixk3 and llama.cpp part in {d['workload']}'s sequence {d['sequence']} at new token "
                      f"{d['position']}: radixk3 {d['ours']}, llama.cpp {d['theirs']}; logit gap (radixk3's - "
                      f"llama.cpp's) in the no-cache forward {d['gap_fp32']:+.4g} in fp32, {d['gap_fp64']:+.4g} in "
                      "float64: " + ("a near tie fp32 cannot order" if d["near_tie"] else "NOT a near tie"))
            if len(ties) < c.get("llamacpp_differing_sequences", 1):
                print(f"WARNING: {name}: llama.cpp's f32 greedy tokens differ from radixk3's (token agreement "
                      f"{c['agreement_llamacpp']:.1%}): a conversion bug to find, not a figure to report")
        if c.get("radix_off_equal") is False:
            print(f"WARNING: {name}: radix cache on and off gave different greedy outputs "
                  f"(token agreement {c['radix_on_off_agreement']:.1%})")
    if a.json:
        first = cols[dtypes[0]]
        summary = {"machine": mach, "dtype": dtypes[0], "num_scheduler_steps": a.num_scheduler_steps,
                   "workloads": {w.name: w.shape for w in workloads}}
        keys = [f"ratio_{w.name}" for w in workloads] + ["radix_on_off", "prefill_vs_ideal", "agreement",
                                                         "agreement_sequences", "tok_s", "expert_format",
                                                         "compile_seconds", "quantization",
                                                         "resident_mib", "resident_beyond_pool_mib"]
        summary |= {k: first.get(k) for k in keys}
        if a.llamacpp:
            race_keys = [f"ratio_llamacpp_{k}" for k in first["llamacpp"]["tok_s"]] + ["agreement_llamacpp",
                                                                                       "llamacpp_divergences",
                                                                                       "llamacpp_differing_sequences"]
            summary |= {k: first.get(k) for k in race_keys}
            lc_info = first["llamacpp"]
            summary["llamacpp"] = lc_build | {"threads": threads,
                                   "gguf_type": lc_info["gguf_type"], "tok_s": lc_info["tok_s"],
                                   "peak_rss_mib": lc_info["peak_rss_mib"]}
            summary["quant_columns"] = quant_cols
        summary["weight_floor"] = first["weight_floor"] | {"dram_read_gb_s": dram_gb_s}
        summary["columns"] = cols
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
