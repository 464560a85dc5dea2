"""What every route of the HTTP server shares: the engine, the metrics, the served model's name."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from starlette.requests import Request

from radixk3.config import BUILTIN_PRESET
from radixk3.tokenizer import Tokenizer
from runtime.engine_processes import EngineProcesses
from runtime.http.metrics import ServerMetrics
from runtime.http.responses_store import ResponseStore
from runtime.server_args import ServerArgs
from runtime.tokenizer.chat_format import ChatFormat
from runtime.tokenizer.manager import RequestHandle, TokenizerManager


@dataclass
class ServerState:
    args: ServerArgs
    procs: EngineProcesses
    tm: TokenizerManager
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    started: int = field(default_factory=lambda: int(time.time()))
    # Requests by the id they were submitted with; weak: a finished request's handle is dropped with its route.
    live: weakref.WeakValueDictionary[str, RequestHandle] = field(default_factory=weakref.WeakValueDictionary)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept for previous_response_id

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tm.tokenizer

    @property
    def chat_format(self) -> ChatFormat:
        return self.procs.chat_format

    @property
    def model_name(self) -> str:
        return served_model_name(self.args)


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or args.model or BUILTIN_PRESET


def state_of(request: Request) -> ServerState:
    return request.app.state.server
