"""The one dispatch point between the torch references and the Triton kernels.

`RADIXK3_KERNELS=torch|triton` forces either; by default Triton runs on CUDA tensors and torch elsewhere.
Triton forced on CPU tensors runs under Triton's interpreter (see `triton_launch`): slow, for tests.
Read at every call, so a test or a benchmark can switch backends in one process.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["torch", "triton"]
ENV_VAR = "RADIXK3_KERNELS"


def kernel_backend(device: torch.device) -> Backend:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in ("torch", "triton"):
        return forced  # type: ignore[return-value]
    if forced:
        raise ValueError(f"{ENV_VAR}={forced!r}: expected 'torch' or 'triton'")
    return "triton" if device.type == "cuda" else "torch"
