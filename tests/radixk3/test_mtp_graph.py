"""The MTP proposer's compiled steps (`radixk3.mtp_graph`) against the eager MTP layer on the same cache, with the
built-in k3-gsm8k's MTP layer (fp32): three sequences padded to one bucket of four. A draft step gives the eager
DECODE step's outputs and logits; a greedy draft chain over windows of 4, 2 and 3 tokens gives the drafts of eager
DECODE steps chained one at a time, each on the previous step's argmax; a catch-up over windows with 1, 4 and 2
committed of 4 positions gives the eager EXTEND step's outputs over the committed positions. All three store their
positions' latents where the eager steps store them, leave every other row the sequences own untouched, and write
padding only to the scratch row. Tolerance: compiled and eager fp32 round differently (inductor fuses and reorders
the elementwise work, and the decode graph's attention takes the absorbed form where an eager extend does not),
within 1e-5 of each tensor's scale; drafts are equal."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from radixk3.builtin_model import BUILTIN_MODEL_DIR
from radixk3.checkpoint import load_model
from radixk3.forward_batch import ForwardBatch, ForwardMode
from radixk3.model import KimiForCausalLM
from radixk3.mtp import allocate_mtp_cache
from radixk3.mtp_graph import MTPGraphs

PAGE = 4
ROWS = 96  # 24 pages; row ROWS is the scratch row
WIDTH = 4
PREFIX = torch.tensor([5, 9, 2])


@pytest.fixture(scope="module")
def setup() -> tuple[KimiForCausalLM, MTPGraphs, Tensor]:
    model = load_model(BUILTIN_MODEL_DIR, dtype=torch.float32)
    cache = allocate_mtp_cache(model.config, ROWS + 1)
    graphs = MTPGraphs(model, cache, ROWS, [4], WIDTH)
    graphs.capture()
    return model, graphs, torch.tensor([[3, 7, 1, 0], [10, 2, 5, 0], [8, 11, 0, 0]])  # distinct pages per sequence


def _close(got: Tensor, want: Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def _fill(graphs: MTPGraphs, seed: int) -> Tensor:
    """Random cached latents everywhere (the sequences' prefixes included); returns a copy to compare with."""
    latent = graphs.cache.latent[0]
    latent.copy_(torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed)))
    return latent.clone()


def _rows(table: Tensor, positions: list[list[int]]) -> list[int]:
    return [int(table[i, p // PAGE]) * PAGE + p % PAGE for i, ps in enumerate(positions) for p in ps]


def test_draft_step_equals_the_eager_layer(setup: tuple[KimiForCausalLM, MTPGraphs, Tensor]) -> None:
    model, graphs, table = setup
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3,), generator=gen)
    hidden = torch.randn(3, model.config.hidden_size, generator=gen)
    start = _fill(graphs, 2)
    got = graphs.draft(ids, hidden, PREFIX, table, PAGE)
    assert got is not None and got.hidden.shape == hidden.shape and graphs.replays == 1
    after = graphs.cache.latent[0].clone()
    graphs.cache.latent[0].copy_(start)
    batch = ForwardBatch.from_table(ForwardMode.DECODE, ids, torch.arange(4), PREFIX, torch.zeros(3, dtype=torch.long),
                                    table, PAGE)
    want = model.forward_mtp_batch(0, batch, hidden, graphs.cache)
    _close(got.hidden, want.hidden)
    _close(got.logits, want.logits.float())
    written = _rows(table, [[int(p)] for p in PREFIX])
    _close(after[written], graphs.cache.latent[0][written])
    untouched = [r for r in range(ROWS) if r not in written]
    assert torch.equal(after[untouched], start[untouched])


def test_catch_up_equals_the_eager_layer_over_committed_positions(
        setup: tuple[KimiForCausalLM, MTPGraphs, Tensor]) -> None:
    model, graphs, table = setup
    gen = torch.Generator().manual_seed(3)
    num_tokens = torch.tensor([1, 4, 2])
    ids = torch.randint(0, model.config.vocab_size, (3, WIDTH), generator=gen)
    hidden = torch.randn(3, WIDTH, model.config.hidden_size, generator=gen)
    start = _fill(graphs, 4)
    got = graphs.catch_up(ids, hidden, PREFIX, num_tokens, table, PAGE)
    assert got is not None and got.shape == hidden.shape
    after = graphs.cache.latent[0].clone()
    graphs.cache.latent[0].copy_(start)
    keep = torch.arange(WIDTH)[None, :] < num_tokens[:, None]
    cu = torch.nn.functional.pad(num_tokens.cumsum(0), (1, 0))
    batch = ForwardBatch.from_table(ForwardMode.EXTEND, ids[keep], cu, PREFIX, torch.zeros(3, dtype=torch.long),
                                    table, PAGE)
    want = model.forward_mtp_batch(0, batch, hidden[keep], graphs.cache)
    _close(got[keep], want.hidden)
    written = _rows(table, [list(range(int(p), int(p + n))) for p, n in zip(PREFIX, num_tokens, strict=True)])
    _close(after[written], graphs.cache.latent[0][written])
    untouched = [r for r in range(ROWS) if r not in written]  # the windows' uncommitted positions among them
    assert torch.equal(after[untouched], start[untouched])


def test_chain_drafts_what_eager_steps_chained_one_at_a_time(
        setup: tuple[KimiForCausalLM, MTPGraphs, Tensor]) -> None:
    model, graphs, table = setup
    gen = torch.Generator().manual_seed(5)
    lens = torch.tensor([4, 2, 3])  # window i: its last committed token, then lens[i] - 1 drafts
    hidden = torch.randn(3, model.config.hidden_size, generator=gen)
    start = _fill(graphs, 6)
    got = graphs.chain(hidden, lens, PREFIX, table, PAGE)
    assert got is not None and got.shape == (3, WIDTH - 1) and graphs.chains == 1
    after = graphs.cache.latent[0].clone()
    graphs.cache.latent[0].copy_(start)
    # Eager: draft 1 from the logits of `hidden`, then chain step j (position L + j - 1, on draft j and the
    # previous output) for the windows that still draft.
    draft = model.mtp_logits(0, hidden).float().argmax(-1)
    want, h = [draft], hidden
    for j in range(1, WIDTH - 1):
        on = (lens > j + 1).nonzero().squeeze(1)
        batch = ForwardBatch.from_table(ForwardMode.DECODE, draft[on], torch.arange(on.numel() + 1), PREFIX[on] + j - 1,
                                        torch.zeros(on.numel(), dtype=torch.long), table[on], PAGE)
        out = model.forward_mtp_batch(0, batch, h[on], graphs.cache)
        h = torch.zeros_like(h).index_copy_(0, on, out.hidden)
        draft = torch.zeros_like(draft).index_copy_(0, on, out.logits.float().argmax(-1))
        want.append(draft)
    for i, n in enumerate(lens.tolist()):
        assert got[i, : n - 1].tolist() == [int(d[i]) for d in want[: n - 1]]
    # Chain step j of window i stores its latent at position L + j - 1, for j <= lens[i] - 2; the rest: scratch.
    written = _rows(table, [list(range(int(p), int(p) + int(n) - 2)) for p, n in zip(PREFIX, lens, strict=True)])
    _close(after[written], graphs.cache.latent[0][written])
    untouched = [r for r in range(ROWS) if r not in written]
    assert torch.equal(after[untouched], start[untouched])
