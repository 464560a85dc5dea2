"""The vision tower + projector equal transformers' Kimi_K25VisionModel + Kimi_K25MultimodalProjection on the same
random weights (fp32, within 1e-5), over several image sizes and aspect ratios packed in one call; and the packed
call equals the images encoded one by one (the attention never crosses images)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from vision_oracle import k25_config, k25_image_features, k25_vision_model

from radixk3.config import ConfigError
from radixk3.vision.config import VisionConfig, tiny_vision_dict
from radixk3.vision.weights import random_vision_encoder, vision_tensors

TEXT_HIDDEN = 64
# (t, h, w) patch grids: the table's own 8 x 8, smaller and larger, wide and tall, and a 2-frame clip.
GRIDS = [(1, 8, 8), (1, 4, 6), (1, 10, 4), (1, 2, 16), (1, 12, 12), (2, 6, 4)]


@pytest.fixture(scope="module")
def encoder_and_oracle(tmp_path_factory: pytest.TempPathFactory):
    vcfg = VisionConfig.from_dict(tiny_vision_dict(TEXT_HIDDEN), TEXT_HIDDEN)
    encoder = random_vision_encoder(vcfg, seed=3, std=0.1)
    ckpt: Path = tmp_path_factory.mktemp("k25_vision")
    save_file(vision_tensors(encoder), ckpt / "model.safetensors", metadata={"format": "pt"})
    k25_config(vcfg).save_pretrained(ckpt)  # transformers reads a config.json beside the weights
    return encoder, k25_vision_model(ckpt, vcfg)


def _patches(grids: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def test_packed_images_equal_transformers(encoder_and_oracle) -> None:
    encoder, oracle = encoder_and_oracle
    patches = _patches(GRIDS, seed=0)
    with torch.no_grad():
        ours = encoder.encode(patches, GRIDS)
    ref = k25_image_features(oracle, patches, GRIDS)
    assert ours.shape == ref.shape == (sum(h * w // 4 for _, h, w in GRIDS), TEXT_HIDDEN)
    assert ref.abs().max() > 0.1  # not a vacuous comparison
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_packing_does_not_mix_images(encoder_and_oracle) -> None:
    encoder, _ = encoder_and_oracle
    patches = _patches(GRIDS, seed=1)
    with torch.no_grad():
        packed = encoder.split(encoder.encode(patches, GRIDS), GRIDS)
        alone = [encoder.encode(p, [g]) for p, g in zip(patches.split([t * h * w for t, h, w in GRIDS]), GRIDS,
                                                         strict=True)]
    for a, b in zip(packed, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_config_refuses_what_the_tower_does_not_implement() -> None:
    with pytest.raises(ConfigError, match="use_rmsnorm"):
        VisionConfig.from_dict(tiny_vision_dict(TEXT_HIDDEN) | {"use_rmsnorm": True}, TEXT_HIDDEN)
    with pytest.raises(ConfigError, match="merge_type"):
        VisionConfig.from_dict(tiny_vision_dict(TEXT_HIDDEN) | {"merge_type": "sd2"}, TEXT_HIDDEN)
    with pytest.raises(ConfigError, match="text_hidden_size"):
        VisionConfig.from_dict(tiny_vision_dict(32), TEXT_HIDDEN)
