"""SGLang-compatible frontend language: `@function` programs that append text, `gen`, `select` and roles to a
state, `fork` it, and run (singly, streamed, or in batches) against an in-process `Runtime` or a server's
`RuntimeEndpoint`. An SGLang program runs after `import frontend_lang as sgl`."""

from __future__ import annotations

from frontend_lang.backend import Backend, BackendError
from frontend_lang.chat_template import ChatTemplate
from frontend_lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unnormalized,
)
from frontend_lang.endpoint_backend import RuntimeEndpoint
from frontend_lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from frontend_lang.program import SglFunction, function, get_default_backend, set_default_backend
from frontend_lang.runtime_backend import Runtime
from frontend_lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend", "BackendError", "ChatTemplate", "ChoicesDecision", "ChoicesSamplingMethod", "ProgramState",
    "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin",
    "assistant_end", "function", "gen", "get_default_backend", "image", "greedy_token_selection", "select",
    "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized", "unnormalized",
    "user", "user_begin", "user_end",
]
