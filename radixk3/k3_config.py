"""The native Kimi K3 config.json (`model_type: kimi_k3`) and the K3 presets.

The top level wraps the text model: `text_config` is a `kimi_linear` config carrying the K3 switches, and
`vision_config` describes a vision tower that radixk3 accepts but does not build. `hidden_size`, `vocab_size`
and `quantization_config` may be repeated at the top (forwarded from `text_config`); repeated sizes must agree.
"""

from __future__ import annotations

import json
from typing import Any

from radixk3.config import ConfigError, ModelConfig, VisionSpec, every_mla
from radixk3.hf_config import text_config_dict, text_config_fields

ARCHITECTURE = "KimiK3ForConditionalGeneration"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

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


def default_vision(text_hidden_size: int, media_placeholder_token_id: int | None) -> VisionSpec:
    """The `kimi_k3_vision` defaults as the reference lists them (carried only; never built)."""
    raw = {
        "model_type": "kimi_k3_vision", "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
        "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "num_attention_heads": 12,
        "num_hidden_layers": 27, "hidden_size": 1024, "intermediate_size": 4096, "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "qkv_hidden_size": 1536,
        "text_hidden_size": text_hidden_size,
    }
    return VisionSpec("kimi_k3_vision", json.dumps(raw, sort_keys=True), media_placeholder_token_id)


def kimi_k3_preset() -> ModelConfig:
    """The true K3 sizes, for memory plans only. Launch figures: 93 layers = 69 KDA + 24 MLA, 16 of 896 experts,
    2.8T parameters / 104B active; other sizes are the reference's hints (hidden 7168, latent 3584, 96 heads,
    q_lora 1536, moe_intermediate 3072); attn_res_block_size 12 gives the 8 blocks the native kernel allows."""
    kda, mla = every_mla(93, [*range(4, 93, 4), 93])
    return ModelConfig(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, kda_layers=kda, mla_layers=mla,
        kda_num_heads=96, kda_head_dim=128, conv_kernel_size=4,
        num_attention_heads=96, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=18432, moe_intermediate_size=3072, num_experts=896,
        num_experts_per_token=16, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        rms_norm_eps=1e-6,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, dtype="bfloat16", model_type="kimi_k3",
        kda_full_rank_gate=True, kda_gate_lower_bound=-5.0, mla_use_output_gate=True, attn_res_block_size=12,
        routed_expert_hidden_size=3584, latent_moe_use_norm=True, hidden_act="situ", activation_situ_beta=1.0,
        num_nextn_predict_layers=1, vision=default_vision(7168, 163605),
    )


def k3_tiny_native_preset() -> ModelConfig:
    """Every K3 feature on at test size: k3-tiny's 4 layers (MLA at 1-based 2 and 4), AttnRes blocks of 3 (the
    second one partial), LatentMoE with norm, SiTU with both betas, one MTP layer."""
    kda, mla = every_mla(4, [2, 4])
    return ModelConfig(
        vocab_size=4096, hidden_size=64, num_hidden_layers=4, kda_layers=kda, mla_layers=mla,
        kda_num_heads=2, kda_head_dim=32, conv_kernel_size=4,
        num_attention_heads=2, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        num_expert_group=2, topk_group=1, rms_norm_eps=1e-6,
        model_type="kimi_k3", kda_full_rank_gate=True, kda_gate_lower_bound=-5.0, mla_use_output_gate=True,
        attn_res_block_size=3, routed_expert_hidden_size=32, latent_moe_use_norm=True, hidden_act="situ",
        activation_situ_beta=2.0, activation_situ_linear_beta=4.0, num_nextn_predict_layers=1,
        vision=default_vision(64, 4095),
    )
