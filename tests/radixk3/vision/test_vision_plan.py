"""`radixk3 plan` counts the vision tower: its weights (every rank holds them whole) as the built encoder holds them,
and the activations of the largest image; a text-only model has no vision figures."""

from __future__ import annotations

import orjson
import pytest

from radixk3.cli import main
from radixk3.config import preset
from radixk3.vision.config import VisionConfig
from radixk3.vision.encoder import VisionEncoder
from radixk3.vision.plan import vision_plan


def test_vision_weights_are_the_encoders() -> None:
    cfg = preset("k3-tiny-native")
    plan = vision_plan(cfg)
    assert plan is not None and vision_plan(preset("k3-tiny")) is None
    encoder = VisionEncoder(VisionConfig.from_spec(cfg.vision, cfg.hidden_size)).to(cfg.torch_dtype)
    assert plan.weight_bytes == sum(p.numel() * p.element_size() for p in encoder.parameters())
    assert plan.image_patches == 16384 and 0 < plan.activation_bytes_varlen < plan.activation_bytes_sdpa


def test_plan_prints_the_tower(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "kimi-k3", "--tp", "8", "--ep", "8"]) == 0
    assert "vision tower per rank (replicated" in capsys.readouterr().out
    assert main(["plan", "--preset", "kimi-k3", "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["vision"]["weight_bytes"] > 100e6
    assert main(["plan", "--preset", "k3-tiny", "--json"]) == 0
    assert "vision" not in orjson.loads(capsys.readouterr().out)
