"""The scheduler: waiting queue, running batch, radix cache and pool metadata; no model tensors.

Every request is a run of tokens, the first `num_computed` of which are planned into the cache. A step is
either an extend step (prefill chunks of running and newly admitted requests, at most `chunked_prefill_size`
tokens each and `max_prefill_tokens` in all, shared so that neither a long prompt nor a queue of short ones
starves the other; running decodes ride along unless mixing is off, see `_compose_step`) or, when there is
no prefill work, a decode step with every running decode. Checkpoints (branching point, shared prefixes,
chunk ends, prompt end, every `decode_checkpoint_interval` decode tokens) are requested in the plan of the
step that computes that position and enter the tree when its result is processed.

Results may come one step late (the overlap scheduler plans step N+1 while the worker runs step N): a
decode planned before its input token is known feeds -1, and a request is released (its memory donated
to the tree) only once no step in flight includes it.

Structured output (SGLang's grammar queue): a request with a grammar waits in `grammar_wait` while it
compiles (runtime.grammar: in a worker process under a time budget, then in a thread), then joins the waiting
queue with its matcher; a grammar refused there fails its request as invalid (a 400). Its token mask needs its
previous token, so its decode is never planned while a sample of it is in flight (`grammar_blocked` tells the
step loop to resolve the step in flight first); a step's sampled tokens advance the matchers as they are
processed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.disagg.protocol import RankAgent, TransferStats
from runtime.errors import InvalidRequest
from runtime.grammar import GrammarBackend, GrammarKey
from runtime.messages import GenerateReq, StepPlan, StepResult, TokenOut
from runtime.pool_layout import PoolLayout, pool_budget
from runtime.sampling_params import SamplingParams
from runtime.scheduler.admission import NO_DEMAND, Admission, Demand, request_demand
from runtime.scheduler.disagg import DecodeSide, PrefillSide
from runtime.scheduler.output_processor import OutputProcessor
from runtime.scheduler.page_table import PageTables
from runtime.scheduler.plan_builder import Checkpoint, SeqEntry, StepRecord, build_plan
from runtime.scheduler.policy import NewTokenRatio, order_waiting, running_prefill_share, shared_prefix_leader
from runtime.scheduler.pool import Kind, UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache, MatchResult
from runtime.scheduler.req_cache import ReqCache
from runtime.scheduler.request import Req, radix_key, request_images
from runtime.server_args import ServerArgs
from runtime.spec.ngram import NgramCorpus, NgramIndex, propose_drafts


@dataclass
class SchedulerMetrics:
    steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
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
    mixed_steps: int = 0  # extend steps that running decodes rode in
    state_pool_bytes: int = 0
    kv_pool_bytes: int = 0
    pool_bytes: int = 0  # the unified pool's size (states and KV together), as the workers allocated it
    verify_steps: int = 0
    spec_windows: int = 0  # sequences verified with at least one draft
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # drafts accepted
    # P/D prefill: the transfers its workers made (chunk writes and each room's last), the MLA and KDA bytes they
    # moved, and the bytes and seconds of the writes they timed (each room's last one)
    pd_transfers: int = 0
    pd_kv_bytes: int = 0
    pd_state_bytes: int = 0
    pd_timed_bytes: int = 0
    pd_timed_seconds: float = 0.0
    # The most steps in a row that a decoding request (its first token sampled) was left out of, since the start:
    # how long a decode stalls, in steps rather than seconds. 0 while decodes ride in every step (mixed chunks);
    # 1 where an extend step cannot carry them (speculation, an isolated retry) and they get the next one.
    # A high-water mark (`PEAK_METRICS`): DP ranks combine it by max.
    decode_max_skipped_steps: int = 0

    @property
    def accept_length(self) -> float:
        """Mean tokens a verified sequence gained per step (accepted drafts + the target's own token)."""
        return 1.0 + self.accepted_tokens / self.spec_windows if self.spec_windows else 0.0


MAX_STEP_RETRIES = 2  # failed steps a request may share with others before it fails itself


class Scheduler:
    def __init__(self, args: ServerArgs, layout: PoolLayout, stop_ids: frozenset[int],
                 detokenize: Callable[[list[int], bool], str], grammar: GrammarBackend | None = None, *,
                 pool_bytes: int | None = None, transfer_agents: list[RankAgent] | None = None) -> None:
        """`pool_bytes`: the pool's size, as the worker ranks allocated it (their `WorkerReady.pool_bytes`);
        None: the `--mem-bytes` budget (`pool_budget`), for a scheduler without workers to ask.
        `transfer_agents`: a decode server's ranks' transfer agents, in rank order (P/D disaggregation)."""
        self.args = args
        self.grammar = grammar
        self.grammar_wait: list[tuple[Req, concurrent.futures.Future[Any]]] = []  # compiling, in arrival order
        self.pool = UnifiedPool(layout, pool_budget(layout, args) if pool_bytes is None else pool_bytes)
        self.cache = None if args.disable_radix_cache else HybridRadixCache(self.pool)
        self.ps = layout.page_size
        self.admission = Admission(self.pool, self.cache)
        self.req_cache = ReqCache(self.pool, self.cache)
        self.tables = PageTables(args.max_running_requests)
        self.outputs = OutputProcessor(stop_ids, detokenize)
        self.ratio = NewTokenRatio(args.schedule_conservativeness)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # requests holding pool memory and a row (finished ones until released)
        # A request is running iff it owns a page-table row: `req.row is not None` is the O(1) membership test.
        self.metrics = SchedulerMetrics(pool_bytes=self.pool.geometry.total_bytes)
        self._arrivals = 0
        self._step = 0
        self._inflight: deque[StepRecord] = deque()
        self._retracted_now: set[int] = set()
        self._decodes_owed = False  # the last extend step could not carry the running decodes: they go next
        self.spec = args.speculative_algorithm
        # n-gram: every request's committed tokens (running ones too), where every request also looks for drafts.
        self.ngram_corpus = NgramCorpus(args.speculative_ngram_min, args.speculative_ngram_max,
                                        args.speculative_ngram_capacity) \
            if self.spec == "ngram" and args.speculative_ngram_capacity > 0 else None
        # Drafts of this step's verify windows, by request: n-gram drafts are proposed here; a model proposer's
        # are -1 placeholders that the worker's proposer fills.
        self._drafts: dict[int, list[int]] = {}
        self.paused = False  # /pause_generation: no step is planned until /continue_generation
        # P/D disaggregation: this server's half of it (runtime.scheduler.disagg), if it is a prefill or decode one.
        self.pd_prefill = PrefillSide(args, layout, args.tp_size) if args.disaggregation_mode == "prefill" else None
        self.pd_decode = None
        if args.disaggregation_mode == "decode":
            if not transfer_agents:
                raise ValueError("a decode server needs its ranks' transfer agents")
            self.pd_decode = DecodeSide(args, self.pool, transfer_agents, args.tp_size, self.cache)

    # --- requests in -----------------------------------------------------------------------------------
    def add(self, msg: GenerateReq) -> None:
        """Queue a request checked at the door (its parameters, token ids and options are not checked again);
        refuse it only for what the scheduler alone knows: the pool, the queue, the grammar backend."""
        params = msg.sampling
        try:
            need = len(msg.input_ids) + params.max_new_tokens
            # The request alone, with its state block, must fit the pool (with one spare checkpoint block).
            if not self.pool.fits_packed(-(-need // self.ps), 2):
                raise InvalidRequest(f"prompt + max_new_tokens = {need} tokens exceed the pool's capacity")
            if len(self.waiting) + len(self.grammar_wait) >= self.args.max_queued_requests:
                raise InvalidRequest("the queue is full, try again later")
            if params.grammar is not None and self.grammar is None:
                raise InvalidRequest("structured output is not available in this engine", param=params.grammar[0])
            images = request_images(msg.images, msg.image_patches)
            if self.args.disaggregation_mode != "null":
                params = self._disaggregated(msg)
        except Exception as e:  # refused, or something unexpected: this request fails, never the scheduler
            self.outputs.outbox.append(TokenOut(msg.rid, [], finished="error", error=str(e)))
            return
        self._arrivals += 1
        req = Req(msg.rid, list(msg.input_ids), params, msg.return_logprob, msg.logprob_start_len,
                  msg.top_logprobs_num, arrival=self._arrivals, images=images,
                  prompt_key=radix_key(list(msg.input_ids), images), stream=msg.stream)
        req.bootstrap = msg.bootstrap
        if self.pd_prefill is not None:
            self.pd_prefill.add(req)
        elif self.pd_decode is not None:
            self.pd_decode.add(req)
        elif params.grammar is not None and self.grammar is not None:
            self.grammar_wait.append((req, self.grammar.submit(GrammarKey(*params.grammar))))
        else:
            self.waiting.append(req)

    def _disaggregated(self, msg: GenerateReq) -> SamplingParams:
        """A prefill or decode server's request (checked at the door: `runtime.disagg.door`): a prefill server
        samples the first token only."""
        params = msg.sampling
        if msg.bootstrap is None:  # the door lets none through; a scheduler never serves one half-way
            raise InvalidRequest("a P/D disaggregation server's request needs its bootstrap room")
        if self.args.disaggregation_mode == "prefill":
            return dataclasses.replace(params, max_new_tokens=1, min_new_tokens=min(params.min_new_tokens, 1))
        return params

    def abort(self, rid: str) -> None:
        if self.pd_prefill is not None and (req := self.pd_prefill.abort(rid)) is not None:
            self.outputs.finish(req, "abort")
        if self.pd_decode is not None:
            self.pd_decode.abort(rid)
        for item in list(self.grammar_wait):
            if item[0].rid == rid:
                self.grammar_wait.remove(item)
                self.outputs.finish(item[0], "abort")
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self.outputs.finish(req, "abort")
        for req in self.running:
            if req.rid == rid and not req.finished:
                req.aborted = True  # released once no step in flight includes it

    def fail_all(self, error: str) -> list[TokenOut]:
        """Fail every request with `error` (the watchdog: a step is stuck). Queued requests and running ones
        in no step in flight let go of their memory now. A request in a step in flight keeps its memory until
        that step's result comes (the stuck ranks may still write it, and later plans may still read it); it
        is poisoned, so that result's tokens are discarded and its state is never cached."""
        for req, _ in self.grammar_wait:
            self.outputs.finish(req, "error", error)
        self.grammar_wait = []
        while self.waiting:
            self.outputs.finish(self.waiting.popleft(), "error", error)
        for req in list(self.running):
            if req.finished is None:
                self.outputs.finish(req, "error", error)
            if req.in_flight:
                req.poisoned = True
            else:
                self._settle(req)
        self._refresh_metrics()
        return self.take_outputs()

    # --- pausing (SGLang's /pause_generation and /continue_generation) ----------------------------------
    def pause(self, mode: str) -> None:
        """Plan no step until `resume`; requests keep arriving and queue. Steps in flight complete. `in_place`:
        running requests keep their memory and go on where they stopped; `retract`: they give it back (what
        they computed stays in the radix cache) and queue again, to be recomputed; `abort`: every request,
        queued or running, is aborted."""
        if mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"unknown pause mode {mode!r}")
        self.paused = True
        if mode == "abort":
            rids = [r.rid for r, _ in self.grammar_wait] + [r.rid for r in self.waiting] + \
                [r.rid for r in self.running if r.active]
            for rid in rids:
                self.abort(rid)
        elif mode == "retract":
            for req in sorted((r for r in self.running if r.active), key=lambda r: -r.arrival):
                if req.in_flight:
                    req.retract_pending = True  # retracted once its step is processed
                else:
                    self._retract(req)  # newest first: the oldest ends at the queue's head
        self._refresh_metrics()

    def resume(self) -> None:
        self.paused = False

    @property
    def has_work(self) -> bool:
        if self.paused:  # only what is in flight, to be sent, or to be let go of
            return bool(self._inflight or self.outputs.outbox or any(not r.active for r in self.running))
        return bool(self.waiting or self.running or self.outputs.outbox or self._inflight or self.grammar_wait
                    or self._pd_busy)

    @property
    def _rows_taken(self) -> int:
        """Page-table rows in use or promised: the running requests', and (P/D decode) the rooms' on arrival."""
        return len(self.running) + (len(self.pd_decode.rooms) if self.pd_decode is not None else 0)

    @property
    def _pd_busy(self) -> bool:
        side = self.pd_prefill or self.pd_decode
        return side is not None and side.has_work

    @property
    def waiting_on_peer(self) -> bool:
        """Nothing to do but wait for the other side of P/D disaggregation (the loop may sleep a little)."""
        if self.waiting or self.running or self.outputs.outbox or self._inflight or self.grammar_wait:
            return False
        side = self.pd_prefill or self.pd_decode
        return side is not None and side.waiting_on_peer and not side.plan_due

    @property
    def grammar_blocked(self) -> bool:
        """A constrained request's next mask waits for its sample in flight: resolve that step first."""
        return any(r.grammar is not None and r.pending_samples and r.active for r in self.running)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a grammar compiling finishes, at most `timeout` s (when nothing else can be done)."""
        if self.grammar_wait:
            concurrent.futures.wait([f for _, f in self.grammar_wait], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue with a matcher; a failed one fails."""
        still: list[tuple[Req, concurrent.futures.Future[Any]]] = []
        for req, fut in self.grammar_wait:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = self.grammar.matcher(fut.result())  # type: ignore[union-attr]
            except InvalidRequest as e:  # refused by xgrammar, past the time budget, or matching nothing: a 400
                self.outputs.refuse(req, e)
                continue
            except Exception as e:  # the compiler failing
                self.outputs.finish(req, "error", str(e))
                continue
            self.waiting.append(req)
        self.grammar_wait = still

    @property
    def steps_in_flight(self) -> int:
        return len(self._inflight)

    def take_outputs(self) -> list[TokenOut]:
        return self.outputs.take()

    # --- one step --------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Plan the next step (results of the steps in flight may still be outstanding), or None."""
        self._retracted_now = set()  # ids of requests retracted while planning: not readmitted in this step
        self._drafts = {}
        if self.grammar_wait:
            self._admit_compiled()
        self._pd_tick()
        for req in [r for r in self.running if r.in_flight == 0 and not r.active]:
            self._settle(req)
        if self.paused:
            return None
        if self._inflight and self._inflight[-1].decode_steps > 1:
            return None  # nothing is planned behind a decode window: its last samples are its requests' next inputs
        batch, mode, n_prefill, steps = self._compose_step()
        prefill = {id(r) for r, _ in batch[:n_prefill]}
        batch = [(r, n) for r, n in batch if r.row is not None]  # drop requests retracted while planning
        if not batch and self._pd_plan_due():  # nothing to run, but the workers have transfers to make or poll
            self._step += 1
            rec = StepRecord(self._step, "idle", [], [])
            self._inflight.append(rec)
            return self._pd_plan(build_plan(rec, self.pool, self.tables, self.outputs))
        if not batch:
            if not self._inflight:  # nothing runs and nothing will free memory: fail one request, never spin
                if self.running:
                    req = max((r for r in self.running if r.active), key=lambda r: r.arrival, default=None)
                    if req is not None:
                        self.outputs.finish(req, "error", "the request does not fit in the memory pool")
                        self._settle(req)
                elif self.waiting:
                    self.outputs.finish(self.waiting.popleft(), "error", "the request does not fit in the memory pool")
            return None
        self._step += 1
        decodes = sum(1 for r, _ in batch if id(r) not in prefill)
        if 0 < decodes < len(batch):  # prefill chunks and decodes in one step
            self.metrics.mixed_steps += 1
        rec = self._record(batch, mode, steps)
        self._inflight.append(rec)
        for _ in range(steps if decodes else 0):  # a decode window is `steps` decode steps
            self.ratio.on_decode_step()
        return self._pd_plan(build_plan(rec, self.pool, self.tables, self.outputs))

    # --- P/D disaggregation ----------------------------------------------------------------------------
    def _pd_tick(self) -> None:
        """Prefill: admit the requests whose reservation came. Decode: reserve memory for waiting requests (the
        plan of this schedule carries the allocation's copies). Both: fail what the other side gave up on."""
        if self.pd_prefill is not None:
            ready, failed, abort = self.pd_prefill.tick()
            self.waiting.extend(ready)
            for req, error in failed:
                self.outputs.finish(req, "error", error)
            for rid in abort:
                self.abort(rid)
        if self.pd_decode is not None:
            self.pd_decode.reserve(len(self.running), self._step + 1)
            self._pd_take_failed()

    def _pd_take_failed(self) -> None:
        assert self.pd_decode is not None
        failed, aborted = self.pd_decode.take_failed()
        for req, error in failed:
            self.outputs.finish(req, "error", error)
        for req in aborted:
            self.outputs.finish(req, "abort")

    def _pd_plan_due(self) -> bool:
        side = self.pd_prefill or self.pd_decode
        return side is not None and side.plan_due

    def _pd_plan(self, plan: StepPlan) -> StepPlan:
        if self.pd_prefill is not None:
            return dataclasses.replace(plan, **self.pd_prefill.plan_fields(plan.step),
                                       **self.pd_prefill.chunk_fields(plan.step, self.pool))
        if self.pd_decode is not None:
            return dataclasses.replace(plan, **self.pd_decode.plan_fields())
        return plan

    def _pd_step_done(self, result: StepResult, step: int) -> None:
        """After a step's result: prefill hears which sends failed; decode sends the reservations whose copies
        ran and starts the rooms that arrived, each with its first token (which may already end it)."""
        if self.pd_prefill is not None:
            self.pd_prefill.step_done(step, result.pd_failed)
            if result.pd_stats is not None:
                self._pd_count(result.pd_stats)
        if self.pd_decode is None:
            return
        for req, tok, lp in self.pd_decode.step_done(step, result.pd_arrived):
            req.admitted = req.prefill_done = True
            req.last_sampled_step = step
            self.metrics.prompt_tokens += len(req.prompt_ids)
            self.metrics.cached_tokens += req.cached_tokens
            reason = self.outputs.on_token(req, tok, lp, [], [])
            self.tables.assign(req)
            self.running.append(req)
            if reason is not None:
                self.outputs.finish(req, reason)
            else:
                self.outputs.emit(req)
        self._pd_take_failed()

    def _pd_count(self, stats: TransferStats) -> None:
        m = self.metrics
        m.pd_transfers += stats.transfers
        m.pd_kv_bytes += stats.kv_bytes
        m.pd_state_bytes += stats.state_bytes
        m.pd_timed_bytes += stats.timed_bytes
        m.pd_timed_seconds += stats.timed_seconds

    def process(self, result: StepResult) -> list[TokenOut]:
        """Apply the result of the oldest step in flight."""
        rec = self._inflight.popleft()
        if result.step != rec.step:
            raise RuntimeError(f"result of step {result.step} while step {rec.step} is the oldest in flight")
        failed = result.error is not None
        row_errors = dict(result.row_errors)
        sample_i = lp_i = tok_i = 0
        for s in rec.seqs:
            req = s.req
            req.in_flight -= 1
            if s.sampled:
                req.pending_samples -= rec.decode_steps
            if failed:
                self._on_failed_step(req, len(rec.seqs) == 1, result.error)
                continue
            if rec.mode == "verify":
                self.metrics.decode_tokens += 1 + result.num_accepted[sample_i]
            elif rec.decode_steps > 1 or (s.n == 1 and s.start >= len(req.prompt_ids)):
                self.metrics.decode_tokens += s.n
            else:
                self.metrics.prefill_tokens_computed += s.n
            n_lp = len(s.input_lp_positions)
            if s.input_lp_first_none or n_lp:
                self.outputs.collect_input_logprobs(req, s.input_lp_first_none, s.input_lp_positions,
                                                    result.input_logprobs[lp_i : lp_i + n_lp],
                                                    result.input_top_ids[lp_i : lp_i + n_lp],
                                                    result.input_top_logprobs[lp_i : lp_i + n_lp])
                lp_i += n_lp
            if s.sampled:
                i = sample_i
                sample_i += 1
                n_tok = result.num_accepted[i] + 1 if rec.mode == "verify" else rec.decode_steps
                first = tok_i
                tok_i += n_tok
                self._apply_samples(req, result, first, n_tok, row_errors.get(i))
                self._share_tokens(req)
                if rec.mode == "verify":
                    self._commit_window(req, s, n_tok)
                elif rec.decode_steps > 1:  # every token the window fed is in the cache; a stop inside it keeps fewer
                    self._commit_window(req, s, s.n, result.window_fed[i] if result.window_fed else s.n)
        for c in rec.ckpts:
            req = rec.seqs[c.seq].req
            req.pending_ckpts.discard(c.pos)
            if req.poisoned or c.pos > req.num_computed:  # (a decode window's past a stop inside it: not kept)
                self.pool.free_state(c.block)
                continue
            self.tables.mark_changed(req, self.req_cache.insert_checkpoint(req, c.pos, c.block))
            self.metrics.checkpoints += 1
        # Before settling: a request retracted there lets go of its pages, and `on_requeue` then undoes this.
        if self.pd_prefill is not None and not failed:  # the pages its prompt chunks completed go next
            self.pd_prefill.chunks_done([(s.req, s.start + s.n) for s in rec.seqs])
        for s in rec.seqs:
            if s.req.in_flight == 0 and not s.req.active and s.req.row is not None:
                self._settle(s.req)
        self._pd_step_done(result, rec.step)
        self.metrics.steps += 1
        if rec.mode == "decode":
            self.metrics.decode_steps += rec.decode_steps
        elif rec.mode == "verify":
            self.metrics.verify_steps += 1
        elif rec.mode != "idle":
            self.metrics.extend_steps += 1
        self._refresh_metrics()
        return self.take_outputs()

    def _apply_samples(self, req: Req, result: StepResult, first: int, n_tok: int, row_error: str | None) -> None:
        """The tokens sampled for `req` in a step (one, or a verified window's run), in order: a stop, a stop
        string, the length or the grammar may end the request inside the run (the rest is discarded)."""
        if req.finished or req.poisoned:
            return  # planned before the request ended: its tokens are discarded
        if row_error is not None:  # the worker could not sample this row: it fails alone
            req.poisoned = True
            self.outputs.finish(req, "error", row_error)
            return
        req.isolate = False  # a step sampling for it succeeded: it is not the culprit
        lp, ids, lps = result.logprobs, result.top_ids, result.top_logprobs
        if req.bootstrap is not None and not req.output_ids:  # a prefill server sends it with the first token
            req.first_logprob = lp[first] if lp else 0.0
        reason = None
        for j in range(first, first + n_tok):
            tok = result.tokens[j]
            # An aborted request keeps its token: a step in flight may already have fed it.
            reason = self.outputs.on_token(req, tok, lp[j] if lp else 0.0, ids[j] if ids else [],
                                           lps[j] if lps else [])
            if req.grammar is not None:
                if not req.grammar.accept(tok):  # only if the mask left nothing to draw
                    reason = "error"
                elif reason is None and req.grammar.terminated:
                    reason = "stop"
            if reason is not None:
                break
        if reason == "error":
            self.outputs.finish(req, reason, f"the grammar allows no token after {len(req.output_ids) - 1} "
                                             "outputs (its stop tokens banned by min_new_tokens, or nothing left "
                                             "but bytes that are not well-formed UTF-8, such as a surrogate?)")
        elif reason is not None:
            self.outputs.finish(req, reason)
        elif not req.aborted:
            self.outputs.emit(req)

    def _commit_window(self, req: Req, s: SeqEntry, n_tok: int, fed: int | None = None) -> None:
        """The worker committed the window's first n_tok tokens (its last sampled token and the accepted drafts;
        a decode window's every token) into the cache: cut the request's cache back to them, so the rejected
        positions' KV pages return to the pool. If the request ended inside the run it keeps fewer tokens than
        the state has seen: that state is never donated. A decode window stops feeding a sequence after its stop
        token (`fed` tokens): a request that stopped there keeps them all, and its state is exact."""
        committed = s.start + n_tok
        if s.drafts:
            self.metrics.spec_windows += 1
            self.metrics.draft_tokens += len(s.drafts)
            self.metrics.accepted_tokens += n_tok - 1
        req.num_computed = min(committed, req.known_len)
        seen = s.start + (n_tok if fed is None else fed)
        if seen < req.num_computed:  # the worker stopped feeding a request that did not stop: its cache lacks tokens
            req.num_computed = seen
            if not req.poisoned:
                req.poisoned = True
                self.outputs.finish(req, "error", f"the window stopped feeding request {req.rid} at {seen} tokens")
        req.state_ahead = req.state_ahead or seen > req.num_computed
        self.req_cache.shrink(req)
        self.tables.truncate(req)

    def _on_failed_step(self, req: Req, alone: bool, error: str | None) -> None:
        """A step including `req` failed. The forward may have advanced its state: it is never cached. Alone
        in the step (or out of retries) it caused the failure and fails; else it is retried alone."""
        if not req.poisoned and not req.finished and not req.aborted:  # a later step of a poisoned one proves nothing
            if alone or req.retries >= MAX_STEP_RETRIES:
                self.outputs.finish(req, "error", error)
            else:
                req.retry = True
        req.poisoned = True

    def _requeue(self, req: Req, failed: bool) -> None:
        """Free a running request's memory and queue it again to be recomputed; its outputs so far are kept.
        Retracted under memory pressure (`failed` false), it caches what it computed: nothing is lost. After a
        failed step it shared (`failed`), nothing that step may have touched is donated; it runs alone next,
        one retry spent, no longer poisoned (it will be recomputed from what succeeded)."""
        assert req.in_flight == 0
        if self.pd_prefill is not None:
            self.pd_prefill.on_requeue(req)
        self._release(req, donate=not failed)
        req.num_computed = req.branch_len = 0
        req.prefill_done = req.retract_pending = req.poisoned = req.retry = False
        req.ckpt_points.clear()
        req.last_sampled_step = None  # recomputed from scratch: a new prefill, not a decode gap
        self.waiting.appendleft(req)
        self._retracted_now.add(id(req))
        if failed:
            req.isolate = True
            req.retries += 1
        else:
            self.metrics.retractions += 1
            self.ratio.on_retract()

    # --- batches ---------------------------------------------------------------------------------------
    def _compose_step(self) -> tuple[list[tuple[Req, int]], str, int, int]:
        """The next step's sequences, its mode, how many of the sequences (the first ones) are prefill, and its
        decode steps (a decode window, `_window_steps`; 1 otherwise).

        Running decodes ride in every extend step (SGLang's mixed chunk, the default) rather than extend and
        decode steps taking turns: a decode row adds one token to a forward that reads the weights anyway, so
        every decode advances at every step for almost nothing, where turns would add a whole decode step per
        chunk (less prefill throughput under load) and still leave each decode waiting for a chunk. Two extend
        steps cannot carry decodes: a verify window (speculation) runs the KDA layers in verify mode, which a
        prefill chunk cannot share, and a request being isolated runs alone. After such a step the decodes get
        the next one (turns), so none waits for more than one extend step. With mixing off, prefill work goes
        first and decodes wait until none is left."""
        speculate = self.spec is not None
        mixing = self.args.enable_mixed_chunk
        if mixing and self._decodes_owed:
            self._decodes_owed = False
            batch = self._decode_batch([], speculate=speculate)
            if batch:
                return batch, "verify" if self._drafts else "decode", 0, 1
        batch = self._extend_batch()
        if batch:
            n_prefill = len(batch)
            if mixing and not speculate and not batch[0][0].isolate:
                batch += self._decode_batch(batch)
            elif mixing:
                self._decodes_owed = True
            return batch, "extend", n_prefill, 1
        steps = self._window_steps()
        if not steps:
            return [], "decode", 0, 1
        if steps > 1:
            window = self._window_batch(steps)
            if window is not None:
                return window, "decode", 0, steps
        batch = self._decode_batch([], speculate=speculate)
        return batch, "verify" if self._drafts else "decode", 0, 1

    def _window_steps(self) -> int:
        """Decode steps the next decode step runs back to back (`--num-scheduler-steps`, as vLLM's multi-step
        scheduling): one plan, one message each way and one round of stop checks for the window rather than
        for every token, costs that on a CPU take the cores the worker computes on (README: Performance).
        1 where a window cannot be used: something waits to start (it would wait the window out), or a request's
        grammar mask changes token by token (speculation, P/D and DP attention refuse the flag). 0: a
        window could run once the step in flight is back (its samples are the window's first inputs, and a
        window planned behind it would compute past a stop found in it). Never past any request's max_new_tokens
        (no request samples more tokens than it may keep), nor across its min_new_tokens (the stops it bans, the
        plan's `banned`, hold for the whole window)."""
        most = self.args.num_scheduler_steps
        if most == 1 or self.waiting or self.grammar_wait:
            return 1
        decodes = [r for r in self.running if r.active and r.prefill_done and r.row is not None]
        if not decodes or any(r.grammar is not None or r.isolate for r in decodes):
            return 1
        for r in decodes:  # (with a step in flight, its samples are still pending: counted in output_index)
            left = r.params.max_new_tokens - r.output_index
            if self.outputs.banned_at(r, r.output_index):
                left = min(left, r.params.min_new_tokens - r.output_index)
            most = min(most, left)
        if most <= 1:
            return 1
        return 0 if self._inflight else most

    def _extend_batch(self) -> list[tuple[Req, int]]:
        """Prefill chunks within the step's budget (`step_prefill_budget` tokens, at most `chunked_prefill_size`
        for one request): running requests' next chunks first, then new admissions, then whatever is left tops
        the running chunks up. While requests wait to start, the running chunks first take only their share
        of the budget (`running_prefill_share`): a long prompt never holds all of it, so a short request that
        arrives during its prefill starts at the next step, beside its chunk."""
        batch: list[tuple[Req, int]] = []
        budget, chunk = self.args.step_prefill_budget, self.args.chunked_prefill_size
        share = budget
        if self.waiting and self._rows_taken < self.args.max_running_requests:
            share = running_prefill_share(budget, self.ps)
        for req in sorted(self.running, key=lambda r: r.arrival):
            if share <= 0:
                break
            if req.active and not req.prefill_done and req.row is not None:
                if req.isolate and batch:
                    continue  # planned alone, in a step of its own
                n = min(req.known_len - req.num_computed, chunk, budget if req.isolate else share)
                if self._grow(req, n):
                    batch.append((req, n))
                    share -= n
                    budget -= n
                    if req.isolate:
                        break
        batch = [(r, n) for r, n in batch if r.row is not None]
        if batch and batch[0][0].isolate:
            return batch
        if budget > 0:
            budget = self._admit_waiting(batch, budget)
        # What the waiting requests left returns to the running chunks (pages only if free: never a retraction).
        for i, (req, n) in enumerate(batch):
            extra = min(req.known_len - req.num_computed - n, chunk - n, budget)
            if extra > 0 and self.req_cache.grow(req, n + extra):
                batch[i] = (req, n + extra)
                budget -= extra
        return batch

    def _admit_waiting(self, batch: list[tuple[Req, int]], budget: int) -> int:
        """Admit waiting requests into `batch` with their first chunks, within `budget` prefill tokens; returns
        what is left of it."""
        self.waiting = order_waiting(self.waiting, self.cache, self._match_ids, self.args.schedule_policy,
                                     self.args.lpm_max_queue)
        sources = [r for r in self.running if r.active and (not r.prefill_done or r.pending_ckpts)]
        reserved = self._running_reserve()
        deferred: list[Req] = []
        while self.waiting and budget > 0 and self._rows_taken < self.args.max_running_requests:
            req = self.waiting.popleft()
            if id(req) in self._retracted_now:
                deferred.append(req)
                continue
            if len(deferred) >= self.args.lpm_max_queue or (req.isolate and batch):
                # Bound the scan of a long queue of followers; a request to isolate starts the next step.
                self.waiting.appendleft(req)
                break
            match = self.cache.match_prefix(self._match_ids(req)) if self.cache is not None else None
            if match is not None and self._follow(req, match, sources):
                deferred.append(req)
                continue
            demand = self._demand(req, match)
            if not self.admission.fits(demand, reserved) or not self.req_cache.admit(req, match):
                self.waiting.appendleft(req)
                break
            n = min(req.known_len - req.num_computed, self.args.chunked_prefill_size, budget)
            if not self.req_cache.grow(req, n):
                self.req_cache.cache_req(req, donate=False)
                self.waiting.appendleft(req)
                break
            self._count_admission(req, match)
            self.tables.assign(req)
            self.running.append(req)
            self._share_tokens(req)
            batch.append((req, n))
            sources.append(req)
            budget -= n
            reserved = reserved.plus(demand)
            if req.isolate:
                break
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _decode_batch(self, taken: list[tuple[Req, int]], speculate: bool = False) -> list[tuple[Req, int]]:
        """One token for every running request whose tokens are all fed but the last sampled one; with
        `speculate`, that token and its drafts (a verify window). (A decode window's rows: `_window_batch`.)"""
        in_batch = {id(r) for r, _ in taken}
        batch: list[tuple[Req, int]] = []
        self._drafts = {}
        for req in sorted(self.running, key=lambda r: r.arrival):
            if id(req) not in in_batch and self._decodable(req):
                drafts = self._propose(req) if speculate else []
                if drafts and self._grow(req, 1 + len(drafts)):
                    self._drafts[id(req)] = drafts
                    batch.append((req, 1 + len(drafts)))
                elif self._grow(req, 1):
                    batch.append((req, 1))
        batch = [(r, n) for r, n in batch if r.row is not None]
        self._drafts = {id(r): self._drafts[id(r)] for r, _ in batch if id(r) in self._drafts}
        return batch

    def _window_batch(self, steps: int) -> list[tuple[Req, int]] | None:
        """A decode window's rows: every decodable request with pages for the `steps` tokens it feeds. None where
        the pool cannot hold every row's window without retracting a running request: the caller plans one step
        instead, which retracts only for the one token each row needs (a window is a speed-up, never a reason to
        push a request out or to leave one behind). Admission's count (free plus evictable pages) is asked before
        any page is taken; where it says yes and an allocation still fails (blocks pinned by a transfer cannot be
        compacted), the pages taken are given back."""
        self._drafts = {}
        rows = [req for req in sorted(self.running, key=lambda r: r.arrival) if self._decodable(req)]
        need = sum(self.req_cache.pages_needed(r, steps) for r in rows)
        if not self.admission.fits(Demand(need, 0)):  # asked first: a window that cannot fit evicts nothing
            return None
        batch: list[tuple[Req, int]] = []
        for req in rows:
            if not self.req_cache.grow(req, steps):  # (evicts cached pages, never running requests)
                for r in (*(r for r, _ in batch), req):
                    self.req_cache.shrink(r)
                    self.tables.truncate(r)
                return None
            batch.append((req, steps))
        return batch

    @staticmethod
    def _decodable(req: Req) -> bool:
        """Whether running `req` decodes next: its tokens are all fed but the last sampled one."""
        return (req.active and req.prefill_done and req.row is not None
                and not req.isolate  # its first sample since the retry is in flight: wait for it
                and not (req.grammar is not None and req.pending_samples)  # its mask needs that sample
                and req.seq_len - req.num_computed == 1
                and req.output_index < req.params.max_new_tokens)  # else it ends with the pending sample

    def _propose(self, req: Req) -> list[int]:
        """The drafts of `req`'s verify window: up to k, never past max_new_tokens (the window also emits the
        target's own token). n-gram drafts are looked up here; a model proposer's are -1 for the worker."""
        # (no pending-sample check: speculation turns the overlap scheduler off, so the window's first token,
        # last step's sample, is always known here)
        if not req.params.speculative or req.grammar is not None:
            return []
        k = min(self.args.speculative_num_draft_tokens, req.params.max_new_tokens - len(req.output_ids) - 1)
        if k <= 0:
            return []
        if self.pd_decode is not None and not self.pd_decode.can_draft(req):
            return []
        if self.spec != "ngram":
            return [-1] * k
        if req.ngram is None:
            req.ngram = NgramIndex(self.args.speculative_ngram_min, self.args.speculative_ngram_max)
        return propose_drafts(req.ngram, self.ngram_corpus, req.all_ids, k)

    def _follow(self, req: Req, match: MatchResult, sources: list[Req]) -> bool:
        """Whether `req` should wait for a leader to checkpoint a prefix they share (in-batch prefix caching);
        if so, ask the leader for that checkpoint."""
        found = shared_prefix_leader(self._match_ids(req), match.prefix_len, sources, self.ps)
        if found is None:
            return False
        leader, pos = found
        if pos > leader.num_computed:
            leader.ckpt_points.add(pos)
        return True

    def _grow(self, req: Req, n: int) -> bool:
        """Pages for `n` more tokens of running `req`; under pressure retract the newest other running
        request that no step in flight includes (a batch member is dropped from the batch), or, if all are
        in flight, mark one to be retracted when its step is processed and skip `req` for this step."""
        while not self.req_cache.grow(req, n):
            victims = [r for r in self.running if r is not req and r.active and r.in_flight == 0]
            if victims:
                self._retract(max(victims, key=lambda r: r.arrival))
                continue
            later = [r for r in self.running if r is not req and r.active]
            if later:
                max(later, key=lambda r: r.arrival).retract_pending = True
            return False
        return True

    def _retract(self, req: Req) -> None:
        """Under memory pressure: free a running request's memory, caching what it computed, and queue it again."""
        self._requeue(req, failed=False)

    def _settle(self, req: Req) -> None:
        """A request that is in no step in flight and will not be scheduled again: release or retract it."""
        if req.retry and not (req.finished or req.aborted):
            self._requeue(req, failed=True)
        elif req.finished or req.aborted or req.poisoned:
            if self.pd_prefill is not None and req.bootstrap is not None:
                self.pd_prefill.on_release(req, self.pool)  # before its memory is let go
            self._release(req, donate=not req.poisoned)
            if not req.finished:
                self.outputs.finish(req, "abort")
        elif req.retract_pending:
            self._retract(req)

    def _share_tokens(self, req: Req) -> None:
        """Index what `req` committed since the last call in the n-gram corpus, for every request to draft from:
        its prompt when admitted, its outputs as a step's samples are accepted (`output_ids` only ever holds
        tokens the request keeps; drafts and in-flight samples are not among them). Costs O(new tokens x n-gram
        sizes) per call, so a step costs O(its committed tokens), never O(corpus)."""
        if self.ngram_corpus is None:
            return
        seen = 0 if req.corpus_doc is None else req.corpus_doc.seen
        if seen < req.known_len:
            req.corpus_doc = self.ngram_corpus.extend(req.corpus_doc, req.ids(seen, req.known_len))

    def _release(self, req: Req, donate: bool) -> None:
        self.req_cache.cache_req(req, donate and not req.state_ahead)
        req.state_ahead = False
        self.tables.release(req)
        self.running.remove(req)

    # --- the step record -------------------------------------------------------------------------------
    def _record(self, batch: list[tuple[Req, int]], mode: str, steps: int = 1) -> StepRecord:
        """Checkpoints and input-logprob rows of each sequence; advances what each request has planned."""
        rec = StepRecord(self._step, mode, [], [], decode_steps=steps)
        for i, (req, n) in enumerate(batch):
            a, b = req.num_computed, req.num_computed + n
            drafts = self._drafts.get(id(req), [])
            sampled = b - len(drafts) - (steps - 1) == req.seq_len  # a decode window's own samples are not known yet
            s = SeqEntry(req, a, n, sampled, drafts=drafts)
            if req.wants_input_logprobs:
                s.input_lp_first_none = a == 0 and req.wants_input_logprob(0)
                s.input_lp_positions = [p for p in range(a + 1, b + 1) if req.wants_input_logprob(p)]
            rec.seqs.append(s)
            # A verify window's tokens are not committed yet: it takes no checkpoints (donation still happens).
            for pos in self._checkpoint_positions(req, a, b, sampled) if mode != "verify" else []:
                block = self.req_cache.alloc_checkpoint()
                if block is None:
                    break  # no room: skipped (the later ones would need room too)
                rec.ckpts.append(Checkpoint(i, pos, block))
                req.pending_ckpts.add(pos)
                req.ckpt_points.discard(pos)
            req.num_computed = b
            req.in_flight += 1
            if sampled:
                req.pending_samples += steps
                req.prefill_done = True
                if req.last_sampled_step is not None:
                    skipped = rec.step - req.last_sampled_step - 1
                    self.metrics.decode_max_skipped_steps = max(self.metrics.decode_max_skipped_steps, skipped)
                req.last_sampled_step = rec.step
        return rec

    def _checkpoint_positions(self, req: Req, a: int, b: int, sampled: bool) -> list[int]:
        """Positions in (a, b] where the step must checkpoint `req`'s state."""
        if self.cache is None:
            return []
        ps = self.ps
        want: set[int] = set()
        if not req.prefill_done:
            want.add(req.branch_len)  # the branching point found by matching
            want.add((len(req.prompt_ids) - 1) // ps * ps)  # the prompt's end, as far as a repeat can hit
            want.update(req.ckpt_points)  # prefixes that waiting requests share with this one
            if not sampled:
                want.add(b // ps * ps)  # a chunk ending mid-prompt
        else:
            req.decode_since_checkpoint += b - a
            if req.decode_since_checkpoint >= self.args.decode_checkpoint_interval:
                want.add(b // ps * ps)  # b itself for a decode token; a window's last page boundary in it
            want.update(req.ckpt_points)
        out = sorted(p for p in want if a < p <= b and p % ps == 0 and p not in req.pending_ckpts)
        if out and (out[-1] == b or req.prefill_done):
            req.decode_since_checkpoint = b - out[-1]
        return out

    # --- admission -------------------------------------------------------------------------------------
    def _match_ids(self, req: Req) -> list[int]:
        ids = req.all_key_ids
        if req.wants_input_logprobs:  # tokens whose input logprobs are wanted must be recomputed
            ids = ids[: max(req.logprob_start_len - 1, 0) + 1]
        return ids

    def _decode_reserve(self, req: Req) -> int:
        """Decode tokens admission reserves pages for: the new-token ratio's share of those left."""
        return math.ceil(self.ratio.value * max(req.params.max_new_tokens - len(req.output_ids), 0))

    def _demand(self, req: Req, match: MatchResult | None) -> Demand:
        if match is None:
            match = MatchResult([], None, None, 0, 0)  # type: ignore[arg-type]
        return request_demand(self.ps, match, req.known_len, self._decode_reserve(req))

    def _running_reserve(self) -> Demand:
        """Pages the running requests will still take (prompt remainder and their decode reserve)."""
        pages = 0
        for r in self.running:
            if r.active:
                target = -(-(r.known_len + self._decode_reserve(r)) // self.ps)
                pages += max(0, target - len(r.pages))
        return Demand(pages, 0) if pages else NO_DEMAND

    def _count_admission(self, req: Req, match: MatchResult | None) -> None:
        if req.admitted:  # count each request once, not again after a retraction
            return
        req.admitted = True
        req.cached_tokens = req.num_computed
        self.metrics.cached_tokens += req.num_computed
        self.metrics.prompt_tokens += len(req.prompt_ids)
        if match is not None and match.state is not None:
            self.metrics.state_hits += 1
        else:
            self.metrics.state_misses += 1

    # --- metrics and invariants ------------------------------------------------------------------------
    def metrics_now(self) -> SchedulerMetrics:
        """The counters as of now (an abort or a release since the last step is reflected)."""
        self._refresh_metrics()
        return self.metrics

    def flush_cache(self) -> bool:
        """Empty the radix cache (and the compiled grammars) if nothing is running, queued or in flight; return
        whether it was flushed."""
        if self.waiting or self.running or self._inflight or self.grammar_wait or self._pd_busy:
            return False
        if self.cache is not None:
            self.cache.evict(Kind.KV, self.pool.pages_used + 1)
            self.cache.evict(Kind.STATE, self.pool.states_used + 1)
        if self.ngram_corpus is not None:
            self.ngram_corpus.clear()
        if self.grammar is not None:
            self.grammar.clear_cache()
        self._refresh_metrics()
        return True

    def _refresh_metrics(self) -> None:
        m = self.metrics
        m.running, m.queued = len(self.running), len(self.waiting) + len(self.grammar_wait)
        if self.pd_prefill is not None:  # waiting for decode's reservation
            m.queued += len(self.pd_prefill.waiting)
        if self.pd_decode is not None:  # waiting for memory, or for prefill's transfer
            m.queued += len(self.pd_decode.pending) + len(self.pd_decode.rooms)
        u = self.pool.usage()
        m.state_pool_bytes, m.kv_pool_bytes = u.state_bytes, u.kv_bytes
        if self.cache is not None:
            s = self.cache.stats()
            m.evictions = s.evicted_pages + s.evicted_states

    def check_integrity(self) -> None:
        """The pool, the tree and every request's share of them, the page-table rows, the in-flight counts."""
        self.pool.check_integrity()
        ckpt_blocks = [c.block for rec in self._inflight for c in rec.ckpts]
        live = [r.state for r in self.running if r.state is not None]
        assert len(live) == len(self.running), "a running request has no live state"
        rooms_states, rooms_pages = self.pd_decode.holds() if self.pd_decode is not None else ([], [])
        if self.cache is not None:
            held_pages = [p for r in self.running for p in r.pages[r.tree_pages :]] + rooms_pages
            self.cache.check_integrity(held_pages=held_pages, held_states=live + ckpt_blocks + rooms_states)
        else:
            assert set(live + rooms_states) == self.pool.live_states() and not ckpt_blocks, "state blocks leaked"
            assert {p for r in self.running for p in r.pages} | set(rooms_pages) == self.pool.live_pages(), (
                "KV pages leaked")
        self.tables.check_integrity(self.running)
        if self.ngram_corpus is not None:
            self.ngram_corpus.check_integrity()
        counts: dict[int, int] = {}
        for rec in self._inflight:
            for s in rec.seqs:
                counts[id(s.req)] = counts.get(id(s.req), 0) + 1
        for r in self.running:
            if r.grammar is not None:
                r.grammar.check_integrity()
            assert r.in_flight == counts.get(id(r), 0), f"request {r.rid}: in-flight count drifted"
            assert len(r.pages) == -(-r.num_computed // self.ps), f"request {r.rid}: pages != planned tokens"
            assert r.num_computed <= r.seq_len, f"request {r.rid}: planned past its tokens"
        for r in self.waiting:
            assert r.state is None and not r.pages and r.row is None, f"waiting request {r.rid} holds pool memory"
