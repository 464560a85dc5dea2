"""The compiled verify step (`radixk3.verify_graph`) and MTP's compiled steps (`radixk3.mtp_graph`) end to end:
speculation (k = 3) with every step compiled gives the eager engine's greedy tokens, which are the no-cache greedy
loop's; the state-parity hook checks every commit bit for bit. n-gram: on the speculative exactness prompts, with
the small K3-format model trained in `test_spec_engine` (its drafts are mostly accepted, so every window
position's logits decide tokens); windows shorter than k + 1 (fewer drafts found) run padded. MTP: on gsm8k
questions with the built-in k3-gsm8k. One request at a time: one bucket (batch 1), so few compiles, the costly
part."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from bench.gsm8k import DATA, one_example, read_jsonl
from kernels import pool_ops_cpu
from radixk3.builtin_model import BUILTIN_MODEL_DIR
from radixk3.checkpoint import load_model
from radixk3.model import KimiForCausalLM
from radixk3.tokenizer import load_tokenizer
from runtime.local_engine import LocalEngine
from runtime.scheduler.scheduler import SchedulerMetrics
from runtime.server_args import COMPILE_ENV, ServerArgs
from runtime.worker.model_worker import ModelWorker
from tests.greedy import greedy_reference
from tests.runtime.test_spec_engine import GREEDY, MAX_NEW, _prompts, _trained


class Run(NamedTuple):
    outputs: list[list[int]]
    metrics: SchedulerMetrics
    worker: ModelWorker


def _eager_then_compiled(monkeypatch: pytest.MonkeyPatch, model: KimiForCausalLM, prompts: list[list[int]],
                         algorithm: str, rows: int) -> dict[str, Run]:
    """The prompts through an eager engine ("0") and a compiled one ("1"), k = 3, up to `rows` requests at once
    (buckets 1, 2, 4, ... up to `rows`)."""
    # A fresh dynamo cache: after another engine's graphs of these step functions in this process, dynamo takes the
    # cache key as an input, and such shared graphs are not called directly (asserted below).
    torch._dynamo.reset()
    runs = {}
    for compiled in ("0", "1"):
        monkeypatch.setenv(COMPILE_ENV, compiled)
        eng = LocalEngine(ServerArgs(speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
                                     max_running_requests=rows, compile_max_bs=rows, debug_spec_state=True), model,
                          check=True)
        outputs = eng.generate(prompts, GREEDY)
        eng.scheduler.check_integrity()
        assert (eng.worker.verify_graphs is not None) == (eng.worker.graphs is not None) == (compiled == "1")
        runs[compiled] = Run(outputs, eng.scheduler.metrics, eng.worker)
    verify = runs["1"].worker.verify_graphs
    assert verify is not None and verify.replays == runs["1"].metrics.verify_steps > 0
    assert verify.cpp_window == pool_ops_cpu.available()  # the window ops registered in C++ where they build
    # after its first step of a shape a graph is called without dynamo (`radixk3/step_graph.py`)
    assert sum(g.direct_calls for g in verify.step_graphs) > 0
    return runs


def test_compiled_speculation_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _trained()
    prompts = _prompts(model.config.vocab_size)[3:14]
    runs = _eager_then_compiled(monkeypatch, model, prompts, "ngram", 1)
    assert runs["1"].outputs == runs["0"].outputs == [greedy_reference(model, p, MAX_NEW) for p in prompts]
    m = runs["1"].metrics
    assert m.accepted_tokens > m.draft_tokens / 3, "the trained target accepts most drafts"


def test_compiled_mtp_speculation_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """MTP speculation (k = 3) with every step compiled (decode and verify with the target's hiddens, the MTP
    draft and catch-up steps, `radixk3/mtp_graph.py`) gives the eager engine's greedy tokens, which are the no-cache
    loop's, and drafts what the eager proposer drafts: the same tokens are accepted. The target is the built-in
    k3-gsm8k (fp32), whose trained MTP layer's drafts are often accepted, on gsm8k questions, one at a time (padding
    and several windows per step: `tests/radixk3/test_mtp_graph.py`)."""
    model = load_model(BUILTIN_MODEL_DIR, dtype=torch.float32)
    tok = load_tokenizer()
    prompts = [tok.encode(one_example(e, False)) for e in read_jsonl(DATA / "test.jsonl")[:4]]
    runs = _eager_then_compiled(monkeypatch, model, prompts, "mtp", 1)
    assert runs["1"].outputs == runs["0"].outputs == [greedy_reference(model, p, MAX_NEW) for p in prompts]
    graphs = runs["1"].worker.proposer.graphs  # type: ignore[union-attr]
    assert graphs is not None and runs["0"].worker.proposer.graphs is None  # type: ignore[union-attr]
    eager, compiled = runs["0"].metrics, runs["1"].metrics
    assert graphs.replays > compiled.verify_steps  # draft chains and catch-ups
    assert graphs.chains == compiled.verify_steps  # every window greedy: all its drafts in one chain call
    assert all(g.direct_calls > 0 for g in graphs.step_graphs)  # draft, catch-up, chain: each called directly
    assert compiled.accepted_tokens == eager.accepted_tokens > eager.verify_steps / 2
