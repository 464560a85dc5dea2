"""The worker's job for one step: apply the plan's pool copies and page-table changes, run the forward in the
plan's mode through the attention backend, sample."""

from __future__ import annotations

import numpy as np
import torch

from kernels.sampling import SamplingRow, sample
from kernels.state_checkpoints import StateCheckpoints
from radixk3.config import BUILTIN_PRESET, preset
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM, build_model
from runtime.messages import StepPlan, StepResult
from runtime.pool import CopyCommand
from runtime.pool_buffer import PoolBuffer
from runtime.pool_layout import pool_layout, serving_dtype
from runtime.server_args import ServerArgs
from runtime.worker_page_table import WorkerPageTable


def load_worker_model(args: ServerArgs) -> KimiForCausalLM:
    if args.model is None:
        model = build_model(preset(BUILTIN_PRESET), seed=args.seed, device=args.device)
    else:
        from radixk3.checkpoint import load_model

        model = load_model(args.model, device=args.device)
    dtype = serving_dtype(model.config, args)
    return model if dtype == model.config.torch_dtype else model.cast_(dtype)


class ModelWorker:
    def __init__(self, args: ServerArgs, model: KimiForCausalLM | None = None) -> None:
        self.args = args
        self.model = model if model is not None else load_worker_model(args)
        self.layout = pool_layout(self.model.config, args)
        self.buffer = PoolBuffer(self.layout, args.mem_bytes, device=args.device)
        cfg = self.model.config
        self.cache = HybridCache(
            recurrent=[self.buffer.recurrent_state(i) for i in range(cfg.num_kda_layers)],
            conv=[self.buffer.conv_state(i) for i in range(cfg.num_kda_layers)],
            latent=[self.buffer.kv(i) for i in range(cfg.num_mla_layers)],
        )
        self.tables = WorkerPageTable(self.model.device, rows=max(args.max_running_requests, 1))

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a, dtype=np.int64)).to(self.model.device)

    def apply_plan_changes(self, plan: StepPlan) -> None:
        """Byte copies, then page moves, then table writes, then row resets: the order the plan prescribes."""
        self.buffer.apply_copies(CopyCommand(*c) for c in plan.copies)
        self.tables.move_pages(plan.page_moves)
        self.tables.write(plan.table_rows, plan.table_cols, plan.table_pages)
        for row, history in plan.reset_rows:
            self.tables.reset(row, history)

    def forward_batch(self, plan: StepPlan) -> ForwardBatch:
        """The plan's sequences as a ForwardBatch over the worker's page table."""
        rows = self._tensor(plan.rows)
        cu = np.asarray(plan.cu_seqlens, dtype=np.int64)
        prefix = np.asarray(plan.prefix_lens, dtype=np.int64)
        ids = self._tensor(plan.input_ids)
        if (np.asarray(plan.input_ids) < 0).any():  # tokens sampled last step, which the plan could not know
            lens = torch.from_numpy(np.diff(cu)).to(ids.device)
            seq_rows = torch.repeat_interleave(rows, lens, output_size=ids.numel())
            ids = torch.where(ids < 0, self.tables.last_token[seq_rows], ids)
        ps = self.layout.page_size
        num_pages = int(-(-(prefix + np.diff(cu)).max() // ps)) if len(prefix) else 0
        ck = None
        if len(plan.ckpt_slot):
            ck = StateCheckpoints(self._tensor(plan.ckpt_seq), self._tensor(plan.ckpt_offset),
                                  self._tensor(plan.ckpt_slot))
        return ForwardBatch.from_table(
            ForwardMode(plan.mode), ids, self._tensor(cu), self._tensor(prefix), self._tensor(plan.state_slots),
            self.tables.block_table(plan.rows, num_pages), ps, ck, self._tensor(plan.logits_index),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self.apply_plan_changes(plan)
        if plan.mode == ForwardMode.IDLE.value:
            return StepResult(step=plan.step, tokens=[], logprobs=[], top_ids=[], top_logprobs=[], input_logprobs=[])
        batch = self.forward_batch(plan)
        logits = self.model.forward_batch(batch, self.cache).float()
        n = len(plan.sample_params)
        for row, ban in enumerate(plan.banned):
            if ban:
                logits[row, ban] = float("-inf")
        # Table row of each sampled logits row: sampled rows come first, one per sampled sequence.
        sampled_seqs = np.searchsorted(np.asarray(plan.cu_seqlens), np.asarray(plan.logits_index[:n]), "right") - 1
        sampled_rows = [int(plan.rows[s]) for s in sampled_seqs]
        params = [SamplingRow(**p) for p in plan.sample_params]
        histories = [self.tables.histories.get(r, []) for r in sampled_rows]
        res = sample(logits[:n], params, histories, plan.top_logprobs_num)
        tokens = res.tokens.tolist()
        self.tables.record_samples(sampled_rows, res.tokens, tokens)
        input_lp: list[float] = []
        if plan.input_logprob_rows:
            lp = logits.log_softmax(-1)
            idx = self._tensor(np.array([r for r, _ in plan.input_logprob_rows]))
            tok = self._tensor(np.array([x for _, x in plan.input_logprob_rows]))
            input_lp = lp[idx, tok].tolist()
        return StepResult(
            step=plan.step, tokens=tokens, logprobs=res.logprobs.tolist(),
            top_ids=res.top_ids.tolist(), top_logprobs=res.top_logprobs.tolist(), input_logprobs=input_lp,
        )
