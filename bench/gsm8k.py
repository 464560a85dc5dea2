"""gsm8k few-shot, in the shape of SGLang's `benchmark/gsm8k/bench_sglang.py`: throughput and prefix-cache
behaviour of a serving backend on a workload whose prompts share one long few-shot prefix.

Each prompt is `--num-shots` "Question: ...\\nAnswer: ..." blocks from the train set, separated by blank
lines, then a test question and "\\nAnswer:". A frontend program generates the answer (temperature 0, stops
"Question", "Assistant:", "<|separator|>", `--max-new-tokens`), `--parallel` programs at a time through
`run_batch`; the answer's last number is compared with the label's (SGLang's extraction).

Backends:
  srt           a running server, `--host` / `--port` (`radixk3 serve ...`), through `RuntimeEndpoint`
  engine        an in-process `radixk3.Engine` through `Runtime` (`--disable-radix-cache` for the baseline)
  transformers  the same prompts through transformers' `KimiLinearForCausalLM.generate` on the same
                checkpoint, `--parallel` prompts per left-padded batch, no prefix cache
Without `--model`, engine and transformers share a random checkpoint of `--preset` (seed 0) written into a
temp dir. Random weights answer near zero questions right: the harness then measures throughput and cache
behaviour only.

Prints Accuracy, Invalid, Latency, Output throughput and the cache hit rate (cached prompt tokens / prompt
tokens, from the server's per-request meta_info), appends a JSON line to `--result-file`, and with `--json`
ends with one JSON object of the figures.

    python bench/gsm8k.py --backend engine --num-questions 200 [--disable-radix-cache] [--json]
    python bench/gsm8k.py --compare --preset k3-small [--json]     # radix on, radix off, transformers: one run
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(REPO))

from bench.ideal_cache import ideal_cached  # noqa: E402

DATA = REPO / "bench" / "data" / "gsm8k"
STOPS = ["Question", "Assistant:", "<|separator|>"]
INVALID = -9999999
RANDOM_WEIGHTS_NOTE = ("note: random weights answer (almost) nothing right; until trained weights are served "
                       "this harness measures throughput and cache behaviour, not accuracy")


# --- the workload (SGLang's) ---------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_example(e: dict[str, str], include_answer: bool) -> str:
    text = "Question: " + e["question"] + "\nAnswer:"
    return text + " " + e["answer"] if include_answer else text


def few_shot_prefix(train: list[dict[str, str]], k: int) -> str:
    return "".join(one_example(e, True) + "\n\n" for e in train[:k])


def answer_value(text: str) -> int | float:
    """The last number in `text` (commas dropped), or INVALID."""
    numbers = re.findall(r"\d+", text.replace(",", ""))
    if not numbers:
        return INVALID
    try:
        return ast.literal_eval(numbers[-1])
    except (SyntaxError, ValueError):
        return INVALID


@dataclass
class Workload:
    prefix: str
    questions: list[str]
    labels: list[int | float]


def workload(data_path: Path, train_path: Path, num_shots: int, num_questions: int) -> Workload:
    test = read_jsonl(data_path)[:num_questions]
    labels = [answer_value(e["answer"]) for e in test]
    assert all(x != INVALID for x in labels), "a label without a number"
    return Workload(few_shot_prefix(read_jsonl(train_path), num_shots), [one_example(e, False) for e in test],
                    labels)


# --- results -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    answers: list[str]
    completion_tokens: list[int]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    latency: float


def summarise(w: Workload, o: Outcome) -> dict[str, Any]:
    preds = [answer_value(a) for a in o.answers]
    n = len(preds)
    out_tokens = sum(o.completion_tokens)
    prompt = sum(o.prompt_tokens)
    return {
        "accuracy": sum(p == label for p, label in zip(preds, w.labels, strict=True)) / n,
        "invalid": sum(p == INVALID for p in preds) / n,
        "latency": o.latency,
        "output_throughput": out_tokens / o.latency,
        "cache_hit_rate": sum(o.cached_tokens) / prompt if prompt else 0.0,
        "num_questions": n,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt,
        "cached_tokens": sum(o.cached_tokens),
    }


# --- backends ------------------------------------------------------------------------------------------
def run_frontend(w: Workload, backend: Any, a: argparse.Namespace) -> Outcome:  # noqa: ANN401
    import frontend_lang as sgl

    few_shot = w.prefix

    @sgl.function
    def few_shot_gsm8k(s, question):  # noqa: ANN001, ANN202
        s += few_shot + question
        s += sgl.gen("answer", max_tokens=a.max_new_tokens, stop=STOPS)

    tic = time.perf_counter()
    states = few_shot_gsm8k.run_batch([{"question": q} for q in w.questions], temperature=0,
                                      num_threads=a.parallel, progress_bar=not a.no_progress, backend=backend)
    latency = time.perf_counter() - tic
    metas = [s.get_meta_info("answer") for s in states]
    return Outcome([s["answer"] for s in states], [m["completion_tokens"] for m in metas],
                   [m["prompt_tokens"] for m in metas], [m.get("cached_tokens", 0) for m in metas], latency)


def first_stop(text: str) -> int:
    hits = [text.find(s) for s in STOPS if s in text]
    return min(hits) if hits else -1


def finish(tok: Any, ids: list[int]) -> tuple[str, int]:  # noqa: ANN401
    """(answer text, tokens generated) of one transformers row, ended as the engine ends a request: at its
    first stop token, or at the token that completes a stop string (the text cut before it)."""
    stop_ids = set(tok.stop_ids)
    window = max(len(s.encode()) for s in STOPS) + 1
    for n in range(1, len(ids) + 1):
        if ids[n - 1] in stop_ids:
            return tok.decode(ids[: n - 1]), n
        if first_stop(tok.decode(ids[max(0, n - window) : n])) >= 0:
            text = tok.decode(ids[:n])
            return text[: first_stop(text)], n
    return tok.decode(ids), len(ids)


def run_transformers(w: Workload, ckpt: Path, tok: Any, a: argparse.Namespace) -> Outcome:  # noqa: ANN401
    import torch

    from bench.transformers_cpu import hide_fla

    hide_fla(torch.cuda.is_available())
    import transformers

    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    model = transformers.KimiLinearForCausalLM.from_pretrained(ckpt, use_kernels=False, dtype=dtype).eval()
    window = max(len(s.encode()) for s in STOPS) + 1

    class StopStrings(transformers.StoppingCriteria):
        """Rows whose newest tokens complete a stop string are done (the engine's rule)."""

        def __init__(self, prompt_len: int) -> None:
            self.prompt_len = prompt_len

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
            tails = input_ids[:, self.prompt_len :][:, -window:].tolist()
            return torch.tensor([first_stop(tok.decode(t)) >= 0 for t in tails], device=input_ids.device)

    prompts = [tok.encode(w.prefix + q, add_bos=True) for q in w.questions]
    answers: list[str] = []
    completion: list[int] = []
    tic = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), a.parallel):
            chunk = prompts[i : i + a.parallel]
            width = max(map(len, chunk))
            ids = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=a.max_new_tokens, do_sample=False,
                                 eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id,
                                 stopping_criteria=transformers.StoppingCriteriaList([StopStrings(width)]))
            for row in gen[:, width:].tolist():
                text, n = finish(tok, row)
                answers.append(text)
                completion.append(n)
            if not a.no_progress:
                print(f"  transformers: {min(i + a.parallel, len(prompts))}/{len(prompts)}", flush=True)
    latency = time.perf_counter() - tic
    return Outcome(answers, completion, [len(p) for p in prompts], [0] * len(prompts), latency)


# --- main ----------------------------------------------------------------------------------------------
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("srt", "engine", "transformers"), default="srt")
    ap.add_argument("--num-shots", type=int, default=5)
    ap.add_argument("--data-path", type=Path, default=DATA / "test.jsonl", help="gsm8k test questions (jsonl)")
    ap.add_argument("--train-path", type=Path, default=None, help="few-shot examples (default: train.jsonl "
                    "beside --data-path)")
    ap.add_argument("--num-questions", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=64, help="programs in flight (transformers: batch size)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--host", default="http://127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--result-file", type=Path, default=Path("result.jsonl"))
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir for engine / transformers")
    ap.add_argument("--preset", default="k3-tiny", help="without --model: a random checkpoint of this preset")
    ap.add_argument("--disable-radix-cache", action="store_true", help="engine: no prefix cache (the baseline)")
    ap.add_argument("--mem-mib", type=int, default=512, help="engine: pool per rank, MiB")
    ap.add_argument("--max-running-requests", type=int, default=64, help="engine")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    ap.add_argument("--compare", action="store_true", help="one run: the engine with radix on, with radix off, "
                    "and transformers on the same checkpoint, with their throughput ratios")
    a = ap.parse_args(argv)
    if a.train_path is None:
        a.train_path = a.data_path.parent / "train.jsonl"
    if a.num_questions < 1 or a.parallel < 1 or a.max_new_tokens < 1:
        ap.error("--num-questions, --parallel and --max-new-tokens must be >= 1")
    return a


def run(a: argparse.Namespace, w: Workload, tmp: Path) -> tuple[Outcome, str, Any]:
    """The outcome, a description of what served it, and the model's tokenizer (None for a server)."""
    if a.backend == "srt":
        from frontend_lang import RuntimeEndpoint

        url = f"{a.host}:{a.port}"
        endpoint = RuntimeEndpoint(url)
        try:
            return run_frontend(w, endpoint, a), f"server at {url}", None
        finally:
            endpoint.shutdown()
    ckpt = a.model
    if ckpt is None:
        from radixk3.checkpoint import write_random_checkpoint
        from radixk3.config import preset

        ckpt = write_random_checkpoint(preset(a.preset), tmp / a.preset, seed=0)
    what = f"{'random ' + a.preset + ' (seed 0)' if a.model is None else ckpt.name}"
    from radixk3.tokenizer import checkpoint_tokenizer

    tok = checkpoint_tokenizer(ckpt)
    if a.backend == "transformers":
        return run_transformers(w, ckpt, tok, a), f"transformers KimiLinearForCausalLM.generate on {what}", tok
    from frontend_lang import Runtime

    kw: dict[str, Any] = {"mem_bytes": a.mem_mib << 20, "max_running_requests": a.max_running_requests,
                          "disable_radix_cache": a.disable_radix_cache}
    if a.dtype != "auto":
        kw["dtype"] = a.dtype
    with Runtime(ckpt, **kw) as rt:
        radix = "off" if a.disable_radix_cache else "on"
        return run_frontend(w, rt, a), f"radixk3 Engine in process on {what}, radix cache {radix}", rt.tokenizer


COMPARED = (("radix_on", "engine", False), ("radix_off", "engine", True), ("transformers", "transformers", False))


def compare(a: argparse.Namespace, w: Workload) -> int:
    """`--compare`: the three baselines of SGLang's gsm8k comparison measured in this run, on one checkpoint."""
    from bench.machine_info import cpu_name

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="radixk3-gsm8k-") as tmp:
        ckpt = a.model
        if ckpt is None:
            from radixk3.checkpoint import write_random_checkpoint
            from radixk3.config import preset

            ckpt = write_random_checkpoint(preset(a.preset), Path(tmp) / a.preset, seed=0)
        for name, backend, off in COMPARED:
            sub = argparse.Namespace(**(vars(a) | {"backend": backend, "disable_radix_cache": off, "model": ckpt}))
            outcome, served, _ = run(sub, w, Path(tmp))
            rows[name] = summarise(w, outcome) | {"served_by": served}
            r = rows[name]
            print(f"{name:<13} {r['output_throughput']:9.1f} tok/s  latency {r['latency']:7.1f} s  "
                  f"cache hit rate {r['cache_hit_rate']:.3f}", flush=True)
    what = f"random {a.preset} (seed 0)" if a.model is None else a.model.name
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; {what}; {a.num_questions} questions, {a.num_shots} shots, "
          f"parallel {a.parallel}, max new tokens {a.max_new_tokens}")
    base = rows["transformers"]["output_throughput"]
    ratios = {f"ratio_{k}_vs_transformers": rows[k]["output_throughput"] / base for k in ("radix_on", "radix_off")}
    ratios["ratio_radix_on_vs_off"] = rows["radix_on"]["output_throughput"] / rows["radix_off"]["output_throughput"]
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(RANDOM_WEIGHTS_NOTE)
    if a.json:
        print(json.dumps({k: rows["radix_on"][k] for k in ("accuracy", "invalid", "latency", "output_throughput",
                                                           "cache_hit_rate")} | ratios | {"runs": rows}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    w = workload(a.data_path, a.train_path, a.num_shots, a.num_questions)
    if a.compare:
        return compare(a, w)
    with tempfile.TemporaryDirectory(prefix="radixk3-gsm8k-") as tmp:
        outcome, served, tokenizer = run(a, w, Path(tmp))
    res = summarise(w, outcome)
    res["ideal_cache_hit_rate"] = None
    if tokenizer is not None:  # what a perfect prefix cache would serve of these prompts
        prompts = [tokenizer.encode(w.prefix + q, add_bos=True) for q in w.questions]
        res["ideal_cache_hit_rate"] = ideal_cached(prompts) / sum(map(len, prompts))
    print(f"backend: {served}; {a.num_questions} questions, {a.num_shots} shots, parallel {a.parallel}, "
          f"max new tokens {a.max_new_tokens}")
    print(f"Accuracy: {res['accuracy']:.3f}")
    print(f"Invalid: {res['invalid']:.3f}")
    print(f"Latency: {res['latency']:.3f} s")
    print(f"Output throughput: {res['output_throughput']:.3f} token/s")
    ideal = res["ideal_cache_hit_rate"]
    print(f"Cache hit rate: {res['cache_hit_rate']:.3f} ({res['cached_tokens']} of {res['prompt_tokens']} prompt "
          "tokens served from the prefix cache" + ("" if ideal is None else f"; an ideal cache: {ideal:.3f}") + ")")
    if a.model is None or res["accuracy"] < 0.05:
        print(RANDOM_WEIGHTS_NOTE)
    record = {"task": "gsm8k", "backend": a.backend, "served_by": served, "num_gpus": 0,
              "latency": round(res["latency"], 3), "accuracy": round(res["accuracy"], 3),
              "num_requests": a.num_questions, "other": {"num_questions": a.num_questions, "parallel": a.parallel},
              **{k: res[k] for k in ("invalid", "output_throughput", "cache_hit_rate")}}
    with open(a.result_file, "a") as f:
        f.write(json.dumps(record) + "\n")
    if a.json:
        print(json.dumps(res | {"backend": a.backend, "served_by": served, "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
