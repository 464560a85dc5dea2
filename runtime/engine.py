"""The offline API: `Engine(model=..., **server_args)`. The calling process is the tokenizer process; it
starts the scheduler and worker processes, talks to them over ZeroMQ and watches that they stay alive.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing as mp
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixk3.tokenizer import Tokenizer
from runtime.messages import (
    AbortReq,
    GenerateReq,
    MetricsOut,
    MetricsReq,
    Shutdown,
    TokenOut,
    WorkerReady,
    decode,
    encode,
)
from runtime.processes import endpoint, scheduler_main, tokenizer_for, worker_main
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs


class EngineError(RuntimeError):
    """The engine could not start, or a process died; pending requests fail with this."""


@dataclass
class _Pending:
    queue: queue.Queue[TokenOut | EngineError] = field(default_factory=queue.Queue)


class Engine:
    def __init__(self, model: str | None = None, *, startup_timeout: float = 120.0, **kwargs: Any) -> None:
        self.args = ServerArgs(model=model, **kwargs)
        self.tokenizer: Tokenizer = tokenizer_for(self.args)
        self._ipc_dir = tempfile.mkdtemp(prefix="radixk3-")
        self._ctx = zmq.Context()
        self._to_sched = self._ctx.socket(zmq.PUSH)
        self._to_sched.setsockopt(zmq.LINGER, 0)
        self._from_sched = self._ctx.socket(zmq.PULL)
        self._from_sched.setsockopt(zmq.LINGER, 0)
        self._from_sched.bind(endpoint(self._ipc_dir, "sched_out"))
        spawn = mp.get_context("spawn")
        self._procs = [spawn.Process(target=worker_main, args=(self.args, self._ipc_dir, 0), daemon=True,
                                     name="radixk3-worker-0")]
        self._procs.append(spawn.Process(target=scheduler_main, args=(self.args, self._ipc_dir, 1), daemon=True,
                                         name="radixk3-scheduler"))
        for p in self._procs:
            p.start()
        self._to_sched.connect(endpoint(self._ipc_dir, "sched_in"))
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self.dead: EngineError | None = None
        self._metrics: queue.Queue[dict[str, Any]] = queue.Queue()
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._receiver = threading.Thread(target=self._receive, daemon=True, name="radixk3-receiver")
        self._receiver.start()
        atexit.register(self.shutdown)

    # --- lifecycle -------------------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ready = 0
        while ready < 1:
            if self._from_sched.poll(200):
                msg = decode(self._from_sched.recv_multipart())
                if isinstance(msg, WorkerReady):
                    if msg.error is not None:
                        raise EngineError(f"startup failed: {msg.error}")
                    ready += 1
            if (dead := self._dead_child()) is not None:
                if self._from_sched.poll(1000):  # a failing child says why before it exits
                    msg = decode(self._from_sched.recv_multipart())
                    if isinstance(msg, WorkerReady) and msg.error is not None:
                        raise EngineError(f"startup failed: {msg.error}")
                raise EngineError(f"startup failed: {dead}")
            if time.monotonic() > deadline:
                raise EngineError(f"startup timed out after {timeout:.0f}s")

    def _dead_child(self) -> str | None:
        for p in self._procs:
            if not p.is_alive():
                return f"process {p.name} exited with code {p.exitcode}"
        return None

    def _receive(self) -> None:
        while not self._closed:
            if self._from_sched.poll(100):
                msg = decode(self._from_sched.recv_multipart())
                if isinstance(msg, MetricsOut):
                    self._metrics.put(msg.metrics)
                    continue
                with self._lock:
                    pending = self._pending.get(msg.rid)
                    if msg.finished is not None:
                        self._pending.pop(msg.rid, None)
                if pending is not None:
                    pending.queue.put(msg)
            elif (dead := self._dead_child()) is not None and not self._closed:
                self.dead = EngineError(f"{dead}; pending requests failed")
                self.shutdown()
                return

    def _fail_all(self, err: EngineError) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.queue.put(err)

    def shutdown(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._to_sched.send_multipart(encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        grace = 1.0 if self.dead is not None else 5.0  # a dead sibling means nobody will answer
        for p in self._procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._fail_all(self.dead or EngineError("the engine was shut down"))
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- requests --------------------------------------------------------------------------------------
    def _submit(self, input_ids: list[int], sampling: dict[str, Any], **kw: Any) -> tuple[str, _Pending]:
        SamplingParams.from_dict(sampling)  # refuse bad parameters here, with a clear message
        rid = f"r{next(self._ids)}"
        pending = _Pending()
        with self._lock:  # registered before shutdown's _fail_all, or refused: never left waiting
            if self.dead is not None or self._closed:
                raise self.dead or EngineError("the engine is shut down")
            self._pending[rid] = pending
        self._send(GenerateReq(rid, input_ids, sampling, **kw))
        return rid, pending

    def _send(self, msg: Any) -> None:
        # ZeroMQ sockets are not thread-safe; callers may be on several threads.
        with self._send_lock:
            if not self._closed:
                self._to_sched.send_multipart(encode(msg))

    def get_metrics(self, timeout: float = 10.0) -> dict[str, Any]:
        """The scheduler's counters: running, queued, prefill tokens computed, cached tokens, state checkpoint
        hits/misses, pool bytes per side, evictions, retractions, checkpoints."""
        self._send(MetricsReq())
        return self._metrics.get(timeout=timeout)

    def abort(self, rid: str) -> None:
        self._send(AbortReq(rid))

    def _ids_of(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_bos=True)

    def stream(self, prompt: str | list[int], sampling_params: dict[str, Any] | None = None,
               timeout: float | None = None, **kw: Any) -> Iterator[TokenOut]:
        """TokenOut chunks of one request as they are produced; the last has `finished` set."""
        rid, pending = self._submit(self._ids_of(prompt), dict(sampling_params or {}), **kw)
        return self._chunks(rid, pending, timeout)

    def _chunks(self, rid: str, pending: _Pending, timeout: float | None) -> Iterator[TokenOut]:
        while True:
            try:
                item = pending.queue.get(timeout=timeout)
            except queue.Empty:
                self.abort(rid)
                raise TimeoutError(f"request {rid} produced nothing for {timeout}s") from None
            if isinstance(item, EngineError):
                raise item
            yield item
            if item.finished is not None:
                return

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 timeout: float | None = None, **kw: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a batch (returns a list), all submitted at once."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch: list[Any] = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(batch)
        # `n` samples of a prompt are n requests (the radix cache shares their prompt); seeds stay distinct.
        expanded = [(p, sp | self._sample_index(sp, i)) for p, sp in zip(batch, params, strict=True)
                    for i in range(int(sp.get("n", 1)))]
        subs = [self._submit(self._ids_of(p), sp, **kw) for p, sp in expanded]
        results = [self._collect(rid, pending, sp, timeout) for (rid, pending), (_, sp) in zip(subs, expanded,
                                                                                             strict=True)]
        return results[0] if single and len(results) == 1 else results

    @staticmethod
    def _sample_index(sp: dict[str, Any], i: int) -> dict[str, Any]:
        out: dict[str, Any] = {"n": 1}
        if sp.get("seed") is not None:
            out["seed"] = sp["seed"] + i
        return out

    def _collect(self, rid: str, pending: _Pending, sampling: dict[str, Any], timeout: float | None
                 ) -> dict[str, Any]:
        ids: list[int] = []
        meta: dict[str, Any] = {"output_token_logprobs": [], "input_token_logprobs": [], "output_top_logprobs": []}
        for item in self._chunks(rid, pending, timeout):
            ids.extend(item.token_ids)
            meta["output_token_logprobs"].extend(item.logprobs)
            meta["output_top_logprobs"].extend(item.top_logprobs)
            meta["input_token_logprobs"].extend(item.input_logprobs)
        return self._result(rid, ids, item, sampling, meta)

    def _result(self, rid: str, ids: list[int], last: TokenOut, sampling: dict[str, Any], meta: dict[str, Any]
                ) -> dict[str, Any]:
        text = self.tokenizer.decode(ids, skip_special_tokens=sampling.get("skip_special_tokens", True))
        if isinstance(last.matched_stop, str) and last.matched_stop in text:
            text = text[: text.index(last.matched_stop)]
        return {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": last.finished, "matched": last.matched_stop},
                "prompt_tokens": last.prompt_tokens,
                "completion_tokens": len(ids),
                "cached_tokens": last.cached_tokens,
                "error": last.error,
                **meta,
            },
        }

    async def async_stream(self, prompt: str | list[int], sampling_params: dict[str, Any] | None = None,
                           **kw: Any) -> AsyncIterator[TokenOut]:
        """Async streaming variant: yields TokenOut chunks without blocking the event loop."""
        it = self.stream(prompt, sampling_params, **kw)
        while True:
            item = await asyncio.to_thread(next, it, None)
            if item is None:
                return
            yield item
