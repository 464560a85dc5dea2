"""A request as the scheduler tracks it: tokens, what of them the cache holds (or will once the planned
steps have run), what it owns in the pool, its page-table row, and its output bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from runtime.messages import Bootstrap, ImageRef
from runtime.sampling_params import SamplingParams
from runtime.scheduler.radix_cache import Node
from runtime.spec.ngram import CorpusDoc, NgramIndex

if TYPE_CHECKING:
    from runtime.grammar import GrammarMatcher


# An image's pad positions are keyed in the radix tree by a value drawn from its content hash, above every token id
# (SGLang's pad_value idea, in the key only: the worker still gets the pad id), so that two images behind the same
# pad ids never share cached tokens and the same image hits.
IMAGE_KEY_BASE = 1 << 60


def image_key_id(content_hash: str) -> int:
    return IMAGE_KEY_BASE + int(content_hash[:15], 16)


class ReqImage(NamedTuple):
    ref: ImageRef
    patches: np.ndarray  # flattened float32, ref.num_patches patches


def request_images(refs: list[ImageRef], patches: np.ndarray) -> list[ReqImage]:
    """A GenerateReq's images, each with its own slice of the message's patches."""
    total = sum(r.num_patches for r in refs)
    if not refs:
        return []
    per_patch = len(patches) // total
    if per_patch * total != len(patches):
        raise ValueError(f"{len(patches)} patch values for {total} patches")
    out, at = [], 0
    for r in refs:
        out.append(ReqImage(r, patches[at : at + r.num_patches * per_patch]))
        at += r.num_patches * per_patch
    return out


def radix_key(prompt_ids: list[int], images: list[ReqImage]) -> list[int] | None:
    """The prompt as the radix tree keys it (each image's pads replaced by its hash's value); None without images."""
    if not images:
        return None
    key = list(prompt_ids)
    for im in images:
        r = im.ref
        key[r.offset : r.offset + r.num_tokens] = [image_key_id(r.content_hash)] * r.num_tokens
    return key


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival: int = 0  # admission order, for FCFS
    images: list[ReqImage] = field(default_factory=list)  # in prompt order
    prompt_key: list[int] | None = None  # `radix_key` of the prompt (None: the prompt ids themselves)
    stream: bool = True  # False: read whole, its tokens sent after the first every NON_STREAM_INTERVAL and at the end

    output_ids: list[int] = field(default_factory=list)
    # Cache bookkeeping. `num_computed` tokens are planned: once the steps in flight have run, the KV of
    # tokens [0, num_computed) is in `pages` (the first `tree_pages` of which belong to the radix tree, the
    # rest to this request) and the KDA state after them is in the live block `state`. Under the overlap
    # scheduler the last of them may be a token still being sampled (fed to the worker as -1).
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    tree_pages: int = 0
    state: int | None = None
    node: Node | None = None  # the locked tree node the request's tree pages end at
    branch_len: int = 0  # the match's branching point: a step checkpoints the state there
    ckpt_points: set[int] = field(default_factory=set)  # more positions to checkpoint (prefixes others share)
    pending_ckpts: set[int] = field(default_factory=set)  # checkpoints planned, not yet in the tree
    cached_tokens: int = 0
    decode_since_checkpoint: int = 0
    prefill_done: bool = False  # the chunk that samples its first token (since admission) is planned
    last_sampled_step: int | None = None  # the last step planned to sample for it: its decode gaps count from there
    # Page table: the worker's row for this request and how many of its columns the worker holds.
    row: int | None = None
    table_cols: int = 0
    dirty_cols: set[int] = field(default_factory=set)  # columns whose page changed (swapped for the tree's)
    # Steps planned and not yet processed that include this request, and how many of them sample for it.
    in_flight: int = 0
    pending_samples: int = 0
    # Output bookkeeping.
    new_token_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)  # parallel to the above
    input_logprob_next: int = 0  # first prompt position whose input logprob is still to be collected
    admitted: bool = False
    sent_tokens: int = 0
    finished: str | None = None
    matched_stop: int | str | None = None
    stop_from_end: int | None = None  # a matched stop string's or regex's place in the text (TokenOut's)
    aborted: bool = False
    retract_pending: bool = False  # retract once its in-flight steps are processed
    poisoned: bool = False  # a step including it failed: its state must never be cached
    # Isolation of worker errors: a request in a failed step with others is retried (from scratch, alone
    # until a step that samples for it succeeds), so that a failure is pinned on the request causing it.
    retry: bool = False  # poisoned by a failed step it shared: requeue once no step in flight includes it
    isolate: bool = False  # planned alone
    retries: int = 0
    # Structured output: the matcher has accepted exactly `output_ids` (tokens are accepted as processed).
    grammar: GrammarMatcher | None = None
    # Speculative decoding: the n-gram proposer's index of this request's tokens, its document in the shared
    # n-gram corpus (its committed tokens), and whether its live state is past its kept tokens (a stop inside
    # an accepted run): such a state is never donated to the tree.
    ngram: NgramIndex | None = None
    corpus_doc: CorpusDoc | None = None
    state_ahead: bool = False
    # P/D disaggregation: the room pairing this request's prefill and decode halves, and (prefill side) the
    # logprob of its first token, sent with it.
    bootstrap: Bootstrap | None = None
    first_logprob: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def known_len(self) -> int:
        """Tokens whose ids are known (prompt + processed outputs)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def seq_len(self) -> int:
        """Tokens the sequence will have once the samples in flight are processed."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending_samples

    @property
    def output_index(self) -> int:
        """Index among the outputs of the next token to be sampled."""
        return len(self.output_ids) + self.pending_samples

    def ids(self, start: int, end: int) -> list[int]:
        """Known token ids [start, end), without building the whole sequence."""
        return self._span(self.prompt_ids, start, end)

    def key_ids(self, start: int, end: int) -> list[int]:
        """`ids(start, end)` as the radix tree keys them: an image's pads by its content hash."""
        return self._span(self.prompt_ids if self.prompt_key is None else self.prompt_key, start, end)

    def _span(self, prompt: list[int], start: int, end: int) -> list[int]:
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return prompt[start:] + self.output_ids[: end - n]

    @property
    def all_key_ids(self) -> list[int]:
        return self.key_ids(0, self.known_len)

    @property
    def active(self) -> bool:
        """Still to be scheduled (not finished, aborted, failed, or waiting to be retracted)."""
        return not (self.finished or self.aborted or self.poisoned or self.retract_pending)

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids)

    def wants_input_logprob(self, pos: int) -> bool:
        """Whether prompt token `pos`'s logprob is still to be collected (not already, before a retraction)."""
        return self.wants_input_logprobs and max(self.logprob_start_len, self.input_logprob_next) <= pos < len(
            self.prompt_ids)
