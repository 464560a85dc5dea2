"""The role markup programs write through `system` / `user` / `assistant`, as the model's chat encoding frames a
message: Kimi's chat turns (`KIMI`, framed by `radixk3.tokenizer.turn_start` as the tokenizer's chat template
frames them) or K3's own messages (`K3`, `runtime.tokenizer.k3_encoding` with thinking off). Tests hold each equal
to its renderer. The markup is a `ChatPrompt`, so a backend that tokenises can give its markers, and only them,
special ids."""

from __future__ import annotations

from dataclasses import dataclass

from radixk3.chat_prompt import ChatPrompt
from radixk3.tokenizer import END_OF_MSG, IM_END, XTML_CLOSE, turn_start
from runtime.tokenizer.k3_encoding import close_tag, open_tag

_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """Kimi's chat turns; prompts start with BOS."""

    add_bos: bool = True

    def prefix(self, role: str) -> ChatPrompt:
        return turn_start(role)

    def suffix(self, role: str) -> ChatPrompt:
        turn_start(role)  # refuses an unknown role, as `prefix` does
        return ChatPrompt.marker(IM_END)

    def stop_markers(self, role: str) -> tuple[str, ...]:
        """Markers that end what the model writes inside `role` besides the model's stop ids."""
        return ()


@dataclass(frozen=True)
class K3ChatTemplate(ChatTemplate):
    """K3's messages, thinking off: an assistant message is its response channel; no BOS. The model closes its
    response with `<|close|>` (then, in its own markup, the message), so a `gen` inside the assistant role
    stops there and the role's suffix writes the closing markup."""

    add_bos: bool = False

    def prefix(self, role: str) -> ChatPrompt:
        opening = open_tag("message", ("role", _known(role)))
        return opening + open_tag("response") if role == "assistant" else opening

    def suffix(self, role: str) -> ChatPrompt:
        closing = close_tag("message") + ChatPrompt.marker(END_OF_MSG)
        return close_tag("response") + closing if _known(role) == "assistant" else closing

    def stop_markers(self, role: str) -> tuple[str, ...]:
        return (XTML_CLOSE,) if role == "assistant" else ()


def _known(role: str) -> str:
    if role not in _ROLES:
        raise ValueError(f"unsupported chat role {role!r}; expected one of {sorted(_ROLES)}")
    return role


KIMI = ChatTemplate()
K3 = K3ChatTemplate()
