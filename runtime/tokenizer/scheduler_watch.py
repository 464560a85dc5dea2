"""The tokenizer side's watchdog over the schedulers (`--watchdog-timeout`), and what the engine reports stuck.

A scheduler with work sends a `Heartbeat` every `ServerArgs.heartbeat_interval` seconds, whether it is planning
or waiting on its ranks. One that owes news (requests are pending on it) and has sent none for longer than the
timeout is silent, i.e. stuck itself (stopped, or hung in a call): its pending requests are failed by the
manager. It is healthy again once it is heard from. A scheduler's own watchdog may also report that a step of
its ranks is stuck (`Heartbeat.stuck`), until that step comes back. Times are the caller's (monotonic seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


class SchedulerWatch:
    def __init__(self, num_replicas: int, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self._heard = [now] * num_replicas
        self._owed_since: list[float | None] = [None] * num_replicas  # since when requests have been pending
        self.silent: list[str | None] = [None] * num_replicas  # why a scheduler is taken for stuck, until heard
        self.reported: list[str | None] = [None] * num_replicas  # what a scheduler says is stuck

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def heard(self, replica: int, stuck: str | None, now: float) -> None:
        """A heartbeat of `replica`'s scheduler, with what its own watchdog finds stuck (None: nothing)."""
        self._heard[replica] = now
        self.silent[replica] = None
        self.reported[replica] = stuck

    def check(self, pending: Mapping[int, int], now: float, describe: Callable[[int], str]) -> list[int]:
        """The replicas whose scheduler has just gone silent: requests pending on it (`pending[replica]`, a
        count) and no word from it for longer than the timeout. `describe(replica)` names the scheduler."""
        newly = []
        for i in range(len(self._heard)):
            n = pending.get(i, 0)
            if not n:
                self._owed_since[i] = None
                continue
            if self._owed_since[i] is None:
                self._owed_since[i] = now
            quiet = now - max(self._heard[i], self._owed_since[i])  # type: ignore[type-var]
            if self.silent[i] is None and quiet > self.timeout_s:
                self.silent[i] = (f"watchdog: {describe(i)} sent nothing for {quiet:.1f} s with {n} request(s) "
                                  f"pending (--watchdog-timeout {self.timeout_s:g} s)")
                newly.append(i)
        return newly

    @property
    def stuck(self) -> str | None:
        """What is stuck in the engine, if anything: silent schedulers and the steps schedulers report."""
        why = [w for w in self.silent + self.reported if w is not None]
        return "; ".join(why) if why else None
