"""A captured step function, compiled by torch.compile and, on CPU, called without dynamo once compiled.

Why: a compiled step is called through dynamo's frame evaluation (its guards, then bytecode that gathers the
graph's inputs: the step's tensors and every weight of the model, ~140 of them for k3-small) before inductor's
code (with AOTAutograd's runtime wrapper) runs. A captured step's inputs never change but for the step's own
tensors, so, as SGLang's CUDA-graph runner replays a graph, the graph dynamo runs for a step is recorded on that
step's call (`_recording_backend`), and later steps that dynamo's guards would send to the same graph call it
directly, with inputs built from the step's fields and the weights it read (`DirectCall`). k3-small's batch-1 step
5.17 -> 4.93 and 5.02 -> 4.72 ms (median graph call, two runs; 6.30 -> 6.01 and 6.03 -> 5.71 ms a token in one
process, windows of 8), the built-in model's 0.53 -> 0.43 ms; a batch-32 step within noise (interleaved runs, same
tokens).

What dynamo's guards check of a call is the direct call's key (`StepGraph._key`): each field's dtype, shape (the
KV length too, unless no guard of the graph names its symbol and its range is every size from 2, as dynamo leaves
a dynamic size: then one recording serves every length), grad and inference flags, the process state the traced
code reads (the few-row GEMM's switch, the kernel backend) and the global state dynamo guards (`GlobalStateGuard`:
grad mode, threads, default dtype). The model's modules are not guarded anyway (`decode_graph.compile_options`).
A graph is called directly only where its recording accounts for it: one graph ran; each of its inputs is a field
of the step, an int whose traced symbol is one of the step's sizes, or a parameter or buffer of the model (the
fixed objects the graph reads: a serving model's weights are written in place, never replaced); dynamo's result
is the graph's outputs, in order, in the step function's structure. Anything else goes through dynamo as before:
a step whose fields are not contiguous plain CPU tensors or repeat one tensor, a graph with another input (an int
dynamo made symbolic: a cache key, once engines of two caches in one process ran the same step code; their graphs
are shared, as before, not called directly), and CUDA (CUDA graphs: `cudagraph_mark_step_begin` and the trees'
bookkeeping stay with torch.compile).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch._C._dynamo.guards import GlobalStateGuard
from torch.utils._sympy.numbers import int_oo

from kernels import linear_cpu
from kernels.backend import kernel_backend

_CPU = torch.device("cpu")

StepInputs = Sequence[Tensor]  # a step: a NamedTuple of tensors (`PaddedDecode`, `PaddedVerify`, ...)


class Source(NamedTuple):
    """Where one graph input comes from: the step's field `field` (its size at `dim`: the KV length), or `fixed`:
    a weight, or a size that the step's shapes (the graph's key) fix."""

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
    state: GlobalStateGuard  # the global state dynamo guards (grad mode, threads, default dtype, ...) as recorded

    def __call__(self, step: StepInputs) -> Any:  # noqa: ANN401
        args = [s.fixed if s.field < 0 else step[s.field] if s.dim < 0 else step[s.field].shape[s.dim]
                for s in self.sources]
        leaves: list[Tensor | None] = [None] * self.structure.num_leaves
        for at, out in zip(self.outputs, self.graph(*args), strict=True):
            leaves[at] = out
        return pytree.tree_unflatten(leaves, self.structure)


# A graph input's symbolic sizes as dynamo traced it: a tensor's shape, an int's expression (None: neither)
Symbols = tuple[str, ...] | str | None
# What a recording call saw: each graph it ran, with its inputs, their symbols, the symbols no guard names, its outputs
Seen = list[tuple[Callable[..., Sequence[Tensor]], tuple[Any, ...], list[Symbols], frozenset[str], Sequence[Tensor]]]


class _Recording(threading.local):
    """The graphs the current thread's recording call ran (`seen`; None while not recording). Module state, not a
    `StepGraph`'s: the backend's graphs live in dynamo's cache of the step function's code, which outlives any
    instance, and must hold none alive (nor, through it, its cache)."""

    seen: Seen | None = None


_RECORDING = _Recording()


@functools.cache
def _recording_backend(options: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    """A torch.compile backend: inductor (`compile_fx` with `options`, as the "inductor" backend calls it), each
    graph's calls noted while a step records (`_RECORDING`). One per options: dynamo reuses a compiled entry only
    for its own backend, and the step functions' entries serve every instance (every engine in a process)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        symbols = [_symbols(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"]
        graph = compile_fx(gm, example_inputs, config_patches=dict(options))
        free = _unguarded_symbols()

        def run(*args: Any) -> Sequence[Tensor]:  # noqa: ANN401  (dynamo calls a backend's graph unboxed)
            outs = graph(*args)
            seen = _RECORDING.seen
            if seen is not None:
                seen.append((graph, args, symbols, free, outs))
            return outs

        return run

    return backend


def _unguarded_symbols() -> frozenset[str]:
    """The symbols of the graph being compiled that no guard of its mentions and whose range is every size from 2
    up (dynamo's default for a dynamic size): a graph valid at one value of such a symbol is valid at all of them.
    Read after inductor compiled it, as its guards are complete then."""
    ctx = torch._guards.TracingContext.try_get()
    env = ctx.fake_mode.shape_env if ctx is not None and ctx.fake_mode is not None else None
    if env is None:
        return frozenset()
    guarded = {str(x) for g in env.guards for x in g.expr.free_symbols}
    return frozenset(str(x) for x, r in env.var_to_range.items()
                     if str(x) not in guarded and r.lower <= 2 and r.upper == int_oo)


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
            inductor = tuple(sorted((k, v) for k, v in options.items() if k != "guard_filter_fn"))
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
            if call is not None and call.state.check():
                self.direct_calls += 1
                return call(step)
        torch._dynamo.mark_static(static, 0)
        torch._dynamo.mark_dynamic(dynamic, 1)
        if key is None:
            return self._compiled(step)
        before, seen = _RECORDING.seen, []
        _RECORDING.seen = seen
        try:
            result = self._compiled(step)
        finally:
            _RECORDING.seen = before
        found = self._direct(step, dynamic, seen, result)
        if found is not None:
            call, any_length = found
            self._calls[key if any_length else (*key, dynamic.shape[1])] = call
        return result

    @staticmethod
    def _key(step: StepInputs, dynamic: Tensor) -> tuple[Any, ...] | None:
        """What dynamo's guards check of a step, which the graph a direct call runs was chosen by: each field's
        dtype, shape (but the KV length: see `_direct`), grad and inference flags, and what the traced code reads
        of the process (the few-row GEMM's switch, the kernel backend's); None (through dynamo) where a field is
        not a contiguous plain CPU tensor or two fields are one tensor (dynamo passes it once)."""
        if len({id(t) for t in step}) != len(step):
            return None
        key: list[Any] = [linear_cpu.enabled(), kernel_backend(_CPU)]
        for t in step:
            if type(t) is not Tensor or t.device.type != "cpu" or not t.is_contiguous():
                return None
            shape = tuple(t.shape) if t is not dynamic else (t.shape[0], -1, *t.shape[2:])
            key.append((t.dtype, shape, t.requires_grad, t.is_inference()))
        return tuple(key)

    def _direct(self, step: StepInputs, dynamic: Tensor, seen: Seen,
                result: Any) -> tuple[DirectCall, bool] | None:  # noqa: ANN401
        """How to call the graph this step ran directly, where the call shows it: one graph ran; each of its inputs
        is a field of the step, an int whose traced symbol is one of the step's sizes, or a weight; its outputs
        are dynamo's result. With whether it serves every KV length: where the length's symbol is free (no guard
        of the graph names it, its range every size from 2), else only this length. None otherwise."""
        if len(seen) != 1:
            return None
        graph, args, symbols, free, outs = seen[0]
        leaves, structure = pytree.tree_flatten(result)
        outputs = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor))
        if (len(outputs) != len(outs) or any(leaves[i] is not o for i, o in zip(outputs, outs, strict=True))
                or any(not isinstance(leaf, Tensor | None) for leaf in leaves) or len(symbols) != len(args)):
            return None
        fields = list(step)
        at = [next((i for i, t in enumerate(fields) if t is a), -1) for a in args]
        dyn = next((j for j, a in enumerate(args) if a is dynamic), None)
        dyn_symbols = symbols[dyn] if dyn is not None else None
        if not isinstance(dyn_symbols, tuple) or len(dyn_symbols) < 2:
            return None
        length = dyn_symbols[1]  # the KV length's symbol (a number where the graph was specialised to it)
        any_length = length in free
        sizes = {d for j, i in enumerate(at) if i >= 0 and isinstance(symbols[j], tuple) for d in symbols[j]}
        sources: list[Source] = []
        for a, i, sym in zip(args, at, symbols, strict=True):
            if i >= 0:
                sources.append(Source(field=i))
            elif isinstance(a, Tensor) and id(a) in self._weights:
                sources.append(Source(fixed=self._weights[id(a)]))
            elif isinstance(a, int) and any_length and sym == length:
                sources.append(Source(field=at[dyn], dim=1))
            elif isinstance(a, int) and isinstance(sym, str) and sym in sizes:
                sources.append(Source(fixed=a))  # a size the key fixes (the length too, where not free)
            else:  # another tensor, or an int of another source (an attribute dynamo made symbolic)
                return None
        return DirectCall(graph, tuple(sources), structure, outputs, GlobalStateGuard()), any_length
