"""External oracles: fla-core's naive KDA functions and transformers' KimiLinearForCausalLM.

fla's package __init__ imports Triton kernels that need a GPU driver, so the naive reference is loaded
by file path, and `fla` is hidden from transformers so that it takes its pure-torch fallbacks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

from bench.transformers_cpu import hide_fla


@cache
def fla_naive_kda() -> ModuleType:
    """fla-core's `ops/kda/naive.py` (naive_recurrent_kda, naive_chunk_kda), loaded without importing fla."""
    # Located through the distribution, not `import fla`: transformers_module() hides fla from imports.
    try:
        path = Path(str(importlib.metadata.distribution("fla-core").locate_file("fla/ops/kda/naive.py")))
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError("fla-core is not installed (pip install -e '.[test]')") from e
    module_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@cache
def transformers_module() -> ModuleType:
    """transformers with fla hidden, so KimiLinear runs its torch fallbacks on CPU."""
    hide_fla(cuda=False)  # the oracles run on the CPU
    import transformers

    return transformers
