"""The engine's own exceptions (bad requests are `runtime.sampling_params.InvalidRequest`)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not start, a process died, or it is shut down; pending requests fail with this."""


class EngineOverloaded(EngineError):
    """Refused for now: too many requests are pending (HTTP 503); nothing already accepted is dropped."""


class ShuttingDown(EngineError):
    """The server is shutting down and its grace period for in-flight requests is over (HTTP 503): the request
    is aborted."""
