"""The flat `kimi_linear` config.json: the public Kimi-Linear format, and the `text_config` of native K3.

Keys we read, keys we accept and ignore (they do not change the math), everything else is a `ConfigError` that
names the key. The K3 switches are ordinary keys of this config (vLLM's `KimiLinearConfig` has them all).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixk3.config import ConfigError, ModelConfig


def text_config_dict(cfg: ModelConfig, *, all_switches: bool) -> dict[str, Any]:
    """The flat `kimi_linear` config: the whole Kimi-Linear config.json, or K3's `text_config`.

    With `all_switches` False (the public format) a K3 switch is written only when it is on, so that a
    Kimi-Linear model's config.json stays exactly the public one.
    """
    out: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": cfg.moe_renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "use_grouped_topk": True,
        "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": cfg.dtype,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in cfg.kda_layers],
            "full_attn_layers": [i + 1 for i in cfg.mla_layers],
            "num_heads": cfg.kda_num_heads,
            "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.conv_kernel_size,
        },
    }
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for key, field in _TEXT_SWITCHES.items():
        if all_switches or getattr(cfg, field) != defaults[field]:
            out[key] = getattr(cfg, field)
    for key, field in _LINEAR_ATTN_SWITCHES.items():
        if all_switches or getattr(cfg, field) != defaults[field]:
            out["linear_attn_config"][key] = getattr(cfg, field)
    return out


# config.json key -> ModelConfig field, for the K3 switches.
_TEXT_SWITCHES = {
    "mla_use_output_gate": "mla_use_output_gate",
    "attn_res_block_size": "attn_res_block_size",
    "routed_expert_hidden_size": "routed_expert_hidden_size",
    "latent_moe_use_norm": "latent_moe_use_norm",
    "activation_situ_beta": "activation_situ_beta",
    "activation_situ_linear_beta": "activation_situ_linear_beta",
}
_LINEAR_ATTN_SWITCHES = {"use_full_rank_gate": "kda_full_rank_gate", "gate_lower_bound": "kda_gate_lower_bound"}

_READ_KEYS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
    "num_experts", "num_experts_per_token", "num_shared_experts", "routed_scaling_factor", "moe_renormalize",
    "first_k_dense_replace", "moe_layer_freq", "num_expert_group", "topk_group", "rms_norm_eps",
    "num_nextn_predict_layers", "hidden_act", *_TEXT_SWITCHES,
}
_IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "model_max_length", "max_position_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "initializer_range", "use_cache",
    "attention_dropout", "attention_bias", "pretraining_tp", "output_router_logits", "num_key_value_heads",
    "tie_word_embeddings", "use_grouped_topk", "topk_method", "moe_router_activation_func", "mla_use_nope",
    "dtype", "torch_dtype", "model_type", "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id",
    "linear_attn_config", "router_aux_loss_coef", "layer_types", "mlp_layer_types", "scoring_func",
    "norm_topk_prob", "num_experts_per_tok", "n_group", "n_shared_experts", "num_local_experts", "name_or_path",
    "_name_or_path",
}
_LINEAR_ATTN_KEYS = {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
                     *_LINEAR_ATTN_SWITCHES}


def _get(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ..., where: str = "") -> Any:
    name = f"{where}{key}"
    if key not in raw:
        if default is ...:
            raise ConfigError(f"missing required key {name!r}")
        return default
    value = raw[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"{name} must be {kind}, got {value!r}")
    if float in kinds and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise ConfigError(f"{name} must be {kind}, got {value!r}")
    return value


_NONE = type(None)


def text_config_fields(raw: dict[str, Any], *, k3: bool) -> dict[str, Any]:
    """ModelConfig fields from a flat `kimi_linear` config: the public config.json, or with `k3` K3's
    `text_config` (errors then name keys as `text_config.KEY`). The 1-based `kda_layers` decide the layer types:
    every other layer is MLA (vLLM never consults `full_attn_layers`, only checks that it is a layer list)."""
    where = "text_config." if k3 else ""
    model_type = raw.get("model_type")
    if model_type != "kimi_linear":
        raise ConfigError(f"{where}model_type must be 'kimi_linear' (or 'kimi_k3' at the top), got {model_type!r}")
    unknown = set(raw) - _IGNORED_KEYS - _READ_KEYS
    if unknown:
        raise ConfigError(f"unknown config key(s): {sorted(where + k for k in unknown)}")
    if raw.get("mla_use_nope", True) is not True:
        raise ConfigError(f"{where}mla_use_nope must be true: Kimi MLA layers use no rotary embedding")
    if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{where}moe_router_activation_func {raw['moe_router_activation_func']!r} is not 'sigmoid'")
    if raw.get("tie_word_embeddings", False):
        raise ConfigError(f"{where}tie_word_embeddings must be false for Kimi checkpoints")
    lac = _get(raw, "linear_attn_config", dict, where=where)
    unknown_lac = set(lac) - _LINEAR_ATTN_KEYS
    if unknown_lac:
        raise ConfigError(f"unknown key(s) in {where}linear_attn_config: {sorted(unknown_lac)}")
    n_layers = _get(raw, "num_hidden_layers", int, where=where)
    w = f"{where}linear_attn_config."
    kda_1 = _get(lac, "kda_layers", list, where=w)
    mla_1 = _get(lac, "full_attn_layers", list, where=w)
    for key, lst in (("kda_layers", kda_1), ("full_attn_layers", mla_1)):
        bad = [i for i in lst if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n_layers]
        if bad:
            raise ConfigError(f"{w}{key} holds {bad}: entries are 1-based layer numbers in 1..{n_layers}")
    kda = tuple(sorted(i - 1 for i in kda_1))
    mla = tuple(i for i in range(n_layers) if i not in kda) if k3 else tuple(sorted(i - 1 for i in mla_1))
    dtype = raw.get("torch_dtype", raw.get("dtype", "bfloat16"))
    eos = raw.get("eos_token_id", 3)
    if isinstance(eos, list):
        eos = eos[0]
    v_head_dim = raw.get("v_head_dim")
    rms_eps = _get(raw, "rms_norm_eps", float, 1e-5, where=where)
    fields: dict[str, Any] = dict(
        vocab_size=_get(raw, "vocab_size", int, where=where),
        hidden_size=_get(raw, "hidden_size", int, where=where),
        num_hidden_layers=n_layers,
        kda_layers=kda,
        mla_layers=mla,
        kda_num_heads=_get(lac, "num_heads", int, where=w),
        kda_head_dim=_get(lac, "head_dim", int, where=w),
        conv_kernel_size=_get(lac, "short_conv_kernel_size", int, 4, where=w),
        num_attention_heads=_get(raw, "num_attention_heads", int, where=where),
        kv_lora_rank=_get(raw, "kv_lora_rank", int, where=where),
        q_lora_rank=_get(raw, "q_lora_rank", (int, _NONE), None, where=where),
        qk_nope_head_dim=_get(raw, "qk_nope_head_dim", int, where=where),
        qk_rope_head_dim=_get(raw, "qk_rope_head_dim", int, where=where),
        v_head_dim=v_head_dim if isinstance(v_head_dim, int) else _get(raw, "qk_nope_head_dim", int, where=where),
        intermediate_size=_get(raw, "intermediate_size", int, where=where),
        moe_intermediate_size=_get(raw, "moe_intermediate_size", int, where=where),
        num_experts=_get(raw, "num_experts", int, raw.get("num_local_experts", ...), where=where),
        num_experts_per_token=_get(raw, "num_experts_per_token", int, raw.get("num_experts_per_tok", ...),
                                   where=where),
        num_shared_experts=_get(raw, "num_shared_experts", int, raw.get("n_shared_experts", 0), where=where),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, 1.0, where=where),
        moe_renormalize=_get(raw, "moe_renormalize", bool, True, where=where),
        first_k_dense_replace=_get(raw, "first_k_dense_replace", int, 0, where=where),
        moe_layer_freq=_get(raw, "moe_layer_freq", int, 1, where=where),
        num_expert_group=_get(raw, "num_expert_group", int, raw.get("n_group", 1), where=where),
        topk_group=_get(raw, "topk_group", int, 1, where=where),
        rms_norm_eps=rms_eps,
        bos_token_id=raw.get("bos_token_id", 2),
        eos_token_id=eos,
        pad_token_id=raw.get("pad_token_id", 0),
        dtype=dtype,
        kda_full_rank_gate=_get(lac, "use_full_rank_gate", bool, False, where=w),
        kda_gate_lower_bound=_get(lac, "gate_lower_bound", (float, _NONE), None, where=w),
        mla_use_output_gate=_get(raw, "mla_use_output_gate", bool, False, where=where),
        attn_res_block_size=_get(raw, "attn_res_block_size", (int, _NONE), None, where=where),
        routed_expert_hidden_size=_get(raw, "routed_expert_hidden_size", (int, _NONE), None, where=where),
        latent_moe_use_norm=_get(raw, "latent_moe_use_norm", bool, False, where=where),
        hidden_act=_get(raw, "hidden_act", str, "silu", where=where),
        activation_situ_beta=_get(raw, "activation_situ_beta", (float, _NONE), None, where=where),
        activation_situ_linear_beta=_get(raw, "activation_situ_linear_beta", (float, _NONE), None, where=where),
        num_nextn_predict_layers=_get(raw, "num_nextn_predict_layers", int, 0, where=where),
    )
    if k3:
        fields["model_type"] = "kimi_k3"
    return fields
