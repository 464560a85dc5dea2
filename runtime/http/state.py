"""What every route of the HTTP server shares: the engine, the metrics, the served model's name."""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field

from starlette.requests import Request

from radixk3.tokenizer import Tokenizer
from runtime.engine_processes import EngineProcesses
from runtime.http.api_errors import APIError
from runtime.http.metrics import ServerMetrics
from runtime.http.responses_store import ResponseStore
from runtime.pool_layout import pool_layout
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

    @functools.cached_property
    def kv_token_bytes(self) -> int:
        """The pool bytes one token's latent KV takes (all MLA layers, a draft's included)."""
        return pool_layout(self.procs.config, self.args).kv_token_bytes

    @property
    def model_path(self) -> str:
        return self.args.model_id

    def check_model(self, model: str) -> None:
        """SGLang's names of the served model: the served name, "default" (SGLang's documentation sends it) and
        the model path; any other name is a 404, as in vLLM."""
        if model not in (self.model_name, "default", self.model_path):
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", param="model", code="model_not_found")


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or args.model_id


def state_of(request: Request) -> ServerState:
    return request.app.state.server
