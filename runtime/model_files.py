"""What a model directory gives the processes: its config, its tokenizer, the ids that end a generation and the
default sampling parameters of its generation_config.json (`radixk3.builtin_model`: the built-in model when no
model is named, a preset's random weights when one is)."""

from __future__ import annotations

from radixk3.builtin_model import checkpoint_dir, random_preset
from radixk3.config import ModelConfig, preset
from radixk3.config_formats import load_model_config
from radixk3.generation_config import FILE_NAME, load_generation_config
from radixk3.tokenizer import Tokenizer, checkpoint_tokenizer
from radixk3.vision.config import has_vision_weights
from runtime.errors import InvalidRequest
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs


def model_config(args: ServerArgs) -> ModelConfig:
    if (name := random_preset(args.model)) is not None:
        return preset(name).replace(vision=None)  # a random preset's vision_config comes without a tower
    directory = checkpoint_dir(args.model)
    cfg = load_model_config(directory)
    if cfg.vision is not None and not has_vision_weights(directory):
        return cfg.replace(vision=None)  # a vision_config without the tower's tensors: text only
    return cfg


def tokenizer_for(args: ServerArgs) -> Tokenizer:
    """The model directory's tokenizer by `--tokenizer-mode` (`radixk3.tokenizer.checkpoint_tokenizer`)."""
    return checkpoint_tokenizer(checkpoint_dir(args.model), args.tokenizer_mode, args.trust_remote_code)


def stop_ids(args: ServerArgs, tok: Tokenizer, cfg: ModelConfig) -> frozenset[int]:
    """The ids that end a generation (unless a request ignores eos): the tokenizer's stop markers, the config's
    eos, and generation_config.json's eos ids."""
    generation = load_generation_config(checkpoint_dir(args.model))
    return frozenset(tok.stop_ids) | {cfg.eos_token_id} | set(generation.eos_token_ids)


def sampling_defaults(args: ServerArgs) -> dict[str, object]:
    """Every request's default sampling parameters beneath its own (`--sampling-defaults`): generation_config.json's
    with `model`, none with `openai`. ValueError naming the file's field if the file's values are out of range."""
    if args.sampling_defaults != "model":
        return {}
    defaults = load_generation_config(checkpoint_dir(args.model)).sampling
    try:
        SamplingParams.from_dict(defaults)
    except InvalidRequest as e:
        raise ValueError(f"{FILE_NAME}: {e.message}") from None
    return defaults
