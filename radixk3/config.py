"""Typed model config, and the presets (the built-in test models and the true sizes for memory plans).

Two checkpoint formats share one `ModelConfig`: the public Kimi-Linear one (`model_type: kimi_linear`, flat;
`hf_config`) and native Kimi K3 (`model_type: kimi_k3`, the text model nested under `text_config`; `k3_config`);
`config_formats` reads and writes a config.json in either (this module imports neither, so nothing cycles). The K3
switches (full-rank and safe KDA gates, Gated MLA, Block Attention Residuals, LatentMoE, SiTU, MTP layers) are
fields whose defaults are the Kimi-Linear model. Layer lists in the checkpoint are 1-based
(`linear_attn_config.kda_layers` / `full_attn_layers`); here they are kept 0-based. Every unknown or inconsistent
value is a `ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixk3.quant_format import ExpertQuant


class ConfigError(ValueError):
    """A config.json value is missing, unknown or inconsistent; the message names the key."""


# Names only: the scheduler and tokenizer processes read configs without importing torch (hundreds of MiB each).
_DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("kimi_linear", "kimi_k3")
ACTIVATIONS = ("silu", "situ")


@dataclass(frozen=True)
class VisionSpec:
    """A checkpoint's vision tower, carried as its raw `vision_config` so that the config round-trips and a text
    load never depends on it; `radixk3.vision` parses it strictly when it builds the tower (the worker does). A
    model without one refuses requests with images (`ModelConfig.check_images`)."""

    model_type: str
    config_json: str  # the `vision_config` object as canonical JSON
    media_placeholder_token_id: int | None = None


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
    # Moonshot's code builds kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps (Kimi-Linear format
    # only: see `mla_kv_norm_eps`).
    kv_a_layernorm_eps: float = 1e-6
    bos_token_id: int = 2
    eos_token_id: int = 3
    pad_token_id: int = 0
    dtype: str = "float32"
    model_type: str = "kimi_linear"  # the checkpoint format: tensor names and config layout
    # Native Kimi K3 switches (the defaults are the Kimi-Linear model).
    kda_full_rank_gate: bool = False  # linear_attn_config.use_full_rank_gate: KDA output gate g_proj [H*D, hid]
    kda_gate_lower_bound: float | None = None  # linear_attn_config.gate_lower_bound: the safe decay gate
    mla_use_output_gate: bool = False  # Gated MLA: o_proj(attn * sigmoid(g_proj x))
    attn_res_block_size: int | None = None  # Block Attention Residuals replace the additive residual
    routed_expert_hidden_size: int | None = None  # LatentMoE: routed experts run in this dimension
    latent_moe_use_norm: bool = False
    hidden_act: str = "silu"  # "situ": SiTU-GLU in experts, shared experts and dense MLPs
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    num_nextn_predict_layers: int = 0  # MTP layers, checkpoint layers num_hidden_layers + i
    vision: VisionSpec | None = None
    # The routed experts' packed format (config.json `quantization_config`); None: stored in `dtype`.
    expert_quant: ExpertQuant | None = None

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
        self._check_k3_switches()

    def _check_k3_switches(self) -> None:
        if self.model_type not in FORMATS:
            raise ConfigError(f"model_type must be one of {list(FORMATS)}, got {self.model_type!r}")
        lb = self.kda_gate_lower_bound
        if lb is not None and not -5.0 <= lb < 0.0:
            raise ConfigError(f"linear_attn_config.gate_lower_bound must be in [-5, 0), got {lb}")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ConfigError(f"attn_res_block_size must be >= 1, got {self.attn_res_block_size}")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size <= 0:
            raise ConfigError(f"routed_expert_hidden_size must be positive, got {self.routed_expert_hidden_size}")
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            raise ConfigError("latent_moe_use_norm needs routed_expert_hidden_size (the norm acts in the latent)")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not one of {list(ACTIVATIONS)}")
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            beta = getattr(self, name)
            if beta is not None and not beta > 0:
                raise ConfigError(f"{name} must be positive, got {beta}")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.vision is not None and self.model_type != "kimi_k3":
            raise ConfigError("vision_config belongs to the kimi_k3 format only")

    # Derived sizes (cheap properties so that they can never disagree with the fields).
    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

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

    @property
    def kda_o_norm_eps(self) -> float:
        # K3's full-rank-gate layer hard-codes 1e-5; the Kimi-Linear layer (also K3's when the switch is off)
        # uses rms_norm_eps.
        return 1e-5 if self.kda_full_rank_gate else self.rms_norm_eps

    @property
    def mla_kv_norm_eps(self) -> float:
        """kv_a_layernorm's eps: Moonshot's Kimi-Linear code uses the RMSNorm default, the K3 reference (vLLM)
        rms_norm_eps."""
        return self.rms_norm_eps if self.is_k3_format else self.kv_a_layernorm_eps

    @property
    def mla_q_norm_eps(self) -> float:
        """q_a_layernorm's eps, by the same two conventions."""
        return self.rms_norm_eps if self.is_k3_format else 1e-6

    @property
    def is_k3_format(self) -> bool:
        return self.model_type == "kimi_k3"

    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        """Also for MTP layers (index num_hidden_layers + i): the same rule decides MoE or dense."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def check_images(self, num_images: int) -> None:
        """Refuse requests that carry images when the checkpoint has no vision tower."""
        if num_images > 0 and self.vision is None:
            raise ConfigError(f"request has {num_images} image(s) but this model has no vision tower")

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json (`path` the file or its directory), as a dict; ConfigError when absent or
    not JSON."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"config.json not found at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


# --- presets ---------------------------------------------------------------------------------------------


def every_mla(n_layers: int, mla_1based: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    mla = tuple(i - 1 for i in mla_1based)
    return tuple(i for i in range(n_layers) if i not in mla), mla


def _kimi_linear_48b() -> ModelConfig:
    kda, mla = every_mla(27, [4, 8, 12, 16, 20, 24, 27])
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
    kda, mla = every_mla(8, [4, 8])
    return ModelConfig(
        vocab_size=4096, hidden_size=512, num_hidden_layers=8, kda_layers=kda, mla_layers=mla,
        kda_num_heads=8, kda_head_dim=64, conv_kernel_size=4,
        num_attention_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
        num_experts_per_token=4, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
    )


def _k3_tiny() -> ModelConfig:
    # Two of each layer type, MoE with two expert groups: small enough for fast tests, covers every path.
    kda, mla = every_mla(4, [2, 4])
    return ModelConfig(
        vocab_size=4096, hidden_size=64, num_hidden_layers=4, kda_layers=kda, mla_layers=mla,
        kda_num_heads=2, kda_head_dim=32, conv_kernel_size=4,
        num_attention_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        num_expert_group=2, topk_group=1,
    )


def _kimi_k3() -> ModelConfig:
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


def _k3_tiny_native() -> ModelConfig:
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


PRESETS = {
    "k3-tiny": _k3_tiny,
    "k3-tiny-native": _k3_tiny_native,
    "k3-small": _k3_small,
    "kimi-linear-48b": _kimi_linear_48b,
    "kimi-k3": _kimi_k3,
}
# The preset tests and benches serve with random weights (`--model-path k3-tiny`), and its weights' default seed.
TINY_PRESET = "k3-tiny"
PRESET_SEED = 0
# True-size presets exist for memory plans only; never allocate their weights here.
TRUE_SIZE_PRESETS = frozenset({"kimi-linear-48b", "kimi-k3"})


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
