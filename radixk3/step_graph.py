"""A captured step function, compiled by torch.compile and, on CPU, called without dynamo once compiled.

Why: a compiled step is called through dynamo's frame evaluation (its guards, then bytecode that gathers the
graph's inputs: the step's tensors and every weight of the model, ~140 of them for k3-small) and AOTAutograd's
runtime wrapper before inductor's code runs. A captured step's inputs never change but for the step's own tensors
(its rows static, its KV length dynamic), so, as SGLang's CUDA-graph runner replays a graph, the graph dynamo
runs for a step's shapes is recorded on that step's call (`_recording_backend`) and later steps of those shapes
call it directly, with inputs built from the step's fields and the weights it read (`DirectCall`). k3-small's
batch-1 step 5.17 -> 4.93 ms (median graph call; 6.30 -> 6.01 ms a token in one process, windows of 8), the
built-in model's 0.53 -> 0.43 ms; a batch-32 step within noise (interleaved runs, same tokens).

A graph is called directly only where its recording proved how: one graph ran; each of its inputs is one of the
step's tensors, the dynamic length (the int whose symbol is that length's in the traced shapes), a size the step's
shapes fix (the key), or a parameter or buffer of the model (those fixed objects are what the graph reads: a
serving model's weights are written in place, never replaced); dynamo's result is the graph's outputs, in order,
in the step function's structure (leaves None but those). Anything else goes through dynamo as before: a step
whose fields are not contiguous CPU tensors or repeat one tensor, a graph with another input (an instance's int
that dynamo made symbolic once a second engine in the process ran the same code: its cache key), and CUDA (CUDA
graphs: `cudagraph_mark_step_begin` and the trees' bookkeeping stay with torch.compile). What direct calls skip
are dynamo's guards: the key holds what they check of a step (dtypes, shapes, contiguity, the few-row GEMM's
switch); the model's modules are not guarded anyway (`decode_graph.compile_options`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from kernels import linear_cpu

StepInputs = Sequence[Tensor]  # a step: a NamedTuple of tensors (`PaddedDecode`, `PaddedVerify`, ...)


class Source(NamedTuple):
    """Where one graph input comes from: the step's field `field`, that field's size at `dim` (the dynamic KV
    length), or `fixed`: a weight, or a size that the step's shapes (the graph's key) fix."""

    field: int = -1
    dim: int = -1
    fixed: Tensor | int | None = None


class DirectCall(NamedTuple):
    """One compiled graph and how to call it with a step: its inputs' sources, its result's structure (whose
    leaves are None but the graph's outputs, in turn, at `outputs`)."""

    graph: Callable[..., Sequence[Tensor]]
    sources: tuple[Source, ...]
    structure: pytree.TreeSpec
    outputs: tuple[int, ...]

    def __call__(self, step: StepInputs) -> Any:  # noqa: ANN401
        args = [s.fixed if s.field < 0 else step[s.field] if s.dim < 0 else step[s.field].shape[s.dim]
                for s in self.sources]
        leaves: list[Tensor | None] = [None] * self.structure.num_leaves
        for at, out in zip(self.outputs, self.graph(*args), strict=True):
            leaves[at] = out
        return pytree.tree_unflatten(leaves, self.structure)


# A graph input's symbolic sizes as dynamo traced it: a tensor's shape, an int's expression (None: neither)
Symbols = tuple[str, ...] | str | None
# What a recording call saw: each graph it ran, with its inputs, their symbols and its outputs
Seen = list[tuple[Callable[..., Sequence[Tensor]], tuple[Any, ...], list[Symbols], Sequence[Tensor]]]


class _Recording(threading.local):
    """The graphs the current thread's recording call ran (`seen`; None while not recording). Per thread and not
    per `StepGraph`: dynamo's cache of compiled frames lives as long as a step function's code and is shared by
    its instances (a second engine's steps of the same shapes find the first's graphs), so a backend's graphs
    report to whichever step records, and hold none of them alive."""

    seen: Seen | None = None


_RECORDING = _Recording()


def _recording_backend(options: dict[str, Any]) -> Callable[..., Any]:
    """A torch.compile backend: inductor (`compile_fx` with `options`, as the "inductor" backend calls it), each
    graph's calls noted while a step records (`_RECORDING`)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        symbols = [_symbols(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"]
        graph = compile_fx(gm, example_inputs, config_patches=options)

        def run(*args: Any) -> Sequence[Tensor]:  # noqa: ANN401  (dynamo calls a backend's graph unboxed)
            outs = graph(*args)
            seen = _RECORDING.seen
            if seen is not None:
                seen.append((graph, args, symbols, outs))
            return outs

        return run

    return backend


def _symbols(value: Any) -> Symbols:  # noqa: ANN401
    if isinstance(value, Tensor):
        return tuple(str(d) for d in value.shape)
    if isinstance(value, torch.SymInt):
        return str(value)
    return None


class StepGraph:
    """`fn(step)` compiled with torch.compile (fullgraph, `options`); on CPU each of its graphs called directly
    once recorded (see the module's docstring). `weights`: the tensors a graph may read as fixed inputs (the
    model's parameters and buffers)."""

    def __init__(self, fn: Callable[[Any], Any], options: dict[str, Any], direct: bool,
                 weights: Sequence[Tensor]) -> None:
        self.direct = direct
        guard_filter = {k: v for k, v in options.items() if k == "guard_filter_fn"}
        if direct:
            inductor = {k: v for k, v in options.items() if k != "guard_filter_fn"}
            self._compiled = torch.compile(fn, fullgraph=True, backend=_recording_backend(inductor),
                                           options=dict(guard_filter))
        else:
            self._compiled = torch.compile(fn, fullgraph=True, options=dict(options))
        self._weights = {id(w): w for w in weights}
        self._calls: dict[tuple[Any, ...], DirectCall] = {}
        self.direct_calls = 0  # steps served without dynamo (tests check that the path ran)

    def __call__(self, step: StepInputs, static: Tensor, dynamic: Tensor) -> Any:  # noqa: ANN401
        """fn(step), `static`'s first dimension static and `dynamic`'s second dynamic (both fields of `step`)."""
        key = self._key(step, dynamic) if self.direct else None
        if key is not None:
            call = self._calls.get(key) or self._calls.get((*key, dynamic.shape[1]))
            if call is not None:
                self.direct_calls += 1
                return call(step)
        torch._dynamo.mark_static(static, 0)
        torch._dynamo.mark_dynamic(dynamic, 1)
        if key is None:
            return self._compiled(step)
        seen: Seen = []
        _RECORDING.seen = seen
        try:
            result = self._compiled(step)
        finally:
            _RECORDING.seen = None
        self._record(key, step, dynamic, seen, result)
        return result

    @staticmethod
    def _key(step: StepInputs, dynamic: Tensor) -> tuple[Any, ...] | None:
        """What the graph of a step is chosen by: the fast-linear switch, each field's dtype and shape (the
        dynamic length left out); None (through dynamo) where a field is not a contiguous CPU tensor, or two
        fields are one tensor (dynamo passes it once)."""
        if len({id(t) for t in step}) != len(step):
            return None
        key: list[Any] = [linear_cpu.enabled()]
        for t in step:
            if not isinstance(t, Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                return None
            key.append((t.dtype, tuple(t.shape) if t is not dynamic else (t.shape[0], -1)))
        return tuple(key)

    def _record(self, key: tuple[Any, ...], step: StepInputs, dynamic: Tensor,
                seen: Seen, result: Any) -> None:  # noqa: ANN401
        """Keep how to call the graph that just ran directly, where this call shows it (one graph ran, its inputs
        all accounted for, its outputs dynamo's result)."""
        if len(seen) != 1:
            return
        graph, args, symbols, outs = seen[0]
        leaves, structure = pytree.tree_flatten(result)
        outputs = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor))
        if (len(outputs) != len(outs) or any(leaves[i] is not o for i, o in zip(outputs, outs, strict=True))
                or any(not isinstance(leaf, Tensor | None) for leaf in leaves)):
            return
        fields = list(step)
        if len({id(t) for t in fields}) != len(fields):
            return
        dyn = next(i for i, t in enumerate(fields) if t is dynamic)
        at_dyn = next((j for j, a in enumerate(args) if a is dynamic), None)
        if len(symbols) != len(args) or at_dyn is None:
            return
        dyn_symbols = symbols[at_dyn]
        assert isinstance(dyn_symbols, tuple)
        width = dyn_symbols[1]  # the dynamic length's symbol (a number where the graph was specialised to it)
        # the symbols of the step's other sizes: the key (the step's shapes) fixes them
        fixed_sizes = {d for j, a in enumerate(args) if any(a is t for t in fields) for d in symbols[j] or ()} - {width}
        sources: list[Source] = []
        sized = False
        for a, sym in zip(args, symbols, strict=True):
            if isinstance(a, Tensor):
                at = next((i for i, t in enumerate(fields) if t is a), None)
                if at is not None:
                    sources.append(Source(field=at))
                elif id(a) in self._weights:
                    sources.append(Source(fixed=self._weights[id(a)]))
                else:
                    return
            elif isinstance(a, int) and sym == width:
                sources.append(Source(field=dyn, dim=1))
                sized = True
            elif isinstance(a, int) and sym in fixed_sizes:
                sources.append(Source(fixed=a))
            else:  # an int of another source (an attribute dynamo made symbolic): not known here
                return
        # a graph without the length as an input was specialised to this length: only for it
        self._calls[key if sized else (*key, dynamic.shape[1])] = DirectCall(graph, tuple(sources), structure,
                                                                                 outputs)
