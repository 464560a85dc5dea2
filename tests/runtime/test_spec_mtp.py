"""The MTP proposer (`--speculative-algorithm mtp`, runtime/spec_proposers.py) end to end on `k3-tiny-native`
random weights (one MTP layer, its latents nested in the target's pool): greedy outputs equal the plain no-cache
greedy loop (k = 1, 3: k > 1 chains the one layer; radix on and off; page sizes 1 and 16), with the state-parity
hook on; seeded sampled runs repeat; a checkpoint without MTP layers is refused."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from radixk3.config import preset
from radixk3.generate import greedy_reference
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.pool_buffer import PoolBuffer
from runtime.pool_layout import pool_layout
from runtime.server_args import ServerArgs

MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    m = build_model(preset("k3-tiny-native"), seed=11)
    assert m.config.num_nextn_predict_layers == 1
    return m


@pytest.fixture(scope="module")
def workload(model):  # noqa: ANN001, ANN201
    g = random.Random(3)
    vocab = model.config.vocab_size

    def rand(n: int) -> list[int]:
        return [g.randrange(vocab) for _ in range(n)]

    shots = rand(30)
    prompts = [shots + rand(g.randrange(2, 9)) for _ in range(2)]  # shared prefix: radix hits
    prompts += [rand(g.randrange(5, 25)) for _ in range(2)]
    prompts.append(list(prompts[0]))
    return prompts, [greedy_reference(model, p, MAX_NEW) for p in prompts]


def _engine(model, **kw) -> LocalEngine:  # noqa: ANN001
    return LocalEngine(ServerArgs(speculative_algorithm="mtp", debug_spec_state=True, **kw), model, check=True)


CONFIGS = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16, chunked_prefill_size=32),
}


@pytest.mark.parametrize(("name", "k"), [("radix", 1), ("radix", 3), ("no_radix", 3), ("page16", 1), ("page16", 3)])
def test_greedy_with_mtp_equals_plain(model, workload, name: str, k: int) -> None:  # noqa: ANN001
    prompts, refs = workload
    eng = _engine(model, speculative_num_draft_tokens=k, **CONFIGS[name])
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
    """No-cache drafts for the window at position L = len(seq) - 1, and the MTP outputs they come from: MTP
    layer 0 over (h_p, token p+1) for p < L, then chained over its own outputs and drafts."""
    ids = torch.tensor(seq)
    h = model.prenorm_hidden(ids, torch.tensor([0, len(seq)]))[:-1]
    nxt, drafts, outs = ids[1:], [], []
    for _ in range(k):
        out = model.forward_mtp(0, nxt, h)
        d = out.logits[-1].argmax()
        drafts.append(int(d))
        outs.append(out.hidden[-1])
        h, nxt = torch.cat([h, out.hidden[-1:]]), torch.cat([nxt, d[None]])
    return drafts, outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_drafts_are_the_no_cache_mtp_chain(model, workload, page_size: int) -> None:  # noqa: ANN001
    """Every verify window's drafts and the MTP outputs behind them equal the no-cache MTP chain on the
    committed tokens: the cached MTP latents, the catch-up after each verify and the chain are right (not only
    harmless to the outputs)."""
    prompts, refs = workload
    k = 3
    eng = _engine(model, speculative_num_draft_tokens=k, page_size=page_size)
    proposer = eng.worker.proposer
    seen: list[tuple[int, list[int], list[torch.Tensor]]] = []
    chain: list[torch.Tensor] = []
    real_propose, real_mtp = proposer.propose, model.forward_mtp_batch

    def record(batch, rows, params):  # noqa: ANN001, ANN202
        chain.clear()
        outs = [proposer.last_out[int(rows[0])].clone()]
        proposer.model.forward_mtp_batch = mtp
        try:
            probs = real_propose(batch, rows, params)
        finally:
            del proposer.model.forward_mtp_batch
        seen.append((int(batch.prefix_lens[0]), batch.input_ids[1:].tolist(), outs + list(chain)))
        return probs

    def mtp(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        out = real_mtp(*a, **kw)
        chain.append(out.hidden[0].clone())
        return out

    proposer.propose = record
    assert eng.generate([prompts[2]], GREEDY) == [refs[2]]
    full = prompts[2] + refs[2]
    assert len(seen) > 3
    for prefix, drafts, outs in seen:
        ref_drafts, ref_outs = _reference_chain(model, full[: prefix + 1], len(drafts))
        assert drafts == ref_drafts, prefix
        torch.testing.assert_close(torch.stack(outs), torch.stack(ref_outs[: len(outs)]), atol=1e-4, rtol=1e-4)


def test_trained_mtp_layer_accepts_drafts_on_gsm8k() -> None:
    """The trained spec pair's target (`bench/train_spec_pair.py`, when cached: never trained here) drafts with
    its own trained MTP layer: a good share of its drafts is accepted on gsm8k questions (~0.7 at k = 1)."""
    import json

    from bench.train_spec_pair import DATA, cache_root
    from radixk3.checkpoint import load_model
    from radixk3.tokenizer import load_tokenizer

    targets = sorted(p.parent / "target" for p in cache_root().glob("*/report.json"))
    if not targets or not (targets[0] / "config.json").is_file():
        pytest.skip("no cached spec pair (bench/train_spec_pair.py builds it)")
    target = load_model(targets[0])
    if target.config.num_nextn_predict_layers < 1:
        pytest.skip("the cached spec pair's target has no MTP layer")
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
    assert rate > 0.2


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
