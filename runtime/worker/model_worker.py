"""The worker's job for one step: apply the plan's pool copies and page-table changes, run the forward in the
plan's mode through the attention backend, sample."""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback

import numpy as np
import torch

from kernels import conv1d_cpu as fused_conv
from kernels import kda_decode_cpu as fused_kda
from kernels import moe_gemm_cpu as fused_moe
from kernels.sampling import LogitBias, SampleResult, TokenMask
from kernels.sampling_tensors import SamplingTensors
from kernels.spec_layout import pad, window_layout
from kernels.state_checkpoints import StateCheckpoints
from radixk3.builtin_model import checkpoint_dir, random_preset
from radixk3.config import preset
from radixk3.decode_graph import DecodeGraphs, Scratch
from radixk3.decode_window import DecodeWindow
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM, build_model
from radixk3.mtp_graph import MTPGraphs
from radixk3.parallel import is_collective_failure, parallel_state
from radixk3.spec_window import SpecWindow, WindowRows, check_committed_states
from radixk3.verify_graph import VerifyGraphs
from radixk3.vision.config import has_vision_weights
from radixk3.vision.encoder import VisionEncoder
from runtime.disagg.protocol import META_SLOT_BYTES, ChunkSend, RankAgent, SendCommand, TransferStats
from runtime.messages import StepPlan, StepResult
from runtime.pool_layout import CopyCommand, pool_budget, pool_layout, serving_dtype
from runtime.server_args import ServerArgs
from runtime.spec.mtp import MTPProposer
from runtime.spec.proposers import build_proposer, lockstep_proposer
from runtime.worker.image_embedder import ImageEmbedder
from runtime.worker.page_table import WorkerPageTable
from runtime.worker.pool_buffer import PoolBuffer, torch_dtype
from runtime.worker.pool_memory import pool_memory_bytes
from runtime.worker.sampler import WorkerSampler
from runtime.worker.transfer_agent import TransferAgent, make_agent

log = logging.getLogger(__name__)

# The speculative algorithms whose steps the compiled graphs cover: n-gram (no proposer in the worker) and MTP
# (its graphs return the target's pre-norm hiddens, and its own steps are captured: `mtp_graph.py`).
COMPILED_SPECULATION = (None, "ngram", "mtp")


def load_worker_model(args: ServerArgs) -> KimiForCausalLM:
    if (name := random_preset(args.model)) is not None:
        model = build_model(preset(name), seed=args.seed, device=args.device)
        dtype = serving_dtype(model.config, args)
        model = model if dtype == model.config.dtype else model.cast_(torch_dtype(dtype))
    else:
        from radixk3.checkpoint import load_model

        # In the serving dtype from the start: each tensor is converted as it is read, so a bf16 engine never holds
        # the whole model in the checkpoint's fp32 as well (a load-time copy that set the worker's peak).
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        model = load_model(checkpoint_dir(args.model), device=args.device, dtype=dtype)
    if args.quantization is not None:
        from radixk3.weight_quant import quantize_model_

        quantize_model_(model, args.quantization)
    return model


def load_worker_vision(args: ServerArgs, model: KimiForCausalLM) -> VisionEncoder | None:
    """The checkpoint's vision tower (None for a text-only model), in the text model's serving dtype. Every rank
    holds it whole: it is small beside the text model, and its output feeds the replicated first-layer input."""
    directory = checkpoint_dir(args.model)
    if directory is None or model.config.vision is None or not has_vision_weights(directory):
        return None  # a text-only checkpoint (its vision_config, if any, without the tower's tensors)
    from radixk3.vision.weights import load_vision_encoder

    return load_vision_encoder(directory, device=model.device, dtype=torch_dtype(serving_dtype(model.config, args)))


def _pages_spanned(prefix: np.ndarray, lens: np.ndarray, page_size: int) -> int:
    """Pages the longest sequence spans after this step (0 for no sequence): the block table's width."""
    return int(-(-(prefix + lens).max() // page_size)) if len(prefix) else 0


class ModelWorker:
    def __init__(self, args: ServerArgs, model: KimiForCausalLM | None = None,
                 vision: VisionEncoder | None = None) -> None:
        """`model` and `vision` (its tower) given: used as they are; `model` None: both load from `args.model`."""
        self.args = args
        if model is None:
            model = load_worker_model(args)
            vision = load_worker_vision(args, model)
        self.model = model
        held = getattr(self.model, "quantization", None)
        if held != args.quantization:  # a model given ready-made must be the one the flag describes
            raise ValueError(f"--quantization {args.quantization}: the model given is quantised as {held} "
                             "(quantise it with radixk3.weight_quant.quantize_model_ first)")
        self.images = ImageEmbedder(vision, args.image_encoder_cache_bytes) if vision is not None else None
        self.layout = pool_layout(self.model.config, args)
        # Sized after the weights loaded (a --mem-fraction of what is left), the same on every rank of the group.
        budget = pool_budget(self.layout, args, pool_memory_bytes(args, self.model.device))
        compiled = self._compiles(args)
        self.buffer = PoolBuffer(self.layout, budget, device=args.device, scratch=compiled)
        self.pool_bytes = self.buffer.geometry.total_bytes  # what the scheduler builds its pool metadata for
        cfg = self.model.config
        self.cache = HybridCache(
            recurrent=[self.buffer.recurrent_state(i) for i in range(cfg.num_kda_layers)],
            conv=[self.buffer.conv_state(i) for i in range(cfg.num_kda_layers)],
            latent=[self.buffer.kv(i) for i in range(cfg.num_mla_layers)],
        )
        if self.model.device.type == "cpu" and cfg.num_kda_layers:
            fused_kda.available()  # build (or find built) the CPU ops now, not in the first step
            fused_conv.available()
            fused_moe.available()
        self.tables = WorkerPageTable(self.model.device, rows=max(args.max_running_requests, 1))
        self.sampler = WorkerSampler()
        self.window: SpecWindow | None = None
        if args.speculative_algorithm is not None:
            # compiled: one more row, the verify graphs' padding rows' (`window_scratch_row`)
            self.window = SpecWindow.allocate(
                cfg, args.spec_state, max(args.max_running_requests, 1) + compiled,
                args.speculative_num_draft_tokens + 1,
                torch_dtype(self.layout.kv_dtype), self.model.device, record_inputs=args.debug_spec_state)
        # A model proposer (draft model) fills the verify windows' drafts; its cache lives in the same pool.
        self.proposer = build_proposer(args, self.model, self.buffer)
        # DP attention with MTP or a draft model: the proposer joins the other groups' calls (LockstepProposer).
        self.lockstep = lockstep_proposer(self.proposer, self.model.dp_attention)
        # P/D disaggregation: this rank's transfer agent, the rooms it expects (room -> metadata slot), the
        # notifications each room's transfers sent so far and (from its last transfer's) how many it has in all,
        # and (prefill) the chunk writes this step started.
        self.transfer: TransferAgent | None = None
        if args.disaggregation_mode != "null":
            self.transfer = make_agent(args.disaggregation_transfer_backend, self.buffer.data,
                                       max(args.max_running_requests, 1))
        self._expect: dict[int, int] = {}
        self._notified: dict[int, int] = {}
        self._room_transfers: dict[int, int] = {}
        self._posted: list[tuple[ChunkSend, object]] = []
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        if compiled:  # paid here, at startup, once per batch-size bucket
            scratch = Scratch(self.buffer.scratch_state_slot, self.buffer.scratch_kv_row)  # type: ignore[arg-type]
            hidden = self.proposer is not None and self.proposer.needs_hidden
            self.graphs = self._capture_decode(args, scratch, hidden)
            if self.graphs is not None and self.window is not None and not args.disable_compiled_verify:
                self._capture_speculation(args, scratch, hidden, self.graphs.cpp_wrapper)

    def _capture_decode(self, args: ServerArgs, scratch: Scratch, hidden: bool) -> DecodeGraphs | None:
        """The compiled decode step: with inductor's C++ wrapper unless `--disable-cpp-wrapper`, with its Python
        one where the C++ one fails to build (its wrapper is a Python extension: a machine without Python's
        headers, say), and None (decode runs eagerly) where neither does; each failure logged with its cause."""
        for cpp_wrapper in (False,) if args.disable_cpp_wrapper else (True, False):
            graphs = DecodeGraphs(self.model, self.cache, scratch, args.compile_buckets, with_hidden=hidden,
                                  cpp_wrapper=cpp_wrapper)
            try:
                graphs.capture()
                return graphs
            except Exception:  # a model part the compiler cannot capture: serve, eagerly, and say why
                if graphs.cpp_wrapper:
                    log.warning("the compiled decode step failed to build with inductor's C++ wrapper; trying its "
                                "Python one", exc_info=True)
                    continue
                log.warning("the compiled decode step failed to build; decode runs eagerly", exc_info=True)
                break
        return None

    def _capture_speculation(self, args: ServerArgs, scratch: Scratch, hidden: bool, cpp_wrapper: bool) -> None:
        """The compiled verify step and (MTP with one layer) the MTP layer's steps, with the decode step's wrapper;
        what fails to build runs eagerly."""
        assert self.window is not None
        try:
            verify = VerifyGraphs(self.model, self.cache, scratch, args.compile_buckets, self.window,
                                  self.window_scratch_row, with_hidden=hidden, cpp_wrapper=cpp_wrapper)
            verify.capture()
            self.verify_graphs = verify
            if isinstance(self.proposer, MTPProposer) and self.model.config.num_nextn_predict_layers == 1:
                mtp = MTPGraphs(self.model, self.proposer.cache, scratch.kv_row, args.compile_buckets,
                                self.window.width, cpp_wrapper=cpp_wrapper)
                mtp.capture()
                self.proposer.graphs = mtp
        except Exception:
            log.warning("the compiled verify (or MTP) steps failed to build; they run eagerly", exc_info=True)

    def _compiles(self, args: ServerArgs) -> bool:
        """The compiled decode step covers one rank's plain decode: not a TP group or DP attention (collectives),
        not speculative decoding with a draft model or DSpark (their proposers' steps run eagerly; n-gram's and
        MTP's decode and verify steps are compiled, `verify_graph.py`, and MTP's own, `mtp_graph.py`), not
        packed routed experts (a step dequantises the experts it routes to: shapes that depend on the routes), not
        `--quantization` (its experts read their routes on the host: a capture would fail after its compile time)."""
        state = parallel_state()
        return (args.compile_decode and state.tp_size == 1 and not state.dp_attention
                and args.speculative_algorithm in COMPILED_SPECULATION and self.model.config.expert_quant is None
                and args.quantization is None)

    @property
    def window_scratch_row(self) -> int:
        """The draft window's row past the scheduler's rows, which the verify graphs' padding rows write."""
        return max(self.args.max_running_requests, 1)

    @property
    def compile_seconds(self) -> dict[int, float]:
        """Seconds the compiled steps (decode, and verify and MTP's when built) took to build, per batch-size
        bucket (empty: eager decode)."""
        out: dict[int, float] = {}
        mtp = getattr(self.proposer, "graphs", None)
        for graphs in (self.graphs, self.verify_graphs, mtp):
            for b, sec in (graphs.report.seconds.items() if graphs is not None else ()):
                out[b] = out.get(b, 0.0) + sec
        return out

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.array(a, dtype=np.int64))
        return t if self.model.device.type == "cpu" else t.to(self.model.device)

    def apply_plan_changes(self, plan: StepPlan) -> None:
        """Byte copies, then page moves, then table writes, then row resets: the order the plan prescribes."""
        self.buffer.apply_copies(CopyCommand(*c) for c in plan.copies)
        self.tables.move_pages(plan.page_moves)
        self.tables.write(plan.table_rows, plan.table_cols, plan.table_pages)
        self.sampler.reset(plan.reset_rows)
        if self.images is not None:
            self.images.reset_rows(r for r, _ in plan.reset_rows)

    def _params(self, plan: StepPlan) -> SamplingTensors:
        """The plan's sampling columns as the sampler's tensors (one row per sampled row)."""
        return SamplingTensors.from_columns(plan.sampling, self.model.device)

    def _logit_bias(self, plan: StepPlan, row_of: np.ndarray | None = None) -> LogitBias | None:
        """The plan's logit biases, each at row `row_of[r]` of the logits sampled (sampled row r itself if None)."""
        if not plan.logit_bias:
            return None
        entries = plan.logit_bias if row_of is None else [(int(row_of[r]), t, b) for r, t, b in plan.logit_bias]
        return LogitBias.of(entries, self.model.device)

    @staticmethod
    def _grammar_mask(plan: StepPlan, rows: np.ndarray) -> TokenMask | None:
        """The grammar mask of the plan's constrained rows, each at its row `rows[j]` of the logits sampled."""
        if not len(plan.grammar_rows):
            return None
        bitmask = torch.from_numpy(np.array(plan.grammar_mask, dtype=np.int32).reshape(len(rows), -1))
        return TokenMask(torch.from_numpy(np.array(rows, dtype=np.int64)), bitmask)

    def forward_batch(self, plan: StepPlan) -> ForwardBatch:
        """The plan's sequences as a ForwardBatch over the worker's page table. Its index arithmetic (the -1
        inputs' last tokens, each new token's KV slot) is done on the host, in numpy, where the table is host
        memory (CPU), as `ForwardBatch.from_table` does it in torch on a device: a torch call costs a few
        microseconds in the interpreter a step's weight reads keep evicting, a numpy one about a microsecond."""
        if self.tables.device.type != "cpu":
            return self._forward_batch_device(plan)
        rows = np.asarray(plan.rows, dtype=np.int64)
        cu = np.array(plan.cu_seqlens, dtype=np.int64)  # copies: arrays off the wire are read-only
        prefix = np.array(plan.prefix_lens, dtype=np.int64)
        lens = np.diff(cu)
        seq = np.repeat(np.arange(len(rows)), lens)  # each new token's sequence
        ids = np.array(plan.input_ids, dtype=np.int64)
        future = ids < 0  # tokens sampled last step, which the plan could not know
        if future.any():
            ids[future] = self.tables.last_token.numpy()[rows[seq[future]]]
        ps = self.layout.page_size
        num_pages = _pages_spanned(prefix, lens, ps)
        table = self.tables.host_block_table(rows, num_pages)
        pos = np.arange(len(ids)) - cu[:-1][seq] + prefix[seq]
        kv_slots = table[seq, pos // ps] * ps + pos % ps
        mode = ForwardMode(plan.mode)
        if mode is ForwardMode.DECODE and len(ids) != len(rows):
            raise ValueError(f"a decode batch adds one token per sequence: {len(ids)} tokens for {len(rows)} sequences")
        batch = ForwardBatch(mode, torch.from_numpy(ids), torch.from_numpy(cu), torch.from_numpy(prefix),
                             self._tensor(plan.state_slots), torch.from_numpy(table), ps, torch.from_numpy(kv_slots),
                             self._checkpoints(plan), self._tensor(plan.logits_index))
        return self._with_images(plan, batch)

    def _forward_batch_device(self, plan: StepPlan) -> ForwardBatch:
        """`forward_batch` over a page table on a device (CUDA): the -1 inputs read the last tokens there."""
        rows = self._tensor(plan.rows)
        cu = np.asarray(plan.cu_seqlens, dtype=np.int64)
        prefix = np.asarray(plan.prefix_lens, dtype=np.int64)
        ids = self._tensor(plan.input_ids)
        if (np.asarray(plan.input_ids) < 0).any():
            lens = torch.from_numpy(np.diff(cu)).to(ids.device)
            seq_rows = torch.repeat_interleave(rows, lens, output_size=ids.numel())
            ids = torch.where(ids < 0, self.tables.last_token[seq_rows], ids)
        ps = self.layout.page_size
        num_pages = _pages_spanned(prefix, np.diff(cu), ps)
        batch = ForwardBatch.from_table(
            ForwardMode(plan.mode), ids, self._tensor(cu), self._tensor(prefix), self._tensor(plan.state_slots),
            self.tables.block_table(plan.rows, num_pages), ps, self._checkpoints(plan), self._tensor(plan.logits_index),
        )
        return self._with_images(plan, batch)

    def _checkpoints(self, plan: StepPlan) -> StateCheckpoints | None:
        return self._checkpoints_at(plan.ckpt_seq, plan.ckpt_offset, plan.ckpt_slot)

    def _checkpoints_at(self, seq: np.ndarray, offset: np.ndarray, slot: np.ndarray) -> StateCheckpoints | None:
        if not len(slot):
            return None
        return StateCheckpoints(self._tensor(seq), self._tensor(offset), self._tensor(slot))

    def _with_images(self, plan: StepPlan, batch: ForwardBatch) -> ForwardBatch:
        if not plan.images:
            return batch
        if self.images is None:
            raise ValueError("a step with images for a model without a vision tower")
        return dataclasses.replace(batch, embeds=self.images.override(plan))

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. An exception becomes a failed StepResult (the scheduler then confines it to the
        request that caused it), never a dead worker; only a broken TP group (a failed collective) escapes."""
        stats = TransferStats()
        failed = self._pd_send(plan, stats) if self.transfer is not None else []
        try:
            res = self._execute(plan)
        except Exception as e:
            if is_collective_failure(e):  # the TP group is broken: not this step's fault, fatal for the rank
                raise
            res = StepResult(plan.step, [], [], [], [], [], error=traceback.format_exc(limit=8))
        finally:
            if self.transfer is not None:
                failed += self._pd_wait_chunks(plan, stats)
        if self.transfer is not None:
            res.pd_failed = failed
            res.pd_stats = stats if stats.transfers else None
            res.pd_arrived = self._pd_arrivals() if plan.pd_poll else []
        return res

    def _pd_send(self, plan: StepPlan, stats: TransferStats) -> list[tuple[int, str]]:
        """Before the plan's byte copies (which may move the pages being sent): the peers to add, the rooms'
        last writes (each finished before the next; a failed one is reported, never the step's failure), the
        rooms to expect (a slot of -1: forget the room). Returns (room, error) of the failed sends."""
        assert self.transfer is not None
        rank = parallel_state().tp_rank
        for peer in plan.pd_peers:
            try:  # a peer this agent cannot add: its sends fail by name ("no transfer peer"), never the worker
                self.transfer.add_peer(peer["decode_id"], RankAgent(**peer["ranks"][rank]))
            except Exception:
                log.exception("P/D: cannot add the decode server's transfer agent %s", peer["decode_id"])
        failed: list[tuple[int, str]] = []
        for c in plan.pd_sends:
            cmd = SendCommand(**c)
            t0 = time.perf_counter()
            try:
                self.transfer.send(cmd)
            except Exception as e:
                failed.append((cmd.room, f"{type(e).__name__}: {e}"))
                continue
            kv = len(cmd.src_pages) * cmd.page_bytes
            stats.transfers += 1
            stats.kv_bytes += kv
            stats.state_bytes += cmd.state_bytes
            stats.timed_bytes += kv + cmd.state_bytes + META_SLOT_BYTES
            stats.timed_seconds += time.perf_counter() - t0
        for gone in plan.pd_forget:  # after the sends: a write queued for a dead peer fails by name
            try:
                self.transfer.remove_peer(gone)
            except Exception:
                log.exception("P/D: cannot remove the dead decode server's transfer agent %s", gone)
        for room, slot in plan.pd_expect:
            if slot < 0:
                self._expect.pop(room, None)
                self._notified.pop(room, None)
                self._room_transfers.pop(room, None)
            else:
                self._expect[room] = slot
        return failed

    def _pd_post_chunks(self, plan: StepPlan) -> None:
        """After the plan's copies (the pages' places are the plan's), start the writes of the pages prompt chunks
        completed; they run beside the forward (which writes none of those pages: complete prompt pages are
        never written again) and are waited for after it (`_pd_wait_chunks`)."""
        assert self.transfer is not None
        if self.buffer.data.is_cuda:  # the copies run on the stream: the transfer reads after them
            torch.cuda.current_stream().synchronize()
        for c in plan.pd_chunks:
            chunk = ChunkSend(**c)
            try:
                handle = self.transfer.post(chunk)
            except Exception as e:  # reported with the waits, never the step's failure
                handle = e
            self._posted.append((chunk, handle))

    def _pd_wait_chunks(self, plan: StepPlan, stats: TransferStats) -> list[tuple[int, str]]:
        """Wait for the chunk writes this step started; (room, error) of those that failed or never started."""
        assert self.transfer is not None
        posted, self._posted = self._posted, []
        failed: list[tuple[int, str]] = []
        for chunk, handle in posted:
            try:
                if isinstance(handle, Exception):
                    raise handle
                self.transfer.wait(handle)
            except Exception as e:
                failed.append((chunk.room, f"{type(e).__name__}: {e}"))
                continue
            stats.transfers += 1
            stats.kv_bytes += len(chunk.src_pages) * chunk.page_bytes
        for c in plan.pd_chunks[len(posted) :]:
            failed.append((int(c["room"]), "the step failed before its chunk's write started"))
        return failed

    def _pd_arrivals(self) -> list[tuple[int, int, float]]:
        """The expected rooms whose transfer completed on every rank of the group: (room, first token, logprob)."""
        assert self.transfer is not None
        for room, transfers in self.transfer.poll():
            self._notified[room] = self._notified.get(room, 0) + 1
            if transfers is not None:
                self._room_transfers[room] = transfers
        done = {r for r in self._expect if self._notified.get(r, 0) >= self._room_transfers.get(r, 1 << 62)}
        state = parallel_state()
        if state.tp_size > 1:  # each rank's bytes come from its own peer rank: a room is there once on all
            every: list[set[int]] = [set() for _ in range(state.tp_size)]
            torch.distributed.all_gather_object(every, done, group=state.group)
            done = set.intersection(*every)
        out = []
        for room in sorted(done):
            tok, lp = self.transfer.meta[self._expect.pop(room)].tolist()
            self._notified.pop(room)
            self._room_transfers.pop(room)
            out.append((room, int(tok), lp))
        return out

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        self.apply_plan_changes(plan)
        if plan.pd_chunks and self.transfer is not None:
            self._pd_post_chunks(plan)
        if plan.mode == ForwardMode.IDLE.value:
            if self.model.dp_attention:  # DP attention, nothing for this group: join the others' FFN collectives
                if self.lockstep is not None:
                    self.lockstep.idle_drafts(1, self.lockstep.draft_calls(plan.dp_window_width))
                self.model.idle_step()
                self._join_observations(plan)
            return StepResult(step=plan.step, tokens=[], logprobs=[], top_ids=[], top_logprobs=[], input_logprobs=[])
        if plan.mode == ForwardMode.VERIFY.value:
            return self._verify(plan)
        if plan.decode_steps > 1:
            return self._decode_window(plan)
        batch = self.forward_batch(plan)
        if self.lockstep is not None:
            self.lockstep.idle_drafts(1, self.lockstep.draft_calls(plan.dp_window_width))
        pre: list[torch.Tensor] | None = [] if self.proposer is not None and self.proposer.needs_hidden else None
        logits = self._forward(batch, pre)
        n = plan.num_sampled
        # Table row of each sampled logits row: sampled rows come first, one per sampled sequence.
        sampled_seqs = np.searchsorted(np.asarray(plan.cu_seqlens), np.asarray(plan.logits_index[:n]), "right") - 1
        sampled_rows = [int(plan.rows[s]) for s in sampled_seqs]
        res, row_errors = self.sampler.sample(logits[:n], self._params(plan), sampled_rows, plan.banned,
                                              plan.top_logprobs_num,
                                              self._grammar_mask(plan, np.asarray(plan.grammar_rows)),
                                              self._logit_bias(plan))
        tokens = res.tokens.tolist()
        self.tables.set_last(sampled_rows, res.tokens)
        if self.proposer is not None:  # after sampling: an MTP proposer reads each sequence's sampled token
            next_last = torch.full((len(plan.rows),), -1, dtype=torch.int64, device=res.tokens.device)
            next_last[torch.from_numpy(sampled_seqs).to(next_last.device)] = res.tokens
            self.proposer.observe(batch, pre[0] if pre else None, next_last, self._tensor(plan.rows))
        input_lp: list[float] = []
        input_top_ids: list[list[int]] = []
        input_top_lps: list[list[float]] = []
        if plan.input_logprob_rows:
            idx = self._tensor(np.array([r for r, _ in plan.input_logprob_rows]))
            tok = self._tensor(np.array([x for _, x in plan.input_logprob_rows]))
            lp = logits[idx].float().log_softmax(-1)
            input_lp = lp[torch.arange(len(idx), device=lp.device), tok].tolist()
            top = lp.topk(plan.top_logprobs_num, dim=-1)
            input_top_ids, input_top_lps = top.indices.tolist(), top.values.tolist()
        return StepResult(
            step=plan.step, tokens=tokens, logprobs=res.logprobs.tolist(),
            top_ids=res.top_ids.tolist(), top_logprobs=res.top_logprobs.tolist(), input_logprobs=input_lp,
            row_errors=row_errors, input_top_ids=input_top_ids, input_top_logprobs=input_top_lps,
        )

    def _decode_window(self, plan: StepPlan) -> StepResult:
        """`plan.decode_steps` decode steps back to back (`--num-scheduler-steps`), each as a one-step plan would
        run it: step j feeds every sequence the token step j - 1 sampled (the row's last token, as an overlapped
        plan's -1 input), samples its output `step + j` (the same seeded draw) and writes the checkpoints at the
        window's j + 1-th token. Through the decode graphs the steps' inputs are built once (`DecodeWindow`).
        The tokens and logprobs come sequence after sequence, `decode_steps` each; a row that failed to sample
        at some step is reported once (its later tokens are placeholders)."""
        n = plan.decode_steps
        rows = [int(r) for r in plan.rows]
        params = self._params(plan)
        bias = self._logit_bias(plan)
        feed = np.full(len(rows), -1, dtype=np.int64)
        prefix, offsets = np.asarray(plan.prefix_lens), np.asarray(plan.ckpt_offset)
        ckpt_seq, ckpt_slot = np.asarray(plan.ckpt_seq), np.asarray(plan.ckpt_slot)
        window: DecodeWindow | None = None
        steps: list[SampleResult] = []
        errors: dict[int, str] = {}
        stops = [set(ids) for ids in plan.window_stops]
        stopped_at = [n] * len(rows)  # the step at which each sequence sampled a stop (n: none)
        for j in range(n):
            at = offsets == j + 1
            ones = np.ones(int(at.sum()), dtype=np.int64)
            if window is not None:
                ck = self._checkpoints_at(ckpt_seq[at], ones, ckpt_slot[at])
                logits = window.step(steps[-1].tokens, ck)
            else:
                batch = self.forward_batch(dataclasses.replace(
                    plan, input_ids=plan.input_ids if j == 0 else feed, prefix_lens=prefix + j, ckpt_seq=ckpt_seq[at],
                    ckpt_offset=ones, ckpt_slot=ckpt_slot[at]))
                if j == 0 and self.graphs is not None and self.proposer is None and self.graphs.supports(batch):
                    window = DecodeWindow(self.graphs, batch, self._window_table(plan, n), n)
                    logits = window.step(None, batch.checkpoints)
                else:
                    logits = self._forward(batch, None)
            res, row_errors = self.sampler.sample(logits, params._replace(step=params.step + j), rows, plan.banned,
                                                  plan.top_logprobs_num, None, bias)
            self.tables.set_last(rows, res.tokens)
            steps.append(res)
            for i, e in row_errors:
                if j <= stopped_at[i]:  # a sample past the sequence's stop is discarded, and so is its error
                    errors.setdefault(i, e)
            if any(stops):
                stopped = [i for i, t in enumerate(res.tokens.tolist()) if stopped_at[i] == n and t in stops[i]]
                for i in stopped:
                    stopped_at[i] = j
                if window is not None and j + 2 < n:  # it feeds the stop at j + 1, then nothing
                    window.stop(stopped)
        tokens, lps, top_ids, top_lps = (torch.stack(f, dim=1).flatten(0, 1) for f in zip(*steps, strict=True))
        return StepResult(step=plan.step, tokens=tokens.tolist(), logprobs=lps.tolist(), top_ids=top_ids.tolist(),
                          top_logprobs=top_lps.tolist(), input_logprobs=[], row_errors=sorted(errors.items()),
                          window_fed=[min(n, at + 2) for at in stopped_at] if window is not None else [])

    def _window_table(self, plan: StepPlan, steps: int) -> torch.Tensor:
        """The rows' block table spanning a decode window's last token (its pages are the plan's already)."""
        prefix = np.asarray(plan.prefix_lens, dtype=np.int64)
        num_pages = _pages_spanned(prefix, np.full(len(prefix), steps), self.layout.page_size)
        if self.tables.device.type == "cpu":
            return torch.from_numpy(self.tables.host_block_table(np.asarray(plan.rows, dtype=np.int64), num_pages))
        return self.tables.block_table(plan.rows, num_pages)

    def _join_observations(self, plan: StepPlan) -> None:
        """DP attention, a group that observed nothing this step (idle, or a verify the proposer does not observe):
        join the observation calls of the groups that did."""
        lock = self.lockstep
        if lock is not None and (plan.dp_extends or (lock.observes_verify and plan.dp_window_width > 0)):
            lock.idle_observe()

    def _forward(self, batch: ForwardBatch, prenorm: list[torch.Tensor] | None) -> torch.Tensor:
        """The target's step; the pre-norm hiddens (or a DSpark proposer's aux states: the target's states after
        its `aux_layer_ids`, concatenated) are asked for only when a proposer reads them."""
        ids = self.proposer.aux_layer_ids if self.proposer is not None else ()
        if not ids:  # the graphs give the pre-norm hiddens when captured with them (`with_hidden`)
            if self.graphs is not None and self.graphs.supports(batch):
                return self.graphs.run(batch, prenorm)
            if self.verify_graphs is not None and self.verify_graphs.supports(batch):
                return self.verify_graphs.run(batch, prenorm)
        if prenorm is None:
            return self.model.forward_batch(batch, self.cache).float()
        if ids:
            aux = dict.fromkeys(ids, torch.empty(0))
            logits = self.model.forward_batch(batch, self.cache, aux=aux).float()
            prenorm.append(torch.cat([aux[i] for i in ids], dim=-1))
            return logits
        return self.model.forward_batch(batch, self.cache, prenorm=prenorm).float()

    def _verify(self, plan: StepPlan) -> StepResult:
        """One verify step: the target runs every sequence's window (its last sampled token and its drafts)
        from the live state without writing it; acceptance decides how many drafts each keeps; the window
        commit then advances the KDA states by exactly the committed tokens (ReplaySSM or snapshot copy)."""
        assert self.window is not None, "a verify plan for an engine without speculative decoding"
        batch = self.forward_batch(plan)
        rows = self._tensor(plan.rows)
        cu = np.asarray(plan.cu_seqlens, dtype=np.int64)
        lens = np.diff(cu)
        n, width = len(lens), int(lens.max())
        starts = cu[:-1]
        params = self._params(plan)  # one row per window position, packed as the windows' tokens
        draft_probs = None
        if self.proposer is not None:  # before the target reads the window: its drafts replace the placeholders
            draft_probs = self.proposer.propose(batch, rows, params)
        if self.lockstep is not None:  # propose made this group's own calls: join the widest window's others
            lock = self.lockstep
            lock.idle_drafts(lock.draft_calls(width) + 1, lock.draft_calls(plan.dp_window_width))
        lay = window_layout(batch.cu_seqlens, int(batch.input_ids.numel()))  # once: the backend reuses it
        batch.spec = WindowRows(self.window, rows, lay)
        cache = self.cache
        before = None
        if self.args.debug_spec_state:
            before = ([t.index_select(0, batch.state_slots) for t in cache.recurrent],
                      [t.index_select(0, batch.state_slots) for t in cache.conv])
        pre: list[torch.Tensor] | None = [] if self.proposer is not None and self.proposer.needs_hidden else None
        logits = self._forward(batch, pre)
        # Sampled rows come sequence after sequence, one per window position: padded to [N, width, V].
        padded = pad(logits[: lay.total], lay)
        drafts = pad(batch.input_ids, lay)[:, 1:]  # zeros past a window's drafts (ignored)
        banned = [plan.banned[starts[i] : starts[i] + lens[i]] for i in range(n)]
        # Padded position j of window i: its own row, or (past the window) the window's last, never emitted.
        positions = starts[:, None] + np.minimum(np.arange(width)[None], lens[:, None] - 1)
        # Every window full: the padded positions are the packed ones, in order.
        padded_params = params if lay.full else params.take(self._tensor(positions.reshape(-1)))
        # Constrained requests never draft: their one position is masked as in decode, at its padded row.
        g = np.asarray(plan.grammar_rows, dtype=np.int64)
        seq = np.repeat(np.arange(n), lens)
        mask = self._grammar_mask(plan, seq[g] * width + (g - starts[seq[g]]))
        every = np.arange(len(seq))  # each sampled row's padded position, for the logit biases
        bias = self._logit_bias(plan, seq * width + (every - starts[seq]))
        res, row_errors = self.sampler.verify(padded, drafts, torch.from_numpy(lens - 1), padded_params,
                                              [int(r) for r in plan.rows], banned, plan.top_logprobs_num, mask,
                                              draft_probs, bias)
        num_accepted = res.num_accepted
        self.window.commit(cache.recurrent, cache.conv, batch.state_slots, rows, num_accepted + 1)
        if self.proposer is not None:
            self.proposer.commit(batch.state_slots, rows, num_accepted.to(rows.device) + 1, before is not None)
        if before is not None:
            check_committed_states(self.window, before, cache.recurrent, cache.conv, batch.state_slots, rows,
                                   num_accepted + 1)
        counts = (num_accepted + 1).tolist()
        tokens: list[int] = []
        logprobs: list[float] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        all_tokens, all_lps = res.tokens.tolist(), res.logprobs.tolist()
        all_top, all_top_lps = res.top_ids.tolist(), res.top_logprobs.tolist()
        for i, c in enumerate(counts):
            tokens += all_tokens[i][:c]
            logprobs += all_lps[i][:c]
            top_ids += all_top[i][:c]
            top_lps += all_top_lps[i][:c]
        last = torch.tensor([t[c - 1] for t, c in zip(all_tokens, counts, strict=True)], device=rows.device)
        self.tables.last_token[rows] = last
        if pre:  # the MTP proposer catches up over the committed positions with the target's hiddens there
            assert self.proposer is not None
            self.proposer.after_verify(batch, pre[0], num_accepted.to(rows.device) + 1, last, rows)
        if self.lockstep is not None and not self.lockstep.observes_verify:
            self._join_observations(plan)
        return StepResult(step=plan.step, tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps,
                          input_logprobs=[], row_errors=row_errors, num_accepted=num_accepted.tolist())
