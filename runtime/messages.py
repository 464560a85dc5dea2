"""Typed messages between the processes, serialised with orjson; bulk int arrays travel as raw frames.

A message is a list of ZeroMQ frames: frame 0 is the orjson header (the dataclass fields that are not
arrays, plus the message type), then one raw int64 frame per array field, in field order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import orjson


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs; else from this prompt position on
    top_logprobs_num: int = 0
    stream: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass
class TokenOut:
    """New tokens of one request since its last TokenOut; `finished` set on the last one."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finished: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class StepPlan:
    """What a worker runs in one step: byte copies in the pool, then one forward, then sampling."""

    ARRAYS: ClassVar[tuple[str, ...]] = (
        "input_ids", "cu_seqlens", "prefix_lens", "state_slots", "kv_slots", "kv_indices", "kv_indptr",
        "logits_index",
    )
    step: int
    copies: list[tuple[int, int, int]]
    input_ids: np.ndarray
    cu_seqlens: np.ndarray
    prefix_lens: np.ndarray
    state_slots: np.ndarray
    kv_slots: np.ndarray
    kv_indices: np.ndarray
    kv_indptr: np.ndarray
    logits_index: np.ndarray  # rows whose logits are needed (sampling rows first, then input-logprob rows)
    sample_params: list[dict[str, Any]]  # one per sampled row: SamplingRow fields
    histories: list[list[int]]  # generated tokens per sampled row (for penalties)
    banned: list[list[int]]  # per sampled row: token ids that may not be sampled (stops below min_new_tokens)
    top_logprobs_num: int = 0
    input_logprob_rows: list[tuple[int, int]] = field(default_factory=list)  # (logits row, token id)


@dataclass
class StepResult:
    step: int
    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    input_logprobs: list[float]
    error: str | None = None


@dataclass
class WorkerReady:
    rank: int
    error: str | None = None


@dataclass
class Shutdown:
    pass


@dataclass
class MetricsReq:
    pass


@dataclass
class MetricsOut:
    metrics: dict[str, Any]


MESSAGES: dict[str, type] = {
    cls.__name__: cls
    for cls in (GenerateReq, AbortReq, TokenOut, StepPlan, StepResult, WorkerReady, Shutdown, MetricsReq, MetricsOut)
}


def encode(msg: Any) -> list[bytes]:
    arrays = getattr(type(msg), "ARRAYS", ())
    header = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg) if f.name not in arrays}
    header["_type"] = type(msg).__name__
    frames = [orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)]
    frames.extend(np.ascontiguousarray(getattr(msg, name), dtype=np.int64).tobytes() for name in arrays)
    return frames


def decode(frames: list[bytes]) -> Any:
    header = orjson.loads(frames[0])
    cls = MESSAGES[header.pop("_type")]
    arrays = getattr(cls, "ARRAYS", ())
    for name, raw in zip(arrays, frames[1:], strict=True):
        header[name] = np.frombuffer(raw, dtype=np.int64)
    return cls(**header)
