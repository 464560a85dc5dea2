"""MoonViT3d, K2.5's vision tower (which K3 reuses), in the published checkpoint's layout.

Patches of every image, packed in one sequence (an image's frames one after another, each frame's patches in
raster order), go through:
- `patch_embed.proj` (a 14 x 14 stride-14 conv: one linear map per patch), plus `patch_embed.pos_emb.weight`, a
  learnable (H, W, D) table resampled bicubically to each image's (h, w) grid, plus for clips of several frames a
  fixed sin-cos table over time;
- the blocks (pre-LayerNorm): attention with a fused `wqkv`, 2-D rotary positions (the head's pairs of adjacent
  channels alternate column and row angles, frequencies theta^(-4i/head_dim)) and each image attending only to
  its own patches (`packed_attention`), then a tanh-GELU MLP `fc0`/`fc1`;
- `final_layernorm`, then the 2 x 2 patch merge with temporal pooling: each merged token gathers a kernel of
  neighbouring patches (row-major inside the kernel), averaged over the image's frames.
The result, (merged tokens, kernel patches, D), is what the projector takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixk3.vision.config import VisionConfig
from radixk3.vision.grid import ImageGrid
from radixk3.vision.packed_attention import Packing, packed_attention


def sincos_table(positions: int, dim: int) -> torch.Tensor:
    """(positions, dim): [sin | cos] of position x 10000^(-2i/dim)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, patches: torch.Tensor, grids: Sequence[ImageGrid]) -> torch.Tensor:
        # A stride-p conv over one p x p patch is a linear map of its flattened pixels.
        x = F.linear(patches.flatten(1), self.proj.weight.flatten(1), self.proj.bias)
        return x + self.pos_emb(grids).to(x.dtype)


class PositionEmbedding(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))
        self.register_buffer("time_weight", sincos_table(cfg.pos_emb_time, cfg.hidden_size), persistent=False)

    def forward(self, grids: Sequence[ImageGrid]) -> torch.Tensor:
        """(total patches, D): each image's resampled table (computed once per distinct size), repeated over its
        frames plus the frame's temporal row (none for a single frame)."""
        tables: dict[tuple[int, int], torch.Tensor] = {}
        parts = []
        for g in grids:
            if (g.h, g.w) not in tables:
                tables[(g.h, g.w)] = self._spatial(g.h, g.w)
            spatial = tables[(g.h, g.w)]
            if g.t == 1:
                parts.append(spatial)
                continue
            if g.t > self.time_weight.shape[0]:
                raise ValueError(f"a clip of {g.t} frames: the temporal table has {self.time_weight.shape[0]}")
            parts.append((spatial[None] + self.time_weight[:g.t, None].to(spatial.dtype)).flatten(0, 1))
        return torch.cat(parts)

    def _spatial(self, h: int, w: int) -> torch.Tensor:
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        table = self.weight.permute(2, 0, 1)[None]
        return F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)[0].permute(1, 2, 0).flatten(0, 1)


def rotary_angles(grids: Sequence[ImageGrid], head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """(total patches, head_dim / 2): the angle of each channel pair; pair 2i turns by the patch's column, pair
    2i + 1 by its row, both at frequency theta^(-4i/head_dim); every frame of a clip repeats its image's."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4]
                             / head_dim))
    parts = []
    for g in grids:
        rows = torch.arange(g.h, device=device).repeat_interleave(g.w).float()
        cols = torch.arange(g.w, device=device).repeat(g.h).float()
        angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).flatten(1)
        parts.append(angles.repeat(g.t, 1))
    return torch.cat(parts)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim) with adjacent channels as (real, imaginary) pairs, turned by cos/sin (T, head_dim/2),
    in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.qkv_hidden_size)
        self.wo = nn.Linear(cfg.qkv_hidden_size, cfg.hidden_size)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing: Packing) -> torch.Tensor:
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        attn = packed_attention(q, k, v, packing, scale=self.head_dim ** -0.5)
        x = x + self.wo(attn.flatten(1))
        return x + self.mlp(self.norm1(x))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(hidden, intermediate)
        self.fc1 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=1e-5)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, patches: torch.Tensor, grids: Sequence[ImageGrid]) -> torch.Tensor:
        """patches (total patches, 3, p, p) of `grids`' images packed in order -> (merged tokens, kernel patches,
        hidden), the images' tokens in order."""
        grids = [ImageGrid(*g) for g in grids]
        if patches.shape[0] != sum(g.num_patches for g in grids):
            raise ValueError(f"{patches.shape[0]} patches for grids totalling {sum(g.num_patches for g in grids)}")
        x = self.patch_embed(patches, grids)
        angles = rotary_angles(grids, self.cfg.head_dim, self.cfg.rope_theta, x.device)
        cos, sin = angles.cos(), angles.sin()
        packing = Packing.of([g.num_patches for g in grids], x.device)
        for block in self.encoder.blocks:
            x = block(x, cos, sin, packing)
        x = self.encoder.final_layernorm(x)
        return merge_patches(x, grids, self.cfg.merge_kernel)


def merge_patches(x: torch.Tensor, grids: Sequence[ImageGrid], kernel: tuple[int, int]) -> torch.Tensor:
    """(total patches, D) -> (merged tokens, kh * kw, D): each patch added, weighted 1 / frames, into its merged
    token's slot (the kernel's row-major position), in fp32."""
    kh, kw = kernel
    dest, weight = [], []
    offset = 0
    for g in grids:
        if g.h % kh or g.w % kw:
            raise ValueError(f"grid {tuple(g)} does not divide into {kh} x {kw} kernels")
        rows = torch.arange(g.h)[:, None]
        cols = torch.arange(g.w)[None, :]
        token = (rows // kh) * (g.w // kw) + cols // kw
        slot = (rows % kh) * kw + cols % kw
        dest.append(((offset + token) * (kh * kw) + slot).flatten().repeat(g.t))
        weight.append(torch.full((g.num_patches,), 1.0 / g.t))
        offset += g.num_tokens(kernel)
    index = torch.cat(dest).to(x.device)
    w = torch.cat(weight).to(x.device)
    out = x.new_zeros(offset * kh * kw, x.shape[-1], dtype=torch.float32)
    out.index_add_(0, index, x.float() * w[:, None])
    return out.view(offset, kh * kw, -1).to(x.dtype)
