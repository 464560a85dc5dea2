"""`RuntimeEndpoint(url)`: the backend over a server's native API, `POST /generate` in SGLang's shapes
(`text`, `sampling_params`, `return_logprob`, `logprob_start_len`, `top_logprobs_num`,
`return_text_in_logprobs`, `stream`; a response holds `text` and `meta_info`; a stream is server-sent events
`data: {...}` with the text so far and the new tokens' logprobs, ended by `data: [DONE]`). Any error response
raises BackendError with the server's message.

`select` works on text here (the client has no tokenizer): it caches the prefix (`max_new_tokens: 0`), then
scores, in one batched request from the prefix's last token on, the prefix itself and every prefix + choice.
A choice whose first token there is the prefix's own last token adds its tokens after it; otherwise its
first token merged with the prefix's end and counts as the choice's (SGLang's token healing).

Prompts go as text (`ChatPrompt.text`, the role markup written out), and `/generate` reads text as a raw prompt
whose caller owns the template (SGLang's semantics): a marker string in the program's own text becomes a
control token there too. Programs that put untrusted text in a prompt run on `Runtime`, which encodes it as text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from frontend_lang.backend import Backend, BackendError, check_result
from frontend_lang.choices import ChoiceScore
from radixk3.chat_prompt import ChatPrompt

# The meta_info lists a stream's event holds only the new entries of (the server's incremental streaming).
STREAMED_LOGPROBS = ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs")


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    # --- HTTP --------------------------------------------------------------------------------------------
    def _post(self, payload: dict[str, Any]) -> Any:  # noqa: ANN401
        try:
            r = self.client.post("/generate", content=orjson.dumps(payload),
                                 headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach {self.base_url}: {e}") from e
        if r.status_code >= 400:
            raise BackendError(_message(r.content, r.status_code), r.status_code)
        data = orjson.loads(r.content)
        for item in data if isinstance(data, list) else [data]:
            check_result(item.get("meta_info") or {})
        return data

    def get(self, path: str) -> Any:  # noqa: ANN401
        """GET a JSON route of the server (e.g. `/get_model_info`)."""
        try:
            r = self.client.get(path)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach {self.base_url}: {e}") from e
        if r.status_code >= 400:
            raise BackendError(_message(r.content, r.status_code), r.status_code)
        return orjson.loads(r.content)

    # --- the backend -------------------------------------------------------------------------------------
    def generate(self, prompt: ChatPrompt, sampling: dict[str, Any], options: dict[str, Any]
                 ) -> tuple[str, dict[str, Any]]:
        data = self._post({"text": prompt.text, "sampling_params": sampling, **options})
        return data["text"], data["meta_info"]

    def generate_stream(self, prompt: ChatPrompt, sampling: dict[str, Any], options: dict[str, Any]
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
        payload = {"text": prompt.text, "sampling_params": sampling, **options, "stream": True}
        sent = ""
        logprobs: dict[str, list[Any]] = {}  # each event's new entries, gathered into the meta_info so far
        try:
            with self.client.stream("POST", "/generate", content=orjson.dumps(payload),
                                    headers={"Content-Type": "application/json"}) as r:
                if r.status_code >= 400:
                    raise BackendError(_message(r.read(), r.status_code), r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    body = line[len("data:"):].strip()
                    if body == "[DONE]":
                        return
                    event = orjson.loads(body)
                    if "error" in event and "text" not in event:
                        raise BackendError(_error_text(event))
                    meta = event.get("meta_info") or {}
                    check_result(meta)
                    for key in STREAMED_LOGPROBS:
                        if key in meta:
                            logprobs.setdefault(key, []).extend(meta[key])
                    meta = meta | logprobs
                    full = event.get("text", "")
                    # Events carry the text so far; the new part is what follows what was already yielded.
                    delta = full[len(sent):] if full.startswith(sent) else full
                    sent = full if full.startswith(sent) else sent + full
                    yield delta, meta
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach {self.base_url}: {e}") from e

    def cache_prefix(self, prompt: ChatPrompt) -> dict[str, Any]:
        return self._post({"text": prompt.text, "sampling_params": {"max_new_tokens": 0}})["meta_info"]

    def score_choices(self, prefix: ChatPrompt, choices: list[str]) -> list[ChoiceScore]:
        prompt_tokens = self.cache_prefix(prefix)["prompt_tokens"]
        start = max(prompt_tokens - 1, 0)
        texts = [prefix.text] + [prefix.text + c for c in choices]
        outs = self._post({"text": texts, "sampling_params": [{"max_new_tokens": 0, "temperature": 0}] * len(texts),
                           "return_logprob": True, "logprob_start_len": start, "return_text_in_logprobs": True})
        if not isinstance(outs, list) or len(outs) != len(texts):
            raise BackendError(f"a batch of {len(texts)} prompts got {len(outs) if isinstance(outs, list) else 1}"
                               " results")
        last = _triples(outs[0]["meta_info"]["input_token_logprobs"])
        if len(last) != 1:
            raise BackendError(f"expected one input logprob of the prefix from position {start}, got {len(last)}")
        last_id = last[0][1]
        scores = []
        for c, out in zip(choices, outs[1:], strict=True):
            items = _triples(out["meta_info"]["input_token_logprobs"])
            own = items[1:] if items and items[0][1] == last_id else items
            if not own:
                raise BackendError(f"choice {c!r} adds no token after the prefix")
            scores.append(ChoiceScore([t for _, t in own], [float(lp) for lp, _ in own],
                                      out["meta_info"].get("cached_tokens", 0)))
        return scores

    def shutdown(self) -> None:
        self.client.close()


def _triples(items: list[Any]) -> list[tuple[float, int]]:
    """(logprob, token id) of SGLang's (logprob, token id, text) entries."""
    out = []
    for x in items:
        if not isinstance(x, list | tuple) or len(x) < 2:
            raise BackendError("the server's input_token_logprobs lack token ids (return_text_in_logprobs)")
        out.append((x[0], int(x[1])))
    return out


def _error_text(body: Any) -> str:  # noqa: ANN401
    """The message in the common error shapes: {"error": {"message"}}, {"error": str}, {"message"}, {"detail"}."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key]) if not isinstance(body[key], list) else orjson.dumps(body[key]).decode()
    return str(body)


def _message(content: bytes, status: int) -> str:
    try:
        return _error_text(orjson.loads(content))
    except orjson.JSONDecodeError:
        return content.decode(errors="replace") or f"HTTP {status}"
