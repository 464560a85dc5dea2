"""Quantised checkpoints written through compressed-tensors' own compressors, so that the files are the library's
format: each routed expert's w1 / w2 / w3 (MTP layers' included) is quantised with the library's
`calculate_qparams` (its min-max scales: e8m0 for MXFP4, per group of 32 for INT4, per 128 x 128 block for FP8)
and compressed by the format's compressor; config.json carries the library's `quantization_config`. Every other
tensor is written as the dense checkpoint writes it.

`decompress_weight` is the library's decompression of one weight: the oracle radixk3's dequantisation is tested
against, and how a dense model holding the dequantised values is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixk3.checkpoint import checkpoint_tensors, write_tensors
from radixk3.config_formats import model_config_to_dict
from radixk3.model import KimiForCausalLM
from radixk3.quant_format import ExpertQuant

_ROUTED_WEIGHT = re.compile(r"(.*\.block_sparse_moe\.experts\.\d+\.w[123])\.weight")


def expert_quant_for(kind: str, model_dtype: str) -> ExpertQuant:
    """The format `kind` with compressed-tensors' scale dtype: e8m0 bytes for MXFP4, else the weights' dtype."""
    return ExpertQuant(kind, "uint8" if kind == "mxfp4" else model_dtype)


def _library_config(quant: ExpertQuant) -> Any:
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(quant.quantization_config())


def _qparams(weight: torch.Tensor, quant: ExpertQuant, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's min-max scale and zero point of a [rows, cols] weight, per group or per block."""
    from compressed_tensors.quantization.utils import calculate_qparams

    if quant.kind == "fp8":
        r, c = weight.shape
        br, bc = quant.group
        padded = F.pad(weight, (0, -c % bc, 0, -r % br))
        blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
        return calculate_qparams(blocks.amin((1, 3)), blocks.amax((1, 3)), args)
    groups = weight.unflatten(-1, (-1, quant.group[1]))
    return calculate_qparams(groups.amin(-1), groups.amax(-1), args)


def compress_weight(weight: torch.Tensor, quant: ExpertQuant) -> dict[str, torch.Tensor]:
    """One [rows, cols] weight compressed by compressed-tensors: {suffix: tensor} (`weight_packed`,
    `weight_scale`, ...) as its compressor writes them."""
    from compressed_tensors.compressors import BaseCompressor

    config = _library_config(quant)
    scheme = config.config_groups["group_0"]
    scale, zero_point = _qparams(weight, quant, scheme.weights)
    compressor = BaseCompressor.get_value_from_registry(config.format)
    out = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    return {k: v.contiguous() for k, v in out.items()}


def decompress_weight(tensors: dict[str, torch.Tensor], quant: ExpertQuant) -> torch.Tensor:
    """compressed-tensors' decompression of one compressed weight ({suffix: tensor})."""
    from compressed_tensors.compressors import BaseCompressor

    config = _library_config(quant)
    compressor = BaseCompressor.get_value_from_registry(config.format)
    return compressor.decompress(dict(tensors), config.config_groups["group_0"])["weight"].contiguous()


def quantised_tensors(model: KimiForCausalLM, quant: ExpertQuant) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a dense, unsharded model with its routed experts compressed."""
    out: dict[str, torch.Tensor] = {}
    for name, t in checkpoint_tensors(model).items():
        m = _ROUTED_WEIGHT.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        for suffix, packed in compress_weight(t, quant).items():
            out[f"{m[1]}.{suffix}"] = packed
    return out


def write_quantised_checkpoint(model: KimiForCausalLM, out_dir: str | Path, expert_format: str | None, *,
                               num_shards: int = 1) -> Path:
    """A checkpoint of the dense, unsharded `model` with its routed experts in `expert_format` (mxfp4, int4,
    fp8; None or "none": dense, as `write_checkpoint`)."""
    from radixk3.checkpoint import write_checkpoint

    if expert_format in (None, "none"):
        return write_checkpoint(model, out_dir, num_shards=num_shards)
    if model.config.expert_quant is not None:
        raise ValueError("the model's experts are already packed: quantise a dense model")
    quant = expert_quant_for(expert_format, model.config.dtype)
    config = model_config_to_dict(model.config.replace(expert_quant=quant))
    config["quantization_config"] = _library_config(quant).to_dict()
    return write_tensors(config, quantised_tensors(model, quant), out_dir, num_shards=num_shards)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (one file or sharded)."""
    from safetensors.torch import load_file

    from radixk3.checkpoint import weight_files

    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(weight_files(Path(path)).values())):
        out |= load_file(f)
    return out


def write_dequantised_checkpoint(src: str | Path, out_dir: str | Path) -> Path:
    """The dense checkpoint holding what compressed-tensors decompresses a quantised one's experts to (in the
    model's dtype): what a packed model must compute like."""
    from radixk3.config_formats import load_model_config

    cfg = load_model_config(src)
    quant = cfg.expert_quant
    if quant is None:
        raise ValueError(f"{src} holds no quantised experts (config.json has no quantization_config)")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, t in read_tensors(src).items():
        module, _, suffix = name.rpartition(".")
        if _ROUTED_WEIGHT.fullmatch(module + ".weight") and suffix in (quant.data_suffix, "weight_scale",
                                                                        "weight_shape"):
            modules.setdefault(module, {})[suffix] = t
        else:
            dense[name] = t
    for module, tensors in modules.items():
        dense[f"{module}.weight"] = decompress_weight(tensors, quant).to(cfg.torch_dtype)
    return write_tensors(model_config_to_dict(cfg.replace(expert_quant=None)), dense, out_dir)
