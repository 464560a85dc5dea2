"""The worker's job for one step: apply the pool's byte copies, run the cached forward, sample."""

from __future__ import annotations

import torch

from kernels.sampling import SamplingRow, sample
from radixk3.config import BUILTIN_PRESET, ModelConfig, preset
from radixk3.forward_batch import ForwardBatch, HybridCache
from radixk3.model import KimiForCausalLM, build_model
from runtime.messages import StepPlan, StepResult
from runtime.pool import CopyCommand
from runtime.pool_buffer import PoolBuffer
from runtime.pool_layout import pool_layout
from runtime.server_args import ServerArgs


def load_worker_model(args: ServerArgs) -> KimiForCausalLM:
    if args.model is None:
        return build_model(preset(BUILTIN_PRESET), seed=args.seed, device=args.device)
    from radixk3.checkpoint import load_model

    return load_model(args.model, device=args.device)


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

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self.buffer.apply_copies(CopyCommand(*c) for c in plan.copies)
        dev = self.model.device

        def t(a: object) -> torch.Tensor:
            return torch.tensor(a, dtype=torch.int64, device=dev)

        batch = ForwardBatch(
            input_ids=t(plan.input_ids), cu_seqlens=t(plan.cu_seqlens), prefix_lens=t(plan.prefix_lens),
            state_slots=t(plan.state_slots), kv_slots=t(plan.kv_slots), kv_indices=t(plan.kv_indices),
            kv_indptr=t(plan.kv_indptr), logits_index=t(plan.logits_index),
        )
        logits = self.model.forward_batch(batch, self.cache).float()
        n = len(plan.sample_params)
        for row, ban in enumerate(plan.banned):
            if ban:
                logits[row, ban] = float("-inf")
        rows = [SamplingRow(**p) for p in plan.sample_params]
        res = sample(logits[:n], rows, plan.histories, plan.top_logprobs_num)
        input_lp: list[float] = []
        if plan.input_logprob_rows:
            lp = logits.log_softmax(-1)
            idx = t([r for r, _ in plan.input_logprob_rows])
            tok = t([x for _, x in plan.input_logprob_rows])
            input_lp = lp[idx, tok].tolist()
        return StepResult(
            step=plan.step, tokens=res.tokens.tolist(), logprobs=res.logprobs.tolist(),
            top_ids=res.top_ids.tolist(), top_logprobs=res.top_logprobs.tolist(), input_logprobs=input_lp,
        )
