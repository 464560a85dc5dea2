"""radixk3: a serving runtime for Kimi-K3-class hybrid (KDA + MLA) models.

`radixk3.Engine` and its errors are re-exported from the runtime: the package's public entry points (with the
`radixk3` command, `radixk3.cli`, and `python -m radixk3.launch_server`) are the one exception to "radixk3
imports nothing of runtime" (tests/test_imports.py lists them)."""

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
