"""The scheduler: waiting queue, running batch, radix cache and pool metadata; no model tensors.

Every request is a run of tokens, `all_ids[:num_computed]` of which are in the cache. A step feeds each
running request some of its pending tokens (one for a decode, a chunk for a prefill) and samples the next
token for every request whose tokens are then all fed. Decodes and prefill chunks share one forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from runtime.messages import GenerateReq, StepPlan, StepResult, TokenOut
from runtime.pool import PoolExhausted, UnifiedPool
from runtime.pool_layout import PoolLayout
from runtime.radix_cache import HybridRadixCache, MatchResult
from runtime.request import Req
from runtime.sampling_params import InvalidRequest, SamplingParams
from runtime.server_args import ServerArgs


@dataclass
class SchedulerMetrics:
    steps: int = 0
    running: int = 0
    queued: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    state_hits: int = 0
    state_misses: int = 0
    evictions: int = 0
    retractions: int = 0
    checkpoints: int = 0
    state_pool_bytes: int = 0
    kv_pool_bytes: int = 0


class Scheduler:
    def __init__(self, args: ServerArgs, layout: PoolLayout, stop_ids: frozenset[int],
                 detokenize: Callable[[list[int]], str], vocab_size: int) -> None:
        self.args = args
        self.vocab_size = vocab_size
        self.pool = UnifiedPool(layout, args.mem_bytes)
        self.cache = None if args.disable_radix_cache else HybridRadixCache(self.pool)
        self.ps = layout.page_size
        self.stop_ids = stop_ids
        self.detokenize = detokenize
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.metrics = SchedulerMetrics()
        self._arrivals = 0
        self._step = 0
        self._inflight: list[tuple[Req, int]] = []
        self._retracted_now: set[int] = set()
        self._outbox: list[TokenOut] = []

    # --- requests in -----------------------------------------------------------------------------------
    def add(self, msg: GenerateReq) -> None:
        try:
            params = SamplingParams.from_dict(msg.sampling)
            if not msg.input_ids:
                raise InvalidRequest("the prompt is empty")
            bad = [t for t in msg.input_ids if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"input_ids hold {bad[:3]}: token ids must be ints in [0, {self.vocab_size})")
            if not isinstance(msg.top_logprobs_num, int) or not 0 <= msg.top_logprobs_num <= self.vocab_size:
                raise InvalidRequest(f"top_logprobs_num must be an int in [0, {self.vocab_size}]")
            if not isinstance(msg.logprob_start_len, int):
                raise InvalidRequest("logprob_start_len must be an int")
            need = len(msg.input_ids) + params.max_new_tokens
            # The request alone, with its state block, must fit the pool (with one spare checkpoint block).
            if not self.pool.fits_packed(-(-need // self.ps), 2):
                raise InvalidRequest(f"prompt + max_new_tokens = {need} tokens exceed the pool's capacity")
            if len(self.waiting) >= self.args.max_queued_requests:
                raise InvalidRequest("the queue is full, try again later")
        except (InvalidRequest, TypeError) as e:
            self._outbox.append(TokenOut(msg.rid, [], finished="error", error=str(e)))
            return
        self._arrivals += 1
        self.waiting.append(Req(msg.rid, list(msg.input_ids), params, msg.return_logprob, msg.logprob_start_len,
                                msg.top_logprobs_num, arrival=self._arrivals))

    def abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, "abort")
        for req in self.running:
            if req.rid == rid:
                req.aborted = True  # released after the in-flight step, if any

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outbox)

    def take_outputs(self) -> list[TokenOut]:
        out, self._outbox = self._outbox, []
        return out

    # --- one step --------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        for req in [r for r in self.running if r.aborted]:
            self._release(req)
            self.running.remove(req)
            self._finish(req, "abort")
        self._retracted_now: set[int] = set()  # ids of requests retracted by this step: not readmitted in it
        batch: list[tuple[Req, int]] = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if self._pending(req) == 1:
                if req in self.running and self._ensure_pages(req, 1):
                    batch.append((req, 1))
        budget = self.args.chunked_prefill_size
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req in self.running and self._pending(req) > 1 and budget > 0:
                n = self._chunk_len(req, budget)
                if self._ensure_pages(req, n):
                    batch.append((req, n))
                    budget -= n
        self._order_waiting()
        deferred: list[Req] = []
        branching: set[tuple[int, ...]] = set()  # branching points this step's prefills will checkpoint
        while self.waiting and budget > 0 and len(self.running) < self.args.max_running_requests:
            req = self.waiting.popleft()
            if id(req) in self._retracted_now:
                deferred.append(req)
                continue
            match = self.cache.match_prefix(self._match_ids(req)) if self.cache is not None else None
            if match is not None and match.branch_len > match.prefix_len and \
                    tuple(req.all_ids[: match.branch_len]) in branching:
                deferred.append(req)  # next step it hits the checkpoint another request is making now
                continue
            if not self._admit(req, match):
                self.waiting.appendleft(req)
                break
            n = self._chunk_len(req, budget)
            if not self._ensure_pages(req, n, retract=False):
                self._release(req)
                self.waiting.appendleft(req)
                break
            if req.branch_len > req.num_computed:
                branching.add(tuple(req.all_ids[: req.branch_len]))
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        batch = [(r, n) for r, n in batch if r in self.running and id(r) not in self._retracted_now]
        if not batch:
            # Nothing can run and nothing will free memory: fail one request rather than spin.
            if self.running:
                req = max(self.running, key=lambda r: r.arrival)
                self._done(req, "error", error="the request does not fit in the memory pool")
            elif self.waiting:
                self._finish(self.waiting.popleft(), "error", error="the request does not fit in the memory pool")
            return None
        self._step += 1
        self._inflight = batch
        return self._plan(batch)

    def process(self, result: StepResult) -> list[TokenOut]:
        if result.error is not None:
            for req, _ in self._inflight:
                self._release(req, donate=False)  # the forward may have advanced its state: never cache it
                self.running.remove(req)
                self._finish(req, "error", error=result.error)
            self._inflight = []
            return self.take_outputs()
        sample_i = 0
        lp_i = 0
        for req, n in self._inflight:
            start = req.num_computed
            req.num_computed += n
            if req.wants_input_logprobs:
                lp_i = self._collect_input_logprobs(req, start, n, result, lp_i)
            if n == 1 and req.num_computed > len(req.prompt_ids):
                self.metrics.decode_tokens += 1
                req.decode_since_checkpoint += 1
            else:
                self.metrics.prefill_tokens_computed += n
            if req.num_computed == len(req.all_ids):
                self._on_token(req, result, sample_i)
                sample_i += 1
            elif not req.aborted:
                self._checkpoint(req)  # a prefill chunk ended mid-prompt
        self._inflight = []
        self.metrics.steps += 1
        self._refresh_metrics()
        return self.take_outputs()

    # --- internals -------------------------------------------------------------------------------------
    def _pending(self, req: Req) -> int:
        return len(req.all_ids) - req.num_computed

    def _chunk_len(self, req: Req, budget: int) -> int:
        n = min(self._pending(req), budget)
        if req.branch_len > req.num_computed:
            n = min(n, req.branch_len - req.num_computed)
        if n < self._pending(req):  # not the last chunk: end it on a page boundary so it can be checkpointed
            end = (req.num_computed + n) // self.ps * self.ps
            if end > req.num_computed:
                n = end - req.num_computed
        return n

    def _order_waiting(self) -> None:
        if self.cache is None or self.args.schedule_policy == "fcfs" or len(self.waiting) > self.args.lpm_max_queue:
            return
        # Longest prefix match first: requests that share cached prefixes run while those are hot.
        scored = sorted(self.waiting, key=lambda r: (-self.cache.match_prefix(self._match_ids(r)).prefix_len,
                                                     r.arrival))
        self.waiting = deque(scored)

    def _match_ids(self, req: Req) -> list[int]:
        ids = req.all_ids
        if req.wants_input_logprobs:  # tokens whose input logprobs are wanted must be recomputed
            ids = ids[: max(req.logprob_start_len - 1, 0) + 1]
        return ids

    def _admit(self, req: Req, match: MatchResult | None) -> bool:
        """Give `req` its live state block (with the matched checkpoint copied in) and its matched pages.
        `match` is this step's fresh `match_prefix` of the request (None without a radix cache)."""
        try:
            if self.cache is None or match is None:
                req.state = self.pool.alloc_state()
                return True
            self.cache.lock(match.node)
            try:
                req.state = self.cache.alloc_live_state(match)
            except PoolExhausted:
                self.cache.unlock(match.node)
                raise
        except PoolExhausted:
            return False
        req.node = match.node
        req.pages = list(match.pages)
        req.tree_pages = len(match.pages)
        req.num_computed = match.prefix_len
        req.branch_len = match.branch_len
        if not req.admitted:  # count each request once, not again after a retraction
            req.admitted = True
            req.cached_tokens = match.prefix_len
            self.metrics.cached_tokens += match.prefix_len
            self.metrics.prompt_tokens += len(req.prompt_ids)
            if match.state is not None:
                self.metrics.state_hits += 1
            else:
                self.metrics.state_misses += 1
        return True

    def _ensure_pages(self, req: Req, n: int, retract: bool = True) -> bool:
        """Pages for `n` more tokens of `req`; under pressure retract the newest other running requests."""
        need = -(-(req.num_computed + n) // self.ps) - len(req.pages)
        while need > 0:
            try:
                req.pages.extend(self.pool.alloc_pages(need))
                return True
            except PoolExhausted:
                victims = [r for r in self.running if r is not req and r not in (b for b, _ in self._inflight)]
                if not retract or not victims:
                    return False
                self._retract(max(victims, key=lambda r: r.arrival))
        return True

    def _retract(self, req: Req) -> None:
        """Free a running request's memory (caching what it computed) and queue it again; nothing is lost."""
        self._release(req)
        self.running.remove(req)
        req.num_computed = 0
        req.branch_len = 0
        self.waiting.appendleft(req)
        self._retracted_now.add(id(req))
        self.metrics.retractions += 1

    def _release(self, req: Req, donate: bool = True) -> None:
        """Return the request's pool memory: donate its state and KV to the tree where possible."""
        if req.state is None:
            return
        own_from = req.tree_pages
        if donate and self.cache is not None and req.num_computed > 0 and req.num_computed % self.ps == 0:
            k = req.num_computed // self.ps
            self.cache.insert(req.all_ids[: req.num_computed], req.pages[:k], req.state)  # donation
            own_from = k
        else:
            self.pool.free_state(req.state)
        self.pool.free_pages(req.pages[own_from:])
        if req.node is not None:
            self.cache.unlock(req.node)  # type: ignore[union-attr]
        req.state, req.node, req.pages, req.tree_pages = None, None, [], 0
        req.slots_epoch = -1

    def _checkpoint(self, req: Req) -> None:
        """Copy the live state into a tree node at the current (page-aligned) position."""
        if self.cache is None or req.num_computed % self.ps or req.state is None:
            return
        try:
            ckpt = self.pool.alloc_state()
        except PoolExhausted:
            return
        self.pool.copy_state(req.state, ckpt)
        k = req.num_computed // self.ps
        res = self.cache.insert(req.all_ids[: req.num_computed], req.pages[:k], ckpt)
        req.pages[:k] = res.pages
        req.slots_epoch = -1  # duplicates were swapped for the tree's pages
        req.tree_pages = k
        self.cache.lock(res.node)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node = res.node
        req.decode_since_checkpoint = 0
        self.metrics.checkpoints += 1

    def _on_token(self, req: Req, result: StepResult, i: int) -> None:
        tok = result.tokens[i]
        p = req.params
        if p.max_new_tokens == 0:
            self._done(req, "length")
            return
        req.output_ids.append(tok)
        if req.return_logprob:
            req.new_token_logprobs.append(result.logprobs[i])
            top = list(zip(result.top_ids[i], result.top_logprobs[i], strict=True))
            req.new_top_logprobs.append(top[: req.top_logprobs_num])
        n_out = len(req.output_ids)
        if tok in self._stop_tokens(req):  # masked while below min_new_tokens (see _plan)
            req.matched_stop = tok
            self._done(req, "stop")
        elif n_out >= p.min_new_tokens and p.stop and (s := self._stop_string(req)) is not None:
            req.matched_stop = s
            self._done(req, "stop")
        elif n_out >= p.max_new_tokens:
            self._done(req, "length")
        elif req.aborted:
            self._done(req, "abort")
        else:
            if req.decode_since_checkpoint >= self.args.decode_checkpoint_interval:
                self._checkpoint(req)
            self._emit(req)

    def _stop_tokens(self, req: Req) -> set[int]:
        return set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(self.stop_ids))

    def _stop_string(self, req: Req) -> str | None:
        """The stop string that occurs first in the output, if any."""
        text = self.detokenize(req.output_ids)
        hits = [(text.find(s), s) for s in req.params.stop if s in text]
        return min(hits)[1] if hits else None

    def _done(self, req: Req, reason: str, error: str | None = None) -> None:
        self._release(req)
        self.running.remove(req)
        self._finish(req, reason, error)

    def _finish(self, req: Req, reason: str, error: str | None = None) -> None:
        req.finished = reason
        self._emit(req, error)

    def _emit(self, req: Req, error: str | None = None) -> None:
        new = req.output_ids[req.sent_tokens :]
        if not new and req.finished is None and not req.input_logprobs:
            return
        out = TokenOut(req.rid, new, finished=req.finished, matched_stop=req.matched_stop,
                       prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens, error=error)
        if req.return_logprob:
            out.logprobs, out.top_logprobs = req.new_token_logprobs, req.new_top_logprobs
            out.input_logprobs, req.input_logprobs = req.input_logprobs, []
            req.new_token_logprobs, req.new_top_logprobs = [], []
        req.sent_tokens = len(req.output_ids)
        self._outbox.append(out)

    @staticmethod
    def _wants_input_logprob(req: Req, pos: int) -> bool:
        """Whether prompt token `pos`'s logprob is still to be collected (not already, before a retraction)."""
        return max(req.logprob_start_len, req.input_logprob_next) <= pos < len(req.prompt_ids)

    def _collect_input_logprobs(self, req: Req, start: int, n: int, result: StepResult, k: int) -> int:
        if start == 0 and self._wants_input_logprob(req, 0):
            req.input_logprobs.append(None)  # the first token has no context
            req.input_logprob_next = 1
        for j in range(start, start + n):
            if self._wants_input_logprob(req, j + 1):
                req.input_logprobs.append(result.input_logprobs[k])
                req.input_logprob_next = j + 2
                k += 1
        return k

    def _token_slots(self, req: Req, end: int, epoch: int) -> list[int]:
        """Physical KV slots of req's tokens [0, end), extended incrementally: recomputed only when a
        compaction moved pages (epoch) or the request's page list was rewritten (checkpoint, admission)."""
        if req.slots_epoch != epoch or len(req.slots) > end:
            req.slots, req.slots_epoch = [], epoch
        req.slots.extend(self.pool.token_slots(req.pages, len(req.slots), end))
        return req.slots

    def _plan(self, batch: list[tuple[Req, int]]) -> StepPlan:
        epoch = self.pool.usage().compaction_moves
        ids: list[int] = []
        cu, prefix, slots, kv_slots, kv_idx, indptr = [0], [], [], [], [], [0]
        sample_rows: list[int] = []
        params: list[dict] = []
        histories: list[list[int]] = []
        banned: list[list[int]] = []
        lp_rows: list[tuple[int, int]] = []  # (packed row, next token)
        top_n = 0
        for req, n in batch:
            a, b = req.num_computed, req.num_computed + n
            ids.extend(req.all_ids[a:b])
            prefix.append(a)
            slots.append(self.pool.state_slot(req.state))  # type: ignore[arg-type]
            all_slots = self._token_slots(req, b, epoch)
            kv_slots.extend(all_slots[a:b])
            kv_idx.extend(all_slots)
            indptr.append(len(kv_idx))
            base = cu[-1]
            cu.append(base + n)
            if req.wants_input_logprobs:
                for j in range(a, b):
                    if self._wants_input_logprob(req, j + 1):
                        lp_rows.append((base + j - a, req.prompt_ids[j + 1]))
            if b == len(req.all_ids):
                sample_rows.append(base + n - 1)
                params.append(req.params.row(len(req.output_ids)).__dict__)
                histories.append(req.output_ids)
                banned.append(sorted(self._stop_tokens(req)) if len(req.output_ids) < req.params.min_new_tokens
                              else [])
                top_n = max(top_n, req.top_logprobs_num if req.return_logprob else 0)
        logits_index = sample_rows + [r for r, _ in lp_rows]
        copies = [tuple(c) for c in self.pool.drain_copies()]
        return StepPlan(
            step=self._step, copies=copies, input_ids=np.array(ids), cu_seqlens=np.array(cu),
            prefix_lens=np.array(prefix), state_slots=np.array(slots), kv_slots=np.array(kv_slots),
            kv_indices=np.array(kv_idx), kv_indptr=np.array(indptr), logits_index=np.array(logits_index),
            sample_params=params, histories=histories, banned=banned, top_logprobs_num=top_n,
            input_logprob_rows=[(len(sample_rows) + i, tok) for i, (_, tok) in enumerate(lp_rows)],
        )

    def _refresh_metrics(self) -> None:
        m = self.metrics
        m.running, m.queued = len(self.running), len(self.waiting)
        u = self.pool.usage()
        m.state_pool_bytes, m.kv_pool_bytes = u.state_bytes, u.kv_bytes
        if self.cache is not None:
            s = self.cache.stats()
            m.evictions = s.evicted_pages + s.evicted_states

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.cache is not None:
            held_pages = [p for r in self.running for p in r.pages[r.tree_pages :]]
            held_states = [r.state for r in self.running if r.state is not None]
            self.cache.check_integrity(held_pages=held_pages, held_states=held_states)
        for r in self.waiting:
            assert r.state is None and not r.pages, f"waiting request {r.rid} holds pool memory"
