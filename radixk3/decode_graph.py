"""The captured decode step: the whole decode forward (every layer, the attention backend's pool ops, the
logits) compiled once per batch-size bucket and replayed, as SGLang's CUDA-graph runner does on GPU.

- Buckets: a step of n sequences runs at the smallest bucket B >= n (the worker's: 1, 2, 4, ...); rows n..B-1
  are padding: they read and write only the pool's scratch state slot and scratch KV row (`Scratch`, kept
  outside the scheduler's slots) and their logits are dropped. Shapes are static per bucket except the length of
  the KV row table (dynamic on CPU; padded to a power of two on CUDA, where each length records its own graph).
- The graph covers the decode step: one token per sequence, one rank (no collectives); a step's radix-tree
  checkpoints are slot copies before and after the replay (`DecodeGraphs.run`); with `with_hidden` it also returns
  the pre-norm final hiddens (the MTP proposer reads them).
  Everything else runs eagerly (`DecodeGraphs.supports`). Sampling (grammar masks, biases) stays outside the
  graph, so constrained requests still replay it. The slot checks that read tensors back to the host (the eager
  backend's `_validate`, here `DecodeGraphs.validate`) run once per step before the call.
- The pool ops (short conv, KDA, MLA store + attention) are opaque custom ops inside the graph (see `_CACHES`);
  inductor compiles and fuses everything around them (projections, norms, gates, the MoE, the logits).
- CPU: inductor (C++ codegen). CUDA: the same compiled step with CUDA graphs (mode "reduce-overhead").
The eager forward stays the oracle: `tests/runtime/test_decode_graph.py` checks the compiled step's greedy tokens
against the eager step's.
"""

from __future__ import annotations

import abc
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import conv1d_cpu as fused_conv
from kernels import kda_decode_cpu as fused_kda
from kernels import linear_cpu, pool_ops_cpu
from kernels import mla_decode_cpu as fused_mla
from kernels.backend import kernel_backend
from kernels.conv1d_pool import conv1d_decode
from kernels.kda_pool import kda_decode
from kernels.mla import mla_decode_padded, mla_decode_padded_cpu
from kernels.mla_paged import check_store_slots, mla_store
from kernels.opaque_op import opaque_op
from kernels.state_checkpoints import StateCheckpoints, check_slots
from radixk3.attention_backend import SlotPairs, copy_states, decode_checkpoints
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.kda_attention import KDAAttention
from radixk3.model import KimiForCausalLM
from radixk3.step_graph import StepGraph

log = logging.getLogger(__name__)


class Scratch(NamedTuple):
    """Where padded rows read and write: a KDA state slot and a KV row no sequence ever owns."""

    state_slot: int
    kv_row: int


class PaddedDecode(NamedTuple):
    """One bucket's inputs, B rows (padding included)."""

    input_ids: Tensor  # [B] int64
    state_slots: Tensor  # [B] int64
    kv_slots: Tensor  # [B] int64, where each row's new latent is stored
    kv_rows: Tensor  # [B, S] int64, each row's cached KV rows (its own token's last), padded with any valid row
    kv_lens: Tensor  # [B] int64, valid entries of kv_rows per row


# The pool views alias one byte buffer in several dtypes, which a compiled graph cannot take as mutated inputs
# (AOTAutograd refuses aliased inputs with different bases, and as_strided views of one base cannot be
# functionalised). So the pool ops are opaque custom ops that reach the cache through this table, by key: inside
# the graph they are calls on activations only; the pools are state outside it, as a KV cache is to a CUDA graph
# (fixed addresses, written in place).
_CACHES: dict[int, HybridCache] = {}
_NEXT_KEY = itertools.count()


class FusedPools(NamedTuple):
    """Which pool ops of a cache's captured steps call the C++ CPU ops directly, decided once when the steps are
    built (each op's switch, `RADIXK3_FUSED_*=0`, is still read at every call): the generic entry points re-check
    backend, dtypes and layouts and convert their inputs at every call, a few microseconds each in an interpreter
    that a step's weight reads keep evicting from the caches (~80 us a conv call in a batch-1 step, ~13 of it the
    op itself)."""

    conv: bool
    kda: bool
    mla: bool

    @staticmethod
    def of(model: KimiForCausalLM, cache: HybridCache) -> FusedPools:
        dev = model.device
        cpu32 = dev.type == "cpu" and kernel_backend(dev) == "torch" and model.lm_head.weight.dtype == torch.float32
        weights = [m.conv_weight() for m in model.modules() if isinstance(m, KDAAttention)]
        conv = (cpu32 and fused_conv.available() and all(fused_conv.pool_fusable(p) for p in cache.conv)
                and all(w.dtype == torch.float32 and w.is_contiguous() for w in weights))
        kda = cpu32 and fused_kda.available() and all(fused_kda.pool_fusable(p) for p in cache.recurrent)
        mla = cpu32 and fused_mla.available() and all(
            p.dtype == torch.float32 and p.stride(-1) == 1 for p in cache.latent)
        return FusedPools(conv, kda, mla)


_FUSED: dict[int, FusedPools] = {}
_GRAPH_ENTRIES = 0  # the compiled entries all CapturedSteps of this process may make (dynamo's limits follow)


def compile_options(cuda: bool, cpp_wrapper: bool = False) -> dict[str, object]:
    """torch.compile's options for a captured step: CUDA graphs on CUDA (mode "reduce-overhead"), and no guards
    on the model's modules: a serving model's modules never change (its weights are read at each call, never
    baked in), and checking them cost ~90 us a call on CPU, a tenth of a batch-1 MTP draft step. `cpp_wrapper`
    (CPU): inductor's C++ wrapper, which makes the step's kernel and op calls from C++ (the worker's default;
    `--disable-cpp-wrapper`)."""
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} | (
        {"triton.cudagraphs": True} if cuda else {"cpp_wrapper": True} if cpp_wrapper else {})


# Outputs are contiguous, as their fake (shape) functions say.
@opaque_op("radixk3::pool_conv_decode")
def pool_conv_decode(cache_key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor) -> Tensor:
    """`conv1d_decode` on KDA layer `layer`'s conv pool of cache `cache_key`, in place."""
    pool = _CACHES[cache_key].conv[layer]
    if _FUSED[cache_key].conv and fused_conv.available():  # the same op conv1d_decode picks, and the same SiLU
        return F.silu(fused_conv.conv1d_cpu_prepared(x.contiguous(), weight, pool, slots.contiguous()))
    return conv1d_decode(x, weight, pool, slots, validate=False).contiguous()


@torch.library.register_fake("radixk3::pool_conv_decode")
def _(cache_key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor) -> Tensor:
    return torch.empty_like(x)


@opaque_op("radixk3::pool_kda_decode")
def pool_kda_decode(cache_key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    slots: Tensor) -> Tensor:
    """`kda_decode` on KDA layer `layer`'s recurrent pool of cache `cache_key`, in place."""
    pool = _CACHES[cache_key].recurrent[layer]
    if _FUSED[cache_key].kda and fused_kda.available():  # kda_decode's op (no gate, beta or norm here)
        return fused_kda.kda_decode_cpu(q, k, v, g, beta, pool, slots, q.shape[-1] ** -0.5)
    return kda_decode(q, k, v, g, beta, pool, slots, validate=False).contiguous()


@torch.library.register_fake("radixk3::pool_kda_decode")
def _(cache_key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
      slots: Tensor) -> Tensor:
    return torch.empty_like(v)


@opaque_op("radixk3::pool_mla_decode")
def pool_mla_decode(cache_key: int, layer: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor,
                    kv_slots: Tensor, kv_rows: Tensor, kv_lens: Tensor, scale: float) -> Tensor:
    """Store the new latents in MLA layer `layer`'s buffer of cache `cache_key`, then attend over `kv_rows`."""
    buf = _CACHES[cache_key].latent[layer]
    if _FUSED[cache_key].mla and fused_mla.available():  # mla_store's, then mla_decode_padded's op
        buf.index_put_((kv_slots,), latent)
        return mla_decode_padded_cpu(q_nope, q_pe, buf, kv_b_weight, kv_rows, kv_lens, scale=scale).contiguous()
    mla_store(buf, kv_slots, latent, validate=False)
    return mla_decode_padded(q_nope, q_pe, buf, kv_b_weight, kv_rows, kv_lens, scale=scale).contiguous()


@torch.library.register_fake("radixk3::pool_mla_decode")
def _(cache_key: int, layer: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor,
      kv_slots: Tensor, kv_rows: Tensor, kv_lens: Tensor, scale: float) -> Tensor:
    n, h, dn = q_nope.shape
    return q_nope.new_empty(n, h, kv_b_weight.shape[0] // h - dn)


class PaddedDecodeBackend:
    """The attention backend of a captured decode step (the interface of `AttentionBackend`): fixed shapes,
    no host reads, no checkpoints; the pool ops are the custom ops above, or with `cpp_ops` their fused paths
    as torch ops registered in C++ (`kernels/pool_ops_cpu.py`: no Python in the call)."""

    decode = True
    verify = False

    def __init__(self, cache_key: int, step: PaddedDecode, cpp_ops: bool = False) -> None:
        self.key = cache_key
        self.step = step
        self.cpp_ops = cpp_ops

    def short_conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        op = pool_ops_cpu.conv_decode if self.cpp_ops else pool_conv_decode
        return op(self.key, layer, x, weight, self.step.state_slots)

    def kda(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        op = pool_ops_cpu.kda_decode if self.cpp_ops else pool_kda_decode
        return op(self.key, layer, q, k, v, g, beta, self.step.state_slots)

    def mla(self, layer: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor,
            scale: float) -> Tensor:
        s = self.step
        op = pool_ops_cpu.mla_decode if self.cpp_ops else pool_mla_decode
        return op(self.key, layer, q_nope, q_pe, latent, kv_b_weight, s.kv_slots, s.kv_rows, s.kv_lens, scale)


class GraphOutput(NamedTuple):
    """A captured step's outputs: fp32 logits at every row, and (for a proposer that reads them, `with_hidden`)
    the pre-norm final hiddens there."""

    logits: Tensor
    hidden: Tensor | None


def padded_decode_logits(model: KimiForCausalLM, cache_key: int, step: PaddedDecode,
                         with_hidden: bool = False, cpp_ops: bool = False) -> GraphOutput:
    """The decode forward of `step`'s B rows over cache `cache_key` -> fp32 logits [B, V] (what is captured);
    `cpp_ops`: the pool ops registered in C++ (`PaddedDecodeBackend`)."""
    b = step.input_ids.shape[0]
    cu = torch.arange(b + 1, device=step.input_ids.device)
    # kv_rows is a page table of page size 1: the layers see an ordinary decode batch.
    batch = ForwardBatch(ForwardMode.DECODE, step.input_ids, cu, step.kv_lens - 1, step.state_slots, step.kv_rows,
                         1, step.kv_slots, attn_backend=PaddedDecodeBackend(cache_key, step, cpp_ops))  # type: ignore[arg-type]
    hidden = model._prenorm_hidden(step.input_ids, cu, batch)
    return GraphOutput(model.lm_head(model.model.norm(hidden)).float(), hidden if with_hidden else None)


@dataclass
class CaptureReport:
    """What starting the graphs cost: seconds per bucket (compile and the first replays)."""

    mode: str
    seconds: dict[int, float]


def row_table(block_table: Tensor, page_size: int, kv_lens: Tensor, width: int) -> Tensor:
    """[R, width] KV rows: row r's first kv_lens[r] positions through its pages `block_table` [R, P], then its
    last position repeated (any valid row: masked out)."""
    pos = torch.minimum(torch.arange(width, device=block_table.device)[None, :], kv_lens[:, None] - 1)
    return block_table.gather(1, pos // page_size) * page_size + pos % page_size


def _release(key: int, registered: bool) -> None:
    """Let go of what a collected set of captured steps left reachable by its key: its cache (the pool tensors)
    here and, `registered`, in the C++ ops' registry; else every engine built in a process keeps its pools."""
    _CACHES.pop(key, None)
    _FUSED.pop(key, None)
    if registered:
        pool_ops_cpu.unregister_pools(key)


def pad_rows(x: Tensor, rows: int, fill: float) -> Tensor:
    """x [n, ...] padded to `rows` rows of `fill`."""
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), fill)]) if rows > x.shape[0] else x


class CapturedSteps(abc.ABC):
    """What every set of captured steps shares: its cache, reached by key from inside the graphs (`_CACHES`), its
    batch-size buckets, the compile options, how a step is replayed (its rows static, its KV length dynamic) and
    how wide a KV row table is."""

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, buckets: Sequence[int],
                 graphs_per_bucket: int, cpp_wrapper: bool = False) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"batch-size buckets must be >= 1, got {list(buckets)}")
        self.model, self.cache = model, cache
        self.key = next(_NEXT_KEY)
        _CACHES[self.key] = cache
        _FUSED[self.key] = FusedPools.of(model, cache)
        # Every fused op built and the C++ registry of pools loaded: the steps call the fused paths with no Python
        # in the call. Decided here, once (the generic ops' switches are read per call; these are not).
        self.cpp_ops = all(_FUSED[self.key]) and pool_ops_cpu.available()
        if self.cpp_ops:
            pool_ops_cpu.register_pools(self.key, cache.conv, cache.recurrent, cache.latent)
        weakref.finalize(self, _release, self.key, self.cpp_ops).atexit = False  # the process's end frees all
        # The dense layers' few-row GEMMs in C++ too, where it builds (each layer decides by dtype and rows).
        self.fused_linear = (model.device.type == "cpu" and kernel_backend(model.device) == "torch"
                             and linear_cpu.available())
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.buckets = sorted(set(buckets))
        self.cpp_wrapper = cpp_wrapper and not self.cuda
        # a label: `compile_options` sets it up
        self.mode = "reduce-overhead" if self.cuda else "cpp_wrapper" if self.cpp_wrapper else "default"
        # One code object per step function, shared by every instance (a process may build several, over other
        # caches or options), one recompile per bucket (and the dynamic KV length): room for all of them, or a
        # fullgraph compile past the limit fails.
        global _GRAPH_ENTRIES
        _GRAPH_ENTRIES += graphs_per_bucket * len(self.buckets)
        dynamo = torch._dynamo.config
        dynamo.cache_size_limit = max(dynamo.cache_size_limit, _GRAPH_ENTRIES)
        dynamo.accumulated_cache_size_limit = max(dynamo.accumulated_cache_size_limit, _GRAPH_ENTRIES)
        self.report = CaptureReport(self.mode, {})
        self.replays = 0  # steps served (tests check that a path ran through the graphs)
        self.step_graphs: list[StepGraph] = []  # each compiled step function (`compiled`)

    kind = "captured"

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Compile every bucket now (on rows that touch only the scratch slots), so that serving never waits. The
        scratch rows are made in inference mode, as a step's are: a graph compiled on ordinary tensors fails its
        guards on a step's inference tensors (their dispatch keys differ) and compiles again while serving."""
        for b in self.buckets:
            start = time.perf_counter()
            for _ in range(2):  # compile, then replay once (on CUDA the first replays record the graph)
                self._run_scratch(b)
            self.report.seconds[b] = time.perf_counter() - start
            log.info("%s graph: batch %d compiled in %.1f s (%s)", self.kind, b, self.report.seconds[b], self.mode)
        return self.report

    @abc.abstractmethod
    def _run_scratch(self, b: int) -> None:
        """Every step function of bucket `b` once, on scratch rows."""

    def compiled(self, fn: Callable[..., Any]) -> StepGraph:
        """`fn` compiled; on CPU its graphs are called without dynamo once compiled (`step_graph`)."""
        weights = [*self.model.parameters(), *self.model.buffers()]
        graph = StepGraph(fn, compile_options(self.cuda, self.cpp_wrapper), not self.cuda, weights)
        self.step_graphs.append(graph)
        return graph

    @torch.inference_mode()
    def replay(self, fn: StepGraph, step: Any, rows: Tensor, kv_rows: Tensor) -> Any:  # noqa: ANN401
        """fn(step), `rows` (a per-row input) static, `kv_rows`' length dynamic."""
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        before = linear_cpu.use(self.fused_linear)
        try:
            return fn(step, rows, kv_rows)
        finally:
            linear_cpu.use(before)

    def kv_width(self, longest: int) -> int:
        # CUDA graphs record one graph per shape: powers of two keep them few. Inductor's kernels take the
        # length as an argument; small steps of 16 only spare it odd sizes.
        if self.cuda:
            return 1 << max(longest - 1, 1).bit_length()
        return -(-longest // 16) * 16

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)


class DecodeGraphs(CapturedSteps):
    """The compiled decode step of one model over one cache, per batch-size bucket."""

    kind = "decode"

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, scratch: Scratch, buckets: Sequence[int],
                 with_hidden: bool = False, cpp_wrapper: bool = False) -> None:
        """`with_hidden`: the graphs also return the pre-norm final hiddens (`run`'s `prenorm`), for the MTP
        proposer; `cpp_wrapper`: compiled with inductor's C++ wrapper (CPU)."""
        super().__init__(model, cache, buckets, 2, cpp_wrapper)
        self.scratch = scratch
        self.with_hidden = with_hidden
        self._fn = self.compiled(self._forward)

    def _forward(self, step: PaddedDecode) -> GraphOutput:
        return padded_decode_logits(self.model, self.key, step, self.with_hidden, self.cpp_ops)

    def _run_scratch(self, b: int) -> None:
        self.call(self._scratch_step(b, 2))

    def _scratch_step(self, b: int, kv_len: int) -> PaddedDecode:
        dev, s = self.device, self.scratch
        full = torch.full((b,), 0, dtype=torch.int64, device=dev)
        return PaddedDecode(full, full + s.state_slot, full + s.kv_row,
                            torch.full((b, self.kv_width(kv_len)), s.kv_row, dtype=torch.int64, device=dev),
                            torch.full((b,), kv_len, dtype=torch.int64, device=dev))

    def call(self, step: PaddedDecode) -> GraphOutput:
        """Replay the bucket of `step`'s rows."""
        return self.replay(self._fn, step, step.input_ids, step.kv_rows)

    def supports(self, batch: ForwardBatch) -> bool:
        """A decode step that fits a bucket (verify windows run eagerly)."""
        return batch.mode is ForwardMode.DECODE and batch.spec is None and self.bucket(batch.num_seqs) is not None

    def run(self, batch: ForwardBatch, prenorm: list[Tensor] | None = None) -> Tensor:
        """Logits [M, V] fp32 for `batch.logits_index` (default: every sequence's token), as the eager
        `model.forward_batch(batch, cache, prenorm=prenorm).float()` gives them (`prenorm`: needs `with_hidden`).
        The step's radix checkpoints are slot copies of every KDA layer's states before and after the replay: the
        graph touches only the rows' own slots and the scratch slot, never a checkpoint's, so copying all layers'
        at once is what the eager step's per-layer copies leave."""
        n = batch.num_seqs
        b = self.bucket(n)
        assert b is not None, "a step the decode graphs do not cover (the caller checks `supports` first)"
        self.validate(batch.state_slots, batch.checkpoints, batch.kv_slots)
        ck = batch.checkpoints
        before, after = (None, None) if ck is None or not len(ck.slot) else decode_checkpoints(batch.state_slots, ck)
        self.copy_states(before)
        self.replays += 1
        out = self.call(self._padded(batch, b))
        self.copy_states(after)
        if prenorm is not None:
            assert out.hidden is not None, "hiddens from graphs captured without them"
            prenorm.append(out.hidden[:n])
        logits = out.logits[:n]
        return logits if batch.logits_index is None else logits[batch.logits_index]

    def copy_states(self, pairs: SlotPairs | None) -> None:
        """Copy every KDA layer's states (recurrent and conv) along `pairs` (from slots, to slots)."""
        if pairs is not None:
            for pool in (*self.cache.recurrent, *self.cache.conv):
                copy_states(pool, pairs)

    def validate(self, state_slots: Tensor, checkpoints: StateCheckpoints | None, kv_slots: Tensor) -> None:
        """The eager backend's per-step checks (host reads), on the real rows: KDA slots and checkpoints in range
        and apart, the KV slots written distinct and in range."""
        if self.cache.recurrent:
            check_slots(state_slots, checkpoints, self.cache.recurrent[0].shape[0])
        if self.cache.latent:
            check_store_slots(kv_slots, self.cache.latent[0].shape[0])

    def _padded(self, batch: ForwardBatch, b: int) -> PaddedDecode:
        """The real rows' tensors, padded to bucket `b` with rows on the scratch slots."""
        s, kv_lens = self.scratch, batch.seq_lens
        rows = row_table(batch.block_table, batch.page_size, kv_lens, self.kv_width(int(kv_lens.max())))
        return PaddedDecode(pad_rows(batch.input_ids, b, 0), pad_rows(batch.state_slots, b, s.state_slot),
                            pad_rows(batch.kv_slots, b, s.kv_row), pad_rows(rows, b, s.kv_row),
                            pad_rows(kv_lens, b, 1))
