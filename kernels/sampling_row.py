"""One row's sampling parameters: a leaf module (no torch), shared by the sampler and by the scheduler
process, which builds the rows of each plan without importing any kernel."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingRow:
    """One row's parameters, as SGLang names them; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    step: int = 0  # tokens generated so far: a seeded request draws a fresh but reproducible number each step
