"""The scheduler's step loop, shared by the scheduler process and LocalEngine.

With overlap (SGLang's overlap scheduler) the loop sends step N+1 before it waits for step N's result, so
the scheduler plans while the worker computes; results are applied one step late. Without it, each plan
waits for the previous result. Workers run plans in the order they are sent. A step with a constrained
decode is not overlapped (as in SGLang): its grammar mask needs the token of the step in flight, so that
step is resolved first; batches without one stay overlapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from runtime.messages import TokenOut

GRAMMAR_POLL_S = 0.005  # the longest a loop with only grammars compiling waits before looking at its inbox


Plan = TypeVar("Plan")
Result = TypeVar("Result")


class StepScheduler(Protocol[Plan, Result]):
    """What the loop needs of a scheduler: `Scheduler` (a StepPlan per step), or `DPAttentionScheduler` (one
    plan per DP rank)."""

    @property
    def has_work(self) -> bool: ...
    @property
    def grammar_blocked(self) -> bool: ...
    @property
    def steps_in_flight(self) -> int: ...
    def schedule(self) -> Plan | None: ...
    def process(self, result: Result) -> list[TokenOut]: ...
    def take_outputs(self) -> list[TokenOut]: ...
    def wait_for_grammars(self, timeout: float) -> None: ...
    def check_integrity(self) -> None: ...


class StepLoop(Generic[Plan, Result]):
    def __init__(self, scheduler: StepScheduler[Plan, Result], send: Callable[[Plan], None],
                 recv: Callable[[], Result], overlap: bool, check_when_idle: bool = True) -> None:
        self.scheduler = scheduler
        self.send, self.recv = send, recv
        self.depth = 1 if overlap else 0  # steps left in flight while the next is planned
        self.check_when_idle = check_when_idle
        self._idle_checked = True

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenOut]:
        """Plan and send one step if there is one; then apply a result if more than `depth` steps are in
        flight (or nothing new could be planned). Returns the outputs produced."""
        s = self.scheduler
        resolved: list[TokenOut] = []
        if s.steps_in_flight and s.grammar_blocked:
            resolved = s.process(self.recv())
        plan = s.schedule()
        if plan is not None:
            self.send(plan)
            self._idle_checked = False
        if s.steps_in_flight > self.depth or (plan is None and s.steps_in_flight):
            outputs = s.process(self.recv())
        else:
            outputs = s.take_outputs()
        outputs = resolved + outputs
        if plan is None and not outputs and not s.steps_in_flight:
            s.wait_for_grammars(GRAMMAR_POLL_S)  # only grammars compiling (if anything): do not spin
        if self.check_when_idle and not self._idle_checked and not s.has_work:
            s.check_integrity()  # cheap enough once per burst of work
            self._idle_checked = True
        return outputs
