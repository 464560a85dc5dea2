"""The compiled decode step (`radixk3.decode_graph`) against the eager one (itself shown equal to the no-cache
greedy loop by the engine exactness tests), on the worker's real pool buffer with its scratch slot and row:
greedy tokens identical at batch 4 (the bucket's own size) and batch 3 (padded to it), page size 4; the padded
rows write only the scratch slot and row, never a bystander's state or KV. One bucket, so one compile (the costly
part: tens of seconds cold, on a tiny model)."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

import radixk3.decode_graph as decode_graph
from kernels import linear_cpu, pool_ops_cpu
from kernels.state_checkpoints import StateCheckpoints
from radixk3.config import preset
from radixk3.decode_graph import DecodeGraphs, FusedPools, Scratch
from radixk3.decode_window import DecodeWindow
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.kda_attention import KDAAttention
from radixk3.model import build_model
from radixk3.moe_layer import Router
from radixk3.parallel_linear import Linear
from runtime.local_engine import LocalEngine
from runtime.pool_layout import pool_layout
from runtime.server_args import COMPILE_ENV, ServerArgs
from runtime.worker.pool_buffer import PoolBuffer
from tests.greedy import greedy_reference

MAX_NEW = 6
PAGE = 4
PAGES_PER_SEQ = 16  # room for the longest prompt and its new tokens
BUCKET = 4


def _graphs_over(model) -> tuple[PoolBuffer, HybridCache, DecodeGraphs]:  # noqa: ANN001
    """A pool buffer (with its scratch slot and row) for `model`, its cache views and decode graphs over them
    (not captured yet)."""
    buf = PoolBuffer(pool_layout(model.config, ServerArgs(page_size=PAGE)), 2 << 20, scratch=True)
    assert buf.scratch_state_slot is not None and buf.scratch_kv_row is not None
    cfg = model.config
    cache = HybridCache(recurrent=[buf.recurrent_state(i) for i in range(cfg.num_kda_layers)],
                        conv=[buf.conv_state(i) for i in range(cfg.num_kda_layers)],
                        latent=[buf.kv(i) for i in range(cfg.num_mla_layers)])
    return buf, cache, DecodeGraphs(model, cache, Scratch(buf.scratch_state_slot, buf.scratch_kv_row), [BUCKET])


@pytest.fixture(scope="module")
def setup():  # noqa: ANN201
    # A fresh dynamo cache: after another cache's graphs of these step functions in this process, dynamo would
    # take the cache key as an input, and such shared graphs are not called directly (`radixk3/step_graph.py`).
    torch._dynamo.reset()
    model = build_model(preset("k3-tiny"), seed=11)
    buf, cache, graphs = _graphs_over(model)
    graphs.capture()
    return model, buf, cache, graphs


def _prompts(vocab: int) -> list[list[int]]:
    g = random.Random(5)
    shots = [g.randrange(vocab) for _ in range(20)]
    return [shots + [g.randrange(vocab) for _ in range(g.randrange(2, 9))] for _ in range(3)] + [
        [g.randrange(vocab) for _ in range(g.randrange(3, 40))] for _ in range(4)]  # 7: a full bucket, a padded one


def _generate(model, cache: HybridCache, graphs: DecodeGraphs | None, prompts: list[list[int]],  # noqa: ANN001
              top: int) -> list[list[int]]:
    """Prefill eagerly, then MAX_NEW greedy decode steps (through the graphs, or eager without); sequence i
    owns state slot top - 1 - i and pages (i + 1) * PAGES_PER_SEQ onwards (as the pool does: states from the
    top, pages from the bottom; the top slot and the first pages are a bystander's)."""
    n = len(prompts)
    dev = model.device
    table = torch.tensor([[(i + 1) * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)] for i in range(n)])
    slots = torch.arange(top - 1, top - 1 - n, -1)

    def step(mode: ForwardMode, ids: list[list[int]], prefix: list[int]) -> list[int]:
        cu = torch.tensor([0, *torch.tensor([len(x) for x in ids]).cumsum(0).tolist()])
        batch = ForwardBatch.from_table(mode, torch.tensor([t for x in ids for t in x], device=dev), cu,
                                        torch.tensor(prefix), slots, table, PAGE)
        if mode is ForwardMode.DECODE and graphs is not None:
            assert graphs.supports(batch)
            logits = graphs.run(batch)
        else:
            logits = model.forward_batch(batch, cache)
        return logits.argmax(-1).tolist()

    out = [[t] for t in step(ForwardMode.EXTEND, prompts, [0] * n)]
    for j in range(1, MAX_NEW):
        toks = step(ForwardMode.DECODE, [[o[-1]] for o in out], [len(p) + j - 1 for p in prompts])
        for o, t in zip(out, toks, strict=True):
            o.append(t)
    return out


def _next_step(prompts: list[list[int]], top: int) -> ForwardBatch:
    """A decode step after `_generate`'s (each sequence's first prompt token again, at its next position), over
    the same state slots and pages."""
    n = len(prompts)
    table = torch.tensor([[(i + 1) * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)] for i in range(n)])
    return ForwardBatch.from_table(ForwardMode.DECODE, torch.tensor([p[0] for p in prompts]), torch.arange(n + 1),
                                   torch.tensor([len(p) + MAX_NEW - 1 for p in prompts]),
                                   torch.arange(top - 1, top - 1 - n, -1), table, PAGE)


def test_compiled_decode_equals_eager(setup) -> None:  # noqa: ANN001
    model, buf, cache, graphs = setup
    prompts = _prompts(model.config.vocab_size)
    # A bystander: the top state slot and the first pages, which no row of these steps may touch.
    top = buf.geometry.num_state_slots - 1
    assert (2 + BUCKET) * PAGES_PER_SEQ * buf.geometry.page_bytes < buf.geometry.state_offset(top - BUCKET)
    cache.recurrent[0][top].fill_(7.0)
    cache.latent[0][: PAGES_PER_SEQ * PAGE].fill_(3.0)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():  # as the worker steps: no compile past capture (its guards hold on these tensors)
        for group in (prompts[:BUCKET], prompts[BUCKET:]):  # 4 rows, then 3 padded to 4
            want = _generate(model, cache, None, group, top)
            assert _generate(model, cache, graphs, group, top) == want
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled, "a step compiled again"
    assert sum(g.direct_calls for g in graphs.step_graphs) > 0, "no step called its graph without dynamo"
    assert bool((cache.recurrent[0][top] == 7.0).all())
    assert bool((cache.latent[0][: PAGES_PER_SEQ * PAGE] == 3.0).all())
    assert graphs.report.seconds[BUCKET] > 0


def test_each_models_graphs_use_their_own_weights(setup) -> None:  # noqa: ANN001
    """The graphs' guards skip the model's modules, and the step function's code (so its compiled entries) is
    shared by every instance: a second model's graphs in the same process, of the same shapes, still compute with
    its own weights (the graphs' arguments, read at each call), and the first model's graphs with the first's."""
    model, buf, cache, graphs = setup
    other = build_model(preset("k3-tiny"), seed=12)
    _, ocache, ographs = _graphs_over(other)
    ographs.capture()
    prompts = _prompts(model.config.vocab_size)[:BUCKET]
    top = buf.geometry.num_state_slots - 1
    with torch.inference_mode():
        for m, c, g in ((other, ocache, ographs), (model, cache, graphs)):
            want = _generate(m, c, None, prompts, top)
            assert _generate(m, c, g, prompts, top) == want
    assert _generate(other, ocache, None, prompts, top) != _generate(model, cache, None, prompts, top)


def test_collected_steps_let_go_of_their_cache() -> None:
    """The graphs' ops reach the cache by key (a table here and the C++ ops' registry): once the steps are
    collected their cache goes too, so each engine a process builds does not keep its pools for good."""
    torch._dynamo.reset()  # (see `setup`)
    buf, cache, graphs = _graphs_over(build_model(preset("k3-tiny"), seed=11))
    graphs.capture()  # each bucket's second scratch step is a direct call: what it holds must not keep the cache
    assert sum(g.direct_calls for g in graphs.step_graphs) > 0
    key, pool = graphs.key, weakref.ref(cache.recurrent[0])
    assert key in decode_graph._CACHES
    del graphs, cache, buf
    gc.collect()
    assert key not in decode_graph._CACHES and pool() is None


def test_the_dense_layers_run_the_few_row_gemm_op(setup) -> None:  # noqa: ANN001
    """On CPU in fp32 the compiled step's projections and logits are `radixk3_gemm::linear` calls (the few-row GEMM
    that reads the weights at the memory's rate; `kernels/linear_cpu.py`), a KDA layer's projections of its input
    one `radixk3_gemm::linears` call, not the GEMM library's."""
    model, buf, cache, graphs = setup
    if not linear_cpu.available():
        pytest.skip("no C++ CPU ops built here")
    prompts = _prompts(model.config.vocab_size)[:BUCKET]
    top = buf.geometry.num_state_slots - 1
    with torch.inference_mode():
        _generate(model, cache, None, prompts, top)
        with torch.profiler.profile() as prof:
            graphs.run(_next_step(prompts, top))
    calls = {e.key: e.count for e in prof.key_averages()}
    # every Linear but MLA's kv_b_proj, whose weight the attention op absorbs rather than multiplies by; a KDA
    # layer's four projections of its input (q|k|v, f_a, b, the gate's) in one `linears` call
    linears = sum(1 for name, m in model.named_modules() if isinstance(m, Linear) and not name.endswith("kv_b_proj"))
    kda = sum(1 for m in model.modules() if isinstance(m, KDAAttention))
    assert kda > 0 and calls.get("radixk3_gemm::linears", 0) == kda
    assert calls.get("radixk3_gemm::linear", 0) == linears - 4 * kda
    # the GEMM library's only calls left are the routers' logits (a few KB of weights each)
    assert calls.get("aten::mm", 0) == sum(1 for m in model.modules() if isinstance(m, Router))
    assert calls.get("aten::addmm", 0) == 0


def test_direct_pool_ops_are_the_generic_ones(setup, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """On CPU in fp32 the pool ops call the C++ ops directly, as torch ops registered in C++ (decided once per
    cache): the same bits as the generic entry points they skip (a second graph over the same cache, its ops
    the Python ones with every fused path off), in logits and in every state and KV row written."""
    model, buf, cache, graphs = setup
    direct = decode_graph._FUSED[graphs.key]
    assert direct == FusedPools.of(model, cache)
    if not any(direct):
        pytest.skip("no C++ CPU ops built here")
    assert graphs.cpp_ops == (all(direct) and pool_ops_cpu.available())
    monkeypatch.setenv(pool_ops_cpu.ENV_VAR, "0")
    generic = DecodeGraphs(model, cache, graphs.scratch, [BUCKET])
    assert not generic.cpp_ops
    decode_graph._FUSED[generic.key] = FusedPools(False, False, False)
    prompts = _prompts(model.config.vocab_size)[:BUCKET]
    top = buf.geometry.num_state_slots - 1
    results = []
    with torch.inference_mode():
        for steps in (graphs, generic):
            before = buf.data.clone()
            _generate(model, cache, None, prompts, top)  # the eager prefill and steps set the pools up
            logits = steps.run(_next_step(prompts, top))
            results.append((logits, buf.data.clone()))
            buf.data.copy_(before)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_checkpoints_are_the_states_around_the_replay(setup) -> None:  # noqa: ANN001
    """A decode step with radix checkpoints replays the graph too: a checkpoint at offset 0 holds the row's states
    (every KDA layer's recurrent and conv) from before the step, one at offset 1 those after it, bit for bit; the
    logits are the same as without checkpoints; a checkpoint on a live slot is refused."""
    model, buf, cache, graphs = setup
    prompts = _prompts(model.config.vocab_size)[:3]
    top = buf.geometry.num_state_slots - 1
    n = len(prompts)
    slots = torch.arange(top - 1, top - 1 - n, -1)
    table = torch.tensor([[(i + 1) * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)] for i in range(n)])
    pools = (*cache.recurrent, *cache.conv)

    def step(ck: StateCheckpoints | None) -> torch.Tensor:
        batch = ForwardBatch.from_table(ForwardMode.DECODE, torch.tensor([p[0] for p in prompts]), torch.arange(n + 1),
                                        torch.tensor([len(p) + MAX_NEW - 1 for p in prompts]), slots, table, PAGE,
                                        checkpoints=ck)
        assert graphs.supports(batch)
        return graphs.run(batch)

    with torch.inference_mode():
        _generate(model, cache, None, prompts, top)  # the eager prefill and steps set the pools up
        start = buf.data.clone()
        plain = step(None)
        after = [p[slots].clone() for p in pools]
        buf.data.copy_(start)
        before = [p[slots].clone() for p in pools]
        replays = graphs.replays
        free = (top - 1 - n, top - 2 - n)  # state slots past the rows', clear of their pages (the pool's two ends)
        assert (2 + n) * PAGES_PER_SEQ * buf.geometry.page_bytes < buf.geometry.state_offset(free[1])
        logits = step(StateCheckpoints(torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor(free)))
        assert graphs.replays == replays + 1
        assert torch.equal(logits, plain)
        for p, b, a in zip(pools, before, after, strict=True):
            assert torch.equal(p[free[0]], b[0]) and torch.equal(p[free[1]], a[2])
            assert torch.equal(p[slots], a)
        with pytest.raises(ValueError, match="distinct"):
            step(StateCheckpoints(torch.tensor([0]), torch.tensor([1]), slots[1:2]))
        with pytest.raises(ValueError, match="offset 0 or 1"):
            step(StateCheckpoints(torch.tensor([0]), torch.tensor([2]), torch.tensor(free[:1])))
        buf.data.copy_(start)


def test_a_window_is_its_steps_one_by_one(setup) -> None:  # noqa: ANN001
    """A `DecodeWindow` of 5 steps (3 rows padded to the bucket, a checkpoint after its third token) gives each
    step's logits, every pool byte and the checkpoint bit for bit as 5 separate replays whose ForwardBatches
    are built step by step; it checks every slot it writes once, up front. A row stopped after the first step
    feeds one more token and is then parked: its state stays what two steps left, its later KV rows unwritten,
    and the other rows' logits are unchanged bit for bit."""
    model, buf, cache, graphs = setup
    prompts = _prompts(model.config.vocab_size)[:3]
    top = buf.geometry.num_state_slots - 1
    n, steps = len(prompts), 5
    slots = torch.arange(top - 1, top - 1 - n, -1)
    free = top - 1 - n
    table = torch.tensor([[(i + 1) * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)] for i in range(n)])
    ck = StateCheckpoints(torch.tensor([1]), torch.tensor([1]), torch.tensor([free]))

    def batch(ids: list[int], j: int, checkpoints: StateCheckpoints | None = None) -> ForwardBatch:
        return ForwardBatch.from_table(ForwardMode.DECODE, torch.tensor(ids), torch.arange(n + 1),
                                       torch.tensor([len(p) + MAX_NEW - 1 + j for p in prompts]), slots, table, PAGE,
                                       checkpoints=checkpoints)

    with torch.inference_mode():
        _generate(model, cache, None, prompts, top)
        start = buf.data.clone()
        ids = [p[0] for p in prompts]
        one_by_one = []
        pools = (*cache.recurrent, *cache.conv)
        for j in range(steps):
            one_by_one.append(graphs.run(batch(ids, j, ck if j == 2 else None)))
            ids = one_by_one[-1].argmax(-1).tolist()
            if j == 1:
                row1_after_two = [p[slots[1]].clone() for p in pools]
        after = buf.data.clone()
        later = torch.tensor([2 * PAGES_PER_SEQ * PAGE + len(prompts[1]) + MAX_NEW - 1 + j for j in range(2, steps)])
        stepped = [lat[later].clone() for lat in cache.latent]  # row 1's KV rows at steps 2 on (pages contiguous)
        buf.data.copy_(start)
        window = DecodeWindow(graphs, batch([p[0] for p in prompts], 0), table, steps)
        replays, fed = graphs.replays, None
        call, seen = graphs.call, []
        graphs.call = lambda step: (seen.append(step), call(step))[1]  # type: ignore[method-assign]
        for j in range(steps):
            logits = window.step(fed, ck if j == 2 else None)
            assert torch.equal(logits, one_by_one[j]), j
            fed = logits.argmax(-1)
        del graphs.call
        assert graphs.replays == replays + steps
        for step in seen:  # every KV row a step names (past its length too) is one its row has written
            own = step.kv_rows[:n] - torch.tensor([(i + 1) * PAGES_PER_SEQ * PAGE for i in range(n)])[:, None]
            assert bool(((own >= 0) & (own < step.kv_lens[:n, None])).all())
        assert torch.equal(buf.data, after)
        with pytest.raises(ValueError, match="window of 5 steps"):
            window.step(fed, None)
        # Row 1 stops after the first step: it feeds one more token, then its state and KV are left alone.
        buf.data.copy_(start)
        untouched = [lat[later].clone() for lat in cache.latent]
        window, fed = DecodeWindow(graphs, batch([p[0] for p in prompts], 0), table, steps), None
        for j in range(steps):
            logits = window.step(fed, None)
            live = [0, 1, 2] if j < 2 else [0, 2]
            assert torch.equal(logits[live], one_by_one[j][live]), j
            fed = one_by_one[j].argmax(-1)  # the rows' own tokens, whatever the parked row's logits
            if j == 0:
                window.stop([1])
        assert all(torch.equal(p[slots[1]], a) for p, a in zip(pools, row1_after_two, strict=True))
        assert all(torch.equal(lat[later], u) for lat, u in zip(cache.latent, untouched, strict=True))
        assert not any(torch.equal(w, u) for w, u in zip(stepped, untouched, strict=True))  # the steps wrote them
        longest = max(len(p) for p in prompts) + MAX_NEW - 2 + steps
        short = table[:, : (longest - 1) // PAGE]  # the window's last step reads a token past these pages
        with pytest.raises(ValueError, match="block table of"):
            DecodeWindow(graphs, batch([p[0] for p in prompts], 0), short, steps)
        buf.data.copy_(start)


@pytest.mark.parametrize("window", [1, 3])
def test_engine_checkpoints_mid_decode_in_the_graph(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    """The engine with its compiled decode step and a radix checkpoint every 4 decode tokens, one step at a time
    or in windows of 3 (`DecodeWindow`): every decode step is a replay (the checkpointed ones too), the outputs
    are the no-cache loop's, and a second wave whose prompts extend the first's outputs resumes from those
    mid-decode checkpoints (state hits) with the no-cache loop's tokens."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    model = build_model(preset("k3-tiny"), seed=11)
    eng = LocalEngine(ServerArgs(page_size=PAGE, decode_checkpoint_interval=4, max_running_requests=2,
                                 compile_max_bs=2, mem_bytes=8 << 20, num_scheduler_steps=window), model, check=True)
    assert eng.worker.graphs is not None
    prompts = _prompts(model.config.vocab_size)[:2]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    first = eng.generate(prompts, params)
    assert first == [greedy_reference(model, p, 12) for p in prompts]
    m = eng.scheduler.metrics
    assert m.checkpoints > 0 and eng.worker.graphs.replays == m.decode_steps > 0
    if window > 1:  # fewer decode plans than decode steps: windows ran
        assert m.steps - m.extend_steps < m.decode_steps
    longer = [p + out[:9] for p, out in zip(prompts, first, strict=True)]
    hits = m.state_hits
    assert eng.generate(longer, params) == [greedy_reference(model, p, 12) for p in longer]
    assert eng.scheduler.metrics.state_hits > hits
    eng.scheduler.check_integrity()


def test_a_stop_inside_a_compiled_window_leaves_its_state_to_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the compiled step a sequence that samples a stop token mid-window feeds it and is then parked on
    the scratch slot and row: its state is its request's at the stop, so the whole output (the stop included) is
    donated and the next turn reuses all of it (no decode checkpoint falls inside: only the donation can give
    that), with the no-cache loop's tokens; the rows beside it decode on unchanged, and a failed draw past its stop
    (discarded with its sample) does not fail it."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    model = build_model(preset("k3-tiny"), seed=11)
    eng = LocalEngine(ServerArgs(page_size=1, num_scheduler_steps=8, decode_checkpoint_interval=64,
                                 max_running_requests=2, compile_max_bs=2, mem_bytes=8 << 20), model, check=True)
    prompts = _prompts(model.config.vocab_size)[:2]
    greedy = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    refs = [greedy_reference(model, p, 20) for p in prompts]
    at = next(i for i in range(9, 13) if refs[0][i] not in refs[0][:i])  # first sampled mid-window, not last in it
    parked: list[int] = []
    stop = DecodeWindow.stop
    monkeypatch.setattr(DecodeWindow, "stop", lambda self, seqs: (parked.extend(seqs), stop(self, seqs))[1])
    sample = eng.worker.sampler.sample

    def failing_past_the_stop(logits, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        res, errors = sample(logits, *args, **kwargs)  # a parked row's later draws fail: dropped with their samples
        alone = len(logits) == 1  # (the stopped request gone: its row index is another's)
        return res, errors + ([] if alone else [(i, "a draw past the stop") for i in parked])

    monkeypatch.setattr(eng.worker.sampler, "sample", failing_past_the_stop)
    rids = [eng.submit(prompts[0], greedy | {"stop_token_ids": [refs[0][at]]}), eng.submit(prompts[1], greedy)]
    outs = eng.run()
    assert len(parked) == 1  # the stop fell where the window parks its row (not in its last two steps)
    assert [outs[r][-1].finished for r in rids] == ["stop", "length"]
    got = [[t for o in outs[r] for t in o.token_ids] for r in rids]
    assert got == [refs[0][: at + 1], refs[1]]
    turn = prompts[0] + got[0] + [5, 6, 7]
    cached = eng.scheduler.metrics.cached_tokens
    assert eng.generate([turn], greedy | {"max_new_tokens": 6}) == [greedy_reference(model, turn, 6)]
    assert eng.scheduler.metrics.cached_tokens - cached == len(prompts[0]) + at + 1
    eng.scheduler.check_integrity()


def test_a_cpp_wrapper_that_fails_to_build_falls_back_to_the_python_one(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The worker compiles its decode step with inductor's C++ wrapper; where that fails (here: made to fail), it
    says so and compiles with the Python wrapper instead of decoding eagerly; with both failing, it decodes eagerly."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    capture = DecodeGraphs.capture

    def failing(self: DecodeGraphs, fail_all: bool) -> object:
        if self.cpp_wrapper or fail_all:
            raise RuntimeError("no C++ wrapper here")
        return capture(self)

    model = build_model(preset("k3-tiny"), seed=11)
    args = ServerArgs(page_size=PAGE, max_running_requests=1, compile_max_bs=1, mem_bytes=4 << 20)
    for fail_all in (False, True):
        monkeypatch.setattr(DecodeGraphs, "capture", lambda self, f=fail_all: failing(self, f))
        caplog.clear()
        eng = LocalEngine(args, model)
        assert "failed to build with inductor's C++ wrapper" in caplog.text
        if fail_all:
            assert eng.worker.graphs is None and "decode runs eagerly" in caplog.text
        else:
            assert eng.worker.graphs is not None and not eng.worker.graphs.cpp_wrapper
            prompt = _prompts(model.config.vocab_size)[0]
            assert eng.generate([prompt], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}) == [
                greedy_reference(model, prompt, 4)]
            assert eng.worker.graphs.replays == 3


def test_scratch_lies_outside_the_schedulers_pool() -> None:
    """The scratch slot and row start at or past the bytes the scheduler hands out, and do not overlap."""
    layout = pool_layout(preset("k3-tiny"), ServerArgs(page_size=PAGE))
    plain = PoolBuffer(layout, 1 << 20)
    buf = PoolBuffer(layout, 1 << 20, scratch=True)
    g = buf.geometry
    assert g == plain.geometry and plain.scratch_state_slot is None
    state_start = g.state_offset(buf.scratch_state_slot)
    kv_start = buf.scratch_kv_row * layout.kv_token_bytes
    assert state_start == g.total_bytes and kv_start >= state_start + g.state_block_bytes
    assert buf.data.numel() >= kv_start + layout.kv_token_bytes
    buf.recurrent_state(0)[buf.scratch_state_slot].fill_(1.0)
    buf.kv(0)[buf.scratch_kv_row].fill_(1.0)
    assert not bool(buf.data[: g.total_bytes].any())  # nothing the scheduler owns was written


def test_compile_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert ServerArgs().compile_decode and not ServerArgs(disable_compile=True).compile_decode
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert not ServerArgs().compile_decode
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert ServerArgs(disable_compile=True).compile_decode
    assert ServerArgs(compile_max_bs=32).compile_buckets == [1, 2, 4, 8, 16, 32]
    assert ServerArgs(compile_max_bs=32, max_running_requests=6).compile_buckets == [1, 2, 4, 6]
    assert ServerArgs(compile_max_bs=1).compile_buckets == [1]
