"""An image -> what the vision encoder takes and what the prompt needs, as transformers' `Kimi_K25ImageProcessor`
computes it (with Pillow's resampling: its fast path's torchvision resize differs from Pillow's by rounding):

1. RGB, transparency composited onto white;
2. resized (bicubic, aspect kept, never up) so that the patch count fits `max_patches` and each side
   `max_side_patches` patches (`resize_plan`), then zero-padded right and bottom to a multiple of
   patch x merge kernel;
3. scaled to [0, 1] and normalised by mean / std 0.5 (the padding becomes -1);
4. cut into patches, row-major: (h * w, 3, p, p), grid (1, h, w).

`ProcessedImage` carries the patches, the grid, the original size (the prompt writes it: `image {W}x{H}`), the
number of `<|media_pad|>` tokens, and a content hash of the pixels the encoder sees (the radix cache's and the
encoder cache's key).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from radixk3.vision.grid import ImageGrid
from radixk3.vision.prompt import ImageSlot


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    merge_kernel: tuple[int, int] = (2, 2)
    max_patches: int = 16384
    max_side_patches: int = 512  # transformers' size {"max_height": 512, "max_width": 512}, in patches
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ResizePlan:
    height: int  # resized (Pillow bicubic)
    width: int
    padded_height: int  # then zero-padded to multiples of patch x merge kernel
    padded_width: int


@dataclass(frozen=True)
class ProcessedImage:
    patches: np.ndarray  # (grid.num_patches, 3, p, p) float32, row-major over the grid (numpy: the tokenizer
    # process that makes it holds no torch)
    grid: ImageGrid
    width: int  # the original image's size, as the prompt writes it
    height: int
    num_tokens: int  # merged tokens: <|media_pad|> ids in the prompt, embedding rows out of the encoder
    content_hash: str  # sha256 of the resized pixels and their size: equal hashes, equal embeddings

    @property
    def slot(self) -> ImageSlot:
        return ImageSlot(self.width, self.height, self.num_tokens)


def resize_plan(height: int, width: int, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> ResizePlan:
    """The resized and padded size of a (height, width) image."""
    p = cfg.patch_size
    patches = max(1, height // p) * max(1, width // p)
    side = cfg.max_side_patches * p
    scale = min(1.0, math.sqrt(cfg.max_patches / patches), side / height, side / width)
    new_h = min(max(1, int(height * scale)), side)
    new_w = min(max(1, int(width * scale)), side)
    fh, fw = cfg.merge_kernel[0] * p, cfg.merge_kernel[1] * p
    return ResizePlan(new_h, new_w, -(-new_h // fh) * fh, -(-new_w // fw) * fw)


def image_grid(height: int, width: int, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> ImageGrid:
    """The patch grid of a (height, width) image, without its pixels (for counting pad tokens)."""
    plan = resize_plan(height, width, cfg)
    return ImageGrid(1, plan.padded_height // cfg.patch_size, plan.padded_width // cfg.patch_size)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def process_image(image: Image.Image, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> ProcessedImage:
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"image of size {width}x{height}")
    plan = resize_plan(height, width, cfg)
    rgb = to_rgb(image)
    if (plan.width, plan.height) != rgb.size:
        rgb = rgb.resize((plan.width, plan.height), Image.Resampling.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.uint8)  # (H, W, 3)
    digest = hashlib.sha256(f"{plan.height}x{plan.width}:".encode())
    digest.update(pixels.tobytes())
    padded = np.zeros((plan.padded_height, plan.padded_width, 3), dtype=np.uint8)
    padded[: plan.height, : plan.width] = pixels
    # Scaled in float64 then normalised in float32, as transformers' numpy path rounds.
    scaled = (padded.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.asarray(cfg.mean, dtype=np.float32), np.asarray(cfg.std, dtype=np.float32)
    normalised = ((scaled - mean) / std).transpose(2, 0, 1)  # (3, H, W)
    p = cfg.patch_size
    grid = ImageGrid(1, plan.padded_height // p, plan.padded_width // p)
    patches = normalised.reshape(3, grid.h, p, grid.w, p).transpose(1, 3, 0, 2, 4)
    return ProcessedImage(np.ascontiguousarray(patches.reshape(grid.num_patches, 3, p, p)), grid, width, height,
                          grid.num_tokens(cfg.merge_kernel), digest.hexdigest())
