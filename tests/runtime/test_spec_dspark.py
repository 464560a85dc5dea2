"""The DSpark proposer (`--speculative-algorithm dspark`, runtime/spec/dspark.py) end to end on the random
`k3-tiny` target and a random `k3-tiny-dspark` drafter (its context latents nested in the target's pool): greedy
outputs equal the plain no-cache greedy loop (k = 1, 3, 6; radix on and off; page sizes 1 and 16; a pool small
enough to force retraction) with the state-parity hook on; every window's drafts equal the no-cache drafter's on
the committed tokens; seeded sampled runs repeat; a non-DSpark checkpoint is refused; and the trained pair's
drafter has a real share of its drafts accepted on gsm8k."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from radixk3.checkpoint import write_checkpoint
from radixk3.config import ConfigError, preset
from radixk3.dspark import target_aux_states
from radixk3.dspark_checkpoint import write_random_dspark
from radixk3.model import KimiForCausalLM, build_model
from runtime.local_engine import LocalEngine
from runtime.pool_layout import pool_layout
from runtime.server_args import ServerArgs
from runtime.spec.dspark import DSparkProposer, block_length
from tests.greedy import greedy_reference

MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    return build_model(preset("k3-tiny"), seed=11)


@pytest.fixture(scope="module")
def drafter_path(model: KimiForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_dspark(tmp_path_factory.mktemp("dspark") / "d", model, seed=2)


@pytest.fixture(scope="module")
def workload(model: KimiForCausalLM) -> tuple[list[list[int]], list[list[int]]]:
    g = random.Random(3)
    vocab = model.config.vocab_size

    def rand(n: int) -> list[int]:
        return [g.randrange(vocab) for _ in range(n)]

    shots = rand(30)
    prompts = [shots + rand(g.randrange(2, 9)) for _ in range(2)]  # shared prefix: radix hits
    prompts += [rand(g.randrange(5, 25)) for _ in range(2)]
    prompts.append(list(prompts[0]))
    return prompts, [greedy_reference(model, p, MAX_NEW) for p in prompts]


def _engine(model: KimiForCausalLM, path: Path, **kw: object) -> LocalEngine:
    args = ServerArgs(speculative_algorithm="dspark", speculative_draft_model=str(path), debug_spec_state=True,
                      **kw)  # type: ignore[arg-type]
    return LocalEngine(args, model, check=True)


CONFIGS: dict[str, dict[str, object]] = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16, chunked_prefill_size=32),
}


@pytest.mark.parametrize(("name", "k"), [("radix", 1), ("radix", 3), ("radix", 6), ("no_radix", 6),
                                       ("page16", 1), ("page16", 6)])
def test_greedy_with_dspark_equals_plain(model: KimiForCausalLM, drafter_path: Path, workload, name: str,  # noqa: ANN001
                                         k: int) -> None:
    prompts, refs = workload
    eng = _engine(model, drafter_path, speculative_num_draft_tokens=k, **CONFIGS[name])
    assert eng.generate(prompts, GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.verify_steps > 0 and m.draft_tokens > 0
    eng.scheduler.check_integrity()


def test_block_length() -> None:
    k = torch.tensor([0, 1, 2, 3, 4, 6])
    assert block_length(k, 4).tolist() == [1, 2, 3, 4, 4, 6]


def test_dspark_part_of_the_pool(model: KimiForCausalLM, drafter_path: Path) -> None:
    """The drafter's context latents: one MLA-only latent per draft layer after the target's in every token row."""
    lay = pool_layout(model.config, ServerArgs(speculative_algorithm="dspark",
                                               speculative_draft_model=str(drafter_path)))
    own = dataclasses.replace(lay, draft=None)
    assert lay.draft is not None and lay.draft.num_kda_layers == 0 and lay.draft.num_mla_layers == 2
    assert lay.draft.kv_dim == 32 + 8 and lay.state_block_bytes == own.state_block_bytes
    assert lay.kv_token_bytes == own.kv_token_bytes + 2 * 40 * 4


@pytest.mark.parametrize(("page_size", "k"), [(1, 3), (16, 6)])
def test_drafts_are_the_no_cache_drafter(model: KimiForCausalLM, drafter_path: Path, workload,  # noqa: ANN001
                                         page_size: int, k: int) -> None:
    """Every verify window's drafts equal the no-cache drafter's (context latents of the committed tokens from
    the no-cache target, then the block and the Markov head): the cached context latents (extend, decode and
    the committed verify positions) are right, not only harmless to the outputs."""
    prompts, refs = workload
    eng = _engine(model, drafter_path, speculative_num_draft_tokens=k, page_size=page_size)
    proposer = eng.worker.proposer
    assert isinstance(proposer, DSparkProposer)
    drafter = proposer.drafter
    seen: list[tuple[int, list[int]]] = []
    real = proposer.propose

    def record(batch, rows, params):  # noqa: ANN001, ANN202
        probs = real(batch, rows, params)
        seen.append((int(batch.prefix_lens[0]), batch.input_ids[1:].tolist()))
        return probs

    proposer.propose = record  # type: ignore[method-assign]
    assert eng.generate([prompts[2]], GREEDY) == [refs[2]]
    full = prompts[2] + refs[2]
    assert len(seen) >= 3
    for prefix, drafts in seen:
        ids = torch.tensor(full[:prefix])
        with torch.no_grad():
            ctx = drafter.context_latents(target_aux_states(model, drafter.config, ids, torch.tensor([0, prefix])),
                                          torch.arange(prefix))
            ref = drafter.draft(ctx, torch.tensor([0, prefix]), torch.tensor([full[prefix]]),
                                block=int(block_length(torch.tensor(len(drafts)), drafter.config.block_size)))
        assert drafts == ref.tokens[0, : len(drafts)].tolist(), prefix


def test_retraction_under_a_small_pool(model: KimiForCausalLM, drafter_path: Path) -> None:
    """Prompts that fit at admission, then outgrow the pool while decoding: retraction frees (and re-admission
    recomputes) the target's latents and the drafter's context latents together."""
    g = random.Random(1)
    prompts = [[g.randrange(model.config.vocab_size) for _ in range(8)] for _ in range(8)]
    sampling = dict(GREEDY, max_new_tokens=20)
    refs = LocalEngine(ServerArgs(), model).generate(prompts, sampling)  # plain engine (its own tests: == no-cache)
    k = 3
    lay = pool_layout(model.config, ServerArgs(speculative_algorithm="dspark", speculative_num_draft_tokens=k,
                                               speculative_draft_model=str(drafter_path), max_running_requests=8))
    pool = 9 * lay.state_block_bytes + 120 * lay.kv_token_bytes
    eng = _engine(model, drafter_path, speculative_num_draft_tokens=k, max_running_requests=8,
                  mem_bytes=pool + lay.spec_window_bytes("replay", 8, k + 1), chunked_prefill_size=40,
                  schedule_conservativeness=0.0)
    assert eng.generate(prompts, sampling) == refs
    assert eng.scheduler.metrics.retractions > 0
    eng.scheduler.check_integrity()


def test_seeded_sampling_with_dspark_is_reproducible(model: KimiForCausalLM, drafter_path: Path, workload) -> None:  # noqa: ANN001
    prompts, _ = workload
    sampling = {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 5, "ignore_eos": True}
    out = _engine(model, drafter_path, speculative_num_draft_tokens=3).generate(prompts, sampling)
    assert out == _engine(model, drafter_path, speculative_num_draft_tokens=3).generate(prompts, sampling)
    assert all(len(x) == 10 for x in out)


def test_refuses_a_checkpoint_that_is_not_a_drafter(model: KimiForCausalLM, tmp_path: Path) -> None:
    ckpt = write_checkpoint(model, tmp_path / "m")
    with pytest.raises(ConfigError, match="k3_dspark"):
        LocalEngine(ServerArgs(speculative_algorithm="dspark", speculative_draft_model=str(ckpt)), model)
    other = build_model(dataclasses.replace(preset("k3-tiny"), hidden_size=32), seed=1)
    with pytest.raises(ConfigError, match="hidden_size"):
        LocalEngine(ServerArgs(speculative_algorithm="dspark",
                               speculative_draft_model=str(write_random_dspark(tmp_path / "d", model))), other)


def test_trained_dspark_accepts_drafts_on_gsm8k(spec_pair) -> None:  # noqa: ANN001
    """The trained spec pair's drafter (the session's `spec_pair`, tests/conftest.py) on its target: outputs
    identical to plain greedy, and a real share of its drafts accepted on gsm8k questions."""
    import json

    from bench.train_spec_pair import DATA
    from radixk3.checkpoint import load_model
    from radixk3.tokenizer import load_tokenizer

    target = load_model(spec_pair.target)
    tok = load_tokenizer()
    rows = [json.loads(line) for line in (DATA / "test.jsonl").read_text().splitlines()[:2]]
    prompts = [tok.encode(f"Question: {r['question']}\nAnswer:") for r in rows]
    eng = _engine(target, spec_pair.dspark, speculative_num_draft_tokens=1)
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    assert eng.generate(prompts, sampling) == [greedy_reference(target, p, 24) for p in prompts]
    m = eng.scheduler.metrics
    rate = m.accepted_tokens / m.draft_tokens
    print(f"trained DSpark acceptance at k=1: {m.accepted_tokens}/{m.draft_tokens} = {rate:.2f}")
    # The small pair: ~1.0 on its repetitive greedy replies (the bench's recipe: ~0.5); a random drafter: 0.
    assert rate > 0.25
