"""Pydantic models of the OpenAI Responses API (`/v1/responses`), as the `openai` client sends and reads them.

Requests are strict like the chat route's (`runtime.http.openai_protocol`): unknown fields are refused by name.
A field of the API that radixk3 does not support is accepted at its default (null, false, empty, or the API's
default value) and refused with a 400 naming it otherwise, so that nothing is silently ignored. Fields that only
steer OpenAI's own service (`user`, `safety_identifier`, `prompt_cache_key`, `metadata`, `service_tier` "auto" /
"default") change nothing in what the model writes and are accepted as they come.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from runtime.http.openai_protocol import NonEmptyStr, Stop, ToolName


class _Strict(BaseModel):
    """As the chat route's requests: unknown fields refused, no coercion, no NaN or infinities."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# --- input items --------------------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(_Strict):
    type: Literal["input_text"]
    text: StrictStr
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a cache hint: every prompt prefix is cached here


class OutputText(_Strict):
    """An earlier reply's text, sent back as input."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: StrictStr


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def part_text(part: InputText | OutputText | Refusal) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[ContentPart]
    id: StrictStr | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @model_validator(mode="after")
    def _parts_fit_role(self) -> MessageItem:
        if self.role != "assistant" and isinstance(self.content, list):
            if any(not isinstance(p, InputText) for p in self.content):
                raise ValueError(f"a {self.role} message's content parts are input_text")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part_text(p) for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: ToolName
    arguments: StrictStr
    id: StrictStr | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: StrictStr | list[InputText]
    name: ToolName | None = None
    id: StrictStr | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: StrictStr


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: StrictStr


_SEAL = "radixk3-reasoning:"


def seal_reasoning(text: str) -> str:
    """The `encrypted_content` of a reasoning item (`include: ["reasoning.encrypted_content"]`, which clients that
    do not store responses ask for, to send the thinking back): the text itself, base64 under a tag. Not secret:
    radixk3 hides nothing of the thinking, which the item's content carries anyway."""
    return _SEAL + base64.b64encode(text.encode()).decode()


def open_reasoning(sealed: str) -> str:
    if not sealed.startswith(_SEAL):
        raise ValueError("encrypted_content: not written by radixk3 (reasoning from another server cannot be read)")
    try:
        return base64.b64decode(sealed[len(_SEAL):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("encrypted_content: damaged") from None


class ReasoningItem(_Strict):
    """An earlier reply's thinking: its content is what K3 wrote (else its sealed copy, else its summary)."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None
    status: ItemStatus | None = None

    @model_validator(mode="after")
    def _readable(self) -> ReasoningItem:
        if self.encrypted_content is not None:
            open_reasoning(self.encrypted_content)
        return self

    def text(self) -> str:
        if self.content:
            return "".join(p.text for p in self.content)
        if self.encrypted_content is not None:
            return open_reasoning(self.encrypted_content)
        return "".join(p.text for p in self.summary)


def _item_kind(item: Any) -> str:
    """Items are told apart by `type`; a message may leave it out (the API's easy input message)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="unsupported_item",
                  custom_error_message="radixk3 takes input items of the types message, function_call, "
                                       "function_call_output and reasoning"),
]


# --- tools and options --------------------------------------------------------------------------------------


class FunctionTool(_Strict):
    type: Literal["function"]
    name: ToolName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: ToolName


class ReasoningOptions(_Strict):
    # K3's efforts, and "none" for no thinking (the K3 encoding names the ones it takes when one does not fit)
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # K3's thinking comes whole, as content
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: NonEmptyStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> TextFormat:
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError("name and schema are required with type 'json_schema', and only with it")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat route's `response_format`."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the API's default; K3 has no verbosity control


class StreamOptions(_Strict):
    # The API pads its delta events against length side channels (on by default); radixk3's are unpadded, which
    # changes nothing a client reads.
    include_obfuscation: StrictBool = True


# The API's fields for features radixk3 does not have, with the one value each may take besides null.
_DEFAULTS_ONLY: dict[str, Any] = {"background": False, "truncation": "disabled", "top_logprobs": 0,
                                  "conversation": None, "prompt": None, "context_management": [],
                                  "prompt_cache_retention": "in_memory"}


class ResponsesRequest(_Strict):
    model: StrictStr
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    previous_response_id: NonEmptyStr | None = None
    store: StrictBool | None = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = True
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Steer OpenAI's own service only: accepted as they come.
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    service_tier: Literal["auto", "default"] | None = None
    max_tool_calls: StrictInt | None = None  # bounds built-in tools' calls, and radixk3 has none
    # Features radixk3 does not have: their defaults only (`_DEFAULTS_ONLY`).
    background: Any = None
    truncation: Any = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    top_logprobs: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    prompt_cache_retention: Any = None
    # SGLang's extras, sent with the client's `extra_body`.
    request_id: NonEmptyStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: Stop = None
    seed: StrictInt | None = None

    @field_validator(*_DEFAULTS_ONLY, mode="before")
    @classmethod
    def _default_only(cls, value: Any, info: ValidationInfo) -> Any:
        default = _DEFAULTS_ONLY[info.field_name or ""]
        if value is None or (default is not None and value == default):
            return value
        shown = "null" if default is None else orjson.dumps(default).decode()
        raise ValueError(f"radixk3 does not support {info.field_name} other than {shown} (or left out)")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}]: radixk3 takes tools of type function only, not {kind!r}")
        return tools

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def seals_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)


# --- output -------------------------------------------------------------------------------------------------


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputTextPart] = Field(default_factory=list)


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningPart] = Field(default_factory=list)
    encrypted_content: str | None = None


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # prompt tokens the radix cache did not hold: all of them go into it


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> ResponseUsage:
        return cls(input_tokens=prompt_tokens, output_tokens=output_tokens, total_tokens=prompt_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens,
                                                           cache_write_tokens=prompt_tokens - cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error", "invalid_prompt"]
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    reasoning: dict[str, Any] = Field(default_factory=dict)
    text: dict[str, Any] = Field(default_factory=dict)
    temperature: float | None = None
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    usage: ResponseUsage | None = None

    @classmethod
    def echoing(cls, req: ResponsesRequest, rid: str, created: int, model: str) -> ResponseObject:
        """An in-progress response that echoes the request's settings, as the API does."""
        text_format = req.text.format if req.text is not None and req.text.format is not None else None
        return cls(
            id=rid, created_at=created, status="in_progress", model=model, instructions=req.instructions,
            previous_response_id=req.previous_response_id, max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls, parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
            else req.tool_choice or "auto",
            tools=[t.model_dump() for t in req.tools or []],
            reasoning=(req.reasoning or ReasoningOptions()).model_dump(exclude={"generate_summary"}),
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format is not None
                  else {"type": "text"}, "verbosity": "medium"},
            temperature=req.temperature, top_p=req.top_p, store=req.store is not False, metadata=req.metadata or {},
            user=req.user, safety_identifier=req.safety_identifier, prompt_cache_key=req.prompt_cache_key)
