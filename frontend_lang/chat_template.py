"""The role markup programs write through `system` / `user` / `assistant`: Kimi's chat turns, framed by
`radixk3.tokenizer.turn_start` as the tokenizer's chat template frames them (a test holds the two equal).
The markup is a `ChatPrompt`, so a backend that tokenises can give its markers, and only them, special ids."""

from __future__ import annotations

from dataclasses import dataclass

from radixk3.chat_prompt import ChatPrompt
from radixk3.tokenizer import IM_END, turn_start


@dataclass(frozen=True)
class ChatTemplate:
    def prefix(self, role: str) -> ChatPrompt:
        return turn_start(role)

    def suffix(self, role: str) -> ChatPrompt:
        turn_start(role)  # refuses an unknown role, as `prefix` does
        return ChatPrompt.marker(IM_END)


KIMI = ChatTemplate()
