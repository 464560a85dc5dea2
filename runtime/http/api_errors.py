"""HTTP errors of the server: one OpenAI-style body for every refusal, and request bodies parsed strictly.

Every error, on the native and the /v1 routes alike, is `{"error": {"message", "type", "param", "code"}}` with a
message that names the problem, so that a client (or the `openai` package, which reads exactly this shape) can
tell the user what to fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from runtime.errors import ShuttingDown
from runtime.tokenizer.request_stream import Sample, StreamChunk

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("uvicorn.error")  # uvicorn's server log: --log-level sets its level

RETRY_AFTER_S = 1  # what a 503 tells the client to wait: the queue drains at step speed


class OrjsonResponse(Response):
    """JSON responses through orjson (FastAPI's ORJSONResponse is deprecated)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> OrjsonResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return OrjsonResponse(self.body(), self.status, headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def request_failed(s: Sample | StreamChunk) -> APIError:
    """A sample the engine finished with an error: the request's own (a grammar refused at compile) is a 400."""
    if s.invalid:
        return APIError(400, s.error or "invalid request", "invalid_request_error", param=s.error_param)
    return APIError(500, f"request {s.rid} failed: {s.error or 'unknown error'}", "server_error")


def stream_failed(e: BaseException) -> APIError:
    """The engine went away mid-stream, or the server's shutdown ended it: said in the stream, as its status
    line is sent already."""
    if isinstance(e, ShuttingDown):
        return shutting_down(e)
    return APIError(503, f"the request failed: {type(e).__name__}: {e}", "server_error")


def shutting_down(e: ShuttingDown) -> APIError:
    return APIError(503, str(e), "server_error", code="shutting_down")


# How pydantic tags the members of a union in an error's location; never field names here.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:  # a field name, not a validator's tag
            out += f".{part}" if out else part
    return out


def _message(error: Any) -> str:
    if error.get("type") == "extra_forbidden":
        return "unknown field"
    if error.get("type") == "missing":
        return "field required"
    return str(error.get("msg", "invalid value")).removeprefix("Value error, ")


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """What pydantic found wrong with the first bad field, as `field: what is wrong`; a field that may take
    several forms (a string or a list, ...) lists why each form failed."""
    errors = [e | {"loc": tuple(p for p in e.get("loc", ()) if p != "body")} for e in exc.errors()]
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    if len(same) == 1:
        where = _loc(same[0]["loc"])
        text = _message(same[0])
    else:
        common = 1
        while all(len(e["loc"]) > common and e["loc"][common] == same[0]["loc"][common] for e in same):
            common += 1
        where = _loc(same[0]["loc"][:common])
        forms = []
        for e in same:
            inner = _loc(e["loc"][common:])
            forms.append(f"{inner}: {_message(e)}" if inner else _message(e))
        text = "no accepted form matches: " + "; or ".join(dict.fromkeys(forms))
    others = len({e["loc"][:1] for e in errors}) - 1
    more = f" (and {others} more bad field(s))" if others else ""
    return bad_request(f"{where}: {text}{more}" if where else f"{text}{more}", where or None)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated into `model`; any content type is read as JSON (curl's -d sends form type)."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        # orjson refuses invalid UTF-8, NaN/Infinity literals and integers beyond 64 bits, saying which.
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


def install_error_handlers(app: FastAPI) -> None:
    """APIError, FastAPI's own validation and routing errors (404, 405) and anything unexpected, in one shape."""
    from runtime.errors import EngineError, EngineOverloaded, InvalidRequest

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, _: ClientDisconnect) -> Response:
        # While its body was read: nobody to answer and nothing wrong here, so no traceback (which any
        # client could otherwise write into the log at will).
        log.debug("the client left during the body of %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> Response:
        return bad_request(str(exc), exc.param).response()

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_: Request, exc: EngineOverloaded) -> Response:
        return APIError(503, f"the server is overloaded: {exc}; retry later", "server_overloaded",
                        code="overloaded").response()

    @app.exception_handler(ShuttingDown)
    async def _shutting_down(_: Request, exc: ShuttingDown) -> Response:
        return shutting_down(exc).response()

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> Response:
        return APIError(503, f"the engine is unavailable: {exc}", "server_error", code="engine_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                       str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OrjsonResponse(error_body(message, kind), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        return OrjsonResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)
