"""The role markup programs write through `system` / `user` / `assistant`: Kimi's chat template, as
`radixk3.tokenizer.Tokenizer.apply_chat_template` renders it (a test holds the two equal)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixk3.tokenizer import _ROLE_MARKERS, IM_END, IM_MIDDLE


@dataclass(frozen=True)
class ChatTemplate:
    role_markers: dict[str, str] = field(default_factory=lambda: dict(_ROLE_MARKERS))
    middle: str = IM_MIDDLE
    end: str = IM_END

    def _check(self, role: str) -> None:
        if role not in self.role_markers:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(self.role_markers)}")

    def prefix(self, role: str) -> str:
        self._check(role)
        return f"{self.role_markers[role]}{role}{self.middle}"

    def suffix(self, role: str) -> str:
        self._check(role)
        return self.end


KIMI = ChatTemplate()
