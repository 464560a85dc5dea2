"""A K3 checkpoint whose config.json carries a `vision_config` but no vision tensors (radixk3's text-only K3
checkpoints carry the reference's defaults) serves text only: the door's config has no tower, so images are
refused with a clear error, and the worker builds none; with the tower's tensors added, images are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixk3.config import ConfigError
from radixk3.config_formats import load_model_config
from radixk3.published_checkpoint import write_published_checkpoint
from radixk3.vision.config import has_vision_weights
from radixk3.vision.weights import add_random_vision
from runtime.model_files import model_config
from runtime.server_args import ServerArgs


def test_a_vision_config_without_tensors_serves_text_only(tmp_path: Path) -> None:
    path = write_published_checkpoint("k3-tiny-native", tmp_path / "k3", tokenizer="tiktoken")
    assert load_model_config(path).vision is not None and not has_vision_weights(path)
    cfg = model_config(ServerArgs(model=str(path)))
    assert cfg.vision is None
    cfg.check_images(0)
    with pytest.raises(ConfigError, match="no vision tower"):
        cfg.check_images(1)
    add_random_vision(path)
    assert has_vision_weights(path)
    with_tower = model_config(ServerArgs(model=str(path)))
    assert with_tower.vision is not None
    with_tower.check_images(1)
