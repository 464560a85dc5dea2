"""The image preprocessing equals Kimi_K25ImageProcessor's pixel values and grid (its resize / pad / normalise /
patchify on transformers' PIL backend, see `vision_oracle`), over sizes that are kept, padded, scaled down by
the patch budget and by the side limit, and over the modes a decoder returns (RGBA onto white, grey, palette)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vision_oracle import k25_preprocess

from radixk3.vision.image_processor import ImageProcessorConfig, image_grid, process_image


def _image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode if mode != "P" else "RGB"]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode=mode if mode != "P" else "RGB")
    return image.convert("P") if mode == "P" else image


@pytest.mark.parametrize(("width", "height", "mode"), [
    (56, 56, "RGB"),  # already a multiple of 28: kept as is
    (45, 31, "RGB"),  # padded right and bottom
    (13, 9, "RGBA"),  # smaller than a patch, transparency composited
    (300, 40, "L"),  # wide, grey
    (33, 200, "P"),  # tall, palette
    (2000, 1500, "RGB"),  # over the 16384-patch budget: scaled down
    (7400, 60, "RGB"),  # over the 512-patch side limit: scaled down
])
def test_pixels_and_grid_equal_transformers(width: int, height: int, mode: str) -> None:
    image = _image(width, height, mode, seed=width * height)
    ours = process_image(image)
    ref_pixels, ref_grid = k25_preprocess(image)
    assert tuple(ours.grid) == ref_grid
    assert (ours.width, ours.height) == (width, height)
    assert ours.num_tokens == ref_grid[1] * ref_grid[2] // 4
    assert image_grid(height, width) == ours.grid  # the count without the pixels
    assert ours.patches.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(ours.patches), ref_pixels, rtol=0, atol=0)


def test_content_hash_follows_the_pixels() -> None:
    a = _image(60, 40, "RGB", seed=1)
    b = a.copy()
    b.putpixel((59, 39), (0, 0, 0) if a.getpixel((59, 39)) != (0, 0, 0) else (1, 1, 1))
    assert process_image(a).content_hash == process_image(a.copy()).content_hash
    assert process_image(a).content_hash != process_image(b).content_hash
    small = ImageProcessorConfig(max_patches=4)  # 8 patches scaled down: another resize, another hash
    assert process_image(a, small).content_hash != process_image(a).content_hash
