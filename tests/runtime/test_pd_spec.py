"""Speculative decoding on the decode side of P/D disaggregation (in one process, the fake backend): n-gram, MTP,
a draft model and DSpark on decode give the aggregated engine's greedy outputs token for token, with verify windows
really run on decode and never on prefill; the draft model's state and the MTP latents on decode are prefill's
byte for byte; a draft model equal to the target accepts nearly every draft (so its
state over the prompt came with the state block: a draft state left unmoved would reject them); a prefill server
without decode's pool-held proposer is refused by name; top logprobs are refused at the door."""

from __future__ import annotations

import dataclasses
import random

import pytest

from radixk3.checkpoint import write_checkpoint
from radixk3.config import preset
from radixk3.dspark_checkpoint import write_random_dspark
from radixk3.model import build_model
from runtime.errors import InvalidRequest
from runtime.local_engine import LocalEngine
from runtime.messages import Bootstrap
from runtime.server_args import ServerArgs
from tests.runtime.http_server_proc import free_port
from tests.runtime.test_pd_local import _baseline, _close, _finish, _run_both, _state_digest

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
BASE = ServerArgs(disable_compile=True, page_size=4, max_running_requests=8, chunked_prefill_size=16,
                  disaggregation_transfer_backend="fake")


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    """K3-native: one MTP layer (the MTP proposer), and a DSpark drafter's target."""
    return build_model(preset("k3-tiny-native"), seed=11)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:  # noqa: ANN001
    g = random.Random(5)
    v = model.config.vocab_size
    shared = [g.randrange(v) for _ in range(12)]
    # 21 and 13 tokens: with MAX_NEW - 1 outputs computed, a turn ends page-aligned, where decode's tree keeps a state
    return [[g.randrange(v) for _ in range(n)] for n in (3, 21)] + [shared + [g.randrange(v)]]


@pytest.fixture(scope="module")
def want(model, prompts) -> list[list[int]]:  # noqa: ANN001
    """The aggregated engine's greedy outputs (no speculation)."""
    return LocalEngine(dataclasses.replace(BASE, disaggregation_transfer_backend="nixl"), model).generate(
        prompts, GREEDY)


@pytest.fixture(scope="module")
def turn2(prompts, want) -> list[list[int]]:  # noqa: ANN001
    """Each conversation's second turn: its prompt, its answer and three more tokens."""
    return [p + w + [7, 8, 9] for p, w in zip(prompts, want, strict=True)]


@pytest.fixture(scope="module")
def want2(model, turn2) -> list[list[int]]:  # noqa: ANN001
    return LocalEngine(BASE, model).generate(turn2, GREEDY)


@pytest.fixture(scope="module")
def spec_flags(model, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("pd_spec")
    return {"ngram": dict(speculative_algorithm="ngram"),
            "mtp": dict(speculative_algorithm="mtp"),
            "draft": dict(speculative_algorithm="draft",
                          speculative_draft_model=str(write_checkpoint(model, root / "self"))),
            "dspark": dict(speculative_algorithm="dspark",
                           speculative_draft_model=str(write_random_dspark(root / "dspark", model, seed=2)))}


def _pair(model, pre_kw: dict, dec_kw: dict) -> tuple[LocalEngine, LocalEngine, int]:  # noqa: ANN001
    port = free_port()
    pre = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                                          **pre_kw), model, check=True)
    dec = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="decode", debug_spec_state=True, **dec_kw),
                      model, check=True)
    return pre, dec, port


@pytest.mark.parametrize("alg", ["ngram", "mtp", "draft", "dspark"])
def test_speculation_on_decode_equals_aggregated(model, prompts, want, turn2, want2, spec_flags,  # noqa: ANN001
                                                 alg: str) -> None:
    """n-gram needs nothing on prefill (decode's lookup reads the request's tokens, which it has): the second wave
    asks the first again, its drafts from decode's corpus. The pool-held proposers run on prefill too, which
    computes their state over the prompt and never speculates; with the decode-side radix cache, the second wave
    is each conversation's next turn, decode's proposer state over the hit from its own tree."""
    flags = spec_flags[alg]
    if alg == "ngram":
        pre, dec, port = _pair(model, {}, flags)
        waves = [(prompts, want), (prompts, want)]
    else:
        pre, dec, port = _pair(model, flags, dict(flags, disaggregation_decode_enable_radix_cache=True))
        waves = [(prompts, want), (turn2, want2)]
    try:
        for n, (wave, expected) in enumerate(waves):
            rids = []
            for i, p in enumerate(wave):
                boot = Bootstrap("127.0.0.1", port, 100 * n + i)
                pre.submit(p, GREEDY, bootstrap=boot)
                rids.append(dec.submit(p, GREEDY, bootstrap=boot))
            outs = _run_both(pre, dec)
            assert [outs[r] for r in rids] == expected, f"wave {n}"
        m = dec.scheduler.metrics_now()
        assert (m.cached_tokens > 0) == (alg != "ngram"), m.cached_tokens
        assert m.verify_steps > 0 and m.draft_tokens > 0, f"decode never speculated: {m}"
        assert pre.scheduler.metrics_now().verify_steps == 0, "prefill speculated"
        if alg in ("ngram", "draft"):  # repeated outputs / the target as its own draft: drafts are right (the
            # random MTP layer's and drafter's are not)
            assert m.accepted_tokens >= 0.5 * m.draft_tokens, (m.accepted_tokens, m.draft_tokens)
        for e in (pre, dec):
            _baseline(e)
    finally:
        _close(pre, dec)


@pytest.mark.parametrize("alg", ["mtp", "draft"])
def test_proposer_state_bytes_equal_after_transfer(model, spec_flags, alg: str) -> None:  # noqa: ANN001
    """One token on decode (it ends on the first token): the state block decode's tree keeps, the draft model's KDA
    state included, and the pages, the MTP layer's latents included, are prefill's byte for byte."""
    pre, dec, port = _pair(model, spec_flags[alg], spec_flags[alg])
    try:
        one = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
        p = list(range(40, 80))  # page-aligned: both sides donate the state after the whole prompt
        boot = Bootstrap("127.0.0.1", port, 9)
        pre.submit(p, one, bootstrap=boot)
        dec.submit(p, one, bootstrap=boot)
        _run_both(pre, dec)
        assert _state_digest(dec, p) == _state_digest(pre, p)
    finally:
        _close(pre, dec)


def test_prefill_without_decodes_proposer_is_refused_by_name(model, spec_flags) -> None:  # noqa: ANN001
    pre, dec, port = _pair(model, {}, spec_flags["mtp"])
    try:
        rid = dec.submit([1, 2, 3], GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 1))
        last = _finish(dec)[rid][-1]
        assert last.finished == "error" and "speculative proposer" in last.error and "mtp" in last.error, last.error
        _baseline(dec)
    finally:
        _close(pre, dec)


def test_top_logprobs_are_refused_at_the_door(model) -> None:  # noqa: ANN001
    """Only the first token and its logprob move from prefill: asking for top logprobs fails by name on both sides,
    rather than answering with the first token's missing."""
    for mode in ("prefill", "decode"):
        engine = LocalEngine(dataclasses.replace(BASE, disaggregation_mode=mode,
                                                 disaggregation_bootstrap_port=free_port()), model)
        try:
            with pytest.raises(InvalidRequest, match="top logprobs"):
                engine.submit([1, 2], GREEDY, bootstrap=Bootstrap("127.0.0.1", 1, 1), return_logprob=True,
                              top_logprobs_num=2)
            engine.submit([1, 2], GREEDY, bootstrap=Bootstrap("127.0.0.1", 1, 2), return_logprob=True)  # logprobs go
        finally:
            _close(engine)
