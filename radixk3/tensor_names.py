"""Checkpoint tensor names <-> model parameter names, for both checkpoint formats.

Model names are the Kimi-Linear checkpoint names (`model.embed_tokens.weight`, `model.layers.{l}.…`,
`model.norm.weight`, `lm_head.weight`), with MTP layers under `model.mtp_layers.{i}.`. On disk:
- Kimi-Linear: the model names, MTP layer i (if any) at `model.layers.{num_hidden_layers + i}.`.
- Native K3: the same under `language_model.` (vLLM also accepts `language_model.layers.` for
  `language_model.model.layers.`); `model.output_attn_res_{norm,proj}`, `*_res_{norm,proj}` and
  `block_sparse_moe.routed_expert_*` appear with their switches. The MTP layers' own AttnRes tensors are
  ignored (they run with the additive residual), as are the rotary buffers and the vision tower
  (`vision_tower.*`, `mm_projector.*`: `radixk3.vision.weights` reads those). `self_attn.g_proj` is KDA's
  full-rank output gate in a KDA layer and the Gated-MLA gate in an MLA layer: the layer type (from the config)
  decides, and the expected shape differs.

Public names vs parameters: the model fuses projections and stacks experts (`layers.FusedLinear`,
`FusedWeight`, `moe_layer.Experts`), so its state-dict names are not all checkpoint names. `public_layout` maps each
public (unfused, Kimi-Linear) name to a part of one parameter: KDA `self_attn.{q,k,v}_proj.weight` are the row
thirds of `self_attn.qkv_proj.weight` and `{q,k,v}_conv1d.weight` those of `self_attn.qkv_conv1d.weight`
[3P, 1, W]; `{mlp,shared_experts}.{gate,up}_proj.weight` the halves of `gate_up_proj.weight`;
`block_sparse_moe.experts.{e}.w1/w3.weight` the halves of `experts.w13_weight[e]` and `experts.{e}.w2.weight`
is `experts.w2_weight[e]`. Everything else is its own parameter. Loading copies each checkpoint tensor into its
view, saving writes each view under its public name.

Tensor parallelism: a rank may hold only part of a public tensor. A module that does declares
`public_shards(local_name)` (as `public_parts`, names relative to its parent): the public tensor's full shape
and the index of this rank's part in it (`Shard`; index None: another rank holds it all). `public_shards(model)`
collects them; the view `public_tensors` gives for a sharded name is this rank's part, `full[index]`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from radixk3.config import ModelConfig
from radixk3.vision.config import VISION_PREFIXES

K3_PREFIX = "language_model."
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
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


# public name -> (state-dict name, index of the public tensor in that entry)
Layout = dict[str, tuple[str, tuple[int | slice, ...]]]


def public_layout(module: nn.Module) -> Layout:
    """Every public tensor name of `module` (names relative to it) and where its values live: the modules
    that fuse tensors declare their parts (`public_parts`), every other state-dict entry is public as is."""
    layout: Layout = {}
    fused: set[str] = set()
    for mname, sub in module.named_modules():
        parts = getattr(sub, "public_parts", None)
        if parts is None or not mname:
            continue
        parent, _, local = mname.rpartition(".")
        prefix = parent + "." if parent else ""
        for attr, public, index in parts(local):
            layout[prefix + public] = (f"{mname}.{attr}", index)
            fused.add(f"{mname}.{attr}")
    for name in module.state_dict(keep_vars=True):
        if name in fused:
            continue
        if name in layout:
            raise ValueError(f"parameter {name!r} collides with a fused tensor's public name")
        layout[name] = (name, ())
    return layout


def public_tensors(module: nn.Module, *, params_only: bool = False) -> dict[str, torch.Tensor]:
    """Public name -> a view of the (detached) state-dict tensor holding it: writing into a view fills the model.
    `params_only` leaves buffers (the router's correction bias) out."""
    state = module.state_dict()
    params = {n for n, _ in module.named_parameters()} if params_only else None
    return {
        public: state[name][index]
        for public, (name, index) in public_layout(module).items()
        if params is None or name in params
    }


class Shard(NamedTuple):
    full_shape: tuple[int, ...]  # the checkpoint (public) tensor's full shape
    index: tuple[int | slice, ...] | None  # the part of it this rank holds; None: held by another rank only


def public_shards(module: nn.Module) -> dict[str, Shard]:
    """Public name (relative to `module`) -> this rank's `Shard` of it, for every tensor held only in part (or
    not at all: index None). A public name absent from it is held whole. Empty for an unsharded model."""
    shards: dict[str, Shard] = {}
    for mname, sub in module.named_modules():
        declare = getattr(sub, "public_shards", None)
        if declare is None or not mname:
            continue
        parent, _, local = mname.rpartition(".")
        prefix = parent + "." if parent else ""
        for public, shard in declare(local):
            shards[prefix + public] = shard
    return shards
