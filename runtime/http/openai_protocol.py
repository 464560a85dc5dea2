"""Pydantic models of the OpenAI-compatible API (requests strictly typed, responses as OpenAI shapes them).

Requests are strict: a string is not an integer, 2.7 is not an integer, unknown fields are refused by name,
non-finite floats are refused. Ranges of the sampling parameters are the engine's to check
(`runtime.sampling_params`), so that the native and the OpenAI routes refuse the same values the same way.
The fields beyond OpenAI's (`top_k`, `min_p`, ...) are SGLang's extras, sent with the client's `extra_body`;
every field of SGLang's CompletionRequest and ChatCompletionRequest is known: the ones served are declared here,
the others are declined by `runtime.http.sglang_fields` (accepted at their default, a 400 naming them otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from runtime.grammar import ANY_JSON
from runtime.http.api_errors import bad_request
from runtime.http.pd_fields import BootstrapFields
from runtime.http.sglang_fields import CHAT_DECLINED, COMPLETION_DECLINED, Declined, DeclinesSGLangFields


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingFields(DeclinesSGLangFields):

    # OpenAI requires it; SGLang does not, and takes a request without one for its served model ("default").
    model: StrictStr = "default"
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop = None
    seed: StrictInt | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, float] | None = None
    # SGLang's extras.
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    rid: NonEmptyStr | None = None
    regex: StrictStr | None = None  # structured output, as SGLang's extras (OpenAI's is response_format)
    ebnf: StrictStr | None = None
    json_schema: StrictStr | None = None
    stop_regex: Stop = None
    no_stop_trim: StrictBool = False

    @model_validator(mode="after")
    def _refusals(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        """The engine's sampling parameters; unset fields keep the engine's defaults."""
        sp: dict[str, Any] = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "max_new_tokens": max_new_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "regex": self.regex, "ebnf": self.ebnf, "json_schema": self.json_schema,
            "stop_regex": [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex,
            # the engine's defaults, which stay unsent
            "no_stop_trim": self.no_stop_trim or None, "logit_bias": self.logit_bias or None,
        }
        return {k: v for k, v in sp.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class CompletionRequest(_SamplingFields, BootstrapFields):
    declined: ClassVar[Mapping[str, Declined]] = COMPLETION_DECLINED

    prompt: NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr], Field(min_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False  # the prompt before the completion, in text and (with logprobs) in the logprobs
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _completion_refusals(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ValueError("logprobs must be in [0, 5]")
        return self

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        sp = super().sampling(max_new_tokens)
        return sp | (self.response_format.grammar() if self.response_format is not None else {})

    def prompts(self) -> list[str] | list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Strict):
    url: StrictStr  # a data: URL (or base64), or an http(s) URL the server fetches with --allow-image-urls
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the tower sees the processed image either way


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: NonEmptyStr
    arguments: StrictStr  # a JSON object, as OpenAI sends it


class ToolCallIn(_Strict):
    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: NonEmptyStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: NonEmptyStr | None = None
    reasoning_content: StrictStr | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool messages, and only they, carry a tool_call_id")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, TextPart))

    def image_urls(self) -> list[tuple[int, str]]:
        """(content part index, URL) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, p.image_url.url) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]

    @property
    def is_k3(self) -> bool:
        """Needs K3's markup to render (a tool call or its result, or earlier reasoning)."""
        return self.role == "tool" or bool(self.tool_calls) or self.reasoning_content is not None


ToolName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDef(_Strict):
    name: ToolName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: ToolName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "max"]


class JsonSchemaFormat(_Strict):
    name: NonEmptyStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none given: any JSON
    strict: StrictBool | None = None  # the output always follows the schema: strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self

    def grammar(self) -> dict[str, Any]:
        """The engine's sampling parameter for it: any JSON (json_object) or the schema."""
        if self.type == "text":
            return {}
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return {"json_schema": ANY_JSON if schema is None else schema}


class ChatCompletionRequest(_SamplingFields, BootstrapFields):
    declined: ClassVar[Mapping[str, Declined]] = CHAT_DECLINED

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    reasoning_effort: ReasoningEffort | None = None
    # SGLang's and vLLM's for K3: {"thinking": bool} (alias enable_thinking), {"thinking_effort": "low"|"high"|"max"};
    # any variables for a Jinja chat template.
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: the reply continues the final (assistant) message, which stays open; the reasoning in its own
    # field (false: back in the content), streamed as it comes (false: all of it with the last chunk).
    continue_final_message: StrictBool = False
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True

    @model_validator(mode="after")
    def _chat_refusals(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            # an APIError, not a ValueError: pydantic passes it on as it is, with the field named
            raise bad_request("continue_final_message needs the final message to be the assistant's",
                              "continue_final_message")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs=true")
            if not 0 <= self.top_logprobs <= 20:
                raise ValueError("top_logprobs must be in [0, 20]")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not"
                             " in tools")

    def k3_template_kwargs_problem(self) -> str | None:
        """What K3's renderer cannot take in `chat_template_kwargs` (a Jinja template takes any keys)."""
        kw = self.chat_template_kwargs or {}
        unknown = sorted(set(kw) - {"thinking", "enable_thinking", "thinking_effort"})
        if unknown:
            return (f"chat_template_kwargs: unsupported keys {unknown}; supported: thinking, enable_thinking, "
                    "thinking_effort")
        if any(not isinstance(v, bool) for k, v in kw.items() if k != "thinking_effort"):
            return "chat_template_kwargs: thinking must be a boolean"
        if "thinking_effort" in kw and not isinstance(kw["thinking_effort"], str):
            return "chat_template_kwargs: thinking_effort must be a string"
        return None

    @property
    def tools_on(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def is_k3(self) -> bool:
        """Rendered with K3's markup and parsed for reasoning and tool calls; else the plain Kimi template."""
        return (self.tools_on or self.reasoning_effort is not None or bool(self.chat_template_kwargs)
                or any(m.is_k3 for m in self.messages))

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        sp = super().sampling(max_new_tokens)
        return sp | (self.response_format.grammar() if self.response_format is not None else {})


# --- responses ------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixk3"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
