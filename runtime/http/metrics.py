"""Prometheus metrics of the server (`GET /metrics`), with prometheus-client.

Two sources: the scheduler's own counters (running, queued, pool bytes, cache, state checkpoints), fetched at
scrape time with `get_metrics`, and what only the tokenizer process sees (token counters, TTFT, inter-token
and end-to-end latency), observed per request by `RequestTimer`. A scrape never fails for want of the
scheduler's answer (stuck, or the engine down): it serves the last values read, and
`radixk3_scheduler_metrics_staleness_seconds` says how old they are (0: read for this scrape).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "radixk3"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Scheduler counters: (key in SchedulerMetrics, exported name, help). Gauges go up and down; counters only up.
_GAUGES = (
    ("running", "num_running_reqs", "requests in the running batch"),
    ("queued", "num_queued_reqs", "requests waiting to be scheduled"),
    ("pending_requests", "num_pending_reqs", "requests accepted by the server and not finished (the bounded queue)"),
    ("state_pool_bytes", "state_pool_used_bytes", "pool bytes held by KDA states (running and cached)"),
    ("kv_pool_bytes", "kv_pool_used_bytes", "pool bytes held by MLA KV (running and cached)"),
    ("pool_bytes", "pool_bytes", "bytes of the unified pool (KDA states and MLA KV), summed over DP ranks"),
    ("decode_max_skipped_steps", "decode_max_skipped_steps",
     "the most scheduler steps in a row that a decoding request got no token, since the start (0 while decodes ride "
     "in every step; 1 where an extend step cannot carry them, e.g. speculation)"),
)
_COUNTERS = (
    ("steps", "scheduler_steps", "forward steps run"),
    ("prefill_tokens_computed", "prefill_tokens_computed", "prompt tokens run through the model"),
    ("cached_tokens", "cached_prompt_tokens", "prompt tokens served from the radix cache"),
    ("prompt_tokens", "admitted_prompt_tokens",
     "prompt tokens admitted, cached or computed (the cache hit rate's denominator, summable over servers)"),
    ("state_hits", "state_checkpoint_hits", "admissions that found a KDA state checkpoint"),
    ("state_misses", "state_checkpoint_misses", "admissions that found no KDA state checkpoint"),
    ("evictions", "cache_evictions", "radix cache evictions"),
    ("retractions", "retractions", "running requests retracted for memory"),
    ("checkpoints", "state_checkpoints_written", "KDA state checkpoints written"),
    ("verify_steps", "spec_verify_steps", "speculative verify steps run"),
    ("draft_tokens", "spec_draft_tokens", "draft tokens proposed to verify windows"),
    ("accepted_tokens", "spec_accepted_tokens", "draft tokens accepted"),
    ("pd_transfers", "pd_transfers", "P/D prefill: transfers written into decode servers (prompt chunks' pages, and "
     "each request's last: its remaining pages, KDA state and first token)"),
    ("pd_kv_bytes", "pd_kv_bytes_sent", "P/D prefill: MLA KV bytes written into decode servers"),
    ("pd_state_bytes", "pd_state_bytes_sent", "P/D prefill: KDA state bytes written into decode servers"),
    ("pd_timed_bytes", "pd_timed_transfer_bytes", "P/D prefill: bytes of the timed transfers (each request's last)"),
    ("pd_timed_seconds", "pd_timed_transfer_seconds", "P/D prefill: seconds the timed transfers took"),
)


class _SchedulerCollector(Collector):
    """Exports the last scheduler snapshot the scrape handler fetched, and how old it is."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}  # until the first is read: zeros, as of the server's start
        self.read_at = time.monotonic()
        self.fresh = False  # `snapshot` was read for the scrape being rendered

    def update(self, snapshot: dict[str, Any] | None) -> None:
        """A scrape's snapshot, or None when the scheduler did not answer: the last one stays, gone stale."""
        self.fresh = snapshot is not None
        if snapshot is not None:
            self.snapshot, self.read_at = snapshot, time.monotonic()

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{PREFIX}_scheduler_metrics_staleness_seconds",
                                "seconds since the scheduler's values here were read (0: read for this scrape; "
                                "more: it did not answer in time, and these are the last values known)",
                                value=0.0 if self.fresh else time.monotonic() - self.read_at)
        s = self.snapshot
        for key, name, doc in _GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(s.get(key, 0)))
        for key, name, doc in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(s.get(key, 0)))
        windows = s.get("spec_windows", 0)
        yield GaugeMetricFamily(f"{PREFIX}_spec_accept_length", "mean tokens a verified sequence gains per step",
                                value=1 + s.get("accepted_tokens", 0) / windows if windows else 0.0)
        prompt = s.get("prompt_tokens", 0)
        yield GaugeMetricFamily(f"{PREFIX}_cache_hit_rate", "share of admitted prompt tokens found in the cache",
                                value=s.get("cached_tokens", 0) / prompt if prompt else 0.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.scheduler = _SchedulerCollector()
        r.register(self.scheduler)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter(f"{PREFIX}_requests", "finished requests (samples) by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "submit to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "time between generated tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "submit to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def render(self, scheduler_snapshot: dict[str, Any] | None) -> bytes:
        """The exposition, with these scheduler counters, or the last ones known (None: no answer came)."""
        self.scheduler.update(scheduler_snapshot)
        return generate_latest(self.registry)

    def timer(self, counted: bool = True) -> RequestTimer:
        """A request's timer; an uncounted one (SGLang's `log_metrics=false`) observes nothing."""
        return RequestTimer(self if counted else None)


class RequestTimer:
    """Latency of one request's samples; `chunk` for every chunk that carries tokens, `finish` at each end."""

    def __init__(self, metrics: ServerMetrics | None) -> None:
        self._m = metrics
        self._t0 = time.perf_counter()
        self._last: dict[int, float] = {}

    def chunk(self, index: int, num_tokens: int) -> None:
        if num_tokens <= 0 or self._m is None:
            return
        now = time.perf_counter()
        last = self._last.get(index)
        if last is None:
            self._m.ttft.observe(now - self._t0)
        else:  # a chunk of k tokens: k gaps of equal share
            gap = (now - last) / num_tokens
            for _ in range(num_tokens):
                self._m.itl.observe(gap)
        self._last[index] = now
        self._m.generation_tokens.inc(num_tokens)

    def finish(self, reason: str | None, prompt_tokens: int) -> None:
        if self._m is None:
            return
        self._m.e2e.observe(time.perf_counter() - self._t0)
        self._m.prompt_tokens.inc(prompt_tokens)
        self._m.requests.labels(finish_reason=reason or "unknown").inc()

