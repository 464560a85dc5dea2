"""Scheduler and worker in one process: for tests, benchmarks and debugging.

It runs the very same Scheduler, StepLoop and ModelWorker as the multi-process Engine (messages still make
the orjson round trip when `wire=True`), so what it proves about scheduling and caching holds there too.
With overlap (the default, as in the Engine) a sent plan waits in a queue and the worker runs it when the
loop asks for its result, after the next plan was made: exactly the order the overlapped processes see.
`submit` is a door like the tokenizer manager's: the request is parsed and checked there, and nothing past it
checks it again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from radixk3.model import KimiForCausalLM
from radixk3.vision.encoder import VisionEncoder
from runtime.disagg.door import check_disaggregated
from runtime.grammar import GrammarBackend
from runtime.messages import GenerateReq, StepPlan, StepResult, TokenOut, decode, encode
from runtime.model_files import model_config, tokenizer_for
from runtime.model_files import stop_ids as model_stop_ids
from runtime.sampling_params import SamplingParams, check_output_options, check_prompt_ids
from runtime.scheduler.scheduler import Scheduler
from runtime.scheduler.step_loop import StepLoop
from runtime.server_args import ServerArgs
from runtime.worker.model_worker import ModelWorker


class LocalEngine:
    def __init__(self, args: ServerArgs, model: KimiForCausalLM | None = None, *, wire: bool = True,
                 check: bool = False, on_step: Callable[[Scheduler], None] | None = None,
                 vision: VisionEncoder | None = None) -> None:
        self.worker = ModelWorker(args, model, vision)
        tok = tokenizer_for(args)
        cfg = model_config(args) if model is None else model.config
        stop_ids = model_stop_ids(args, tok, cfg)
        self.vocab_size = cfg.vocab_size
        grammar = GrammarBackend(tok, cfg.vocab_size, stop_ids, args)
        agents = [self.worker.transfer.describe()] if self.worker.transfer is not None else None
        self.scheduler = Scheduler(args, self.worker.layout, stop_ids, tok.decode, grammar,
                                   pool_bytes=self.worker.pool_bytes, transfer_agents=agents)
        self.args, self.wire, self.check, self.on_step = args, wire, check, on_step
        self._n = 0
        self._sent: deque[StepPlan] = deque()
        self.loop = StepLoop(self.scheduler, self._sent.append, self._run_next,
                             overlap=args.overlap_schedule)

    def _run_next(self) -> StepResult:
        plan = self._sent.popleft()
        plan = decode(encode(plan)) if self.wire else plan
        res = self.worker.execute(plan)
        return decode(encode(res)) if self.wire else res

    def submit(self, input_ids: list[int], sampling: dict[str, Any] | None, **options: Any) -> str:
        """Check and queue one request (one sample: `n` is not expanded); `options`: GenerateReq's
        (return_logprob, logprob_start_len, top_logprobs_num, images with image_patches). Raises InvalidRequest
        for bad input."""
        params = SamplingParams.from_dict(sampling, self.vocab_size)
        req = GenerateReq(f"l{self._n}", check_prompt_ids(input_ids, self.vocab_size), params.for_sample(0),
                          **options)
        check_output_options(req.return_logprob, req.logprob_start_len, req.top_logprobs_num, self.vocab_size)
        check_disaggregated(self.args.disaggregation_mode, req.bootstrap, params, req.return_logprob,
                            req.logprob_start_len, len(input_ids), req.top_logprobs_num)
        self._n += 1
        self.scheduler.add(req)
        return req.rid

    def run(self) -> dict[str, list[TokenOut]]:
        """Step until every submitted request has finished; returns each request's TokenOut chunks."""
        outs: dict[str, list[TokenOut]] = {}
        s = self.scheduler
        while self.loop.busy:
            got = self.loop.step()
            for o in got:
                outs.setdefault(o.rid, []).append(o)
            if self.check:
                s.check_integrity()
            if self.on_step is not None:
                self.on_step(s)
        return outs

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any], **kw: Any) -> list[list[int]]:
        rids = [self.submit(p, sampling, **kw) for p in prompts]
        outs = self.run()
        return [[t for o in outs[r] for t in o.token_ids] for r in rids]
