"""Pydantic models of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as the `anthropic`
package sends and reads them; requests strict, as the OpenAI ones (`runtime.http.openai_protocol`).

What a local text model cannot do is refused by name (images, documents, server tools, a prefilled reply);
what only concerns Anthropic's own service is accepted at its defaults (`container`, `mcp_servers`, ...: a 400
otherwise). Prompt caching needs no markers here (the radix cache reuses every prefix), so `cache_control` is
accepted anywhere and changes nothing; `metadata` and `service_tier` change nothing either.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from runtime.http.openai_protocol import NonEmptyStr, ToolName


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: Annotated[list[Any], Field(max_length=0)] | None = None  # only a reply's own, and we cite nothing


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: StrictStr | list[TextBlock] | None = None
    # K3's encoding has no error flag: the result's text (which says what failed) is what the model reads.
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None  # ours are empty; any is taken back as it is


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """A block this server cannot read is named (pydantic would only say the tag does not match)."""
        blocks = data.get("content") if isinstance(data, dict) else None
        for block in blocks if isinstance(blocks, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                raise ValueError(f"content blocks of type {kind!r} are not supported (this server takes "
                                 f"{', '.join(_BLOCK_TYPES)})")
        return data

    @model_validator(mode="after")
    def _blocks_by_role(self) -> Message:
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        wrong = kinds - ({"text", "tool_use", "thinking"} if self.role == "assistant" else {"text", "tool_result"})
        if wrong:
            raise ValueError(f"{self.role} messages do not carry {', '.join(sorted(wrong))} blocks")
        return self


class Tool(_Strict):
    name: ToolName
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: StrictBool | None = None  # a forced call follows the schema: strict or not

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"Anthropic's server tools ({kind!r}) are not supported; declare a custom tool "
                             "(name, description, input_schema) and run it yourself")
        return data


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool', and only with it")
        if self.type == "none" and self.disable_parallel_tool_use:
            raise ValueError("disable_parallel_tool_use goes with type auto, any or tool")
        return self


class Thinking(_Strict):
    """K3's thinking on (`enabled`, `adaptive`) or off. `budget_tokens` is checked as Anthropic checks it but not
    enforced apart from `max_tokens` (K3 has no budget of its own; `max_tokens` bounds thinking and reply
    together)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None
    display: Literal["summarized"] | None = None  # the thinking is always shown whole: "omitted" is refused

    @model_validator(mode="after")
    def _shape(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens is required with type 'enabled', and only with it")
        if self.budget_tokens is not None and self.budget_tokens < 1024:
            raise ValueError("budget_tokens must be at least 1024")
        if self.type == "disabled" and self.display is not None:
            raise ValueError("display goes with thinking enabled or adaptive")
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class Metadata(_Strict):
    user_id: StrictStr | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "high", "max"] | None = None  # K3's thinking efforts
    format: JsonOutputFormat | None = None


Nothing = Annotated[None, Field(description="Anthropic's service only: accepted at its default")]


class CountTokensRequest(_Strict):
    model: StrictStr
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # Anthropic's service only.
    container: Nothing = None
    diagnostics: Nothing = None
    mcp_servers: Annotated[list[Any], Field(max_length=0)] | None = None
    context_management: Nothing = None

    @model_validator(mode="after")
    def _tools(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.name is not None and choice.name not in names:
            raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not in tools")
        if self.messages[-1].role != "user":
            raise ValueError("the last message must be the user's: continuing a prefilled assistant reply is not "
                             "supported")
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    stream: StrictBool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Anthropic's service only.
    inference_geo: Nothing = None
    speed: Literal["standard"] | None = None


# --- replies ------------------------------------------------------------------------------------------------


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing to sign: the `anthropic` types want the field


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    """As Anthropic counts: `input_tokens` those not read from the cache, `cache_read_input_tokens` the rest."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ThinkingOut | ToolUseOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensOut(BaseModel):
    input_tokens: int
