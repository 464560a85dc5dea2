"""The MTP proposer (`--speculative-algorithm mtp`, runtime/spec/proposers.py) end to end on `k3-tiny-native`
random weights (one MTP layer, and two, their latents nested in the target's pool): greedy outputs equal the plain
no-cache greedy loop (k = 1, 3, 6: k > n chains the layers cyclically; radix on and off; page sizes 1 and 16), with
the state-parity hook on; drafts equal the no-cache MTP chain; seeded sampled runs repeat; a checkpoint without
MTP layers is refused."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.pool_layout import pool_layout
from runtime.server_args import ServerArgs
from runtime.worker.pool_buffer import PoolBuffer
from tests.greedy import greedy_reference

MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    m = build_model(preset("k3-tiny-native"), seed=11)
    assert m.config.num_nextn_predict_layers == 1
    return m


@pytest.fixture(scope="module")
def model2():  # noqa: ANN201
    """Two MTP layers: drafts chain layer 0, layer 1, then layer 0 again (k > 2)."""
    return build_model(dataclasses.replace(preset("k3-tiny-native"), num_nextn_predict_layers=2), seed=12)


@pytest.fixture(scope="module")
def workload(model):  # noqa: ANN001, ANN201
    return _workload(model)


@pytest.fixture(scope="module")
def workload2(model2):  # noqa: ANN001, ANN201
    """As `workload`, the references from the plain engine (itself tested against the no-cache loop)."""
    prompts = _workload(model2, refs=False)[0]
    return prompts, LocalEngine(ServerArgs(), model2).generate(prompts, GREEDY)


def _workload(model, refs: bool = True):  # noqa: ANN001, ANN202
    g = random.Random(3)
    vocab = model.config.vocab_size

    def rand(n: int) -> list[int]:
        return [g.randrange(vocab) for _ in range(n)]

    shots = rand(30)
    prompts = [shots + rand(g.randrange(2, 9)) for _ in range(2)]  # shared prefix: radix hits
    prompts += [rand(g.randrange(5, 25)) for _ in range(2)]
    prompts.append(list(prompts[0]))
    return prompts, [greedy_reference(model, p, MAX_NEW) for p in prompts] if refs else []


def _engine(model, **kw) -> LocalEngine:  # noqa: ANN001
    return LocalEngine(ServerArgs(speculative_algorithm="mtp", debug_spec_state=True, **kw), model, check=True)


CONFIGS = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16, chunked_prefill_size=32),
}


@pytest.mark.parametrize(("name", "k"), [("radix", 1), ("radix", 3), ("radix", 6), ("no_radix", 3), ("page16", 1),
                                       ("page16", 6)])
def test_greedy_with_mtp_equals_plain(model, workload, name: str, k: int) -> None:  # noqa: ANN001
    prompts, refs = workload
    eng = _engine(model, speculative_num_draft_tokens=k, **CONFIGS[name])
    assert eng.generate(prompts, GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.verify_steps > 0 and m.draft_tokens > 0
    eng.scheduler.check_integrity()


@pytest.mark.parametrize(("name", "k"), [("radix", 3), ("no_radix", 6), ("page16", 6)])
def test_greedy_with_two_mtp_layers_equals_plain(model2, workload2, name: str, k: int) -> None:  # noqa: ANN001
    prompts, refs = workload2
    eng = _engine(model2, speculative_num_draft_tokens=k, **CONFIGS[name])
    assert eng.generate(prompts, GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.verify_steps > 0 and m.draft_tokens > 0
    eng.scheduler.check_integrity()


def test_mtp_part_of_the_pool(model) -> None:  # noqa: ANN001
    """The MTP latents are an MLA-only part after the target's in every token row: no state bytes added."""
    lay = pool_layout(model.config, ServerArgs(speculative_algorithm="mtp"))
    own = dataclasses.replace(lay, draft=None)
    assert lay.draft is not None and lay.draft.num_kda_layers == 0 and lay.draft.num_mla_layers == 1
    assert lay.state_block_bytes == own.state_block_bytes
    assert lay.kv_token_bytes == own.kv_token_bytes + lay.draft.kv_token_bytes
    buf = PoolBuffer(lay, 64 * lay.state_block_bytes)
    buf.data.zero_()
    buf.kv(0, draft=True).fill_(1)
    assert all(bool((buf.kv(i) == 0).all()) for i in range(model.config.num_mla_layers))


def test_seeded_sampling_with_mtp_is_reproducible(model, workload) -> None:  # noqa: ANN001
    prompts, _ = workload
    sampling = {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 5, "ignore_eos": True}
    out = _engine(model, speculative_num_draft_tokens=3).generate(prompts, sampling)
    assert out == _engine(model, speculative_num_draft_tokens=3).generate(prompts, sampling)
    assert all(len(x) == 10 for x in out)


def test_refuses_a_checkpoint_without_mtp_layers() -> None:
    plain = build_model(preset("k3-tiny"), seed=1)
    assert plain.config.num_nextn_predict_layers == 0
    with pytest.raises(ValueError, match="no MTP layers"):
        LocalEngine(ServerArgs(speculative_algorithm="mtp"), plain)



def _reference_chain(model, seq: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:  # noqa: ANN001
    """No-cache drafts for the window at position L = len(seq) - 1, and each MTP layer's output at L-1. Committed
    positions p < L: layer 0 on (token p+1, h_p), layer m > 0 on (token p+1, layer m-1's output at p-1; h_0 at
    p = 0). Draft j+1 from layer j % n at position L-1+j on (d_j, the chain's output one position back), that
    layer's entries caught up over the chain positions it skipped."""
    n = model.config.num_nextn_predict_layers
    ids = torch.tensor(seq)
    h = model.prenorm_hidden(ids, torch.tensor([0, len(seq)]))[:-1]
    nxt = ids[1:]
    toks, hids, outs = [], [], []
    for m in range(n):
        hin = h if m == 0 else torch.cat([h[:1], outs[-1][:-1]])
        outs.append(model.forward_mtp(m, nxt, hin).hidden)
        toks.append(nxt)
        hids.append(hin)
    chain, drafts, written = [outs[0][-1]], [], [0] * n
    for j in range(1, k + 1):
        drafts.append(int(model.mtp_logits((j - 1) % n, chain[j - 1][None]).argmax()))
        if j == k:
            break
        m = j % n
        for s in range(written[m] + 1, j + 1):
            toks[m] = torch.cat([toks[m], torch.tensor([drafts[s - 1]])])
            hids[m] = torch.cat([hids[m], chain[s - 1][None]])
        chain.append(model.forward_mtp(m, toks[m], hids[m]).hidden[-1])
        written[m] = j
    return drafts, [o[-1] for o in outs]


@pytest.mark.parametrize(("layers", "page_size", "k", "chunk"), [(1, 16, 3, None), (2, 1, 6, None), (2, 1, 3, 8)])
def test_drafts_are_the_no_cache_mtp_chain(model, model2, workload, workload2, layers: int,  # noqa: ANN001
                                           page_size: int, k: int, chunk: int | None) -> None:
    """Every verify window's drafts, and each MTP layer's output at the last committed position, equal the
    no-cache MTP chain on the committed tokens: the cached MTP latents of every layer, the catch-up after each
    verify and the chain are right (not only harmless to the outputs); with the prompt in chunks of 8, a chunk's
    last position waits for the next chunk's first token (no stale entry)."""
    target = model if layers == 1 else model2
    prompts, refs = workload if layers == 1 else workload2
    extra = {} if chunk is None else {"chunked_prefill_size": chunk}
    eng = _engine(target, speculative_num_draft_tokens=k, page_size=page_size, **extra)
    proposer = eng.worker.proposer
    seen: list[tuple[int, list[int], torch.Tensor]] = []
    one = 2 if chunk is None else 0  # a prompt of 32+ tokens when chunked
    real_propose = proposer.propose

    def record(batch, rows, params):  # noqa: ANN001, ANN202
        outs = proposer.last_out[:, int(rows[0])].clone()
        probs = real_propose(batch, rows, params)
        seen.append((int(batch.prefix_lens[0]), batch.input_ids[1:].tolist(), outs))
        return probs

    proposer.propose = record
    assert eng.generate([prompts[one]], GREEDY) == [refs[one]]
    full = prompts[one] + refs[one]
    assert len(seen) > 2
    for prefix, drafts, outs in seen:
        ref_drafts, ref_outs = _reference_chain(target, full[: prefix + 1], len(drafts))
        assert drafts == ref_drafts, prefix
        torch.testing.assert_close(outs, torch.stack(ref_outs), atol=1e-4, rtol=1e-4)


def test_trained_mtp_layer_accepts_drafts_on_gsm8k(spec_pair) -> None:  # noqa: ANN001
    """The trained spec pair's target (the session's `spec_pair`, tests/conftest.py) drafts with its own trained
    MTP layer: a good share of its drafts is accepted on gsm8k questions (a random MTP layer: ~0)."""
    import json

    from bench.train_spec_pair import DATA
    from radixk3.checkpoint import load_model
    from radixk3.tokenizer import load_tokenizer

    target = load_model(spec_pair.target)
    assert target.config.num_nextn_predict_layers >= 1
    tok = load_tokenizer()
    rows = [json.loads(line) for line in (DATA / "test.jsonl").read_text().splitlines()[:3]]
    prompts = [tok.encode(f"Question: {r['question']}\nAnswer:") for r in rows]
    eng = LocalEngine(ServerArgs(speculative_algorithm="mtp", speculative_num_draft_tokens=1,
                                 debug_spec_state=True), target, check=True)
    sampling = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    assert eng.generate(prompts, sampling) == [greedy_reference(target, p, 32) for p in prompts]
    m = eng.scheduler.metrics
    rate = m.accepted_tokens / m.draft_tokens
    print(f"trained MTP acceptance at k=1: {m.accepted_tokens}/{m.draft_tokens} = {rate:.2f}")
    assert rate > 0.2  # the small pair: ~0.9 on its repetitive greedy replies (the bench's recipe: ~0.7); random: 0


def test_retraction_under_a_small_pool(model) -> None:  # noqa: ANN001
    """Prompts that fit at admission, then outgrow the pool while decoding: retraction frees (and
    re-admission recomputes) the target's latents and the MTP layer's together."""
    g = random.Random(1)
    prompts = [[g.randrange(model.config.vocab_size) for _ in range(8)] for _ in range(8)]
    sampling = dict(GREEDY, max_new_tokens=20)
    refs = [greedy_reference(model, p, 20) for p in prompts]
    k = 3
    lay = pool_layout(model.config, ServerArgs(speculative_algorithm="mtp", speculative_num_draft_tokens=k,
                                               max_running_requests=8))
    pool = 9 * lay.state_block_bytes + 120 * lay.kv_token_bytes
    eng = _engine(model, speculative_num_draft_tokens=k, max_running_requests=8,
                  mem_bytes=pool + lay.spec_window_bytes("replay", 8, k + 1), chunked_prefill_size=40,
                  schedule_conservativeness=0.0)
    assert eng.generate(prompts, sampling) == refs
    assert eng.scheduler.metrics.retractions > 0
    eng.scheduler.check_integrity()
