"""The vision tower's config: the K3 checkpoint's nested `vision_config` (K2.5's `kimi_k25_vision` keys, which
K3's `kimi_k3_vision` reuses), parsed strictly when the tower is built.

`ModelConfig.vision` carries the raw object (`VisionSpec`) so that a text-only load never depends on it; building
the tower reads it here, where a key this tower does not implement is a `ConfigError` naming it (a checkpoint whose
tower differs is refused, never run wrong). The tower's own sizes may be spelled `vt_*` (K2.5's remote code) or
plain (`hidden_size` ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixk3.config import ConfigError, VisionSpec

VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # the published names of the tower's and projector's tensors


def has_vision_weights(path: str | Path) -> bool:
    """Whether the checkpoint at `path` holds any vision tensor. A `vision_config` without them (radixk3's text-only
    K3 checkpoints carry the reference's defaults) serves text only: images are refused at the door, and the worker
    builds no tower. Torch-free (the tokenizer process asks): the index's names, or the single file's header."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text()).get("weight_map", {})
    else:
        from safetensors import safe_open

        with safe_open(path / "model.safetensors", framework="numpy") as f:
            names = list(f.keys())
    return any(n.startswith(VISION_PREFIXES) for n in names)

# key -> the one value this implementation supports (K2.5's MoonViT3d with the patchmergerv2 projector)
_FIXED = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "projector_hidden_act": "gelu",
    "hidden_act": "gelu_pytorch_tanh",
    "video_attn_type": "spatial_temporal",
}
_SIZES = ("num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size")
# Keys that describe how the reference runs it, not what it computes.
_IGNORED = {"model_type", "_attn_implementation", "torch_dtype", "dtype", "transformers_version", "architectures"}
_KNOWN = ({"patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "merge_kernel_size",
           "qkv_hidden_size", "text_hidden_size", "mm_hidden_size", "projector_ln_eps", "rope_theta"}
          | set(_FIXED) | set(_SIZES) | {"vt_" + k for k in _SIZES} | _IGNORED)


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int
    pos_emb_height: int  # the learnable 2-D table, interpolated (bicubic) to each image's patch grid
    pos_emb_width: int
    pos_emb_time: int  # frames of the fixed sin-cos temporal table
    num_heads: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    qkv_hidden_size: int  # q, k and v each num_heads x head_dim wide
    merge_kernel: tuple[int, int]  # (rows, cols) of patches merged into one token
    text_hidden_size: int
    projector_ln_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_dim(self) -> int:
        """The projector's width: one merged token's patches side by side."""
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]

    def __post_init__(self) -> None:
        if self.qkv_hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(f"vision_config: qkv_hidden_size {self.qkv_hidden_size} must split into "
                              f"{self.num_heads} heads of a multiple of 4 (2-D rotary pairs)")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        unknown = set(raw) - _KNOWN
        if unknown:
            raise ConfigError(f"vision_config: unsupported key(s) {sorted(unknown)}")
        for key, value in _FIXED.items():
            if key in raw and raw[key] != value:
                raise ConfigError(f"vision_config.{key} must be {value!r}, got {raw[key]!r}")

        def size(key: str) -> int:
            plain, vt = raw.get(key), raw.get("vt_" + key)
            if plain is not None and vt is not None and plain != vt:
                raise ConfigError(f"vision_config.{key} {plain} disagrees with vt_{key} {vt}")
            value = plain if plain is not None else vt
            return _int(key, value)

        hidden = size("hidden_size")
        kernel = raw.get("merge_kernel_size", [2, 2])
        if not (isinstance(kernel, list | tuple) and len(kernel) == 2):
            raise ConfigError(f"vision_config.merge_kernel_size must be [rows, cols], got {kernel!r}")
        for key in ("text_hidden_size", "mm_hidden_size"):
            expected = text_hidden_size if key == "text_hidden_size" else hidden
            if raw.get(key) is not None and raw[key] != expected:
                raise ConfigError(f"vision_config.{key} {raw[key]} must be {expected}")
        return cls(
            patch_size=_int("patch_size", raw.get("patch_size", 14)),
            pos_emb_height=_int("init_pos_emb_height", raw.get("init_pos_emb_height", 64)),
            pos_emb_width=_int("init_pos_emb_width", raw.get("init_pos_emb_width", 64)),
            pos_emb_time=_int("init_pos_emb_time", raw.get("init_pos_emb_time", 4)),
            num_heads=size("num_attention_heads"), num_layers=size("num_hidden_layers"), hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            qkv_hidden_size=_int("qkv_hidden_size", raw.get("qkv_hidden_size", hidden)),
            merge_kernel=(_int("merge_kernel_size", kernel[0]), _int("merge_kernel_size", kernel[1])),
            text_hidden_size=text_hidden_size,
            projector_ln_eps=float(raw.get("projector_ln_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
        )

    @classmethod
    def from_spec(cls, spec: VisionSpec, text_hidden_size: int) -> VisionConfig:
        return cls.from_dict(json.loads(spec.config_json), text_hidden_size)


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"vision_config.{key} must be a positive int, got {value!r}")
    return value


def tiny_vision_dict(text_hidden_size: int) -> dict[str, Any]:
    """A test-size tower in the published keys (`make-checkpoint --vision`): 2 layers of width 32, an 8 x 8
    position table (interpolated for every other grid), 2 x 2 merge."""
    return {
        "model_type": "kimi_k3_vision", "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
        "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "num_attention_heads": 2, "num_hidden_layers": 2,
        "hidden_size": 32, "intermediate_size": 64, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5, "text_hidden_size": text_hidden_size,
    }
