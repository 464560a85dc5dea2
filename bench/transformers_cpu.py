"""transformers' KimiLinear on a machine without a GPU: fla's Triton kernels need a GPU driver, so fla is hidden
from transformers and KimiLinear takes its pure-torch fallbacks (`use_kernels=False` alone does not do it).

transformers picks each kernel when its KimiLinear modelling module is first imported, which is lazy: `import
transformers` (by compressed-tensors, a tokenizer or a chat-template test) does not yet decide it. So fla is
hidden whenever that module is not imported yet, whatever else imported transformers before."""

from __future__ import annotations

import sys

KIMI_LINEAR_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"


def hide_fla(cuda: bool) -> None:
    """Hide fla from later imports unless `cuda` (its kernels run there) or transformers' KimiLinear is already
    imported (then its choice is made: RuntimeError if it was made with fla)."""
    if cuda:
        return
    if KIMI_LINEAR_MODULE in sys.modules:
        if sys.modules.get("fla") is not None:
            raise RuntimeError("transformers' KimiLinear was imported with fla present: its Triton kernels need a "
                               "GPU; hide fla (bench.transformers_cpu.hide_fla) before importing it")
        return
    if sys.modules.get("fla") is not None:
        raise RuntimeError("fla is already imported; transformers' KimiLinear would take its GPU kernels")
    sys.modules["fla"] = None  # type: ignore[assignment]
