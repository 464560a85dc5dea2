"""Typed model config, read from a Hugging Face `config.json` of `model_type: kimi_linear`, plus presets.

Layer lists in the checkpoint are 1-based (`linear_attn_config.kda_layers` / `full_attn_layers`); here they are
kept 0-based. Every unknown or inconsistent value is a `ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class ConfigError(ValueError):
    """A config.json value is missing, unknown or inconsistent; the message names the key."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    kda_layers: tuple[int, ...]  # 0-based
    mla_layers: tuple[int, ...]  # 0-based
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    # MLA (NoPE)
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    routed_scaling_factor: float
    moe_renormalize: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    rms_norm_eps: float = 1e-5
    # Moonshot's code builds kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
    kv_a_layernorm_eps: float = 1e-6
    bos_token_id: int = 2
    eos_token_id: int = 3
    pad_token_id: int = 0
    dtype: str = "float32"
    model_type: str = "kimi_linear"

    def __post_init__(self) -> None:
        layers = sorted(self.kda_layers + self.mla_layers)
        if layers != list(range(self.num_hidden_layers)):
            raise ConfigError(
                "linear_attn_config.kda_layers/full_attn_layers must partition layers 1.."
                f"{self.num_hidden_layers} (1-based); got kda={[i + 1 for i in self.kda_layers]} "
                f"full_attn={[i + 1 for i in self.mla_layers]}"
            )
        positive = ("vocab_size", "hidden_size", "kda_num_heads", "kda_head_dim", "conv_kernel_size",
                    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                    "num_experts_per_token")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim < 0:
            raise ConfigError(f"qk_rope_head_dim must be >= 0, got {self.qk_rope_head_dim}")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token ({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})"
            )
        if self.num_expert_group < 1 or self.num_experts % self.num_expert_group:
            raise ConfigError(f"num_expert_group ({self.num_expert_group}) must divide num_experts")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ConfigError(f"topk_group ({self.topk_group}) must be in 1..num_expert_group")
        if self.moe_layer_freq < 1:
            raise ConfigError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"torch_dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")

    # Derived sizes (cheap properties so that they can never disagree with the fields).
    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_dim(self) -> int:
        """Latent KV values per token per MLA layer: c_kv plus the shared (unrotated) k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv state: q, k and v projections concatenated."""
        return 3 * self.kda_proj_dim

    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # --- config.json -----------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that the public Kimi-Linear checkpoints use (transformers loads it too)."""
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": True,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "num_nextn_predict_layers": 0,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size,
            },
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse_kimi_linear(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"config.json not found at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(raw)


# Keys we read, keys we accept and ignore (they do not change the math), everything else is an error.
_IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "model_max_length", "max_position_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "initializer_range", "use_cache",
    "attention_dropout", "attention_bias", "pretraining_tp", "output_router_logits", "num_key_value_heads",
    "tie_word_embeddings", "hidden_act", "use_grouped_topk", "topk_method", "num_nextn_predict_layers",
    "moe_router_activation_func", "mla_use_nope", "dtype", "torch_dtype", "model_type", "quantization_config",
    "bos_token_id", "eos_token_id", "pad_token_id", "linear_attn_config", "router_aux_loss_coef",
    "layer_types", "mlp_layer_types", "scoring_func", "norm_topk_prob", "num_experts_per_tok", "n_group",
    "n_shared_experts", "num_local_experts", "mla_use_output_gate", "name_or_path", "_name_or_path",
}
_LINEAR_ATTN_KEYS = {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"}


def _get(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ..., where: str = "") -> Any:
    name = f"{where}{key}"
    if key not in raw:
        if default is ...:
            raise ConfigError(f"missing required key {name!r}")
        return default
    value = raw[key]
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else ()):
        raise ConfigError(f"{name} must be {kind}, got {value!r}")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise ConfigError(f"{name} must be {kind}, got {value!r}")
    return value


def _parse_kimi_linear(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type != "kimi_linear":
        raise ConfigError(f"model_type must be 'kimi_linear', got {model_type!r}")
    unknown = set(raw) - _IGNORED_KEYS - {f.name for f in dataclasses.fields(ModelConfig)} - {"dtype"}
    if unknown:
        raise ConfigError(f"unknown config key(s): {sorted(unknown)}")
    if raw.get("mla_use_nope", True) is not True:
        raise ConfigError("mla_use_nope must be true: Kimi MLA layers use no rotary embedding")
    if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"moe_router_activation_func {raw['moe_router_activation_func']!r} is not 'sigmoid'")
    if raw.get("tie_word_embeddings", False):
        raise ConfigError("tie_word_embeddings must be false for Kimi checkpoints")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("num_nextn_predict_layers", 0):
        raise ConfigError("num_nextn_predict_layers > 0 (MTP) is not supported in the kimi_linear format")
    if raw.get("quantization_config") is not None:
        raise ConfigError("quantization_config: quantised checkpoints are not supported yet")
    lac = _get(raw, "linear_attn_config", dict)
    unknown_lac = set(lac) - _LINEAR_ATTN_KEYS
    if unknown_lac:
        raise ConfigError(f"unknown key(s) in linear_attn_config: {sorted(unknown_lac)}")
    n_layers = _get(raw, "num_hidden_layers", int)
    w = "linear_attn_config."
    kda_1 = _get(lac, "kda_layers", list, where=w)
    mla_1 = _get(lac, "full_attn_layers", list, where=w)
    for key, lst in (("kda_layers", kda_1), ("full_attn_layers", mla_1)):
        bad = [i for i in lst if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n_layers]
        if bad:
            raise ConfigError(f"{w}{key} holds {bad}: entries are 1-based layer numbers in 1..{n_layers}")
    dtype = raw.get("torch_dtype", raw.get("dtype", "bfloat16"))
    eos = raw.get("eos_token_id", 3)
    if isinstance(eos, list):
        eos = eos[0]
    v_head_dim = raw.get("v_head_dim")
    return ModelConfig(
        vocab_size=_get(raw, "vocab_size", int),
        hidden_size=_get(raw, "hidden_size", int),
        num_hidden_layers=n_layers,
        kda_layers=tuple(sorted(i - 1 for i in kda_1)),
        mla_layers=tuple(sorted(i - 1 for i in mla_1)),
        kda_num_heads=_get(lac, "num_heads", int, where=w),
        kda_head_dim=_get(lac, "head_dim", int, where=w),
        conv_kernel_size=_get(lac, "short_conv_kernel_size", int, 4, where=w),
        num_attention_heads=_get(raw, "num_attention_heads", int),
        kv_lora_rank=_get(raw, "kv_lora_rank", int),
        q_lora_rank=_get(raw, "q_lora_rank", (int, type(None)), None),
        qk_nope_head_dim=_get(raw, "qk_nope_head_dim", int),
        qk_rope_head_dim=_get(raw, "qk_rope_head_dim", int),
        v_head_dim=v_head_dim if isinstance(v_head_dim, int) else _get(raw, "qk_nope_head_dim", int),
        intermediate_size=_get(raw, "intermediate_size", int),
        moe_intermediate_size=_get(raw, "moe_intermediate_size", int),
        num_experts=_get(raw, "num_experts", int, raw.get("num_local_experts", ...)),
        num_experts_per_token=_get(raw, "num_experts_per_token", int, raw.get("num_experts_per_tok", ...)),
        num_shared_experts=_get(raw, "num_shared_experts", int, raw.get("n_shared_experts", 0)),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, 1.0),
        moe_renormalize=_get(raw, "moe_renormalize", bool, True),
        first_k_dense_replace=_get(raw, "first_k_dense_replace", int, 0),
        moe_layer_freq=_get(raw, "moe_layer_freq", int, 1),
        num_expert_group=_get(raw, "num_expert_group", int, raw.get("n_group", 1)),
        topk_group=_get(raw, "topk_group", int, 1),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-5),
        bos_token_id=raw.get("bos_token_id", 2),
        eos_token_id=eos,
        pad_token_id=raw.get("pad_token_id", 0),
        dtype=dtype,
    )


# --- presets ---------------------------------------------------------------------------------------------


def _every(n_layers: int, mla_1based: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    mla = tuple(i - 1 for i in mla_1based)
    return tuple(i for i in range(n_layers) if i not in mla), mla


def _kimi_k3() -> ModelConfig:
    # Launch figures: 69 KDA + 24 MLA layers, 16 of 896 experts; hidden/heads as the vLLM hints give them.
    kda, mla = _every(93, [*range(4, 93, 4), 93])
    return ModelConfig(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, kda_layers=kda, mla_layers=mla,
        kda_num_heads=96, kda_head_dim=128, conv_kernel_size=4,
        num_attention_heads=96, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=18432, moe_intermediate_size=3072, num_experts=896,
        num_experts_per_token=16, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        rms_norm_eps=1e-6, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, dtype="bfloat16",
    )


def _kimi_linear_48b() -> ModelConfig:
    kda, mla = _every(27, [4, 8, 12, 16, 20, 24, 27])
    return ModelConfig(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, kda_layers=kda, mla_layers=mla,
        kda_num_heads=32, kda_head_dim=128, conv_kernel_size=4,
        num_attention_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=9216, moe_intermediate_size=1024, num_experts=256,
        num_experts_per_token=8, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        rms_norm_eps=1e-5, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, dtype="bfloat16",
    )


def _k3_small() -> ModelConfig:
    # Fixed by the design card so that benchmarks compare like with like.
    kda, mla = _every(8, [4, 8])
    return ModelConfig(
        vocab_size=4096, hidden_size=512, num_hidden_layers=8, kda_layers=kda, mla_layers=mla,
        kda_num_heads=8, kda_head_dim=64, conv_kernel_size=4,
        num_attention_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
        num_experts_per_token=4, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
    )


def _k3_tiny() -> ModelConfig:
    # Two of each layer type, MoE with two expert groups: small enough for fast tests, covers every path.
    kda, mla = _every(4, [2, 4])
    return ModelConfig(
        vocab_size=4096, hidden_size=64, num_hidden_layers=4, kda_layers=kda, mla_layers=mla,
        kda_num_heads=2, kda_head_dim=32, conv_kernel_size=4,
        num_attention_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        num_expert_group=2, topk_group=1,
    )


PRESETS = {
    "k3-tiny": _k3_tiny,
    "k3-small": _k3_small,
    "kimi-linear-48b": _kimi_linear_48b,
    "kimi-k3": _kimi_k3,
}
# True-size presets exist for memory plans only; never allocate their weights here.
TRUE_SIZE_PRESETS = frozenset({"kimi-linear-48b", "kimi-k3"})


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
