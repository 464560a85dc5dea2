"""A request as the scheduler tracks it: tokens, what of them the cache holds, and what it owns in the pool."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.radix_cache import Node
from runtime.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival: int = 0  # admission order, for FCFS

    output_ids: list[int] = field(default_factory=list)
    # Cache bookkeeping. Tokens fed so far = (prompt + output)[:num_computed]; their KV is in `pages`
    # (the first `tree_pages` of which belong to the radix tree; the rest to this request) and the KDA
    # state after them is in the live block `state`.
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    tree_pages: int = 0
    state: int | None = None
    node: Node | None = None  # the locked tree node the request's tree pages end at
    branch_len: int = 0  # a prefill chunk must end here (to checkpoint the branching point)
    cached_tokens: int = 0
    decode_since_checkpoint: int = 0
    slots: list[int] = field(default_factory=list)  # physical KV slots of the fed tokens (a plan-time cache)
    slots_epoch: int = -1
    # Output bookkeeping.
    new_token_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_logprob_next: int = 0  # first prompt position whose input logprob is still to be collected
    admitted: bool = False
    sent_tokens: int = 0
    finished: str | None = None
    matched_stop: int | str | None = None
    aborted: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids)
