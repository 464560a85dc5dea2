"""Quantised routed-expert formats of compressed-tensors checkpoints, read from config.json's
`quantization_config` (`quant_method: compressed-tensors`).

Three formats, as the published checkpoints ship them (one weight matrix [rows, cols], cols the input dim):
- `mxfp4` (`format: mxfp4-pack-quantized`, Kimi K3): `weight_packed` uint8 [rows, cols/2], two e2m1 codes a
  byte (element 2i in the low nibble); `weight_scale` uint8 [rows, cols/32], an e8m0 exponent (2^(s-127)) per
  32 inputs.
- `int4` (`format: pack-quantized`, int 4-bit group 32 symmetric, Kimi K2-Thinking): `weight_packed` int32
  [rows, cols/8], eight (q + 8) nibbles a word (element i at bit 4i); `weight_scale` [rows, cols/32];
  `weight_shape` int64 [2] = (rows, cols).
- `fp8` (`format: float-quantized`, float 8-bit block 128x128, DeepSeek style): `weight` float8_e4m3fn
  [rows, cols]; `weight_scale` [ceil(rows/128), ceil(cols/128)], one per block.
The value is q * scale in the scale's dtype (compressed-tensors' `dequantize`). Only the routed experts may be
quantised here: every other layer is in `ignore` or not targeted (a quantised tensor elsewhere is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from radixk3.config import ConfigError

FORMATS = ("mxfp4", "int4", "fp8")
# compressed-tensors' `format` of each, and the weight args its config group carries.
CT_FORMAT = {"mxfp4": "mxfp4-pack-quantized", "int4": "pack-quantized", "fp8": "float-quantized"}
# The module attributes that hold a packed weight (never cast with the model), and their checkpoint suffixes.
DATA, SCALE, SHAPE = "q_data", "q_scale", "q_shape"
# Scale dtypes by name, with their bytes: names only, so that reading a config (the scheduler and tokenizer
# processes) does not import torch.
_SCALE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}
_DATA_DTYPES = {"mxfp4": ("uint8", 1), "int4": ("int32", 4), "fp8": ("float8_e4m3fn", 1)}
# What the routed experts' linears are called in the checkpoint (MTP layers included).
EXPERT_TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"


@dataclass(frozen=True)
class ExpertQuant:
    """One quantised format of the routed experts' weights."""

    kind: str  # one of FORMATS
    scale_dtype: str  # the dtype weight_scale is stored in ("uint8" for mxfp4's e8m0)

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ConfigError(f"unknown expert format {self.kind!r}; choose one of {list(FORMATS)}")

    @property
    def pack(self) -> int:
        """Values per stored element along the input dim."""
        return {"mxfp4": 2, "int4": 8, "fp8": 1}[self.kind]

    @property
    def data_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, _DATA_DTYPES[self.kind][0])

    @property
    def data_suffix(self) -> str:
        return "weight" if self.kind == "fp8" else "weight_packed"

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.scale_dtype)

    @property
    def group(self) -> tuple[int, int]:
        """(rows, cols) one scale covers."""
        return (128, 128) if self.kind == "fp8" else (1, 32)

    @property
    def has_shape(self) -> bool:
        return self.kind == "int4"

    def shapes(self, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(data shape, scale shape) of a [rows, cols] weight; ConfigError when cols do not pack."""
        gr, gc = self.group
        if self.kind != "fp8" and cols % gc:
            raise ConfigError(f"{self.kind} experts need an input dim that is a multiple of {gc}, got {cols}")
        return (rows, cols // self.pack), (-(-rows // gr), -(-cols // gc))

    def bytes_per_weight(self) -> Fraction:
        """Stored bytes per weight value, scales included (whole groups)."""
        gr, gc = self.group
        return (Fraction(_DATA_DTYPES[self.kind][1], self.pack)
                + Fraction(_SCALE_BYTES[self.scale_dtype], gr * gc))

    def row_index(self, part: slice, rows: int) -> tuple[slice, slice]:
        """(data index, scale index) along the rows for the rows `part` of a [rows, *] weight."""
        gr = self.group[0]
        _check_aligned(part, rows, gr, "output rows")
        return part, slice(part.start // gr, -(-part.stop // gr))

    def col_index(self, part: slice, cols: int) -> tuple[slice, slice]:
        """(data index, scale index) along the cols for the input columns `part` of a [*, cols] weight."""
        gc = self.group[1]
        _check_aligned(part, cols, gc, "input columns")
        return slice(part.start // self.pack, -(-part.stop // self.pack)), slice(part.start // gc, -(-part.stop // gc))

    def quantization_config(self, targets: list[str] | None = None) -> dict[str, Any]:
        """The config.json `quantization_config` of this format over `targets` (the routed experts)."""
        weights: dict[str, Any] = {"num_bits": 8 if self.kind == "fp8" else 4,
                                   "type": "int" if self.kind == "int4" else "float", "symmetric": True,
                                   "dynamic": False}
        if self.kind == "fp8":
            weights |= {"strategy": "block", "block_structure": [128, 128]}
        else:
            weights |= {"strategy": "group", "group_size": 32}
        if self.kind == "mxfp4":
            weights |= {"scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}
        return {"quant_method": "compressed-tensors", "format": CT_FORMAT[self.kind],
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": targets or [EXPERT_TARGET], "weights": weights,
                                              "input_activations": None, "output_activations": None}},
                "ignore": ["lm_head"]}


def _check_aligned(part: slice, size: int, unit: int, what: str) -> None:
    if part.start % unit or (part.stop % unit and part.stop != size):
        raise ConfigError(f"a tensor-parallel shard [{part.start}, {part.stop}) of the routed experts' {size} {what} "
                          f"would split a quantisation group of {unit}: choose --tp / --ep so that each shard of "
                          "moe_intermediate_size is a multiple of it")


def _scheme_kind(fmt: str, weights: dict[str, Any], where: str) -> str:
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    group, block = weights.get("group_size"), weights.get("block_structure")
    if fmt == CT_FORMAT["mxfp4"] and (bits, kind, group) == (4, "float", 32):
        return "mxfp4"
    if fmt == CT_FORMAT["int4"] and (bits, kind, strategy, group) == (4, "int", "group", 32):
        if weights.get("symmetric", True) is not True:
            raise ConfigError(f"{where}: asymmetric int4 (zero points) is not supported")
        return "int4"
    if fmt == CT_FORMAT["fp8"] and (bits, kind, strategy) == (8, "float", "block") and list(block or []) == [128, 128]:
        return "fp8"
    raise ConfigError(f"{where}: format {fmt!r} with weights {weights} is not supported; radixk3 reads "
                      "mxfp4-pack-quantized (fp4, group 32), pack-quantized (int4, group 32, symmetric) and "
                      "float-quantized (fp8, 128x128 blocks)")


def parse_quantization_config(raw: Any, model_dtype: str) -> ExpertQuant | None:
    """The experts' format from config.json's `quantization_config` (None when there is none). One config group
    (the routed experts); scales in `scale_dtype` or else the model's dtype, as compressed-tensors stores them."""
    if raw is None:
        return None
    where = "config.json quantization_config"
    if not isinstance(raw, dict) or raw.get("quant_method") != "compressed-tensors":
        method = raw.get("quant_method") if isinstance(raw, dict) else raw
        raise ConfigError(f"{where}: quant_method {method!r} is not supported (compressed-tensors only)")
    groups = raw.get("config_groups")
    if groups is None and raw.get("format") == CT_FORMAT["mxfp4"]:
        return ExpertQuant("mxfp4", "uint8")  # the format alone fixes the scheme: e2m1, an e8m0 scale per 32
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ConfigError(f"{where}.config_groups: expected one group (the routed experts), got {groups!r}")
    (name, group), = groups.items()
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise ConfigError(f"{where}.config_groups.{name}.weights is missing")
    for act in ("input_activations", "output_activations"):
        if group.get(act) is not None:
            raise ConfigError(f"{where}.config_groups.{name}.{act}: activation quantisation is not supported")
    kind = _scheme_kind(str(raw.get("format")), weights, f"{where}.config_groups.{name}")
    scale = weights.get("scale_dtype")
    scale_dtype = "uint8" if kind == "mxfp4" else str(scale).removeprefix("torch.") if scale else model_dtype
    if scale_dtype not in _SCALE_BYTES:
        raise ConfigError(f"{where}.config_groups.{name}.weights.scale_dtype {scale!r} is not supported")
    return ExpertQuant(kind, scale_dtype)

