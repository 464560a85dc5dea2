"""Model proposers (runtime/spec/proposers.py) end to end: with a draft model whose states and latents live in
the target's pool, greedy outputs equal the plain no-cache greedy loop (k = 1, 3; radix on and off; page sizes 1
and 16; a pool small enough to force retraction); the draft = the target accepts nearly every draft (so the
accept / commit path really runs), with the state-parity hook checking target and draft after every verify."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from radixk3.checkpoint import write_checkpoint
from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.pool_layout import PoolLayout, pool_layout
from runtime.server_args import ServerArgs
from runtime.worker.pool_buffer import PoolBuffer
from tests.greedy import greedy_reference

MAX_NEW = 16
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=11)


@pytest.fixture(scope="module")
def checkpoints(model, tmp_path_factory) -> dict[str, Path]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("drafts")
    return {"self": write_checkpoint(model, root / "self"),
            "other": write_checkpoint(build_model(preset("k3-tiny"), seed=5), root / "other")}


def _prompts(vocab: int) -> list[list[int]]:
    g = random.Random(3)

    def rand(n: int) -> list[int]:
        return [g.randrange(vocab) for _ in range(n)]

    shots = rand(30)
    out = [shots + rand(g.randrange(2, 9)) for _ in range(3)]  # shared prefix: radix hits copy both parts
    out += [rand(g.randrange(5, 25)) for _ in range(3)]
    out.append(list(out[0]))
    return out


@pytest.fixture(scope="module")
def workload(model):  # noqa: ANN001, ANN201
    prompts = _prompts(model.config.vocab_size)
    return prompts, [greedy_reference(model, p, MAX_NEW) for p in prompts]


def _engine(model, draft: Path, **kw) -> LocalEngine:  # noqa: ANN001
    args = ServerArgs(speculative_algorithm="draft", speculative_draft_model=str(draft), debug_spec_state=True,
                      **kw)
    return LocalEngine(args, model, check=True)


CONFIGS = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16, chunked_prefill_size=32),
    "snapshot_page16": dict(spec_state="snapshot", page_size=16, disable_radix_cache=True),
}


@pytest.mark.parametrize(("name", "k"), [("radix", 1), ("radix", 3), ("radix", 6), ("no_radix", 3), ("page16", 1),
                                       ("page16", 6), ("snapshot_page16", 3)])
def test_greedy_equals_plain_with_another_draft_model(model, checkpoints, workload, name: str, k: int) -> None:  # noqa: ANN001
    prompts, refs = workload
    eng = _engine(model, checkpoints["other"], speculative_num_draft_tokens=k, **CONFIGS[name])
    assert eng.generate(prompts, GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.verify_steps > 0 and m.draft_tokens > 0
    eng.scheduler.check_integrity()


@pytest.mark.parametrize(("name", "k"), [("radix", 3), ("page16", 1), ("no_radix", 6), ("snapshot_page16", 3)])
def test_self_draft_accepts_nearly_everything(model, checkpoints, workload, name: str, k: int) -> None:  # noqa: ANN001
    prompts, refs = workload
    eng = _engine(model, checkpoints["self"], speculative_num_draft_tokens=k, **CONFIGS[name])
    assert eng.generate(prompts, GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.draft_tokens > 0 and m.accepted_tokens / m.draft_tokens > 0.9, (m.accepted_tokens, m.draft_tokens)
    eng.scheduler.check_integrity()


def test_retraction_under_a_small_pool(model, checkpoints) -> None:  # noqa: ANN001
    """Short prompts that all fit at admission, then outgrow the pool while decoding: retraction frees (and
    re-admission recomputes) the target's and the draft's parts together."""
    g = random.Random(1)
    prompts = [[g.randrange(model.config.vocab_size) for _ in range(8)] for _ in range(8)]
    sampling = dict(GREEDY, max_new_tokens=20)
    refs = [greedy_reference(model, p, 20) for p in prompts]
    k = 3
    base = ServerArgs(speculative_algorithm="draft", speculative_draft_model=str(checkpoints["other"]),
                      speculative_num_draft_tokens=k, max_running_requests=8)
    lay = pool_layout(model.config, base)
    pool = 9 * lay.state_block_bytes + 120 * lay.kv_token_bytes
    eng = _engine(model, checkpoints["other"], speculative_num_draft_tokens=k, max_running_requests=8,
                  mem_bytes=pool + lay.spec_window_bytes("replay", 8, k + 1) + 8 * lay.draft.state_payload_bytes,
                  chunked_prefill_size=40,
                  schedule_conservativeness=0.0)
    assert eng.generate(prompts, sampling) == refs
    assert eng.scheduler.metrics.retractions > 0
    eng.scheduler.check_integrity()


def test_draft_part_of_the_pool_is_disjoint(model, checkpoints) -> None:  # noqa: ANN001
    """The draft's views sit after the target's in every state block and token row, and never alias them."""
    args = ServerArgs(speculative_algorithm="draft", speculative_draft_model=str(checkpoints["other"]))
    lay = pool_layout(model.config, args)
    own = dataclasses.replace(lay, draft=None)
    assert lay.draft is not None and lay.draft == PoolLayout.from_config(model.config, page_size=1)
    assert lay.state_block_bytes == 2 * own.state_block_bytes and lay.kv_token_bytes == 2 * own.kv_token_bytes
    buf = PoolBuffer(lay, 64 * lay.state_block_bytes)
    # States and pages share the buffer's bytes (the unified pool): check each kind on its own.
    for mine, theirs in [((buf.recurrent_state(0), buf.conv_state(0)),
                          (buf.recurrent_state(0, draft=True), buf.conv_state(0, draft=True))),
                         ((buf.kv(0),), (buf.kv(0, draft=True),))]:
        buf.data.zero_()
        for v in theirs:
            v.fill_(1)
        assert all(bool((v == 0).all()) for v in mine)
        assert all(bool((v == 1).all()) for v in theirs)


def test_refuses_another_vocabulary(model, tmp_path) -> None:  # noqa: ANN001
    other = build_model(dataclasses.replace(preset("k3-tiny"), vocab_size=model.config.vocab_size + 8), seed=1)
    ckpt = write_checkpoint(other, tmp_path / "d")
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(model, ckpt)


def test_seeded_sampling_with_a_draft_model_is_reproducible(model, checkpoints, workload) -> None:  # noqa: ANN001
    """Sampled requests draw their drafts from the draft model's distribution q and verify them against it:
    seeded runs repeat exactly, and the draft = the target (q = p) accepts nearly every sampled draft."""
    prompts, _ = workload
    sampling = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5, "ignore_eos": True}
    a = _engine(model, checkpoints["self"], speculative_num_draft_tokens=3)
    b = _engine(model, checkpoints["self"], speculative_num_draft_tokens=3)
    out = a.generate(prompts, sampling)
    assert out == b.generate(prompts, sampling) and all(len(x) == 12 for x in out)
    m = a.scheduler.metrics
    assert m.draft_tokens > 0 and m.accepted_tokens / m.draft_tokens > 0.9, (m.accepted_tokens, m.draft_tokens)




def test_drafting_runs_k_plus_1_draft_tokens_per_window(model, checkpoints, workload) -> None:  # noqa: ANN001
    """The running draft state: a verify step's draft forwards run one token per window per round, k + 1
    tokens per window in all (not 1 + 2 + ... + (k + 1)); outputs stay exact, self-drafts stay accepted."""
    prompts, refs = workload
    k = 6
    eng = _engine(model, checkpoints["self"], speculative_num_draft_tokens=k)
    proposer = eng.worker.proposer
    draft = proposer.model
    counts: list[tuple[int, int]] = []  # (draft tokens run, window tokens) per verify step
    real_propose, real_forward = proposer.propose, draft.forward_batch
    run: list[int] = []

    def forward(batch, cache, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        run.append(int(batch.input_ids.numel()))
        return real_forward(batch, cache, *a, **kw)

    def record(batch, rows, params):  # noqa: ANN001, ANN202
        run.clear()
        draft.forward_batch = forward
        try:
            probs = real_propose(batch, rows, params)
        finally:
            del draft.forward_batch
        counts.append((sum(run), int(batch.input_ids.numel())))
        return probs

    proposer.propose = record
    assert eng.generate(prompts, GREEDY) == refs
    assert counts and all(ran == window for ran, window in counts), counts
    m = eng.scheduler.metrics
    assert m.accepted_tokens / m.draft_tokens > 0.9, (m.accepted_tokens, m.draft_tokens)
