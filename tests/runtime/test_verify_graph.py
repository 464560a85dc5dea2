"""The compiled verify step (`radixk3.verify_graph`) end to end: n-gram speculation (k = 3) with the decode and
verify steps compiled gives the eager engine's greedy tokens, which are the no-cache greedy loop's, on the
speculative exactness prompts; the state-parity hook checks every commit bit for bit. The target is the small
K3-format model trained in `test_spec_engine` (its drafts are mostly accepted, so every window position's logits
decide tokens), one request at a time: one bucket (batch 1), so two compiles, the costly part; windows shorter
than k + 1 (fewer drafts found) run padded."""

from __future__ import annotations

import pytest
import torch

from bench.gsm8k import DATA, one_example, read_jsonl
from radixk3.builtin_model import BUILTIN_MODEL_DIR
from radixk3.checkpoint import load_model
from radixk3.tokenizer import load_tokenizer
from runtime.local_engine import LocalEngine
from runtime.server_args import COMPILE_ENV, ServerArgs
from tests.greedy import greedy_reference
from tests.runtime.test_spec_engine import GREEDY, MAX_NEW, _prompts, _trained


def test_compiled_speculation_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _trained()
    prompts = _prompts(model.config.vocab_size)[3:14]
    refs = [greedy_reference(model, p, MAX_NEW) for p in prompts]
    outs, metrics = {}, {}
    for compiled in ("0", "1"):
        monkeypatch.setenv(COMPILE_ENV, compiled)
        eng = LocalEngine(ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=3,
                                     max_running_requests=1, compile_max_bs=1, debug_spec_state=True), model,
                          check=True)
        assert (eng.worker.verify_graphs is not None) == (compiled == "1")
        outs[compiled] = eng.generate(prompts, GREEDY)
        metrics[compiled] = eng.scheduler.metrics
        eng.scheduler.check_integrity()
        if compiled == "1":
            assert eng.worker.verify_graphs is not None and eng.worker.graphs is not None
            assert eng.worker.verify_graphs.replays == metrics["1"].verify_steps > 0
    assert outs["1"] == outs["0"] == refs
    assert metrics["1"].accepted_tokens > metrics["1"].draft_tokens / 3, "the trained target accepts most drafts"



def test_compiled_mtp_speculation_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """MTP speculation (k = 3) with every step compiled (decode and verify with the target's hiddens, the MTP
    draft and catch-up steps, `radixk3/mtp_graph.py`) gives the eager engine's greedy tokens, which are the no-cache
    loop's, and drafts what the eager proposer drafts: the same tokens are accepted. The target is the built-in
    k3-gsm8k (fp32), whose trained MTP layer's drafts are often accepted, on gsm8k questions."""
    model = load_model(BUILTIN_MODEL_DIR, dtype=torch.float32)
    tok = load_tokenizer()
    prompts = [tok.encode(one_example(e, False)) for e in read_jsonl(DATA / "test.jsonl")[:4]]
    refs = [greedy_reference(model, p, MAX_NEW) for p in prompts]
    outs, metrics = {}, {}
    for compiled in ("0", "1"):
        monkeypatch.setenv(COMPILE_ENV, compiled)
        eng = LocalEngine(ServerArgs(speculative_algorithm="mtp", speculative_num_draft_tokens=3,
                                     max_running_requests=1, compile_max_bs=1, debug_spec_state=True), model,
                          check=True)
        outs[compiled] = eng.generate(prompts, GREEDY)
        metrics[compiled] = eng.scheduler.metrics
        eng.scheduler.check_integrity()
        graphs = eng.worker.proposer.graphs  # type: ignore[union-attr]
        assert (graphs is not None) == (eng.worker.verify_graphs is not None) == (compiled == "1")
        if graphs is not None:
            assert eng.worker.verify_graphs is not None
            assert eng.worker.verify_graphs.replays == metrics["1"].verify_steps > 0
            assert graphs.replays > metrics["1"].verify_steps  # drafts and catch-ups
    assert outs["1"] == outs["0"] == refs
    assert metrics["1"].accepted_tokens == metrics["0"].accepted_tokens > metrics["0"].verify_steps / 2
