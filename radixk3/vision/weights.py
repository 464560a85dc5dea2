"""The vision encoder's weights in the published K3 (K2.5) layout: the encoder's state-dict names are the
checkpoint's (`vision_tower.patch_embed.{proj,pos_emb}.*`, `vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,
mlp.fc0,mlp.fc1}.*`, `vision_tower.encoder.final_layernorm.*`, `mm_projector.{pre_norm,proj.0,proj.2}.*`), with
`wqkv`'s q and k rows in the checkpoint's own rotary layout (adjacent channel pairs), so loading is a copy.
`add_random_vision` gives a written K3 checkpoint a test-size tower (`make-checkpoint --vision`).

The text model's loader skips these tensors (`tensor_names.VISION_PREFIXES`); `load_vision_encoder` reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixk3.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, weight_files
from radixk3.config import ConfigError, ModelConfig
from radixk3.config_formats import load_model_config
from radixk3.tensor_names import VISION_PREFIXES
from radixk3.vision.config import VisionConfig, tiny_vision_dict
from radixk3.vision.encoder import VisionEncoder


def vision_config_of(cfg: ModelConfig) -> VisionConfig | None:
    """The tower `cfg`'s checkpoint describes, None for a text-only model."""
    if cfg.vision is None:
        return None
    return VisionConfig.from_spec(cfg.vision, cfg.hidden_size)


def random_vision_encoder(cfg: VisionConfig, *, seed: int = 0, std: float = 0.02) -> VisionEncoder:
    """Seeded random weights (normal, `std`; norms around 1), for test checkpoints."""
    encoder = VisionEncoder(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in encoder.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + noise if "norm" in name and name.endswith(".weight") else noise)
    return encoder.requires_grad_(False).eval()


def vision_tensors(encoder: VisionEncoder) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor (CPU, own storage) of every vision weight."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in encoder.state_dict().items()}


def load_vision_encoder(path: str | Path, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> VisionEncoder | None:
    """The checkpoint's vision encoder, None when its config has no `vision_config`; every tensor must be
    present, expected and well shaped."""
    path = Path(path)
    vcfg = vision_config_of(load_model_config(path))
    if vcfg is None:
        return None
    with torch.device("meta"):
        skeleton = VisionEncoder(vcfg)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    files = {k: f for k, f in weight_files(path).items() if k.startswith(VISION_PREFIXES)}
    missing = sorted(set(expected) - set(files))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} (the config has a vision_config)")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r}")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(set(files.values())):
        with safe_open(f, framework="pt") as sf:
            for name in (n for n, g in files.items() if g == f):
                t = sf.get_tensor(name)
                if tuple(t.shape) != expected[name]:
                    raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {expected[name]}")
                if not t.dtype.is_floating_point:
                    raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}: the vision tower is not quantised")
                state[name] = t.to(dtype)
    encoder = VisionEncoder(vcfg).to(dtype)
    encoder.load_state_dict(state)
    return encoder.requires_grad_(False).to(device).eval()


VISION_SHARD = "vision.safetensors"
TEXT_SHARD = "model-00001-of-00001.safetensors"  # a single-file checkpoint's tensors, once it has two files


def add_random_vision(path: str | Path, *, seed: int = 0) -> Path:
    """Give the K3 checkpoint at `path` a seeded random test-size tower (`tiny_vision_dict`): its `vision_config`
    in config.json and its tensors in a shard of their own, listed in the safetensors index (written when the
    checkpoint had a single file, which becomes a shard). The text model's tensors are left as they are."""
    path = Path(path)
    cfg = load_model_config(path)
    if not cfg.is_k3_format:
        raise ConfigError("a vision tower belongs to the kimi_k3 format only (--preset k3-tiny-native)")
    files = weight_files(path)
    if VISION_SHARD in {f.name for f in files.values()} or any(n.startswith(VISION_PREFIXES) for n in files):
        raise CheckpointError(f"{path} has vision tensors already")
    config = json.loads((path / "config.json").read_text())
    config["vision_config"] = tiny_vision_dict(cfg.hidden_size)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    encoder = random_vision_encoder(VisionConfig.from_dict(config["vision_config"], cfg.hidden_size), seed=seed)
    tensors = vision_tensors(encoder)
    save_file(tensors, path / VISION_SHARD, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if (path / INDEX_FILE).is_file():
        total += json.loads((path / INDEX_FILE).read_text()).get("metadata", {}).get("total_size", 0)
    else:  # one file becomes a shard: readers take a lone model.safetensors over an index
        single = (path / SINGLE_FILE).rename(path / TEXT_SHARD)
        files = dict.fromkeys(files, single)
        total += single.stat().st_size
    weight_map = {name: f.name for name, f in files.items()} | dict.fromkeys(tensors, VISION_SHARD)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return path
