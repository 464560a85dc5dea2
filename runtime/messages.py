"""Typed messages between the processes, serialised with orjson; bulk int arrays travel as raw frames.

A message is a list of ZeroMQ frames: frame 0 is the orjson header (the dataclass fields that are not
arrays, plus the message type), then one raw frame per array field, in field order: int64, or the dtype
the class names for it in `ARRAY_DTYPES`; then, for each group of arrays (`ARRAY_GROUPS`: a dataclass of
arrays, such as a plan's sampling columns), one raw frame per array of the group, in its field order and
its `DTYPES`. A dataclass in the header (`NESTED`; `NESTED_OPTIONAL` where it may be None), or a list of them
(`NESTED_LISTS`), is rebuilt as it was sent: it was checked before it was sent, so it is not checked again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import orjson

from kernels.sampling_columns import SamplingColumns
from runtime.disagg.protocol import TransferStats
from runtime.sampling_params import SamplingParams


class PatchGrid:
    """An image's (t, h, w) patch grid, for the messages that carry one: `num_patches` = t * h * w."""

    grid: tuple[int, int, int]

    def __post_init__(self) -> None:
        self.grid = tuple(self.grid)  # a list after the JSON round trip

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass
class ImageRef(PatchGrid):
    """An image of a request's prompt: its `num_tokens` `<|media_pad|>` ids are prompt positions
    [offset, offset + num_tokens); its patches (`num_patches` = t * h * w of `grid`) travel in the message's
    `image_patches`, image after image. `content_hash` names its pixels (the radix key of its pads, the worker's
    encoder-cache key)."""

    content_hash: str
    grid: tuple[int, int, int]
    offset: int
    num_tokens: int


@dataclass
class Bootstrap:
    """Prefill/decode disaggregation: where the request's prefill server's bootstrap server is, and the room that
    pairs the request's two halves (sglang-router adds these to the request it sends to both servers)."""

    host: str
    port: int
    room: int


@dataclass
class GenerateReq:
    """One sample of a request, checked at the door (the tokenizer manager, LocalEngine): nothing downstream
    validates it again. `image_patches`: the images' patches, flattened float32, in `images` order."""

    NESTED: ClassVar[dict[str, type]] = {"sampling": SamplingParams}
    NESTED_OPTIONAL: ClassVar[dict[str, type]] = {"bootstrap": Bootstrap}
    NESTED_LISTS: ClassVar[dict[str, type]] = {"images": ImageRef}
    ARRAYS: ClassVar[tuple[str, ...]] = ("image_patches",)
    ARRAY_DTYPES: ClassVar[dict[str, type]] = {"image_patches": np.float32}
    rid: str
    input_ids: list[int]
    sampling: SamplingParams  # n = 1; sample i of n draws with seed + i
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs; else from this prompt position on
    top_logprobs_num: int = 0
    # False: the consumer reads only the whole result, so the scheduler sends its first token, then its tokens every
    # NON_STREAM_INTERVAL and at the end (`OutputProcessor.emit`), as SGLang does a request without `stream`.
    stream: bool = True
    images: list[ImageRef] = field(default_factory=list)
    image_patches: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    bootstrap: Bootstrap | None = None  # set on a prefill or decode server (P/D disaggregation)


@dataclass
class PlanImage(PatchGrid):
    """An image whose pad run meets a step's new tokens: rows [lo, hi) of its encoder output replace the
    embeddings of packed tokens [dst, dst + hi - lo) of sequence `seq`. Its patches (t * h * w of `grid`) are in
    the plan's `image_patches`, image after image."""

    seq: int
    content_hash: str
    grid: tuple[int, int, int]
    num_tokens: int
    dst: int
    lo: int
    hi: int


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
    # Parallel to input_logprobs: each prompt position's top_logprobs_num (id, logprob), None for the first token.
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finished: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    # Where a matched stop string or regex starts: the characters of the output's text (decoded as the request
    # decodes it) from there to its end, which the tokenizer side cuts off (unless no_stop_trim). The scheduler
    # found the match and knows its place; counted from the end, it needs no decode of the whole output.
    stop_from_end: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    invalid: bool = False  # the error is the request's own (HTTP 400), found after the door: a grammar refused
    error_param: str | None = None  # ... and the field it names


@dataclass
class TokenOuts:
    """A step's TokenOuts in one message (SGLang's BatchTokenIDOut): one send and one receive a step rather than
    one per request, which at batch 32 cost the scheduler and the tokenizer side a few milliseconds a step of
    the two cores the worker computes on."""

    NESTED_LISTS: ClassVar[dict[str, type]] = {"outs": TokenOut}

    outs: list[TokenOut]


@dataclass
class StepPlan:
    """What a worker runs in one step; its size is O(new tokens + requests), never O(context).

    The worker applies, in order: the byte `copies` (compaction moves, copy on hit); the `page_moves`
    (physical KV pages that compaction moved, src -> dst, in order: the worker renames them in its page
    table); the page-table writes `table[table_rows[i], table_cols[i]] = table_pages[i]` (physical page
    ids; the KV slot of position p of a row is table[row, p // page_size] * page_size + p % page_size);
    the `reset_rows` (a row (re)assigned to a request: its penalty history becomes the given output ids).
    Then one forward in `mode` over the sequences, then sampling.

    Sequence i is page-table row `rows[i]`, has `prefix_lens[i]` tokens in the cache (its KDA state in
    physical slot `state_slots[i]` is read iff the prefix is non-empty) and adds the new tokens
    `input_ids[cu_seqlens[i]:cu_seqlens[i+1]]`; an input id of -1 stands for the token last sampled for
    that row (the overlap scheduler plans a decode before it knows that token). Checkpoint m writes the
    KDA state of sequence `ckpt_seq[m]` after `ckpt_offset[m]` of its new tokens into physical slot
    `ckpt_slot[m]`. The first `num_sampled` entries of `logits_index` are the sampled rows, in sequence
    order (a verify window samples at each of its positions); the rest are input-logprob rows. Sampled row i
    draws with the parameters of entry i of the `sampling` columns.

    Structured output: sampled row `grammar_rows[j]` may only draw the tokens whose bits are set in row j of
    `grammar_mask`, the packed bitmask (int32 [len(grammar_rows), ceil(vocab / 32)], flattened; bit t % 32 of
    word t // 32 is token t): O(constrained rows x vocab / 32) per step.
    """

    ARRAYS: ClassVar[tuple[str, ...]] = (
        "table_rows", "table_cols", "table_pages", "rows", "prefix_lens", "cu_seqlens", "state_slots",
        "input_ids", "ckpt_seq", "ckpt_offset", "ckpt_slot", "logits_index", "grammar_rows", "grammar_mask",
        "image_patches",
    )
    ARRAY_DTYPES: ClassVar[dict[str, type]] = {"grammar_mask": np.int32, "image_patches": np.float32}
    NESTED_LISTS: ClassVar[dict[str, type]] = {"images": PlanImage}
    ARRAY_GROUPS: ClassVar[dict[str, type]] = {"sampling": SamplingColumns}
    step: int
    mode: str  # "extend" | "decode" | "verify" | "idle" (radixk3.forward_batch.ForwardMode values)
    copies: list[tuple[int, int, int]]
    page_moves: list[tuple[int, int]]
    table_rows: np.ndarray
    table_cols: np.ndarray
    table_pages: np.ndarray
    rows: np.ndarray
    prefix_lens: np.ndarray
    cu_seqlens: np.ndarray
    state_slots: np.ndarray
    input_ids: np.ndarray
    ckpt_seq: np.ndarray
    ckpt_offset: np.ndarray
    ckpt_slot: np.ndarray
    logits_index: np.ndarray
    sampling: SamplingColumns  # one entry per sampled row
    banned: list[list[int]]  # per sampled row: token ids that may not be sampled (stops below min_new_tokens)
    # (sampled row, token id, bias) for the rows of requests with a logit_bias: added to those logits before the draw
    logit_bias: list[tuple[int, int, float]] = field(default_factory=list)
    reset_rows: list[tuple[int, list[int]]] = field(default_factory=list)
    top_logprobs_num: int = 0
    input_logprob_rows: list[tuple[int, int]] = field(default_factory=list)  # (logits row, token id)
    grammar_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    grammar_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    # DP attention: what every group's step holds, as far as a model proposer's calls (which carry the shared
    # MoE / FFN's collectives) depend on it, so that each group joins the calls the others make: the widest
    # verify window over every group (0: none verifies), and whether some group runs an extend or decode step.
    dp_window_width: int = 0
    dp_extends: bool = False
    # A decode plan's window (`--num-scheduler-steps`): decode steps the worker runs back to back, step j feeding
    # each sequence the token step j - 1 sampled and sampling its output `sampling.step + j`; checkpoint m is
    # written by the step whose input is the sequence's `ckpt_offset[m]`-th token of the window.
    decode_steps: int = 1
    # A decode window's, per sequence: the token ids that end its request (its stops, none while below
    # min_new_tokens). A sequence that samples one feeds it at the next step and then nothing more, so that its
    # state and KV are its request's at the stop (donatable); the steps after that compute on the scratch slot.
    window_stops: list[list[int]] = field(default_factory=list)
    # Images whose pad runs meet this step's new tokens, and their patches (flattened float32, in that order).
    images: list[PlanImage] = field(default_factory=list)
    image_patches: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    # P/D disaggregation (runtime.disagg.protocol's dicts), applied before the byte copies: a prefill rank
    # adds the decode peers (`pd_peers`), forgets the dead ones (`pd_forget`: their decode ids) and writes the
    # finished prefills' memory into them (`pd_sends`); a decode rank learns which rooms to expect (`pd_expect`:
    # room -> metadata slot) and, with `pd_poll`, reports the rooms that arrived.
    pd_peers: list[dict[str, Any]] = field(default_factory=list)
    pd_forget: list[str] = field(default_factory=list)
    pd_sends: list[dict[str, Any]] = field(default_factory=list)
    # Prefill: the pages prompt chunks completed, written beside the step's forward (after its copies).
    pd_chunks: list[dict[str, Any]] = field(default_factory=list)
    pd_expect: list[tuple[int, int]] = field(default_factory=list)
    pd_poll: bool = False

    @property
    def num_sampled(self) -> int:
        return self.sampling.num_rows


@dataclass
class StepResult:
    step: int
    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    input_logprobs: list[float]
    error: str | None = None  # the whole step failed: no token of it is valid
    # Per input-logprob row: the plan's top_logprobs_num best (id, logprob) of the full distribution.
    input_top_ids: list[list[int]] = field(default_factory=list)
    input_top_logprobs: list[list[float]] = field(default_factory=list)
    # The step ran but sampling these sampled rows failed: (row index, error); -1 tokens stand in for them.
    row_errors: list[tuple[int, str]] = field(default_factory=list)
    # Verify steps: drafts accepted per sampled sequence; `tokens` (and the logprob lists) then hold, sequence
    # after sequence, num_accepted[i] + 1 tokens each (the accepted drafts and the target's own next token),
    # and a row error's index is the sequence's. A decode window's: `decode_steps` tokens per sequence, alike.
    num_accepted: list[int] = field(default_factory=list)
    # A decode window's, per sequence: the tokens it fed into its cache (`decode_steps`, fewer where it stopped
    # feeding after a stop token; empty: every sequence fed them all).
    window_fed: list[int] = field(default_factory=list)
    dp_rank: int = 0  # DP attention: the attention group whose plan this is the result of
    # P/D decode: (room, first token, its logprob) of each transfer that completed; a prefill rank's failed
    # sends: (room, error), and what its transfers moved in the step (None: none)
    pd_arrived: list[tuple[int, int, float]] = field(default_factory=list)
    pd_failed: list[tuple[int, str]] = field(default_factory=list)
    pd_stats: TransferStats | None = None

    NESTED_OPTIONAL: ClassVar[dict[str, type]] = {"pd_stats": TransferStats}


@dataclass
class WorkerReady:
    """A rank's readiness, with the size of the pool it allocated (the scheduler's pool metadata must match it),
    or why it could not start."""

    rank: int
    error: str | None = None
    pool_bytes: int | None = None  # the pool buffer's bytes (PoolGeometry.total_bytes); None with an error
    pid: int | None = None  # the rank's process, so that the scheduler's watchdog can say it is stopped
    # Its compiled decode step's batch-size buckets and the seconds each took to build (empty: decode is eager).
    compile_buckets: list[int] = field(default_factory=list)
    compile_seconds: list[float] = field(default_factory=list)
    transfer: dict[str, Any] | None = None  # P/D: this rank's transfer agent (runtime.disagg.protocol.RankAgent)


@dataclass
class RankFailed:
    """A rank's last word: its collective failed or a peer went away; the whole engine fails with `error`."""

    rank: int
    error: str


@dataclass
class Shutdown:
    pass


@dataclass
class Heartbeat:
    """A scheduler is alive (sent while it has work, and at once when `stuck` changes): the tokenizer side's
    watchdog notices a scheduler that falls silent with requests pending. `stuck`: what the scheduler's own
    watchdog found stuck (a step its ranks have not finished within --watchdog-timeout); None: healthy."""

    replica: int
    stuck: str | None = None


@dataclass
class MetricsReq:
    req_id: str = ""  # echoed in the reply, so a late reply is never taken for a newer request's


@dataclass
class MetricsOut:
    metrics: dict[str, Any]
    req_id: str = ""


# Scheduler metrics that are high-water marks: DP ranks and replicas combine them by max (the rest add up).
PEAK_METRICS = frozenset({"decode_max_skipped_steps"})


def combine_metrics(per: list[dict[str, Any]]) -> dict[str, Any]:
    """Several schedulers' metrics as one: counts and byte totals added up, the high-water marks' max."""
    out: dict[str, Any] = {}
    for m in per:
        for k, v in m.items():
            out[k] = max(out[k], v) if k in PEAK_METRICS and k in out else out.get(k, 0) + v
    return out


@dataclass
class FlushCacheReq:
    req_id: str = ""


@dataclass
class FlushCacheOut:
    req_id: str
    flushed: bool  # False while requests are running or queued: the cache is left as it is


@dataclass
class PauseReq:
    """SGLang's /pause_generation: plan no step until a ContinueReq (mode: in_place, retract or abort)."""
    req_id: str = ""
    mode: str = "in_place"


@dataclass
class ContinueReq:
    req_id: str = ""


@dataclass
class PauseOut:
    """The scheduler's answer to a PauseReq or a ContinueReq: whether it is paused now."""
    req_id: str
    paused: bool


MESSAGES: dict[str, type] = {
    cls.__name__: cls
    for cls in (GenerateReq, AbortReq, TokenOut, TokenOuts, StepPlan, StepResult, WorkerReady, RankFailed, Shutdown,
                Heartbeat, MetricsReq, MetricsOut, FlushCacheReq, FlushCacheOut, PauseReq, ContinueReq, PauseOut)
}


def _group_arrays(cls: type) -> list[tuple[str, str, type]]:
    """(group, field, dtype) of every array of the class's array groups, in frame order."""
    return [(group, f.name, kind.DTYPES[f.name])
            for group, kind in getattr(cls, "ARRAY_GROUPS", {}).items() for f in dataclasses.fields(kind)]


def encode(msg: Any) -> list[bytes]:
    cls = type(msg)
    arrays = getattr(cls, "ARRAYS", ())
    groups = getattr(cls, "ARRAY_GROUPS", {})
    header = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)
              if f.name not in arrays and f.name not in groups}
    header["_type"] = cls.__name__
    frames = [orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)]
    dtypes = getattr(cls, "ARRAY_DTYPES", {})
    frames.extend(np.ascontiguousarray(getattr(msg, name), dtype=dtypes.get(name, np.int64)).tobytes()
                  for name in arrays)
    frames.extend(np.ascontiguousarray(getattr(getattr(msg, group), name), dtype=dtype).tobytes()
                  for group, name, dtype in _group_arrays(cls))
    return frames


def decode(frames: list[bytes]) -> Any:
    header = orjson.loads(frames[0])
    cls = MESSAGES[header.pop("_type")]
    arrays = getattr(cls, "ARRAYS", ())
    dtypes = getattr(cls, "ARRAY_DTYPES", {})
    in_groups = _group_arrays(cls)
    if len(frames) != 1 + len(arrays) + len(in_groups):
        raise ValueError(f"{cls.__name__}: {len(frames)} frames, expected {1 + len(arrays) + len(in_groups)}")
    for name, raw in zip(arrays, frames[1:], strict=False):
        header[name] = np.frombuffer(raw, dtype=dtypes.get(name, np.int64))
    grouped: dict[str, dict[str, np.ndarray]] = {group: {} for group in getattr(cls, "ARRAY_GROUPS", {})}
    for (group, name, dtype), raw in zip(in_groups, frames[1 + len(arrays) :], strict=True):
        grouped[group][name] = np.frombuffer(raw, dtype=dtype)
    for group, kind in getattr(cls, "ARRAY_GROUPS", {}).items():
        header[group] = kind(**grouped[group])
    for name, kind in getattr(cls, "NESTED", {}).items():
        header[name] = kind(**header[name])
    for name, kind in getattr(cls, "NESTED_OPTIONAL", {}).items():
        if header.get(name) is not None:
            header[name] = kind(**header[name])
    for name, kind in getattr(cls, "NESTED_LISTS", {}).items():
        header[name] = [kind(**item) for item in header[name]]
    return cls(**header)
