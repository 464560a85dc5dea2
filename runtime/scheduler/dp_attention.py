"""DP attention's scheduler (`--dp M --enable-dp-attention`): M attention groups behind one scheduler process.

Each DP rank (attention group of tp / M worker ranks) has its own requests, its own `Scheduler` (radix tree,
unified pool, page tables) and its own speculative windows; a `DPRouter` inside this process picks a request's
group (`--load-balance-method`). The MoE / MLP of every layer runs over every group's tokens at once, so the
groups must step in lockstep: each step is one plan per group, sent together, and a group with nothing to do
gets an IDLE plan (its ranks run the layers on zero rows and join the collectives). A step's results are one
per group, from each group's first rank, in group order.

Speculation runs per DP rank, each replaying its own requests' KDA inputs. N-gram drafts add no forward. The MTP
layers' and the draft model's calls (their MoE / FFN is shared too) vary with each group's windows and mode, so
every plan says what all groups' steps hold (`StepPlan.dp_window_width`, `dp_extends`) and a group that makes
fewer calls joins the others' on zero rows (`runtime/spec/proposers.py::LockstepProposer`). DSpark's drafter is
replicated on every rank and its only sharded parts, the target's embedding and LM head, belong to the attention
group: it runs no collective across groups.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

import numpy as np

from kernels.sampling_columns import SamplingColumns
from runtime.dp_router import CacheAwareConfig, DPRouter
from runtime.grammar import GrammarBackend
from runtime.messages import GenerateReq, StepPlan, StepResult, TokenOut, combine_metrics
from runtime.pool_layout import PoolLayout
from runtime.scheduler.scheduler import Scheduler, SchedulerMetrics
from runtime.server_args import ServerArgs


def idle_plan(step: int) -> StepPlan:
    """A step with no sequences: the group's ranks only join the other groups' collectives."""
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(step, "idle", [], [], empty, empty, empty, empty, empty, np.zeros(1, dtype=np.int64), empty,
                    empty, empty, empty, empty, empty, SamplingColumns.of(0), [])


class DPAttentionScheduler:
    """M `Scheduler`s stepped together; the step loop sees it as one scheduler whose plan is a list of M plans
    (one per DP rank) and whose result is the list of their results."""

    def __init__(self, args: ServerArgs, layout: PoolLayout, stop_ids: frozenset[int],
                 detokenize: Callable[[list[int], bool], str], grammar: Callable[[], GrammarBackend | None], *,
                 pool_bytes: int | None = None) -> None:
        # Every group's pool is one size: the ranks of the replica agreed on it (one TP group).
        self.groups = [Scheduler(args, layout, stop_ids, detokenize, grammar(), pool_bytes=pool_bytes)
                       for _ in range(args.dp_size)]
        self.router = DPRouter(args.dp_size, args.load_balance_method, CacheAwareConfig())
        self._inflight: deque[list[bool]] = deque()  # per step in flight: which groups ran a real plan
        self._idle_steps = 0

    # --- requests in -----------------------------------------------------------------------------------
    def add(self, msg: GenerateReq) -> None:
        self.groups[self.router.route(msg.rid, msg.input_ids, msg.sampling.max_new_tokens)].add(msg)

    def abort(self, rid: str) -> None:
        g = self.router.replica_of(rid)
        if g is not None:
            self.groups[g].abort(rid)

    def fail_all(self, error: str) -> list[TokenOut]:
        """Every group's requests fail (the watchdog: a step is stuck); see `Scheduler.fail_all`."""
        return self._finished([o for s in self.groups for o in s.fail_all(error)])

    def pause(self, mode: str) -> None:
        for s in self.groups:
            s.pause(mode)

    def resume(self) -> None:
        for s in self.groups:
            s.resume()

    @property
    def paused(self) -> bool:
        return self.groups[0].paused

    # --- the step loop's view --------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._inflight) or any(s.has_work for s in self.groups)

    @property
    def grammar_blocked(self) -> bool:
        return any(s.grammar_blocked for s in self.groups)

    @property
    def steps_in_flight(self) -> int:
        return len(self._inflight)

    def wait_for_grammars(self, timeout: float) -> None:
        waiting = [s for s in self.groups if s.grammar_wait]
        for s in waiting:
            s.wait_for_grammars(timeout / len(waiting))

    def schedule(self) -> list[StepPlan] | None:
        plans = [s.schedule() for s in self.groups]
        if all(p is None for p in plans):
            return None
        self._inflight.append([p is not None for p in plans])
        self._idle_steps += 1
        out = [p if p is not None else idle_plan(-self._idle_steps) for p in plans]
        # A model proposer's calls before the target's forward follow the widest window, after it whether a
        # group observed an extend or decode step: every group joins as many.
        width = max((int(np.diff(p.cu_seqlens).max()) for p in out if p.mode == "verify"), default=0)
        extends = any(p.mode in ("extend", "decode") for p in out)
        for p in out:
            p.dp_window_width, p.dp_extends = width, extends
        return out

    def process(self, results: list[StepResult]) -> list[TokenOut]:
        """Apply the oldest step's results: each group that ran a real plan takes its own."""
        ran = self._inflight.popleft()
        if len(results) != len(self.groups):
            raise RuntimeError(f"{len(results)} results for {len(self.groups)} DP ranks")
        outs: list[TokenOut] = []
        for s, real, res in zip(self.groups, ran, results, strict=True):
            outs += s.process(res) if real else s.take_outputs()
        return self._finished(outs)

    def take_outputs(self) -> list[TokenOut]:
        return self._finished([o for s in self.groups for o in s.take_outputs()])

    def _finished(self, outs: list[TokenOut]) -> list[TokenOut]:
        for o in outs:
            if o.finished is not None:
                self.router.finished(o.rid)
        return outs

    # --- metrics and invariants ------------------------------------------------------------------------
    def group_metrics(self) -> list[SchedulerMetrics]:
        return [s.metrics_now() for s in self.groups]

    def metrics_now(self) -> SchedulerMetrics:
        """Every group's counters added up (each is a count or a byte total; a high-water mark takes the max)."""
        return SchedulerMetrics(**combine_metrics([dataclasses.asdict(m) for m in self.group_metrics()]))

    def flush_cache(self) -> bool:
        flushed = all([s.flush_cache() for s in self.groups])  # a list: every idle group flushes
        if flushed:  # nothing outstanding: the router's picture of the trees is empty too
            self.router = DPRouter(len(self.groups), self.router.method, self.router.config)
        return flushed

    def check_integrity(self) -> None:
        for s in self.groups:
            s.check_integrity()
        assert all(len(ran) == len(self.groups) for ran in self._inflight)
        for g, s in enumerate(self.groups):
            assert s.steps_in_flight == sum(ran[g] for ran in self._inflight), f"DP rank {g}: steps in flight drifted"
        self.router.check_integrity()
