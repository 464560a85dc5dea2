"""DSpark drafter checkpoints: a directory with config.json (`k3_dspark`) and model.safetensors, written and read
with the project's conventions (`checkpoint.py`: public, unfused tensor names; every tensor present, expected and
well shaped). Names: `model.layers.{i}.…` (DeepseekV3's: `self_attn.q_a_proj`, `mlp.gate_proj`, …),
`model.final_norm`, `model.context_proj`, `model.context_norm`, `model.markov_w1`, `model.markov_w2`. The
embedding and lm_head are the target's: `model.embed_tokens.weight` / `lm_head.weight` are ignored if stored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixk3.checkpoint import SINGLE_FILE, CheckpointError
from radixk3.dspark import DSparkModel
from radixk3.dspark_config import DSparkConfig, k3_tiny_dspark_preset
from radixk3.model import KimiForCausalLM
from radixk3.parallel import replicated
from radixk3.tensor_names import public_tensors

PREFIX = "model."
ALIASED = ("model.embed_tokens.weight", "lm_head.weight")


def write_dspark_checkpoint(model: DSparkModel, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    # Cloned: public tensors may be views of fused parameters (gate|up), and safetensors refuses shared storage.
    tensors = {PREFIX + k: v.detach().to("cpu", copy=True).contiguous() for k, v in public_tensors(model).items()}
    save_file(tensors, out / SINGLE_FILE, metadata={"format": "pt"})
    return out


def build_dspark(cfg: DSparkConfig, target: KimiForCausalLM, seed: int | None = None) -> DSparkModel:
    """A drafter of `cfg` on `target`'s device (seeded random weights when `seed` is given)."""
    with replicated():  # the drafter is small: whole on every TP rank (it reads the target's whole aux states)
        model = DSparkModel(cfg, target)
    if seed is not None:
        init_random_dspark_(model, seed)
    return model.to(cfg.torch_dtype).to(target.device).eval()


@torch.no_grad()
def init_random_dspark_(model: DSparkModel, seed: int) -> DSparkModel:
    """Seeded fan-in scaled weights, drawn per public tensor in name order (as `model.init_random_`)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(public_tensors(model, params_only=True).items()):
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name == "markov_w1.weight":
            p.copy_(torch.randn(p.shape, generator=gen))
        else:  # linear [out, in]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def load_dspark(path: str | Path, target: KimiForCausalLM) -> DSparkModel:
    path = Path(path)
    cfg = DSparkConfig.from_file(path)
    model = build_dspark(cfg, target)
    state = public_tensors(model)
    file = path / SINGLE_FILE
    if not file.is_file():
        raise CheckpointError(f"no {SINGLE_FILE} in {path}")
    with safe_open(file, framework="pt") as f:
        names = {n for n in f.keys() if n not in ALIASED}
        for n in sorted(names):
            if not n.startswith(PREFIX) or n[len(PREFIX):] not in state:
                raise CheckpointError(f"unexpected tensor {n!r}")
        missing = sorted(PREFIX + k for k in state if PREFIX + k not in names)
        if missing:
            raise CheckpointError(f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                      if len(missing) > 1 else ""))
        for n in sorted(names):
            t, dst = f.get_tensor(n), state[n[len(PREFIX):]]
            if tuple(t.shape) != tuple(dst.shape):
                raise CheckpointError(f"tensor {n!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(t.to(dst.dtype))
    return model


def write_random_dspark(out_dir: str | Path, target: KimiForCausalLM, *, seed: int = 0,
                        cfg: DSparkConfig | None = None) -> Path:
    """A seeded random drafter (default: the `k3-tiny-dspark` preset, for a `k3-tiny-native` target)."""
    return write_dspark_checkpoint(build_dspark(cfg or k3_tiny_dspark_preset(), target, seed), out_dir)
