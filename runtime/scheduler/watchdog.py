"""The scheduler's watchdog over its ranks (`--watchdog-timeout`): when each step went out and when its result
came back, whether the oldest step outstanding has run past the timeout, and when the scheduler last told the
tokenizer side that it is alive (its heartbeat, sent while it has work).

A step's clock starts when it was sent or when the step before it came back, whichever is later: with the
overlap scheduler a step waits behind the one in flight, and only its own run counts. Once fired, the watchdog
stays fired until every step that was outstanding has come back: until then the stuck ranks may still write
the memory of those steps' requests, which therefore stays theirs. Times are the caller's (monotonic seconds).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepWatchdog:
    timeout_s: float  # 0: off (no deadline, no heartbeat)
    heartbeat_s: float
    stuck: str | None = None  # why the watchdog fired, until the steps outstanding then have all come back
    _sent: deque[float] = field(default_factory=deque)  # when each step without a result yet went out
    _last_back: float = -math.inf
    _last_beat: float = -math.inf

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def sent(self, now: float) -> None:
        if self.enabled:
            self._sent.append(now)

    def came_back(self, now: float) -> bool:
        """The oldest outstanding step's result came; True if that ends a stuck spell (nothing outstanding)."""
        if not self._sent:
            return False
        self._sent.popleft()
        self._last_back = now
        if self.stuck is not None and not self._sent:
            self.stuck = None
            return True
        return False

    def overdue(self, now: float) -> float | None:
        """How long the oldest outstanding step has run, if that is past the timeout and has not fired yet."""
        if self.stuck is not None or not self._sent:
            return None
        ran = now - max(self._sent[0], self._last_back)
        return ran if ran > self.timeout_s else None

    def beat_due(self, now: float) -> bool:
        return self.enabled and now - self._last_beat >= self.heartbeat_s

    def beaten(self, now: float) -> None:
        self._last_beat = now

    def wait_s(self, now: float) -> float | None:
        """How long a scheduler waiting on a result may sleep before its next heartbeat or deadline; None:
        as long as it likes (the watchdog is off)."""
        if not self.enabled:
            return None
        wake = self._last_beat + self.heartbeat_s
        if self._sent and self.stuck is None:
            wake = min(wake, max(self._sent[0], self._last_back) + self.timeout_s)
        return max(0.0, wake - now)
