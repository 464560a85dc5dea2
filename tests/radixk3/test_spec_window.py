"""The verify forward and the draft window's commit (ReplaySSM and the snapshot baseline) against plain decode."""

from __future__ import annotations

import pytest
import torch

from radixk3.config import preset
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import build_model
from radixk3.spec_window import SpecWindow, WindowRows, check_committed_states
from runtime.pool_layout import PoolLayout

TOL = 1e-5


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=3)


def _prefill(model, cache, prompts, slots):  # noqa: ANN001, ANN202
    kv = [list(range(200 * i, 200 * i + len(p))) for i, p in enumerate(prompts)]
    model.forward_batch(ForwardBatch.build(prompts, [0] * len(prompts), slots, kv), cache)


def _states(cache: HybridCache, slots: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    idx = torch.tensor(slots)
    rec = [t.index_select(0, idx).clone() for t in cache.recurrent]
    return rec, [t.index_select(0, idx).clone() for t in cache.conv]


@pytest.mark.parametrize("mode", ["replay", "snapshot"])
def test_verify_then_commit_equals_decode(model, mode: str) -> None:  # noqa: ANN001
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    windows = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (4, 2)]
    accept = [3, 1]  # tokens of each window that are committed
    slots = [1, 4]
    cache = HybridCache.allocate(cfg, num_state_slots=6, num_kv_slots=400)
    _prefill(model, cache, prompts, slots)
    plain = HybridCache(*([t.clone() for t in ts] for ts in (cache.recurrent, cache.conv, cache.latent)))

    # plain decode of each window, token by token: logits and the state after the committed tokens
    want_logits, want_states = [], []
    for i, (p, w) in enumerate(zip(prompts, windows, strict=True)):
        got = []
        for t, tok in enumerate(w):
            kv = list(range(200 * i, 200 * i + len(p) + t + 1))
            step = ForwardBatch.build([[tok]], [len(p) + t], [slots[i]], [kv])
            got.append(model.forward_batch(step, plain))
            if t + 1 == accept[i]:
                want_states.append(_states(plain, [slots[i]]))
        want_logits.append(torch.cat(got))

    window = SpecWindow.allocate(cfg, mode, rows=3, width=4, dtype=cfg.torch_dtype, record_inputs=True)
    before = _states(cache, slots)
    rows = torch.tensor([2, 0])
    kv = [list(range(200 * i, 200 * i + len(p) + len(w)))
          for i, (p, w) in enumerate(zip(prompts, windows, strict=True))]
    batch = ForwardBatch.build(windows, [len(p) for p in prompts], slots, kv, all_logits=True)
    batch.mode = ForwardMode.VERIFY
    batch.spec = WindowRows(window, rows)
    logits = model.forward_batch(batch, cache)
    assert torch.equal(_states(cache, slots)[0][0], before[0][0]), "verify must not write the live state"
    assert (logits[:4] - want_logits[0]).abs().max() < TOL
    assert (logits[4:] - want_logits[1]).abs().max() < TOL

    num = torch.tensor(accept)
    state_slots = torch.tensor(slots)
    window.commit(cache.recurrent, cache.conv, state_slots, rows, num)
    check_committed_states(window, before, cache.recurrent, cache.conv, state_slots, rows, num)
    for i in range(2):
        rec, conv = _states(cache, [slots[i]])
        for layer in range(cfg.num_kda_layers):
            assert (rec[layer] - want_states[i][0][layer]).abs().max() < TOL
            assert (conv[layer] - want_states[i][1][layer]).abs().max() < TOL


def test_state_parity_hook_catches_a_wrong_count(model) -> None:  # noqa: ANN001
    cfg = model.config
    prompt = list(range(20, 30))
    cache = HybridCache.allocate(cfg, num_state_slots=2, num_kv_slots=64)
    _prefill(model, cache, [prompt], [0])
    window = SpecWindow.allocate(cfg, "replay", rows=1, width=3, dtype=cfg.torch_dtype)
    before = _states(cache, [0])
    batch = ForwardBatch.build([[5, 6, 7]], [10], [0], [list(range(13))], all_logits=True)
    batch.mode = ForwardMode.VERIFY
    batch.spec = WindowRows(window, torch.tensor([0]))
    model.forward_batch(batch, cache)
    slots, rows = torch.tensor([0]), torch.tensor([0])
    window.commit(cache.recurrent, cache.conv, slots, rows, torch.tensor([2]))
    with pytest.raises(AssertionError, match="differs from plain decode"):
        check_committed_states(window, before, cache.recurrent, cache.conv, slots, rows, torch.tensor([3]))


def test_scratch_bytes_match_the_layout_and_favour_replay() -> None:
    cfg = preset("k3-tiny")
    layout = PoolLayout.from_config(cfg)
    for mode in ("replay", "snapshot"):
        w = SpecWindow.allocate(cfg, mode, rows=5, width=4, dtype=cfg.torch_dtype)
        assert w.nbytes == layout.spec_window_bytes(mode, 5, 4)
    k3 = PoolLayout.from_config(preset("kimi-k3"), tp=8)
    assert k3.spec_window_bytes("snapshot", 1, 4) / k3.spec_window_bytes("replay", 1, 4) >= 32
