"""Speculation on a trained model pair (the session's `spec_pair`, tests/conftest.py: `bench/train_spec_pair.py`'s
trainer at a small recipe, a K3-format target with an MTP layer, a draft model and a DSpark drafter, trained on
the shipped gsm8k train set) instead of the bench's cached artifact, so that it runs everywhere. For every
proposer at k = 1, 3 and 6, greedy outputs equal the plain no-cache greedy loop token for token over gsm8k
prompts sharing a few-shot prefix (one of them twice), with the state-parity hook checking every verify step; at
k = 3 also with the radix cache off, with page size 16 and chunked prefill, and (on short question openings)
with a pool small enough to force retraction. The pair is trained, so drafts are accepted: commits replay real
runs of accepted tokens."""

from __future__ import annotations

from typing import Any

import pytest

from bench.gsm8k import DATA, few_shot_prefix, one_example, read_jsonl
from bench.train_spec_pair import SpecPair
from radixk3.checkpoint import load_model
from radixk3.model import KimiForCausalLM
from radixk3.tokenizer import load_tokenizer
from runtime.local_engine import LocalEngine
from runtime.pool_layout import pool_budget, pool_layout
from runtime.server_args import ServerArgs
from tests.greedy import greedy_reference

MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PROPOSERS = ("ngram", "mtp", "draft", "dspark")


@pytest.fixture(scope="module")
def target(spec_pair: SpecPair) -> KimiForCausalLM:
    return load_model(spec_pair.target)


@pytest.fixture(scope="module")
def workload(target: KimiForCausalLM) -> tuple[list[list[int]], list[list[int]]]:
    tok = load_tokenizer()
    prefix = few_shot_prefix(read_jsonl(DATA / "train.jsonl"), 1)
    prompts = [tok.encode(prefix + one_example(e, False)) for e in read_jsonl(DATA / "test.jsonl")[:5]]
    prompts.append(list(prompts[0]))  # the same question again: radix hit, and the n-gram corpus holds it
    return prompts, [greedy_reference(target, p, MAX_NEW) for p in prompts]


def _args(pair: SpecPair, alg: str, k: int, **kw: Any) -> ServerArgs:  # noqa: ANN401
    drafter = {"draft": pair.draft, "dspark": pair.dspark}.get(alg)
    return ServerArgs(model=str(pair.target), speculative_algorithm=alg, speculative_num_draft_tokens=k,
                      speculative_draft_model=None if drafter is None else str(drafter), debug_spec_state=True,
                      **kw)


def _check(eng: LocalEngine, workload: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, refs = workload
    assert eng.generate(prompts, GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.verify_steps > 0 and m.accepted_tokens > 0, "no draft of the trained pair was accepted"
    eng.scheduler.check_integrity()


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("alg", PROPOSERS)
def test_greedy_equals_plain(spec_pair: SpecPair, target: KimiForCausalLM, workload, alg: str,  # noqa: ANN001
                             k: int) -> None:
    _check(LocalEngine(_args(spec_pair, alg, k), target, check=True), workload)


@pytest.mark.parametrize("config", ["no_radix", "page16_chunked"])
@pytest.mark.parametrize("alg", PROPOSERS)
def test_greedy_equals_plain_across_cache_settings(spec_pair: SpecPair, target: KimiForCausalLM,
                                                   workload, alg: str, config: str) -> None:  # noqa: ANN001
    kw = {"no_radix": dict(disable_radix_cache=True), "page16_chunked": dict(page_size=16, chunked_prefill_size=48)}
    _check(LocalEngine(_args(spec_pair, alg, 3, **kw[config]), target, check=True), workload)


@pytest.mark.parametrize("alg", PROPOSERS)
def test_retraction_under_a_small_pool(spec_pair: SpecPair, target: KimiForCausalLM, alg: str) -> None:
    """Eight short question openings that all fit at admission, then outgrow the pool while decoding:
    retraction frees the target's and the proposer's parts together, and re-admission recomputes them."""
    tok = load_tokenizer()
    prompts = [tok.encode("Question: " + e["question"])[:10] for e in read_jsonl(DATA / "test.jsonl")[5:13]]
    refs = [greedy_reference(target, p, MAX_NEW) for p in prompts]
    base = _args(spec_pair, alg, 3, max_running_requests=8)
    lay = pool_layout(target.config, base)
    scratch = base.mem_bytes - pool_budget(lay, base)  # the draft window (and drafting state), outside the pool
    eng = LocalEngine(_args(spec_pair, alg, 3, max_running_requests=8, chunked_prefill_size=40,
                            schedule_conservativeness=0.0,
                            mem_bytes=scratch + 9 * lay.state_block_bytes + 120 * lay.kv_token_bytes),
                      target, check=True)
    _check(eng, (prompts, refs))
    assert eng.scheduler.metrics.retractions > 0

