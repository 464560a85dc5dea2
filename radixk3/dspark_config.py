"""K3's DSpark drafter config (`model_type: k3_dspark`, a subset of DeepseekV3Config), and its tiny preset.

The drafter is a separate checkpoint tied to one target: `target_layer_ids` (0-based) name the target layers
whose output states (AttnRes partial sums, or the residual stream) feed `context_proj`, and the embedding and
lm_head are the target's (so `hidden_size` and `vocab_size` must match it: `check_target`). The switches the
reference requires off (`mla_use_nope`, `mla_use_output_gate`, `mla_use_qk_norm`, `dspark_bonus_anchor`) and
the ones not built here (`enable_confidence_head`, `sample_from_anchor=False`) are refused with a ConfigError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixk3.config import ConfigError, ModelConfig, read_config_json

MODEL_TYPE = "k3_dspark"
ARCHITECTURE = "K3DSparkModel"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Keys a DeepseekV3-style config.json may carry that do not change this model (accepted and dropped).
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "initializer_range", "use_cache", "tie_word_embeddings",
    "attention_bias", "attention_dropout", "hidden_act", "pretraining_tp", "parallel_drafting", "auto_map",
    "name_or_path", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
    "rope_scaling",
}
# Must be False: the reference refuses them for DSpark.
_MUST_BE_FALSE = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor")


@dataclass(frozen=True)
class DSparkConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int  # draft layers: dense MLA (RoPE, q-LoRA, no gate) + MLP
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]  # 0-based: the aux state after target layer i
    num_target_layers: int
    target_hidden_size: int
    draft_vocab_size: int
    markov_rank: int
    dspark_noise_token_id: int
    block_size: int = 4  # N: query tokens per pass (anchor + N-1 noise), N drafts
    rope_theta: float = 50000.0
    rms_norm_eps: float = 1e-6
    sample_from_anchor: bool = True
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    mla_use_qk_norm: bool = False
    dspark_bonus_anchor: bool = False
    enable_confidence_head: bool = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
                     "num_target_layers", "target_hidden_size", "markov_rank", "block_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ConfigError(f"target_layer_ids {list(self.target_layer_ids)} must be distinct, in "
                              f"0..{self.num_target_layers - 1} (0-based)")
        if self.draft_vocab_size != self.vocab_size:
            raise ConfigError(f"draft_vocab_size ({self.draft_vocab_size}) must equal vocab_size ({self.vocab_size})")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ConfigError(f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        for name in _MUST_BE_FALSE:
            if getattr(self, name):
                raise ConfigError(f"{name} must be False for DSpark (the reference refuses it)")
        if not self.sample_from_anchor:
            raise ConfigError("sample_from_anchor=False is not supported: the first draft comes from the anchor")
        if self.enable_confidence_head:
            raise ConfigError("enable_confidence_head is not supported (no adaptive verification)")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"torch_dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")

    @property
    def kv_dim(self) -> int:
        """Context latent per position per draft layer: normed c_kv | rotated k_pe (the MLA cache row)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def aux_dim(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def replace(self, **changes: Any) -> DSparkConfig:
        return dataclasses.replace(self, **changes)

    def check_target(self, target: ModelConfig) -> None:
        """This drafter reads `target`'s states and aliases its embedding and lm_head: sizes must agree."""
        pairs = (("num_target_layers", self.num_target_layers, target.num_hidden_layers),
                 ("target_hidden_size", self.target_hidden_size, target.hidden_size),
                 ("hidden_size", self.hidden_size, target.hidden_size),
                 ("vocab_size", self.vocab_size, target.vocab_size))
        for name, mine, theirs in pairs:
            if mine != theirs:
                raise ConfigError(f"DSpark {name} {mine} does not match the target's {theirs}")

    # --- config.json -----------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out["torch_dtype" if f.name == "dtype" else f.name] = list(v) if isinstance(v, tuple) else v
        out["parallel_drafting"] = True
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DSparkConfig:
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"model_type must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
        if raw.get("rope_scaling") is not None:
            raise ConfigError("rope_scaling is not supported for DSpark (plain RoPE at rope_theta)")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r}: DSpark's MLP is SwiGLU ('silu')")
        names = {f.name for f in dataclasses.fields(cls)}
        fields: dict[str, Any] = {}
        for key, value in raw.items():
            name = "dtype" if key in ("torch_dtype", "dtype") else key
            if name in names:
                fields[name] = tuple(value) if name == "target_layer_ids" else value
            elif key not in _IGNORED_KEYS:
                raise ConfigError(f"unknown DSpark config key {key!r}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in fields]
        if missing:
            raise ConfigError(f"DSpark config needs {missing}")
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> DSparkConfig:
        return cls.from_hf_dict(read_config_json(path))


def k3_tiny_dspark_preset() -> DSparkConfig:
    """The drafter of the `k3-tiny-native` target (hidden 64, vocab 4096, 4 layers): two draft layers reading
    target layers 1 and 3, blocks of 4."""
    return DSparkConfig(
        vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
        target_layer_ids=(1, 3), num_target_layers=4, target_hidden_size=64, draft_vocab_size=4096,
        markov_rank=16, dspark_noise_token_id=0, block_size=4,
    )
