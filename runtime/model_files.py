"""What a model directory gives the processes: its config and its tokenizer (the built-in model when no
directory is given)."""

from __future__ import annotations

from pathlib import Path

from radixk3.config import BUILTIN_PRESET, ModelConfig, preset
from radixk3.config_formats import load_model_config
from radixk3.tokenizer import Tokenizer, load_tokenizer
from runtime.server_args import ServerArgs


def model_config(args: ServerArgs) -> ModelConfig:
    return preset(BUILTIN_PRESET) if args.model is None else load_model_config(args.model)


def tokenizer_for(args: ServerArgs) -> Tokenizer:
    if args.model is not None and (Path(args.model) / "tokenizer.model").is_file():
        return load_tokenizer(Path(args.model) / "tokenizer.model")
    return load_tokenizer()
