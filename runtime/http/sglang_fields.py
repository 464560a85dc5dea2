"""SGLang's request fields that radixk3 knows but does not serve: accepted at their default, refused otherwise.

SGLang's clients (its frontend, `bench_serving`, sglang-router) send many of SGLang's request fields on every
request at their default values. Each route's request model declares the fields radixk3 serves; the fields of
SGLang 0.5.23's schemas that it does not serve are listed here, each with SGLang's default. A declined field
sent at a value that asks for nothing (null, false, an empty string, list or object, or SGLang's default) is
dropped before the request is validated; at any other value the request is a 400 naming the field, so that no
feature asked for is silently ignored. A name in no SGLang schema stays an unknown field (400).

The tables are enumerable: a route's SGLang fields are its model's fields plus its table here
(tests/runtime/test_http_sglang_fields.py checks that against the installed sglang).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from pydantic import BaseModel, ConfigDict, model_validator

from runtime.http.api_errors import bad_request


@dataclass(frozen=True)
class Declined:
    """An SGLang feature radixk3 does not serve: the field's SGLang default, and what the feature is."""

    default: Any
    feature: str


def _declined(default: Any, feature: str, *names: str) -> dict[str, Declined]:
    return {name: Declined(default, feature) for name in names}


# Fields of SGLang's /generate (GenerateReqInput) and of its OpenAI requests alike.
_COMMON = (
    _declined(None, "routing to a data-parallel rank", "routed_dp_rank", "data_parallel_rank",
                "disagg_prefill_dp_rank")
    | _declined(False, "returning hidden states", "return_hidden_states")
    | _declined(False, "returning the routed experts", "return_routed_experts")
    | _declined(0, "returning the routed experts", "routed_experts_start_len")
    | _declined(None, "sessions", "session_id", "session_params")
    | _declined(None, "LoRA adapters", "lora_path")
    | _declined(None, "custom logit processors", "custom_logit_processor")
    | _declined(None, "watermarking", "watermark")
    | _declined(None, "multimodal inputs", "images_config", "mm_processor_kwargs")
    | _declined(None, "cache namespaces", "extra_key", "cache_salt")
    | _declined(None, "request priorities", "priority")
    | _declined(None, "custom metric labels", "custom_labels")
)

GENERATE_DECLINED: Mapping[str, Declined] = (
    _COMMON
    | _declined(None, "input embeddings", "input_embeds", "positional_embed_overrides")
    | _declined(None, "multimodal inputs", "video_data", "audio_data", "mm_hashes",
                "mm_content_hashes", "video_config", "modalities", "need_wait_for_mm_inputs", "num_items_assigned",
                "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
                "video_max_dynamic_patch")
    | _declined(False, "multimodal inputs", "use_audio_in_video")
    | _declined(None, "logprobs of chosen token ids", "token_ids_logprob")
    | _declined(None, "returning the sampling mask", "return_sampling_mask", "sampling_logprobs_mode")
    | _declined(False, "flat raw top logprobs", "return_flat_raw_top_logprobs",
                "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64")
    | _declined(False, "returning the indexer's top-k", "return_indexer_topk")
    | _declined(None, "LoRA adapters", "lora_id")
    | _declined(None, "prefill-decode disaggregation", "bootstrap_pair_key", "decode_tp_size")
    | _declined(None, "routing keys", "routing_key")
    | _declined(None, "conversation tracking", "conversation_id")
    | _declined(None, "multi-tokenizer mode", "http_worker_ipc")
    | _declined(False, "background requests", "background")
    | _declined(False, "required reasoning", "require_reasoning")
    | _declined(None, "thinking budgets", "max_thinking_tokens")
    | _declined(False, "returning bytes (image generation)", "return_bytes")
    | _declined(False, "returning the entropy", "return_entropy")
    | _declined(False, "returning the prompt's token ids", "return_prompt_token_ids")
    | _declined(None, "trace propagation", "external_trace_header")
    | _declined(None, "the caller's receive time", "received_time")
    | _declined(None, "multi-item scoring", "multi_item_delimiter_indices", "token_indices_to_pool")
    | _declined(None, "KV hints", "kv_hints")
)

_OPENAI = (
    _COMMON
    | _declined(False, "cache token details", "return_cached_tokens_details")
    | _declined(False, "speculative token details", "return_spec_tokens_details")
    | _declined(False, "returning token ids", "return_token_ids")
    | _declined(None, "custom parameters", "custom_params")
)

COMPLETION_DECLINED: Mapping[str, Declined] = _OPENAI

CHAT_DECLINED: Mapping[str, Declined] = (
    _OPENAI
    | _declined(False, "returning the prompt's token ids", "return_prompt_token_ids")
    | _declined(False, "returning meta info", "return_meta_info")
    | _declined(False, "returning ids in sglext", "return_input_ids_in_sglext", "return_output_ids_in_sglext")
    | _declined(False, "returning the sampling mask", "return_sampling_mask")
    | _declined(None, "returning the sampling mask", "sampling_logprobs_mode")
    | _declined(False, "flat raw top logprobs", "return_flat_raw_output_top_logprobs")
    | _declined(True, "flat raw top logprobs", "return_flat_raw_top_logprobs_b64")
    | _declined(None, "SGLang's thinking parameter (use chat_template_kwargs)", "thinking")
    | _declined(None, "task hints", "task")
    | _declined(None, "multimodal inputs", "max_dynamic_patch", "min_dynamic_patch", "video_config")
    | _declined(False, "multimodal inputs", "use_audio_in_video")
    | _declined(None, "prompt token ids in place of messages", "input_ids")
)


def asks_nothing(value: Any, default: Any) -> bool:
    """`value` asks for nothing: null, false, empty, or the field's default (compared within its own type, so
    that `1` is not taken for `true`)."""
    if value is None or value is False or (isinstance(value, str | list | dict) and not value):
        return True
    return type(value) is type(default) and value == default


def drop_declined(body: Any, table: Mapping[str, Declined]) -> Any:
    """The request body without its declined fields that ask for nothing; a declined field that asks for its
    feature is a 400 naming it. For a request model's `mode="before"` validator: an APIError is no ValueError,
    so pydantic lets it through to the error handler as it is (param and all); anything else is left for the
    model to validate."""
    if not isinstance(body, dict):
        return body
    for name, value in body.items():
        if (rule := table.get(name)) is not None and not asks_nothing(value, rule.default):
            raise bad_request(f"{name}: this server does not support {rule.feature} (send {name} at its default, "
                              f"{orjson.dumps(rule.default).decode()}, or leave it out)", name)
    return {k: v for k, v in body.items() if k not in table}


class DeclinesSGLangFields(BaseModel):
    """A strict request model that knows the SGLang fields of `declined` it does not serve (`drop_declined`)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    declined: ClassVar[Mapping[str, Declined]] = {}

    @model_validator(mode="before")
    @classmethod
    def _declined(cls, data: Any) -> Any:  # noqa: ANN401
        return drop_declined(data, cls.declined)
