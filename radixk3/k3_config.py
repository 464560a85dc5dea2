"""The native Kimi K3 config.json (`model_type: kimi_k3`), read and written (`config_formats` dispatches here).

The top level wraps the text model: `text_config` is a `kimi_linear` config carrying the K3 switches, and
`vision_config` describes the vision tower (carried raw; `radixk3.vision` builds it). `hidden_size`, `vocab_size`
and `quantization_config` may be repeated at the top (forwarded from `text_config`); repeated sizes must agree.
"""

from __future__ import annotations

import json
from typing import Any

from radixk3.config import ConfigError, ModelConfig, VisionSpec
from radixk3.hf_config import text_config_dict, text_config_fields
from radixk3.vision.prompt import IMAGE_PLACEHOLDER

ARCHITECTURE = "KimiK3ForConditionalGeneration"

_TOP_KEYS = {
    "architectures", "model_type", "text_config", "vision_config", "ignore_index", "media_placeholder_token_id",
    "pad_token_id", "bos_token_id", "eos_token_id", "image_placeholder", "quantization_config", "hidden_size",
    "vocab_size", "torch_dtype", "dtype", "transformers_version", "auto_map", "tie_word_embeddings", "use_cache",
    "name_or_path", "_name_or_path", "initializer_range",
}
_FORWARDED = ("hidden_size", "vocab_size")


def parse_kimi_k3(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("model_type") != "kimi_k3":
        raise ConfigError(f"model_type must be 'kimi_k3', got {raw.get('model_type')!r}")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown config key(s): {sorted(unknown)}")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be an object, got {text!r}")
    text = dict(text)
    text.setdefault("model_type", "kimi_linear")
    for key in _FORWARDED:
        if key in raw and key in text and raw[key] != text[key]:
            raise ConfigError(f"{key} {raw[key]} at the top disagrees with text_config.{key} {text[key]}")
        if key in raw:
            text.setdefault(key, raw[key])
    for key in ("torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in raw:
            text.setdefault(key, raw[key])
    fields = text_config_fields(text, k3=True)
    vision_raw = raw.get("vision_config")
    vision = None
    if vision_raw is not None:
        if not isinstance(vision_raw, dict):
            raise ConfigError(f"vision_config must be an object, got {vision_raw!r}")
        placeholder = raw.get("media_placeholder_token_id")
        if placeholder is not None and (isinstance(placeholder, bool) or not isinstance(placeholder, int)):
            raise ConfigError(f"media_placeholder_token_id must be an int, got {placeholder!r}")
        vision = VisionSpec(
            model_type=str(vision_raw.get("model_type", "kimi_k3_vision")),
            config_json=json.dumps(vision_raw, sort_keys=True),
            media_placeholder_token_id=placeholder,
        )
    return ModelConfig(**fields, vision=vision)


def k3_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The nested config.json of a native K3 checkpoint."""
    text = text_config_dict(cfg, all_switches=True)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "kimi_k3",
        "text_config": text,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "ignore_index": -100,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": cfg.dtype,
    }
    if cfg.vision is not None:
        out["vision_config"] = json.loads(cfg.vision.config_json)
        out["image_placeholder"] = IMAGE_PLACEHOLDER
        if cfg.vision.media_placeholder_token_id is not None:
            out["media_placeholder_token_id"] = cfg.vision.media_placeholder_token_id
    return out
