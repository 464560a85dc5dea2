"""What an engine serves when no model is named, and models named by a preset.

The built-in model is a small K3-format model trained on the gsm8k text the project ships, committed with the recipe
that made it (`radixk3/assets/k3-gsm8k/recipe.json`; `python bench/train_spec_pair.py --write-builtin` remakes it),
so a first `make run` writes gsm8k-like English. A model argument that names a preset (`k3-tiny`, `k3-tiny-native`,
`k3-small`) and is not a directory runs that preset with seeded random weights: what tests and benches use.
`RADIXK3_DEFAULT_MODEL` (a directory or a preset name) replaces the built-in model as the default; the test suite
sets it to `k3-tiny`. The default is resolved to a name once, where the engine's arguments are made (each node of a
multi-node engine makes its own: name the model on every node)."""

from __future__ import annotations

import os
from pathlib import Path

from radixk3.config import PRESETS, TRUE_SIZE_PRESETS

BUILTIN_MODEL_DIR = Path(__file__).parent / "assets" / "k3-gsm8k"
BUILTIN_MODEL_NAME = "k3-gsm8k"  # the model id the server reports for it
DEFAULT_MODEL_ENV = "RADIXK3_DEFAULT_MODEL"


def default_model() -> str:
    """The model an engine given none serves: the environment's choice, else the built-in model's name."""
    return os.environ.get(DEFAULT_MODEL_ENV, "").strip() or BUILTIN_MODEL_NAME


def random_preset(model: str | None) -> str | None:
    """The preset `model` names, served with random weights; None for a checkpoint directory or the built-in
    model. ValueError for a true-size preset (its weights would not fit: those exist for memory plans)."""
    if model is None or model not in PRESETS or Path(model).exists():
        return None
    if model in TRUE_SIZE_PRESETS:
        raise ValueError(f"--model-path {model}: a true-size preset, for `radixk3 plan` only; random weights of "
                         f"that size are not built (serve a checkpoint directory, or a test preset: "
                         f"{', '.join(sorted(set(PRESETS) - TRUE_SIZE_PRESETS))})")
    return model


def checkpoint_dir(model: str | None) -> str | None:
    """The directory a model's files come from: the built-in model's for None or its name (unless a directory of
    that name exists), None for a random preset."""
    if model is None or (model == BUILTIN_MODEL_NAME and not Path(model).exists()):
        return str(BUILTIN_MODEL_DIR)
    return None if random_preset(model) is not None else model
