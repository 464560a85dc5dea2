"""Checkpoint tensor names <-> model parameter names, for both checkpoint formats.

Model names are the Kimi-Linear checkpoint names (`model.embed_tokens.weight`, `model.layers.{l}.…`,
`model.norm.weight`, `lm_head.weight`), with MTP layers under `model.mtp_layers.{i}.`. On disk:
- Kimi-Linear: the model names, MTP layer i (if any) at `model.layers.{num_hidden_layers + i}.`.
- Native K3: the same under `language_model.` (vLLM also accepts `language_model.layers.` for
  `language_model.model.layers.`); `model.output_attn_res_{norm,proj}`, `*_res_{norm,proj}` and
  `block_sparse_moe.routed_expert_*` appear with their switches. The MTP layers' own AttnRes tensors are
  ignored (they run with the additive residual), as are the vision tower (`vision_tower.*`, `mm_projector.*`)
  and rotary buffers. `self_attn.g_proj` is KDA's full-rank output gate in a KDA layer and the Gated-MLA gate
  in an MLA layer: the layer type (from the config) decides, and the expected shape differs.
"""

from __future__ import annotations

import re

import torch

from radixk3.config import ModelConfig

K3_PREFIX = "language_model."
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# Tensors that only quantised checkpoints carry (compressed-tensors, fp8 block scales).
QUANTISED_SUFFIXES = {
    "weight_packed": "MXFP4 packed weights (compressed-tensors)",
    "weight_scale": "quantisation scales",
    "weight_global_scale": "quantisation scales",
    "weight_scale_inv": "FP8 block scales",
    "weight_zero_point": "quantisation zero points",
    "weight_shape": "packed-weight shapes",
    "input_scale": "activation quantisation scales",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MTP = re.compile(r"model\.mtp_layers\.(\d+)\.(.+)")
_ATTN_RES = re.compile(r"(self_attention|mlp)_res_(norm|proj)\.weight")


def checkpoint_name(cfg: ModelConfig, name: str) -> str:
    """The on-disk name of model parameter `name`."""
    m = _MTP.fullmatch(name)
    if m:
        name = f"model.layers.{cfg.num_hidden_layers + int(m[1])}.{m[2]}"
    return K3_PREFIX + name if cfg.is_k3_format else name


def model_name(cfg: ModelConfig, ckpt: str) -> str | None:
    """The model parameter that checkpoint tensor `ckpt` fills, None for tensors that are skipped, or a name
    that the model does not have (the caller reports it as unexpected)."""
    name = ckpt
    if name.endswith(SKIPPED_SUFFIXES):
        return None
    if cfg.is_k3_format:
        if name.startswith(VISION_PREFIXES):
            return None
        if not name.startswith(K3_PREFIX):
            return "<unprefixed>." + name  # never a model name: reported as unexpected
        name = name[len(K3_PREFIX):]
        if name.startswith("layers."):
            name = "model." + name
    m = _LAYER.fullmatch(name)
    if m and int(m[1]) >= cfg.num_hidden_layers:
        if _ATTN_RES.fullmatch(m[2]):
            return None
        return f"model.mtp_layers.{int(m[1]) - cfg.num_hidden_layers}.{m[2]}"
    return name


def quantised_reason(name: str, dtype: torch.dtype | None = None) -> str | None:
    """Why tensor `name` (of `dtype`, if known) is a quantised weight, or None if it is a plain one."""
    last = name.rsplit(".", 1)[-1]
    if last in QUANTISED_SUFFIXES:
        return QUANTISED_SUFFIXES[last]
    if dtype is not None and (not dtype.is_floating_point or dtype.itemsize == 1):
        return f"{dtype} storage"
    return None
