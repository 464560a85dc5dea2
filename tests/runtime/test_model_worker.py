"""The worker against hand-written plans: its page table, page moves, -1 inputs and checkpoints reproduce the
no-cache forward, with the torch kernels and with the interpreted Triton kernels on the real pool views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.sampling_columns import SamplingColumns
from radixk3.config import preset
from radixk3.model import build_model
from runtime.messages import StepPlan, decode, encode
from runtime.server_args import ServerArgs
from runtime.worker.model_worker import ModelWorker

PS = 4


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=3)


def _arr(x: list[int]) -> np.ndarray:
    return np.array(x, dtype=np.int64)


def plan(step: int, mode: str, seqs: list[tuple[int, int, int, list[int]]], *, writes: list[tuple[int, int, int]] = (),
         ckpts: list[tuple[int, int, int]] = (), copies: list = (), moves: list = (), all_logits: bool = False,
         ) -> StepPlan:
    """seqs: (row, prefix_len, state_slot, new token ids); every sequence is sampled at its last token."""
    cu = [0]
    for *_, ids in seqs:
        cu.append(cu[-1] + len(ids))
    last = [c - 1 for c in cu[1:]]
    logits_index = last + ([i for i in range(cu[-1])] if all_logits else [])
    p = StepPlan(
        step=step, mode=mode, copies=list(copies), page_moves=list(moves),
        table_rows=_arr([w[0] for w in writes]), table_cols=_arr([w[1] for w in writes]),
        table_pages=_arr([w[2] for w in writes]), rows=_arr([s[0] for s in seqs]),
        prefix_lens=_arr([s[1] for s in seqs]), cu_seqlens=_arr(cu), state_slots=_arr([s[2] for s in seqs]),
        input_ids=_arr([t for *_, ids in seqs for t in ids]), ckpt_seq=_arr([c[0] for c in ckpts]),
        ckpt_offset=_arr([c[1] for c in ckpts]), ckpt_slot=_arr([c[2] for c in ckpts]),
        logits_index=_arr(logits_index), sampling=SamplingColumns.of(len(seqs), temperature=0.0),
        banned=[[] for _ in seqs],
    )
    return decode(encode(p))  # as on the wire


def _reference_next(model, ids: list[int]) -> int:  # noqa: ANN001
    return int(model(torch.tensor(ids))[-1].argmax())


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_worker_follows_plans(model, kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("RADIXK3_KERNELS", kernels)
    w = ModelWorker(ServerArgs(page_size=PS, mem_bytes=4 << 20, max_running_requests=4), model)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, model.config.vocab_size, (10,), generator=g).tolist()
    b = torch.randint(0, model.config.vocab_size, (7,), generator=g).tolist()
    top = w.buffer.geometry.num_state_slots - 1
    sa, sb, ck = top, top - 1, top - 2  # physical state slots
    # Row 2 gets pages 5, 1, 8 (out of order); row 0 gets pages 3, 0.
    writes = [(2, 0, 5), (2, 1, 1), (2, 2, 8), (0, 0, 3), (0, 1, 0)]
    # a's first chunk of 6 tokens with a checkpoint after 4; b's whole prompt.
    r = w.execute(plan(1, "extend", [(2, 0, sa, a[:6]), (0, 0, sb, b)], writes=writes, ckpts=[(0, 4, ck)]))
    assert r.tokens[1] == _reference_next(model, b)
    b.append(r.tokens[1])
    # a's second chunk (prefix 6) rides with b's decode of its sampled token, fed as -1 (the row's last token).
    r = w.execute(plan(2, "extend", [(2, 6, sa, a[6:]), (0, len(b) - 1, sb, [-1])], writes=[(0, 2, 6)]))
    assert r.tokens[0] == _reference_next(model, a)
    assert r.tokens[1] == _reference_next(model, b)
    a.append(r.tokens[0])
    # Compaction moves page 8 (a's third page) to page 2: bytes and the table follow.
    g8 = w.buffer.geometry
    moved = (g8.page_offset(8), g8.page_offset(2), g8.page_bytes)
    for step in range(3, 6):
        extra = {"copies": [moved], "moves": [(8, 2)]} if step == 3 else {}
        r = w.execute(plan(step, "decode", [(2, len(a) - 1, sa, [-1])], **extra))
        assert r.tokens[0] == _reference_next(model, a)
        a.append(r.tokens[0])
    assert int(w.tables.table[2, 2]) == 2
    # The checkpoint holds a's state after 4 tokens: resume from it in a fresh row over a's first page.
    r = w.execute(plan(6, "extend", [(1, 4, ck, a[4:7])], writes=[(1, 0, 5), (1, 1, 1)]))
    assert r.tokens[0] == _reference_next(model, a[:7])
    w.tables.check_integrity()


def test_decode_checkpoint_offsets_and_logits(model) -> None:  # noqa: ANN001
    """Decode checkpoints at offset 0 and 1 hold the states before and after the token; all-position logits
    of an extend equal the no-cache forward within fp32 rounding."""
    w = ModelWorker(ServerArgs(page_size=1, mem_bytes=4 << 20), model)
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    top = w.buffer.geometry.num_state_slots - 1
    w.execute(plan(1, "extend", [(0, 0, top, ids[:8])], writes=[(0, i, i) for i in range(9)]))
    w.execute(plan(2, "decode", [(0, 8, top, ids[8:9])], ckpts=[(0, 0, top - 1), (0, 1, top - 2)]))
    full = model(torch.tensor(ids + [ids[0]]))
    for slot, pos in ((top - 1, 8), (top - 2, 9)):
        # Probe the checkpoint with one more token in row 1 over the same KV (its own page for the probe).
        p = plan(3, "extend", [(1, pos, slot, [ids[0] if pos == 9 else ids[8]])],
                 writes=[(1, i, i) for i in range(pos)] + [(1, pos, 20)])
        w.apply_plan_changes(p)
        got = w.model.forward_batch(w.forward_batch(p), w.cache)
        torch.testing.assert_close(got[0], full[pos], atol=1e-5, rtol=0)


def test_idle_plan_runs_nothing(model) -> None:  # noqa: ANN001
    w = ModelWorker(ServerArgs(mem_bytes=4 << 20), model)
    r = w.execute(plan(1, "idle", []))
    assert r.tokens == [] and r.error is None


def test_host_batch_equals_the_device_paths(model) -> None:  # noqa: ANN001
    """On CPU the worker builds a step's batch in numpy (`forward_batch`); the torch path that a device table
    takes (`_forward_batch_device`, `ForwardBatch.from_table`) gives the same tensors, -1 inputs included."""
    w = ModelWorker(ServerArgs(page_size=PS, mem_bytes=4 << 20, max_running_requests=4), model)
    w.tables.set_last([2, 0], torch.tensor([17, 29]))
    writes = [(2, 0, 5), (2, 1, 1), (2, 2, 8), (0, 0, 3), (0, 1, 0), (3, 0, 7)]
    plans = [
        plan(1, "extend", [(2, 0, 9, list(range(6))), (0, 0, 8, [4, 5, 6])], writes=writes, ckpts=[(0, 4, 7)],
             all_logits=True),
        plan(2, "extend", [(2, 6, 9, [1, 2, 3, 4, 5]), (0, 3, 8, [-1]), (3, 2, 6, [-1, 11])]),
        plan(3, "decode", [(2, 9, 9, [-1]), (0, 4, 8, [-1])]),
    ]
    for p in plans:
        w.apply_plan_changes(p)
        host, dev = w.forward_batch(p), w._forward_batch_device(p)
        for name in ("input_ids", "cu_seqlens", "prefix_lens", "state_slots", "block_table", "kv_slots",
                     "logits_index"):
            assert torch.equal(getattr(host, name), getattr(dev, name)), name
        assert (host.mode, host.page_size) == (dev.mode, dev.page_size)
        assert (host.checkpoints is None) == (dev.checkpoints is None)
    assert host.input_ids.tolist() == [17, 29]
