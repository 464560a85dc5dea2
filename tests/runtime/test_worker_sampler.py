"""The worker sampler's penalty state: at every sampling step, the counts a row's penalties use equal the counts
of its request's outputs (the history-based reference, `output_counts` over them), across rows reused by other
requests and across retraction; and the penalised outputs do not depend on either."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling import output_counts
from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs

PENALISED = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.6,
             "frequency_penalty": 0.4, "presence_penalty": 0.3}


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=41)


def _prompts() -> list[list[int]]:
    return [list(range(40 * i, 40 * i + 40)) for i in range(1, 5)]


def _run(eng: LocalEngine) -> list[list[int]]:
    rids = [eng.submit(p, PENALISED) for p in _prompts()]
    outs = eng.run()
    assert all(outs[r][-1].finished == "length" for r in rids), [outs[r][-1].error for r in rids]
    return [[t for o in outs[r] for t in o.token_ids] for r in rids]


def test_penalty_counts_follow_each_request_across_row_reuse_and_retraction(model) -> None:  # noqa: ANN001
    # Two rows for four requests (rows are reused); admission reserves no decode tokens (conservativeness 0), so
    # decoding outgrows the small pool and retracts. Without overlap, a request's outputs are all processed
    # when the worker samples its next token: the row's counts must be exactly theirs.
    args = ServerArgs(mem_bytes=90_000, chunked_prefill_size=16, schedule_conservativeness=0.0,
                      max_running_requests=2, disable_overlap_schedule=True)
    eng = LocalEngine(args, model, check=True)
    sampler = eng.worker.sampler
    real = sampler.sample
    vocab = model.config.vocab_size
    owners: dict[int, set[str]] = {}
    checked: list[bool] = []  # per sampled row: its counts equal its request's (recorded: the worker would
    # turn an assertion here into a failed step)

    def checking(logits, params, rows, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        by_row = {r.row: r for r in eng.scheduler.running}
        for row in rows:
            req = by_row[row]
            owners.setdefault(row, set()).add(req.rid)
            expect = output_counts([req.output_ids], vocab, logits.device)
            checked.append(torch.equal(sampler.counts([row], vocab, logits.device), expect))
        return real(logits, params, rows, *a, **kw)

    sampler.sample = checking  # type: ignore[method-assign]
    got = _run(eng)
    assert eng.scheduler.metrics.retractions > 0
    assert any(len(rids) > 1 for rids in owners.values())  # a row served several requests
    assert len(checked) >= sum(len(t) for t in got) and all(checked), checked.count(False)
    # The same requests with room for all of them, overlapped: the same penalised tokens.
    assert _run(LocalEngine(ServerArgs(), model, check=True)) == got
