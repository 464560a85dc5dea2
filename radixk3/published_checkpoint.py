"""A random checkpoint in the layout Kimi's published ones have (`radixk3 make-checkpoint --tokenizer ...`):
config.json in the preset's format (nested K3, or flat Kimi-Linear) with compressed-tensors'
`quantization_config` when the routed experts are packed (written by the library's own compressors,
`quant_checkpoint`), sharded safetensors with `model.safetensors.index.json`, the tokenizer (Kimi's
`tiktoken.model` + `tokenizer_config.json`, or the built-in sentencepiece `tokenizer.model`), Kimi's Jinja chat
template for the Kimi-Linear format (K3 carries no template: its encoding is code), and `generation_config.json`.

The config's `vocab_size` and bos / eos / pad ids are the written tokenizer's (for tiktoken: 3840 ids and the
writer's special ids; K3's image placeholder at `<|media_pad|>`). generation_config.json ends a turn where the
published ones do (K3: `<|end_of_msg|>`; Kimi-Linear: `<|im_end|>`) and carries default sampling parameters.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from radixk3.chat_template import write_chat_template
from radixk3.config import ModelConfig, preset
from radixk3.generation_config import write_generation_config
from radixk3.tiktoken_writer import (
    BOS,
    EOS,
    PAD,
    SPECIAL_OFFSETS,
    TINY_TIKTOKEN_BASE,
    TINY_TIKTOKEN_VOCAB_SIZE,
    write_tiktoken_tokenizer,
)
from radixk3.tokenizer import MODEL_FILENAME, load_tokenizer

TOKENIZERS = ("tiktoken", "sentencepiece")
EXPERT_FORMATS = ("mxfp4", "int4", "fp8", "none")
# Default sampling of the written generation_config.json: K3 thinks by default and samples as Kimi's thinking
# models recommend (temperature 1.0); the Kimi-Linear format is an Instruct model (temperature 0.6, as Kimi's
# Instruct models recommend).
K3_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 0.95}
INSTRUCT_SAMPLING: dict[str, Any] = {"temperature": 0.6, "top_p": 1.0}
_MEDIA_PAD = next(k for k, v in SPECIAL_OFFSETS.items() if v == "<|media_pad|>")


def _offset(name: str) -> int:
    return TINY_TIKTOKEN_BASE + next(k for k, v in SPECIAL_OFFSETS.items() if v == name)


def config_for_tokenizer(cfg: ModelConfig, tokenizer: str) -> ModelConfig:
    """`cfg` with the vocabulary and special ids of the tokenizer radixk3 writes (`TOKENIZERS`); the
    sentencepiece one is the built-in tokenizer the presets are sized for."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    if tokenizer == "sentencepiece":
        return cfg
    vision = cfg.vision
    if vision is not None and vision.media_placeholder_token_id is not None:
        vision = dataclasses.replace(vision, media_placeholder_token_id=TINY_TIKTOKEN_BASE + _MEDIA_PAD)
    return dataclasses.replace(cfg, vocab_size=TINY_TIKTOKEN_VOCAB_SIZE, bos_token_id=_offset(BOS),
                               eos_token_id=_offset(EOS), pad_token_id=_offset(PAD), vision=vision)


def write_published_checkpoint(preset_name: str, out_dir: str | Path, *, tokenizer: str,
                               expert_format: str = "none", num_shards: int = 1, seed: int = 0) -> Path:
    """A seeded random checkpoint of `preset_name` in the published layout (see the module's docstring)."""
    from radixk3.model import build_model
    from radixk3.quant_checkpoint import write_quantised_checkpoint

    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"--expert-format must be one of {', '.join(EXPERT_FORMATS)}, got {expert_format!r}")
    cfg = config_for_tokenizer(preset(preset_name), tokenizer)
    out = write_quantised_checkpoint(build_model(cfg, seed=seed), out_dir, expert_format, num_shards=num_shards)
    if tokenizer == "tiktoken":
        (out / MODEL_FILENAME).unlink(missing_ok=True)  # the weights' writer puts the built-in one in
        write_tiktoken_tokenizer(out)
    if not cfg.is_k3_format:
        write_chat_template(out)
    tok = load_tokenizer(out)
    end = tok.end_of_msg_id if cfg.is_k3_format else tok.im_end_id
    if end is None:
        raise ValueError(f"the {tokenizer} tokenizer names no end-of-turn marker for {preset_name}")
    write_generation_config(out, [end], K3_SAMPLING if cfg.is_k3_format else INSTRUCT_SAMPLING)
    return out
