"""The vision encoder: tower + `patchmergerv2` projector, its state-dict names the published checkpoint's
(`vision_tower.*`, `mm_projector.{pre_norm,proj.0,proj.2}.*`).

`VisionEncoder.encode` takes a step's images packed (their patches concatenated, their grids in order) and returns
one embedding per merged token, in the text model's width: the rows that replace the `<|media_pad|>` token
embeddings, image after image (`split` cuts them per image).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from radixk3.vision.config import VisionConfig
from radixk3.vision.tower import ImageGrid, VisionTower


class Projector(nn.Module):
    """patchmergerv2: LayerNorm over each patch's features, the kernel's patches side by side, then
    Linear -> GELU (erf) -> Linear into the text model's width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.projector_ln_eps)
        self.proj = nn.Sequential(nn.Linear(cfg.merged_dim, cfg.merged_dim), nn.GELU(),
                                  nn.Linear(cfg.merged_dim, cfg.text_hidden_size))

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """(tokens, kernel patches, hidden) -> (tokens, text hidden)."""
        return self.proj(self.pre_norm(merged).flatten(1))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg)
        self.mm_projector = Projector(cfg)

    def encode(self, patches: torch.Tensor, grids: Sequence[ImageGrid | tuple[int, int, int]]) -> torch.Tensor:
        """patches (total patches, 3, p, p) -> (total merged tokens, text hidden)."""
        return self.mm_projector(self.vision_tower(patches, grids))

    forward = encode

    def split(self, embeddings: torch.Tensor, grids: Sequence[ImageGrid | tuple[int, int, int]]
              ) -> tuple[torch.Tensor, ...]:
        """`encode`'s rows cut per image."""
        return embeddings.split([ImageGrid(*g).num_tokens(self.cfg.merge_kernel) for g in grids])
