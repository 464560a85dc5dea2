"""Model proposers of speculative decoding, run by the worker: they fill a verify window's draft placeholders
(the scheduler plans `-1` for every draft of a model algorithm) and keep their own caches in step with the
target's committed tokens.

Where proposing happens: at the start of the verify step, in the worker. The window's first token (the one the
target sampled last step) is only known there, and the scheduler's k_i per request (0 near max_new_tokens, for a
grammar or an opted-out request) is already in the plan: drafting earlier would draft for windows that do not
exist and would have to park drafts per row across a retraction.

Draft model (`--speculative-algorithm draft`): a small K3-family model whose KDA states and MLA latents live in
the target's unified pool (`PoolLayout.draft`), at the same state slots and KV slots as the target's, so the
allocator, the radix cache's copies and retraction carry them along. It runs every extend and decode step the
target runs (`observe`: the same batch). In a verify step the draft keeps a running state in scratch (per
page-table row), copied from its live state, which is never written while drafting: round j runs window token j
alone in VERIFY mode from the running state, which records its inputs at window position j of the draft's own
SpecWindow and stores its MLA latent at the window's KV slot; draft j + 1 comes from its logits; the window's
commit over that one position then advances the running state (replay: decode's arithmetic, bit for bit). So a
window costs k + 1 draft tokens (the last round only records the last draft's inputs), and after acceptance
`commit` replays exactly the committed tokens from the untouched live state (the same ReplaySSM / snapshot
commit as the target's).
Greedy requests draft the draft model's argmax. Sampled requests draw each draft from q = the draft's
distribution under the request's temperature / top-k / top-p / min-p (no penalties, bans or grammar: q is only a
proposal, any q keeps rejection sampling exact) with the plain sampler's counter-based stream (independent of the
verifier's accept and residual streams), and hand q to `verify_drafts`: a draft model equal to the target then
accepts every sampled draft, up to rounding.

DP attention (`LockstepProposer`): the draft model is sharded as the target is, so each of its forwards runs the
shared FFN / MoE's collectives over every attention group; the MTP layers likewise. Each step every group makes
the same calls in the same order: before the target's forward as many as the step's widest window drafts with
(`draft_calls`), after it one observation if some group observes; a group with fewer joins on zero rows. DSpark's
drafter is replicated and needs none of this.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import Tensor

from kernels.sampling_tensors import SamplingTensors
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from radixk3.spec_window import SpecWindow, WindowRows, check_committed_states
from runtime.pool_layout import check_draft_config, serving_dtype
from runtime.server_args import ServerArgs
from runtime.spec.drafts import choose, draft_windows
from runtime.spec.dspark import load_dspark_proposer
from runtime.spec.mtp import MTPProposer
from runtime.worker.pool_buffer import PoolBuffer, torch_dtype

MODEL_PROPOSERS = ("draft", "mtp", "dspark")


class Proposer(Protocol):
    needs_hidden: bool  # whether the worker hands the target's pre-norm hiddens to observe / after_verify
    # Non-empty: `hidden` is instead the target's states after these layers, concatenated per token (DSpark).
    aux_layer_ids: tuple[int, ...]

    def observe(self, batch: ForwardBatch, hidden: Tensor | None, next_last: Tensor, rows: Tensor) -> None:
        """After a target extend or decode step over `batch` and its sampling: `hidden` the new tokens'
        pre-norm hiddens (when `needs_hidden`), `next_last[i]` sequence i's sampled token (-1: none sampled)."""

    def propose(self, batch: ForwardBatch, rows: Tensor, params: SamplingTensors) -> Tensor | None:
        """Fill `batch.input_ids` at every window position > 0 with drafts, in place; return the draft
        distributions [N, K, V] for rejection sampling (K = widest window - 1), or None for point masses.
        `params`: the sampling parameters of every window position, packed as `batch.input_ids` (row
        cu_seqlens[i] + j: window i's position j, for which draft j + 1 is drawn)."""

    def commit(self, state_slots: Tensor, rows: Tensor, num_tokens: Tensor, check: bool) -> None:
        """After acceptance: advance the proposer's states by each window's first num_tokens[i] tokens."""

    def after_verify(self, batch: ForwardBatch, hidden: Tensor, num_tokens: Tensor, last: Tensor,
                     rows: Tensor) -> None:
        """After a verify step (only when `needs_hidden`): the window's first num_tokens[i] tokens are
        committed, `last[i]` the token sampled after them, `hidden` the target's pre-norm hiddens [T, H]."""


class LockstepProposer(Proposer, Protocol):
    """A proposer whose calls run collectives across DP attention groups (see the module notes)."""

    observes_verify: bool  # whether it also runs its observation calls after a verify step

    def draft_calls(self, width: int) -> int:
        """Calls `propose` makes before the target's forward for windows up to `width` positions wide."""

    def idle_drafts(self, first: int, last: int) -> None:
        """Join draft calls `first` .. `last` (1-based) that this rank does not make itself."""

    def idle_observe(self) -> None:
        """Join the observation calls after the target's forward (this rank has nothing to observe)."""


class DraftModelProposer:
    needs_hidden = False
    aux_layer_ids: tuple[int, ...] = ()
    observes_verify = False  # a verify step's commit replays the draft's recorded inputs: no forward

    def __init__(self, model: KimiForCausalLM, buffer: PoolBuffer, window: SpecWindow) -> None:
        self.model = model
        self.window = window
        cfg = model.config
        self.cache = HybridCache(
            recurrent=[buffer.recurrent_state(i, draft=True) for i in range(cfg.num_kda_layers)],
            conv=[buffer.conv_state(i, draft=True) for i in range(cfg.num_kda_layers)],
            latent=[buffer.kv(i, draft=True) for i in range(cfg.num_mla_layers)],
        )
        # The running draft state across a verify step's draft rounds, per page-table row (scratch, outside the
        # pool: `pool_budget` takes its bytes); the MLA latents go to the window's own KV slots in the pool.
        rows = window.k[0].shape[0] if window.k else window.snap_recurrent[0].shape[0]
        self.running = HybridCache(
            recurrent=[torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=t.device) for t in self.cache.recurrent],
            conv=[torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=t.device) for t in self.cache.conv],
            latent=self.cache.latent,
        )

    def observe(self, batch: ForwardBatch, hidden: Tensor | None, next_last: Tensor, rows: Tensor) -> None:
        if batch.mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            # Only the last token's logits: the draft's are never read here (input logprobs are the target's).
            self.model.forward_batch(dataclasses.replace(batch, logits_index=None, attn_backend=None), self.cache)

    def propose(self, batch: ForwardBatch, rows: Tensor, params: SamplingTensors) -> Tensor | None:
        ids = batch.input_ids
        starts, lens, width, probs = draft_windows(batch.cu_seqlens, params, self.model.config.vocab_size)
        # The running state starts as the live one; the live state itself is never written while drafting.
        for run, live in zip(self.running.recurrent + self.running.conv, self.cache.recurrent + self.cache.conv,
                             strict=True):
            run[rows] = live[batch.state_slots]
        for j in range(width):
            on = (lens > j).nonzero().squeeze(1)  # the windows that have a position j
            cu = torch.arange(on.numel() + 1, device=ids.device)
            sub = ForwardBatch.from_table(ForwardMode.VERIFY, ids[starts[on] + j], cu, batch.prefix_lens[on] + j,
                                          rows[on], batch.block_table[on], batch.page_size)
            shifted = self._window_from(j)
            sub.spec = WindowRows(shifted, rows[on])  # records position j's inputs for the commit's replay
            logits = self.model.forward_batch(sub, self.running)
            more = lens[on] > j + 1
            if not bool(more.any()):
                continue
            drafting = on[more]
            d, q = choose(logits[more].float(), None if probs is None else params.take(starts[drafting] + j))
            ids[starts[drafting] + j + 1] = d
            if probs is not None:
                probs[drafting, j] = q
            # Advance the running state by token j: the same replay (or snapshot) commit, from scratch to scratch.
            ones = torch.ones_like(drafting)
            shifted.commit(self.running.recurrent, self.running.conv, rows[drafting], rows[drafting], ones)
        return probs

    # DP attention (`LockstepProposer`): a verify step drafts in one forward per window position, an extend or
    # decode step observes in one forward; a rank joins the others' on an idle batch.
    def draft_calls(self, width: int) -> int:
        return width

    def idle_drafts(self, first: int, last: int) -> None:
        if self.model.dp_attention:
            for _ in range(first, last + 1):
                self.model.idle_step()

    def idle_observe(self) -> None:
        if self.model.dp_attention:
            self.model.idle_step()

    def _window_from(self, j: int) -> SpecWindow:
        """The draft's window seen from position j (views): a one-token verify there records at position j."""
        w = self.window
        return dataclasses.replace(w, width=w.width - j, **{
            f: [t[:, j:] for t in getattr(w, f)] for f in ("k", "v", "g", "beta", "x", "snap_recurrent",
                                                            "snap_conv")})

    def commit(self, state_slots: Tensor, rows: Tensor, num_tokens: Tensor, check: bool) -> None:
        c = self.cache
        before = None
        if check:
            before = ([t.index_select(0, state_slots) for t in c.recurrent],
                      [t.index_select(0, state_slots) for t in c.conv])
        self.window.commit(c.recurrent, c.conv, state_slots, rows, num_tokens)
        if before is not None:
            check_committed_states(self.window, before, c.recurrent, c.conv, state_slots, rows, num_tokens)


def lockstep_proposer(proposer: Proposer | None, dp_attention: bool) -> LockstepProposer | None:
    """The proposer if its calls must be lockstepped across DP attention groups, else None."""
    return proposer if dp_attention and isinstance(proposer, (MTPProposer, DraftModelProposer)) else None


def load_draft_model(args: ServerArgs, target: KimiForCausalLM) -> KimiForCausalLM:
    from radixk3.checkpoint import load_model

    assert args.speculative_draft_model is not None
    draft = load_model(args.speculative_draft_model, device=target.device)
    check_draft_config(target.config, draft.config)
    dtype = serving_dtype(target.config, args)
    return draft if dtype == draft.config.dtype else draft.cast_(torch_dtype(dtype))


def build_proposer(args: ServerArgs, target: KimiForCausalLM, buffer: PoolBuffer) -> Proposer | None:
    """The worker's proposer for `args.speculative_algorithm`; None for n-gram (the scheduler drafts)."""
    alg = args.speculative_algorithm
    if alg is None or alg == "ngram":
        return None
    if alg == "mtp":
        return MTPProposer(target, buffer, max(args.max_running_requests, 1))
    if alg == "draft":
        draft = load_draft_model(args, target)
        window = SpecWindow.allocate(draft.config, args.spec_state, max(args.max_running_requests, 1),
                                     args.speculative_num_draft_tokens + 1, torch_dtype(buffer.layout.kv_dtype),
                                     target.device, record_inputs=args.debug_spec_state)
        return DraftModelProposer(draft, buffer, window)
    if alg == "dspark":
        assert args.speculative_draft_model is not None
        return load_dspark_proposer(args.speculative_draft_model, target, buffer)
    raise NotImplementedError(f"--speculative-algorithm {alg}: no worker proposer yet (available: ngram, "
                              f"{', '.join(MODEL_PROPOSERS)})")
