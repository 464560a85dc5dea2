"""The engine's exceptions: a request refused at the door (`InvalidRequest`), and the engine failing or
overloaded (`EngineError`)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says what is wrong and `param` names the field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineError(RuntimeError):
    """The engine could not start, a process died, or it is shut down; pending requests fail with this."""


class EngineOverloaded(EngineError):
    """Refused for now: too many requests are pending (HTTP 503); nothing already accepted is dropped."""


class ShuttingDown(EngineError):
    """The server is shutting down and its grace period for in-flight requests is over (HTTP 503): the request
    is aborted."""
