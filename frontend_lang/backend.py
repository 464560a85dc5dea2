"""What a program's state needs from a backend, and the error it raises with the server's message.

Prompts come as `ChatPrompt`s: the role markup's markers kept apart from the program's text, so that a backend
that tokenises gives only the markers special ids; one that sends text sends `prompt.text`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend_lang.chat_template import KIMI, ChatTemplate
from frontend_lang.choices import ChoiceScore, ChoicesDecision, ChoicesSamplingMethod
from radixk3.chat_prompt import ChatPrompt


class BackendError(RuntimeError):
    """A request the backend refused or failed; the message is the server's (or the engine's) own."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status  # the HTTP status, for RuntimeEndpoint


def check_result(meta: dict[str, Any]) -> None:
    """Raise the request's error, if the backend reports one in its meta_info."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if meta.get("error") or kind == "error":
        raise BackendError(str(meta.get("error") or "the request failed"))


def logprob_of(item: Any) -> float | None:  # noqa: ANN401
    """A bare logprob, or the first field of SGLang's (logprob, token id, text) triple."""
    return item[0] if isinstance(item, list | tuple) else item


class Backend:
    """A completion backend: generate (whole or streamed), cache a prefix, score choices."""

    chat_template: ChatTemplate = KIMI

    def marker_ids(self, markers: tuple[str, ...]) -> list[int]:
        """The special ids of the template's stop markers (a backend whose template has some gives them)."""
        raise NotImplementedError

    def generate(self, prompt: ChatPrompt, sampling: dict[str, Any], options: dict[str, Any]
                 ) -> tuple[str, dict[str, Any]]:
        """The completion of `prompt` and its meta_info."""
        raise NotImplementedError

    def generate_stream(self, prompt: ChatPrompt, sampling: dict[str, Any], options: dict[str, Any]
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(new text, meta_info so far) as the completion of `prompt` is produced."""
        raise NotImplementedError

    def cache_prefix(self, prompt: ChatPrompt) -> dict[str, Any]:
        """Compute `prompt` into the prefix cache without generating (a `max_new_tokens: 0` request)."""
        raise NotImplementedError

    def score_choices(self, prefix: ChatPrompt, choices: list[str]) -> list[ChoiceScore]:
        """Per choice, its tokens' logprobs after `prefix`: the prefix cached first, then one batched request."""
        raise NotImplementedError

    def select(self, prefix: ChatPrompt, choices: list[str], method: ChoicesSamplingMethod) -> ChoicesDecision:
        return method(choices, self.score_choices(prefix, choices))

    def shutdown(self) -> None:
        """Release what the backend holds (processes, connections)."""
