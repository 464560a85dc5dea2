"""A `ModelConfig` from a checkpoint's config.json and back, in the checkpoint's format: `model_type`
`kimi_k3` is native K3 (`k3_config`), anything else the flat Kimi-Linear format (`hf_config`).

Above both format modules and `config` (which they build on), so that no import cycles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixk3.config import ModelConfig, read_config_json
from radixk3.hf_config import text_config_dict, text_config_fields
from radixk3.k3_config import k3_config_dict, parse_kimi_k3
from radixk3.quant_format import parse_quantization_config


def model_config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of `cfg`'s checkpoint format (transformers loads the Kimi-Linear one too)."""
    out = k3_config_dict(cfg) if cfg.is_k3_format else text_config_dict(cfg, all_switches=False)
    if cfg.expert_quant is not None:
        out["quantization_config"] = cfg.expert_quant.quantization_config()
    return out


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """`quantization_config` is read at the top, or in a K3 `text_config` that carries it."""
    cfg = parse_kimi_k3(raw) if raw.get("model_type") == "kimi_k3" else ModelConfig(**text_config_fields(raw, k3=False))
    text = raw.get("text_config")
    quant = raw.get("quantization_config", text.get("quantization_config") if isinstance(text, dict) else None)
    expert_quant = parse_quantization_config(quant, cfg.dtype)
    return cfg if expert_quant is None else cfg.replace(expert_quant=expert_quant)


def load_model_config(path: str | Path) -> ModelConfig:
    """The config of the checkpoint at `path` (its directory or its config.json)."""
    return model_config_from_dict(read_config_json(path))
