"""The role markup programs write through `system` / `user` / `assistant`: Kimi's chat template, as
`radixk3.tokenizer.Tokenizer.apply_chat_template` renders it (a test holds the two equal)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixk3.tokenizer import IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER


@dataclass(frozen=True)
class ChatTemplate:
    role_markers: dict[str, str] = field(default_factory=lambda: {
        "system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT})
    middle: str = IM_MIDDLE
    end: str = IM_END

    def prefix(self, role: str) -> str:
        if role not in self.role_markers:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(self.role_markers)}")
        return f"{self.role_markers[role]}{role}{self.middle}"

    def suffix(self, role: str) -> str:
        if role not in self.role_markers:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(self.role_markers)}")
        return self.end


KIMI = ChatTemplate()
