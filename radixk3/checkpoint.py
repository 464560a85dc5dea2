"""Checkpoints on disk: a directory with config.json, safetensors weights (one file or sharded with
`model.safetensors.index.json`) and the tokenizer, under the public Kimi-Linear tensor names or the native K3
ones (`tensor_names`). The format follows the config's `model_type`.

The model holds fused / stacked parameters (q|k|v, gate|up, the experts as [E, ...]); on disk every tensor keeps
its public name (`experts.{e}.w1.weight`, `q_proj.weight`, ...), so real checkpoints load unchanged and
transformers loads ours. Loading copies each tensor into its view of the fused parameter (merge at load),
writing saves each view under its name (split at save).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radixk3.config import ModelConfig
from radixk3.config_formats import load_model_config, model_config_to_dict
from radixk3.model import KimiForCausalLM, build_model
from radixk3.packed_experts import PACKED_ATTRS, PackedWeights
from radixk3.tensor_names import (
    Shard,
    checkpoint_name,
    model_name,
    public_layout,
    public_shards,
    public_tensors,
    quantised_reason,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, unexpected or malformed; the message names it."""


def builtin_tokenizer_path() -> Path:
    return Path(__file__).parent / "assets" / "tokenizer.model"


def checkpoint_tensors(model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """Every tensor of an unsharded model under its checkpoint name, on CPU, each with its own storage."""
    if public_shards(model):
        raise CheckpointError("this model is a tensor-parallel shard (it holds part of some tensors): save the "
                              "unsharded model (built or loaded without --tp) instead")
    cfg = model.config
    # Cloned: the public tensors are views of fused parameters, and safetensors refuses shared storage.
    return {checkpoint_name(cfg, k): v.detach().to("cpu", copy=True).contiguous()
            for k, v in public_tensors(model).items()}


def write_checkpoint(model: KimiForCausalLM, out_dir: str | Path, *, num_shards: int = 1) -> Path:
    return write_tensors(model_config_to_dict(model.config), checkpoint_tensors(model), out_dir,
                         num_shards=num_shards)


def write_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor], out_dir: str | Path, *,
                  num_shards: int = 1) -> Path:
    """A checkpoint directory: config.json, the tensors (sharded over `num_shards` files with an index) and the
    built-in tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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


def weight_files(path: Path) -> dict[str, Path]:
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


def _first(names: set[str]) -> str:
    first, more = sorted(names)[0], len(names) - 1
    return repr(first) + (f" (and {more} more)" if more else "")


def _fit_shape(name: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Accept the layouts that occur in the wild for the same values: A_log as [H] or [1, 1, H, 1], short-conv
    weights as [C, K] or [C, 1, K]."""
    if tuple(t.shape) != tuple(shape) and t.numel() == shape.numel():
        if name.endswith("A_log") or (name.endswith("conv1d.weight") and t.shape[0] == shape[0]):
            return t.reshape(shape)
    return t


def _read(sf: Any, name: str, ckpt: str, shape: tuple[int, ...], shard: Shard | None) -> torch.Tensor:
    """This rank's part of checkpoint tensor `ckpt` (model name `name`, the whole tensor when unsharded), of
    local `shape`: a slice read when the file's layout is the model's, else the whole (small) tensor refitted."""
    full_shape = shard.full_shape if shard is not None else shape
    sl = sf.get_slice(ckpt)
    on_disk = tuple(sl.get_shape())
    if on_disk == tuple(full_shape):
        t = sl[shard.index] if shard is not None and shard.index is not None else sl[()]
    else:
        t = _fit_shape(name, sf.get_tensor(ckpt), torch.Size(full_shape))
        if tuple(t.shape) != tuple(full_shape):
            raise CheckpointError(f"tensor {ckpt!r} has shape {on_disk}, expected {tuple(full_shape)}")
        if shard is not None and shard.index is not None:
            t = t[shard.index]
    if tuple(t.shape) != shape:  # the shard does not match the rank's view: a bug, not a bad file
        raise CheckpointError(f"tensor {ckpt!r}: read {tuple(t.shape)} for a view of {shape}")
    return t


def load_model(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
               ) -> KimiForCausalLM:
    """Load a checkpoint directory of either format; every tensor must be present, expected and well shaped.
    Under TP (`parallel.init_parallel` before) the model is this rank's shard, and only its part of each
    sharded tensor is read (`get_slice`)."""
    path = Path(path)
    cfg = load_model_config(path)
    if dtype is not None:
        cfg = cfg.replace(dtype=str(dtype).removeprefix("torch."))
    # Allocated, cast to cfg's dtype with fp32 gates; filled below. Built for real, not as a meta-device skeleton
    # first: initialising meta tensors runs torch's Python reference ops, which import torch._dynamo, sympy and
    # triton for good (~150 MiB resident in every worker).
    model = build_model(cfg)
    shards = public_shards(model)
    # Public names; several may fill one fused parameter. Tensors that other ranks hold alone are expected too.
    expected = set(public_layout(model)) | {n for n, s in shards.items() if s.index is None}
    files: dict[str, tuple[str, Path]] = {}  # public model name -> (checkpoint name, file)
    for ckpt, f in sorted(weight_files(path).items()):
        name = model_name(cfg, ckpt)
        if name is None:  # skipped (vision tower, rotary buffers, MTP AttnRes), whatever its format
            continue
        reason = quantised_reason(ckpt)
        if reason is not None and name not in expected:
            why = ("config.json has no quantization_config" if cfg.expert_quant is None
                   else "only the routed experts may be quantised")
            raise CheckpointError(f"tensor {ckpt!r} holds {reason}: {why}")
        if name in files:
            raise CheckpointError(f"tensor {ckpt!r} and {files[name][0]!r} both fill {name!r}")
        files[name] = (ckpt, f)
    missing = expected - set(files)
    if missing:
        raise CheckpointError(f"missing tensor {_first({checkpoint_name(cfg, n) for n in missing})}")
    unexpected = set(files) - expected
    if unexpected:
        raise CheckpointError(f"unexpected tensor {_first({files[n][0] for n in unexpected})}")
    state = public_tensors(model)  # views into the fused parameters: copying into one fills its part
    packed = {n for n, (attr, _) in public_layout(model).items() if attr.rsplit(".", 1)[-1] in PACKED_ATTRS}
    by_file: dict[Path, list[str]] = {}
    for name, (_, f) in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as sf:
            for name in names:
                shard = shards.get(name)
                if shard is not None and shard.index is None:
                    continue  # another rank's: present in the checkpoint, not read here
                ckpt = files[name][0]
                t = _read(sf, name, ckpt, tuple(state[name].shape), shard)
                if name in packed:  # stored as the format stores it: no conversion
                    if t.dtype != state[name].dtype:
                        raise CheckpointError(f"tensor {ckpt!r} has dtype {t.dtype}; its format "
                                              f"({cfg.expert_quant}) stores {state[name].dtype}")
                    state[name].copy_(t)
                    continue
                reason = quantised_reason(ckpt, t.dtype)
                if reason is not None:
                    raise CheckpointError(f"tensor {ckpt!r} has {reason}: only the routed experts may be quantised, "
                                          "as config.json's quantization_config says")
                state[name].copy_(t.to(state[name].dtype))
    for mname, sub in model.named_modules():
        bad = sub.check_shapes() if isinstance(sub, PackedWeights) else None
        if bad is not None:
            raise CheckpointError(f"{mname}: {bad}")
    return model.to(device).eval()
