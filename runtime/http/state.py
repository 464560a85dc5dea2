"""What every route of the HTTP server shares: the engine, the metrics, the served model's name."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from starlette.requests import Request

from radixk3.config import BUILTIN_PRESET
from radixk3.tokenizer import Tokenizer
from runtime.engine_processes import EngineProcesses
from runtime.http.metrics import ServerMetrics
from runtime.model_files import chat_format
from runtime.server_args import ServerArgs
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

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tm.tokenizer

    @cached_property
    def chat_format(self) -> Literal["k3", "kimi"]:
        return chat_format(self.args)

    @property
    def model_name(self) -> str:
        return served_model_name(self.args)


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or args.model or BUILTIN_PRESET


def state_of(request: Request) -> ServerState:
    return request.app.state.server
