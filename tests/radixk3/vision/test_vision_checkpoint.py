"""`radixk3 make-checkpoint --preset k3-tiny-native --vision --tokenizer tiktoken`: the published layout with a
small random vision tower. Its vision tensors load into radixk3's encoder and, through transformers' own K2.5
checkpoint conversion, into transformers' Kimi_K25 classes, which compute the same embeddings; the text model
loads as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from vision_oracle import k25_image_features, k25_vision_model

from radixk3.checkpoint import CheckpointError, load_model
from radixk3.config_formats import load_model_config
from radixk3.vision.image_processor import process_image
from radixk3.vision.weights import VISION_SHARD, add_random_vision, load_vision_encoder, vision_config_of


def test_transformers_loads_the_checkpoint_and_agrees(vision_checkpoint: Path) -> None:
    vcfg = vision_config_of(load_model_config(vision_checkpoint))
    assert vcfg is not None and vcfg.text_hidden_size == 64
    encoder = load_vision_encoder(vision_checkpoint)
    oracle = k25_vision_model(vision_checkpoint, vcfg)
    rng = np.random.default_rng(0)
    images = [process_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
              for w, h in ((60, 40), (30, 90), (112, 112))]
    patches = torch.cat([torch.from_numpy(im.patches) for im in images])
    grids = [tuple(im.grid) for im in images]
    with torch.no_grad():
        ours = encoder.encode(patches, grids)
    ref = k25_image_features(oracle, patches, grids)
    assert ours.shape == (sum(im.num_tokens for im in images), 64)
    assert ref.abs().max() > 0.01
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_text_model_loads_beside_the_tower(vision_checkpoint: Path) -> None:
    model = load_model(vision_checkpoint)
    assert model.config.vision is not None
    with pytest.raises(CheckpointError, match="already"):
        add_random_vision(vision_checkpoint)


def test_missing_vision_tensor_is_named(vision_checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "ck"
    broken.mkdir()
    for f in vision_checkpoint.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / VISION_SHARD)
    del tensors["mm_projector.proj.2.bias"]
    save_file(tensors, broken / VISION_SHARD)
    index = broken / "model.safetensors.index.json"
    listing = json.loads(index.read_text())
    del listing["weight_map"]["mm_projector.proj.2.bias"]
    index.write_text(json.dumps(listing))
    with pytest.raises(CheckpointError, match="mm_projector.proj.2.bias"):
        load_vision_encoder(broken)
