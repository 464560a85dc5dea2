"""The role markup programs write through `system` / `user` / `assistant`: Kimi's chat turns, framed by
`radixk3.tokenizer.turn_start` as the tokenizer's chat template frames them (a test holds the two equal)."""

from __future__ import annotations

from dataclasses import dataclass

from radixk3.tokenizer import IM_END, turn_start


@dataclass(frozen=True)
class ChatTemplate:
    def prefix(self, role: str) -> str:
        return turn_start(role).text

    def suffix(self, role: str) -> str:
        turn_start(role)  # refuses an unknown role, as `prefix` does
        return IM_END


KIMI = ChatTemplate()
