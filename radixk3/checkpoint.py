"""Checkpoints on disk: a directory with config.json, safetensors weights (one file or sharded with
`model.safetensors.index.json`) and the tokenizer, under the public Kimi-Linear tensor names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixk3.config import ModelConfig
from radixk3.model import KimiForCausalLM, build_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Present in some public checkpoints, unused by a NoPE model.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, unexpected or malformed; the message names it."""


def builtin_tokenizer_path() -> Path:
    return Path(__file__).parent / "assets" / "tokenizer.model"


def write_checkpoint(model: KimiForCausalLM, out_dir: str | Path, *, num_shards: int = 1) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    names = sorted(tensors)
    if num_shards <= 1:
        save_file(tensors, out / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i in range(num_shards):
            file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::num_shards]}
            save_file(part, out / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    tok = builtin_tokenizer_path()
    if tok.is_file():
        shutil.copyfile(tok, out / "tokenizer.model")
    return out


def write_random_checkpoint(cfg: ModelConfig, out_dir: str | Path, *, seed: int = 0, num_shards: int = 1) -> Path:
    return write_checkpoint(build_model(cfg, seed=seed), out_dir, num_shards=num_shards)


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = {name: path / file for name, file in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {INDEX_FILE} is missing")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_model(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
               ) -> KimiForCausalLM:
    """Load a Kimi-Linear-format checkpoint directory; every tensor must be present, expected and well shaped."""
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    if dtype is not None:
        cfg = cfg.replace(dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    with torch.device("meta"):
        skeleton = KimiForCausalLM(cfg)
    expected = skeleton.state_dict()
    files = {k: f for k, f in _weight_files(path).items() if not k.endswith(SKIPPED_SUFFIXES)}
    for kind, names in (("missing", set(expected) - set(files)), ("unexpected", set(files) - set(expected))):
        if names:
            first, more = sorted(names)[0], len(names) - 1
            raise CheckpointError(f"{kind} tensor {first!r}" + (f" (and {more} more)" if more else ""))
    model = build_model(cfg)  # allocated, cast to cfg's dtype with fp32 gates; filled below
    state = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as sf:
            for name in names:
                t = sf.get_tensor(name)
                if name.endswith("A_log") and t.numel() == cfg.kda_num_heads and t.shape != state[name].shape:
                    t = t.reshape(state[name].shape)  # [H] and [1, 1, H, 1] both occur in the wild
                if tuple(t.shape) != tuple(state[name].shape):
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(state[name].shape)}"
                    )
                if not t.is_floating_point():
                    raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}; quantised weights are not supported")
                state[name].copy_(t.to(state[name].dtype))
    return model.to(device).eval()
