"""`StepGraph`: a compiled step function whose CPU graphs, once recorded, are called without dynamo. The oracle is
the same function run eagerly; what is checked is that a direct call happens only where its recording proved how
to make it, and then gives what dynamo's call gives."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from radixk3.step_graph import StepGraph


class Step(NamedTuple):
    ids: Tensor  # [B] int64
    pos: Tensor  # [B] int64
    rows: Tensor  # [B, S] int64, S dynamic


class Out(NamedTuple):
    y: Tensor
    extra: Tensor | None


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(32, 8, generator=gen))
        self.proj = nn.Linear(8, 8, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, step: Step) -> Out:
        # the length only through the last column and as a number, as the pool ops take a KV row table
        x = self.emb[step.ids] + self.emb[step.rows[:, -1]] * self.scale + step.pos[:, None] + step.rows.shape[1]
        return Out(self.proj(x), None)


def _step(b: int, s: int, seed: int) -> Step:
    gen = torch.Generator().manual_seed(seed)
    return Step(torch.randint(0, 32, (b,), generator=gen), torch.randint(0, 32, (b,), generator=gen),
                torch.randint(0, 32, (b, s), generator=gen))


def _graph(model: nn.Module) -> StepGraph:
    return StepGraph(model.forward, {}, True, [*model.parameters(), *model.buffers()])


def _through_dynamo(graph: StepGraph, step: Step) -> Out:
    graph.direct = False
    try:
        return graph(step, step.ids, step.rows)
    finally:
        graph.direct = True


# The compiled graph sums in its own order: within fp32 rounding of the function over a few dozen terms.
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _check(graph: StepGraph, model: nn.Module, step: Step) -> None:
    """The step through `graph` as it chooses: dynamo's call of the same graph bit for bit, the function's result
    within fp32 rounding."""
    out = graph(step, step.ids, step.rows)
    assert out.extra is None
    assert torch.equal(out.y, _through_dynamo(graph, step).y)
    torch.testing.assert_close(out.y, model(step).y, **CLOSE)


def test_direct_calls_equal_the_function_at_every_length() -> None:
    """The first call of a shape records its graph; later calls of it, at any KV length (no guard of the graph names
    it), call the graph directly, with the weights as they are now (written in place) and the result's structure
    (a None kept); a call under other global state (here the thread count) goes through dynamo."""
    torch._dynamo.reset()
    model = Toy()
    graph = _graph(model)
    with torch.inference_mode():
        for i, s in enumerate((16, 32, 48, 16, 80)):  # the length unguarded: one graph, called directly from then on
            _check(graph, model, _step(3, s, i))
        assert graph.direct_calls == 4
        model.proj.weight.mul_(2.0)  # a weight written in place: the direct call reads it
        _check(graph, model, _step(3, 32, 9))
        assert graph.direct_calls == 5
        step = _step(5, 16, 10)  # another bucket: recorded on its first call
        graph(step, step.ids, step.rows)
        assert graph.direct_calls == 5
        threads = torch.get_num_threads()  # global state dynamo guards (inductor's loops take the thread count)
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            _check(graph, model, _step(3, 32, 11))
            assert graph.direct_calls == 5
        finally:
            torch.set_num_threads(threads)


def test_steps_it_cannot_prove_go_through_dynamo() -> None:
    """A step whose fields are not contiguous, or are one tensor twice, and a graph that reads a tensor that is
    neither the step's nor a weight, all run through dynamo, and correctly."""
    torch._dynamo.reset()
    model = Toy()
    graph = _graph(model)
    with torch.inference_mode():
        step = _step(3, 16, 0)
        graph(step, step.ids, step.rows)
        wide = torch.randint(0, 32, (3, 32), generator=torch.Generator().manual_seed(1))
        strided = Step(step.ids, step.pos, wide[:, ::2])  # the recorded shapes, not contiguous
        twice = Step(step.ids, step.ids, step.rows)  # dynamo passes one tensor in two fields once
        for s in (strided, twice):
            _check(graph, model, s)
        assert graph.direct_calls == 0
        graph(step, step.ids, step.rows)
        assert graph.direct_calls == 1  # the step itself: recorded before
        stray = torch.full((8,), 3.0)  # read by the function, not a weight: never a fixed input

        def reads_stray(step: Step) -> Out:
            return Out(model(step).y + stray, None)

        other = StepGraph(reads_stray, {}, True, [*model.parameters()])
        for i in range(3):
            step = _step(3, 16, i)
            torch.testing.assert_close(other(step, step.ids, step.rows).y, reads_stray(step).y, **CLOSE)
        assert other.direct_calls == 0
        stray.fill_(-1.0)  # as dynamo sees it now
        torch.testing.assert_close(other(step, step.ids, step.rows).y, reads_stray(step).y, **CLOSE)


class Summed(Toy):
    """Reads every entry of the KV rows: inductor's reduction over the length guards a range of it (<= 4096)."""

    def forward(self, step: Step) -> Out:
        return Out(self.proj(self.emb[step.ids] + self.emb[step.rows].sum(1) * self.scale), None)


def test_a_length_the_graph_guards_is_called_directly_only_where_dynamo_ran_it() -> None:
    """Where a graph's guards name the KV length, a direct call serves only the lengths dynamo chose it for."""
    torch._dynamo.reset()
    model = Summed()
    graph = _graph(model)
    with torch.inference_mode():
        for i, s in enumerate((16, 32, 16, 48, 32)):
            _check(graph, model, _step(3, s, i))
    assert graph.direct_calls == 2  # the second 16 and 32


class Scaled:
    """A step function of an instance with an int attribute, as a `CapturedSteps` reads its cache key: every
    instance shares the function's code (and so dynamo's cache of it)."""

    def __init__(self, model: Toy, k: int) -> None:
        self.model, self.k = model, k

    def step(self, step: Step) -> Out:
        return Out(self.model(step).y * self.k, None)


def test_an_int_that_dynamo_made_an_input_is_never_taken_for_the_length() -> None:
    """A second instance of one step function (one code object, one backend: its compiled entries are shared) with
    another int (16, then 32, as the KV lengths): dynamo makes the int a symbolic graph input, which a direct call
    cannot fill, so that instance's steps go through dynamo, and its int is never taken for the length (a value
    alone would say it is one): the function's results at every length, for both instances."""
    torch._dynamo.reset()
    model = Toy()
    for k in (16, 32):  # powers of two: y * k is exact, so y is compared
        scaled = Scaled(model, k)
        graph = StepGraph(scaled.step, {}, True, [*model.parameters(), *model.buffers()])
        with torch.inference_mode():
            for i, s in enumerate((16, 32, 48, 32)):
                step = _step(3, s, i)
                out = graph(step, step.ids, step.rows)
                assert torch.equal(out.y, _through_dynamo(graph, step).y)
                torch.testing.assert_close(out.y / k, model(step).y, **CLOSE)
        assert graph.direct_calls == (3 if k == 16 else 0)  # the first instance's steps after its first
