"""radixk3: a serving runtime for Kimi-K3-class hybrid (KDA + MLA) models."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineError", "EngineOverloaded", "InvalidRequest"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import radixk3.config` does not pull in the runtime and ZeroMQ.
    if name == "Engine":
        from runtime.tokenizer.engine import Engine

        return Engine
    if name in ("EngineError", "EngineOverloaded", "InvalidRequest"):
        import runtime.errors

        return getattr(runtime.errors, name)
    raise AttributeError(name)
