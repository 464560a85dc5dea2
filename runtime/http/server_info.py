"""The server's info routes, in the shapes SGLang 0.5.23 serves and its clients read: /model_info and
/server_info (with their old names /get_model_info and /get_server_info), /get_load, /tokenize and /detokenize
(also under /v1), and /tokenizer_info.

Who reads what: SGLang's frontend (`RuntimeEndpoint`) picks a chat template by /model_info's `model_path`;
`bench_serving` loads the tokenizer at `tokenizer_path`; sglang-router registers a worker by /server_info and
/model_info and balances by /get_load's `num_tokens`; lm-eval's remote tokenizer reads /tokenizer_info and
tokenizes through /tokenize and /detokenize (vLLM's shapes, which SGLang's extend). `model_path`,
`tokenizer_path` and `served_model_name` are always strings: for the built-in model its name (k3-gsm8k) and its
folder, for a test preset its name and the built-in tokenizer's folder.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.responses import Response

from radixk3.builtin_model import checkpoint_dir
from radixk3.sentencepiece_tokenizer import BUILTIN_MODEL
from runtime.http.api_errors import OrjsonResponse, parse_body
from runtime.http.state import ServerState, state_of
from runtime.sampling_params import check_token_ids

router = APIRouter()

VERSION = "0.1.0"


def tokenizer_path(st: ServerState) -> str:
    """Where the tokenizer's files are: the checkpoint's folder (the built-in model's too), or the built-in
    tokenizer's assets folder for a random preset."""
    return checkpoint_dir(st.args.model) or str(BUILTIN_MODEL.parent)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> Response:
    st = state_of(request)
    fmt, cfg = st.chat_format, st.procs.config
    return OrjsonResponse(st.tm.model_info() | {
        "model_path": st.model_path,
        "served_model_name": st.model_name,
        "tokenizer_path": tokenizer_path(st),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "reasoning_parser": fmt.reasoning_parser,
        "tool_call_parser": fmt.tool_call_parser,
        "disaggregation_mode": "null",  # SGLang's value when prefill and decode run together
        "has_image_understanding": cfg.vision is not None,
        "has_audio_understanding": False,
        "model_type": cfg.model_type,
        "architectures": None,
    })


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    """The server's arguments (the API key hidden), SGLang's names for the ones its clients read, and each
    replica's scheduler counters (`internal_states`; `scheduler`: all replicas together)."""
    st = state_of(request)
    args = dataclasses.asdict(st.args) | {"api_key": None if st.args.api_key is None else "<set>"}
    metrics = await st.tm.get_metrics(timeout=10.0)
    per_replica = metrics.get("replicas", [metrics])
    return OrjsonResponse(args | {
        "model_path": st.model_path,
        "tokenizer_path": tokenizer_path(st),
        "served_model_name": st.model_name,
        "context_length": st.tm.context_length,
        "disaggregation_mode": "null",
        "scheduler": metrics,
        "internal_states": per_replica,
        "version": VERSION,
    })


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """Each replica's load as SGLang's /get_load reports a data-parallel rank's: requests running and waiting,
    and `num_tokens`, the tokens whose latent KV the replica's pool holds (running and cached)."""
    st = state_of(request)
    metrics = await st.tm.get_metrics(timeout=10.0)
    per_replica = metrics.get("replicas", [metrics])
    row = st.kv_token_bytes
    return OrjsonResponse([{"dp_rank": i, "num_reqs": m["running"] + m["queued"], "num_waiting_reqs": m["queued"],
                            "num_tokens": m["kv_pool_bytes"] // row if row else 0}
                           for i, m in enumerate(per_replica)])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    add_special_tokens: StrictBool = True  # radixk3's tokenizers add a bos and nothing else


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt] | Annotated[list[list[StrictInt]], Field(min_length=1)]
    skip_special_tokens: StrictBool = True


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    """A prompt's ids as /generate and /v1/completions encode a text prompt (marker strings become their special
    ids; a bos with `add_special_tokens`); a list of prompts gives a list of lists."""
    st = state_of(request)
    req = await parse_body(request, TokenizeRequest)
    if req.model is not None:
        st.check_model(req.model)
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    for text in texts:
        st.tm.limits.check_text(len(text), 0, "prompt")
    ids = [st.tokenizer.encode(t, add_bos=req.add_special_tokens) for t in texts]
    one = isinstance(req.prompt, str)
    return OrjsonResponse({"tokens": ids[0] if one else ids, "count": len(ids[0]) if one else [len(i) for i in ids],
                           "max_model_len": st.tm.context_length})


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    """The text of the ids: under `text` as SGLang answers, and under `prompt` as vLLM does (lm-eval's remote
    tokenizer reads that)."""
    st = state_of(request)
    req = await parse_body(request, DetokenizeRequest)
    if req.model is not None:
        st.check_model(req.model)
    one = not req.tokens or isinstance(req.tokens[0], int)
    seqs: list[Any] = [req.tokens] if one else req.tokens
    vocab = st.tokenizer.vocab_size
    texts = [st.tokenizer.decode(check_token_ids("tokens", s, vocab), req.skip_special_tokens) for s in seqs]
    text: str | list[str] = texts[0] if one else texts
    return OrjsonResponse({"text": text, "prompt": text})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    """The tokenizer as vLLM's /tokenizer_info describes it (lm-eval reads `eos_token`, `bos_token`,
    `pad_token` and `chat_template`; the last only when it renders chats itself)."""
    st = state_of(request)
    tok, fmt = st.tokenizer, st.chat_format
    special = functools.partial(tok.decode, skip_special_tokens=False)
    # The Jinja template transformers would pick for a chat without tools; radixk3's own chat framings (K3's
    # encoding, the native Kimi one) are no Jinja template: null, and a client renders its own or asks /v1/chat.
    template = fmt.template.templates.get("default") if fmt.template is not None else None
    return OrjsonResponse({
        "tokenizer_class": type(tok).__name__,
        "tokenizer_path": tokenizer_path(st),
        "vocab_size": tok.vocab_size,
        "bos_token": special([tok.bos_id]),
        "eos_token": special([tok.eos_id]),
        "pad_token": special([tok.pad_id]),
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "model_max_length": st.tm.context_length,
        "chat_template": template,
    })
