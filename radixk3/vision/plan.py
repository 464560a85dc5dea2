"""What the vision tower costs a worker rank (`radixk3 plan`): its weights, held whole by every rank (the tower is
replicated under TP: it is small beside the text model, and its rows enter the first layer's input, which every
rank holds whole), and the transient activations of the largest image the processor lets through, an estimate of
the peak inside one block (the residual stream beside the larger of the attention's and the MLP's working set).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixk3.config import ModelConfig
from radixk3.vision.config import VisionConfig
from radixk3.vision.encoder import VisionEncoder
from radixk3.vision.image_processor import ImageProcessorConfig


class VisionPlan(NamedTuple):
    weight_bytes: int  # tower + projector, on every rank
    image_patches: int  # the largest image's patches (the processor's max_patches)
    activation_bytes_varlen: int  # CUDA half precision: flash attention's varlen kernel, no score matrix
    activation_bytes_sdpa: int  # elsewhere: SDPA's block-diagonal mask and per-head scores (T x T)


def vision_weight_numel(vcfg: VisionConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in VisionEncoder(vcfg).parameters())


def vision_plan(cfg: ModelConfig, processor: ImageProcessorConfig | None = None) -> VisionPlan | None:
    """None for a text-only model; the tower is counted in the text model's dtype (the worker serves it so)."""
    if cfg.vision is None:
        return None
    processor = processor if processor is not None else ImageProcessorConfig()
    vcfg = VisionConfig.from_spec(cfg.vision, cfg.hidden_size)
    elt = cfg.torch_dtype.itemsize
    t = processor.max_patches
    residual = t * vcfg.hidden_size * elt
    qkv = 3 * t * vcfg.qkv_hidden_size * elt
    mlp = t * vcfg.intermediate_size * elt
    scores = vcfg.num_heads * t * t * elt + t * t  # per-head scores and the bool mask
    varlen = residual + max(qkv + t * vcfg.qkv_hidden_size * elt, mlp)
    sdpa = residual + max(qkv + scores, mlp)
    return VisionPlan(vision_weight_numel(vcfg) * elt, t, varlen, sdpa)
