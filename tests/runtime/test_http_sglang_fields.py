"""The probe: every field of SGLang 0.5.23's own request schemas, read from the installed `sglang`, against one
live server. At its default each is accepted (200); at a value that asks for something each either works (200,
and the answer shows it) or is a 400 that names it. Likewise for SGLang's extras of /v1/completions and
/v1/chat/completions, and for the info routes SGLang's clients read.

SGLang's `GenerateReqInput` module (srt/managers/io_struct.py) cannot be imported without torchvision, which
cannot be installed beside the CPU torch: its fields are read from the installed source with `ast` (the dataclass's
annotated fields and their default values). Its sampling parameters and OpenAI requests import fine.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import pytest
from pydantic_core import PydanticUndefined
from sglang.srt.entrypoints.openai import protocol as sgl_openai
from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

from runtime.http.native_api import GenerateRequest
from runtime.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from runtime.http.sglang_fields import CHAT_DECLINED, COMPLETION_DECLINED, GENERATE_DECLINED, asks_nothing
from runtime.sampling_params import SGLANG_FIELDS
from tests.runtime.http_server_proc import Server

ROUTER_ADDITIONS = {"model": None}  # sglang-router adds `model` to /generate (its other additions are SGLang's)


def _generate_fields() -> dict[str, Any]:
    """GenerateReqInput's fields and their defaults, from the installed sglang's source."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    source = Path(spec.submodule_search_locations[0], "srt", "managers", "io_struct.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    out: dict[str, Any] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            value = stmt.value
            if isinstance(value, ast.Call):  # field(default=..., kw_only=True)
                value = next(k.value for k in value.keywords if k.arg == "default")
            out[stmt.target.id] = ast.literal_eval(value) if value is not None else None
    return out | ROUTER_ADDITIONS


GENERATE = _generate_fields()
SAMPLING = {f.name: f.default for f in msgspec.structs.fields(SglSamplingParams)}


def _openai_defaults(model: type[Any]) -> dict[str, Any]:
    return {name: f.default for name, f in model.model_fields.items() if f.default is not PydanticUndefined}


COMPLETION = _openai_defaults(sgl_openai.CompletionRequest)
CHAT = _openai_defaults(sgl_openai.ChatCompletionRequest)

PARALLEL = 16  # probe requests in flight at once
PROMPT_FIELDS = ("text", "input_ids", "sampling_params")  # the probe's own prompt and parameters


def test_every_sglang_field_is_known() -> None:
    """Each SGLang field is one radixk3 serves or one it declines, on every route: none is an unknown field."""
    assert len(GENERATE) > 60 and len(COMPLETION) > 40 and len(CHAT) > 60
    for fields, ours, declined in ((GENERATE, GenerateRequest, GENERATE_DECLINED),
                                   (COMPLETION, CompletionRequest, COMPLETION_DECLINED),
                                   (CHAT, ChatCompletionRequest, CHAT_DECLINED)):
        unknown = sorted(set(fields) - set(ours.model_fields) - set(declined))
        assert not unknown, f"{ours.__name__}: SGLang fields neither served nor declined: {unknown}"
        assert not set(ours.model_fields) & set(declined), "a field both served and declined"


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


def _answer(r: httpx.Response, stream: bool) -> tuple[int, Any]:
    if stream and r.status_code == 200:
        return 200, [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return r.status_code, r.json()


def _post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    with server.client() as c:
        return _answer(c.post(path, json=body), bool(body.get("stream")))


def _post_all(server: Server, path: str, bodies: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """(status, answer) of each body, sent all at once: the engine batches them (a stream's answer is its
    events)."""
    with server.client() as c, ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(lambda b: _answer(c.post(path, json=b), bool(b.get("stream"))), bodies))


def _assert_names(name: str, status: int, body: Any) -> None:
    assert status == 400, f"{name}: {status} {body}"
    err = body["error"]
    assert err["param"] == name or name in err["message"], f"{name}: the 400 does not name it: {err}"


def _other(default: Any) -> Any:
    """A value that asks for something, for a field whose feature is declined (refused whatever its type)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 1
    return "probe"


# --- /generate ---------------------------------------------------------------------------------------------

GEN = {"text": "The probe", "sampling_params": {"max_new_tokens": 2}}
LP = {"return_logprob": True}


def _meta(out: Any) -> dict[str, Any]:
    return (out[-1] if isinstance(out, list) else out)["meta_info"]


# Non-default values of the /generate fields radixk3 serves: (value, the rest of the request it needs, check).
# P/D disaggregation's fields: a server in --disaggregation-mode null refuses them by name (a 400).
BOOTSTRAP_PROBES: dict[str, tuple[Any, dict[str, Any], Callable[[Any], bool]]] = {
    "bootstrap_host": ("127.0.0.1", {}, lambda out: False),
    "bootstrap_port": (8998, {"bootstrap_host": "127.0.0.1", "bootstrap_room": 1}, lambda out: False),
    "bootstrap_room": (1, {}, lambda out: False),
}

SERVED_GENERATE: dict[str, tuple[Any, dict[str, Any], Callable[[Any], bool]]] = BOOTSTRAP_PROBES | {
    "rid": ("probe-rid", {}, lambda out: out["meta_info"]["id"] == "probe-rid"),
    "stream": (True, {}, lambda out: isinstance(out, list) and _meta(out)["finish_reason"] is not None),
    "return_logprob": (True, {}, lambda out: len(out["meta_info"]["output_token_logprobs"]) == 2),
    "logprob_start_len": (0, LP, lambda out: len(out["meta_info"]["input_token_logprobs"]) > 0),
    "top_logprobs_num": (2, LP, lambda out: all(len(t) == 2 for t in out["meta_info"]["output_top_logprobs"])),
    "return_text_in_logprobs": (True, LP, lambda out: all(
        isinstance(t[2], str) for t in out["meta_info"]["output_token_logprobs"])),
    "log_metrics": (False, {}, lambda out: out["meta_info"]["completion_tokens"] == 2),
    "no_logs": (True, {}, lambda out: out["meta_info"]["completion_tokens"] == 2),
    "model": ("default", {}, lambda out: out["meta_info"]["completion_tokens"] == 2),
}


def test_generate_fields_at_their_defaults(server: Server) -> None:
    """All of SGLang's /generate fields and sampling parameters at SGLang's defaults, in one request, as its
    clients send them."""
    body = {k: v for k, v in GENERATE.items() if k not in PROMPT_FIELDS}
    body |= {"text": "The probe", "sampling_params": SAMPLING | {"max_new_tokens": 2}}
    status, out = _post(server, "/generate", body)
    assert status == 200, out
    assert out["meta_info"]["completion_tokens"] == 2


# Fields served only by a model with the feature (a vision tower: tests/runtime/test_http_images.py): on the
# built-in text model, a 400 names them.
NEEDS_MODEL_FEATURE = {"image_data"}


def test_generate_fields_asking_for_something(server: Server) -> None:
    """Each /generate field at a value that asks for its feature: it works, or a 400 names it."""
    assert set(SERVED_GENERATE) | set(PROMPT_FIELDS) | NEEDS_MODEL_FEATURE == set(GenerateRequest.model_fields)
    names = [n for n in GENERATE if n not in PROMPT_FIELDS]
    bodies = [GEN | SERVED_GENERATE[n][1] | {n: SERVED_GENERATE[n][0]} if n in SERVED_GENERATE
              else GEN | {n: _other(GENERATE[n])} for n in names]
    for name, (status, out) in zip(names, _post_all(server, "/generate", bodies), strict=True):
        if name in SERVED_GENERATE and name not in BOOTSTRAP_PROBES:
            assert status == 200 and SERVED_GENERATE[name][2](out), f"{name}: {status} {out}"
        else:  # declined, or (the bootstrap fields) served only by a prefill or decode server
            _assert_names(name, status, out)


# Sampling parameters at a value that asks for something, and how an answer shows it worked.
SAMPLING_VALUES: dict[str, tuple[Any, Callable[[Any], bool]]] = {
    "max_new_tokens": (3, lambda out: out["meta_info"]["completion_tokens"] == 3),
    "stop": ("zzz-never", lambda out: out["meta_info"]["completion_tokens"] == 2),
    "stop_token_ids": ([5], lambda out: out["meta_info"]["completion_tokens"] <= 2),
    "stop_regex": ("zzz+", lambda out: out["meta_info"]["completion_tokens"] <= 2),
    "temperature": (0.5, lambda out: True),
    "top_p": (0.9, lambda out: True),
    "top_k": (5, lambda out: True),
    "min_p": (0.1, lambda out: True),
    "frequency_penalty": (0.5, lambda out: True),
    "presence_penalty": (0.5, lambda out: True),
    "repetition_penalty": (1.1, lambda out: True),
    "min_new_tokens": (1, lambda out: out["meta_info"]["completion_tokens"] >= 1),
    "n": (2, lambda out: isinstance(out, list) and len(out) == 2),
    "json_schema": ('{"type": "string"}', lambda out: True),
    "regex": ("[ab]+", lambda out: set(out["text"]) <= {"a", "b"}),
    "ebnf": ('root ::= "a"+', lambda out: set(out["text"]) <= {"a"}),
    "ignore_eos": (True, lambda out: out["meta_info"]["completion_tokens"] == 2),
    "skip_special_tokens": (False, lambda out: True),
    "spaces_between_special_tokens": (False, lambda out: True),
    "no_stop_trim": (True, lambda out: True),
    "stream_interval": (2, lambda out: True),
    "logit_bias": ({"5": 100.0}, lambda out: out["output_ids"] == [5, 5]),
    "sampling_seed": (7, lambda out: True),
}


def test_sampling_params_asking_for_something(server: Server) -> None:
    """Each of SGLang's sampling parameters at a value that asks for something: it works (always, for one radixk3
    supports), or a 400 names it."""
    probes = {n: SAMPLING_VALUES.get(n, (_other(d), lambda out: True)) for n, d in SAMPLING.items()}
    bodies = [GEN | {"sampling_params": {"max_new_tokens": 2, n: v}} for n, (v, _) in probes.items()]
    for (name, (value, works)), (status, out) in zip(probes.items(), _post_all(server, "/generate", bodies),
                                                      strict=True):
        if SGLANG_FIELDS[name].supported:
            assert status == 200, f"{name}={value!r}: {out}"
        if status == 200:
            assert works(out), f"{name}={value!r}: {out}"
        else:
            _assert_names(name, status, out)


# --- OpenAI routes -----------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "The probe"}]
TOOL = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}


SERVED_OPENAI: dict[str, tuple[Any, dict[str, Any], Callable[[Any], bool]]] = BOOTSTRAP_PROBES | {
    "model": ("k3-tiny", {}, lambda out: out["model"] == "k3-tiny"),
    "n": (2, {}, lambda out: len(out["choices"]) == 2),
    "temperature": (0.5, {}, lambda out: True),
    "top_p": (0.9, {}, lambda out: True),
    "stop": ("zzz-never", {}, lambda out: True),
    "seed": (1, {}, lambda out: True),
    "frequency_penalty": (0.5, {}, lambda out: True),
    "presence_penalty": (0.5, {}, lambda out: True),
    "stream": (True, {}, lambda out: isinstance(out, list) and len(out) >= 1),
    "stream_options": ({"include_usage": True}, {"stream": True}, lambda out: out[-1]["usage"] is not None),
    "user": ("probe-user", {}, lambda out: True),
    "logit_bias": ({"5": 100.0}, {}, lambda out: True),
    "top_k": (5, {}, lambda out: True),
    "min_p": (0.1, {}, lambda out: True),
    "repetition_penalty": (1.1, {}, lambda out: True),
    "min_tokens": (1, {}, lambda out: out["usage"]["completion_tokens"] >= 1),
    "stop_token_ids": ([5], {}, lambda out: True),
    "ignore_eos": (True, {}, lambda out: out["usage"]["completion_tokens"] == 2),
    "skip_special_tokens": (False, {}, lambda out: True),
    "rid": ("probe-openai-rid", {}, lambda out: True),
    "regex": ("[ab]+", {}, lambda out: True),
    "ebnf": ('root ::= "a"+', {}, lambda out: True),
    "json_schema": ('{"type": "string"}', {}, lambda out: True),
    "stop_regex": ("zzz+", {}, lambda out: True),
    "no_stop_trim": (True, {}, lambda out: True),
    "response_format": ({"type": "json_object"}, {}, lambda out: True),
    # /v1/completions
    "max_tokens": (1, {}, lambda out: out["usage"]["completion_tokens"] == 1),
    "logprobs": (2, {}, lambda out: len(out["choices"][0]["logprobs"]["tokens"]) == 2),
    "echo": (True, {}, lambda out: True),
    "suffix": (" end", {}, lambda out: True),
    "best_of": (2, {}, lambda out: True),
    # /v1/chat/completions
    "max_completion_tokens": (1, {}, lambda out: out["usage"]["completion_tokens"] == 1),
    "top_logprobs": (2, {"logprobs": True}, lambda out: all(
        len(t["top_logprobs"]) == 2 for t in out["choices"][0]["logprobs"]["content"])),
    "tools": ([TOOL], {}, lambda out: True),
    "tool_choice": ("none", {"tools": [TOOL]}, lambda out: out["choices"][0]["message"]["tool_calls"] is None),
    "parallel_tool_calls": (False, {"tools": [TOOL]}, lambda out: True),
    "reasoning_effort": ("low", {}, lambda out: True),
    "chat_template_kwargs": ({"thinking": False}, {}, lambda out: out["choices"][0]["message"]["reasoning_content"]
                             is None),
    "continue_final_message": (True, {"messages": [*MSGS, {"role": "assistant", "content": "Once"}]},
                               lambda out: out["usage"]["completion_tokens"] >= 1),
    "separate_reasoning": (False, {"chat_template_kwargs": {"thinking": True}},
                           lambda out: out["choices"][0]["message"]["reasoning_content"] is None),
    "stream_reasoning": (False, {"stream": True, "chat_template_kwargs": {"thinking": True}},
                         lambda out: sum(bool(e["choices"] and e["choices"][0]["delta"].get("reasoning_content"))
                                         for e in out) <= 1),
}
# The chat's logprobs is a boolean; the completion's a count.
SERVED_OPENAI_CHAT = SERVED_OPENAI | {"logprobs": (True, {}, lambda out: out["choices"][0]["logprobs"] is not None)}

OPENAI_ROUTES = [
    ("/v1/completions", COMPLETION, CompletionRequest, {"prompt": "The probe"}, SERVED_OPENAI),
    ("/v1/chat/completions", CHAT, ChatCompletionRequest, {"messages": MSGS}, SERVED_OPENAI_CHAT),
]


@pytest.mark.parametrize(("path", "fields", "base"), [(r[0], r[1], r[3]) for r in OPENAI_ROUTES],
                         ids=["completions", "chat"])
def test_openai_fields_at_their_defaults(server: Server, path: str, fields: dict[str, Any],
                                         base: dict[str, Any]) -> None:
    body = fields | base | {"max_tokens": 2}
    status, out = _post(server, path, body)
    assert status == 200, out


@pytest.mark.parametrize(("path", "base"), [(r[0], r[3]) for r in OPENAI_ROUTES], ids=["completions", "chat"])
def test_openai_model_may_be_left_out(server: Server, path: str, base: dict[str, Any]) -> None:
    """SGLang's OpenAI routes default `model` to "default", the served model; so do ours."""
    status, out = _post(server, path, base | {"max_tokens": 2})  # no "model"
    assert status == 200, out


@pytest.mark.parametrize(("path", "fields", "ours", "base", "served"), OPENAI_ROUTES,
                         ids=["completions", "chat"])
def test_openai_fields_asking_for_something(server: Server, path: str, fields: dict[str, Any], ours: type[Any],
                                            base: dict[str, Any], served: dict[str, Any]) -> None:
    """Each SGLang field of the route at a value that asks for something: it works, or a 400 names it."""
    names = [n for n in fields if n not in base]
    assert all(n in served for n in names if n in ours.model_fields), "a served field without a probe value"
    body = base | {"model": "default", "max_tokens": 2}
    bodies = [body | served[n][1] | {n: served[n][0]} if n in ours.model_fields else body | {n: _other(fields[n])}
              for n in names]
    for name, sent, (status, out) in zip(names, bodies, _post_all(server, path, bodies), strict=True):
        if name in ours.model_fields:
            if status == 200:
                assert served[name][2](out), f"{path} {name}={sent[name]!r}: {out}"
            else:  # a served field's value the engine refuses (a feature of the field it does not have)
                _assert_names(name, status, out)
        elif asks_nothing(sent[name], ours.declined[name].default):  # e.g. false where true is the default
            assert status == 200, f"{path} {name}: {out}"
        else:
            _assert_names(name, status, out)


# --- info routes -------------------------------------------------------------------------------------------


def test_info_routes(server: Server) -> None:
    """The shapes SGLang's clients read: names as strings, the router's load, lm-eval's tokenizer routes."""
    with server.client() as c:
        for path in ("/model_info", "/get_model_info"):
            info = c.get(path).json()
            assert all(isinstance(info[k], str) for k in ("model_path", "tokenizer_path", "served_model_name"))
            assert info["served_model_name"] == "k3-tiny" and info["is_generation"] is True
            assert Path(info["tokenizer_path"], "tokenizer.model").is_file()
        for path in ("/server_info", "/get_server_info"):
            si = c.get(path).json()
            assert si["dp_size"] == 1 and si["tp_size"] == 1 and isinstance(si["internal_states"], list)
            assert isinstance(si["model_path"], str) and isinstance(si["version"], str)
        [load] = c.get("/get_load").json()
        assert {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load)
        tinfo = c.get("/tokenizer_info").json()
        assert {"eos_token", "bos_token", "pad_token", "chat_template"} <= set(tinfo)
        ids = c.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
        assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] > 0
        with_bos = c.post("/v1/tokenize", json={"prompt": ["hello world"]}).json()["tokens"][0]
        assert with_bos == [tinfo["bos_token_id"], *ids["tokens"]]
        # The ids are /generate's: the same prompt sent as text and as these ids gives the same greedy tokens.
        greedy = {"sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        by_text = c.post("/generate", json=greedy | {"text": "hello world"}).json()
        by_ids = c.post("/generate", json=greedy | {"input_ids": with_bos}).json()
        assert by_text["output_ids"] == by_ids["output_ids"]
        back = c.post("/detokenize", json={"tokens": ids["tokens"]}).json()
        assert back["text"] == back["prompt"] == "hello world"
        assert c.post("/detokenize", json={"tokens": [[5], [6]]}).json()["text"] == [
            c.post("/detokenize", json={"tokens": [t]}).json()["text"] for t in (5, 6)]
        assert c.post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
        assert c.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
