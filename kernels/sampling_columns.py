"""The sampling parameters of a batch's sampled rows as columns: one numpy array per parameter, one entry per
row. A leaf module (numpy, no torch): the scheduler process builds the columns into each plan, the wire sends
each as a raw frame, and the worker hands them to the sampler (`SamplingTensors.from_columns`) as they are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

# The per-request parameters, as SGLang names them (and as `runtime.sampling_params.SamplingParams` holds them).
PARAMETERS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
              "repetition_penalty")
# A parameter's value that changes nothing; `seed` None: unseeded (a fresh seed each step).
NEUTRAL: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                           "presence_penalty": 0.0, "repetition_penalty": 1.0, "seed": None, "step": 0}


@dataclass
class SamplingColumns:
    """Row i's parameters are entry i of every column; a temperature below 1e-5 (or top_k 1) means greedy."""

    DTYPES: ClassVar[dict[str, type]] = {
        "temperature": np.float32, "top_p": np.float32, "top_k": np.int64, "min_p": np.float32,
        "frequency_penalty": np.float32, "presence_penalty": np.float32, "repetition_penalty": np.float32,
        "seed": np.int64, "seeded": np.bool_, "step": np.int64,
    }
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray  # -1: off
    min_p: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray
    repetition_penalty: np.ndarray
    seed: np.ndarray  # read only where `seeded`
    seeded: np.ndarray
    step: np.ndarray  # the row's output index: a seeded row draws a fresh but reproducible number each step

    @property
    def num_rows(self) -> int:
        return len(self.step)

    @classmethod
    def of(cls, n: int, **values: Any) -> SamplingColumns:
        """`n` rows; each column from `values` (one value for every row, or a sequence of n values), else
        neutral. `seed` (or one of its entries) None: unseeded."""
        unknown = set(values) - set(NEUTRAL)
        if unknown:
            raise TypeError(f"unknown sampling column(s): {sorted(unknown)}")

        def col(name: str) -> list[Any]:
            v = values.get(name, NEUTRAL[name])
            if isinstance(v, Sequence | np.ndarray):
                if len(v) != n:
                    raise ValueError(f"{len(v)} values of {name} for {n} rows")
                return list(v)
            return [v] * n

        seeds = col("seed")
        cols = {name: col(name) for name in (*PARAMETERS, "step")}
        cols["seed"] = [0 if s is None else s for s in seeds]
        cols["seeded"] = [s is not None for s in seeds]
        return cls(**{name: np.array(cols[name], dtype=cls.DTYPES[name]).reshape(n) for name in cls.DTYPES})

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> SamplingColumns:
        """Columns from per-row mappings of column names to values (what a row leaves out is neutral)."""
        names = {name for row in rows for name in row}
        return cls.of(len(rows), **{name: [row.get(name, NEUTRAL.get(name)) for row in rows] for name in names})
