"""A checkpoint's `generation_config.json`: the default sampling parameters its authors chose, and its eos ids.

Read as vLLM's `--generation-config auto` and SGLang's `--sampling-defaults model` read it: the sampling fields
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` become the defaults of every
request (a request's own values win), and `eos_token_id` (one id or a list) adds to the ids that end a
generation. transformers' `top_k: 0` (no cut-off) is SGLang's `-1`. Other fields (`do_sample`, `max_length`,
beam search ...) are transformers' `generate` settings with no meaning here and are ignored, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE_NAME = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass(frozen=True)
class GenerationConfig:
    sampling: dict[str, Any] = field(default_factory=dict)  # SGLang's names, only the fields the file sets
    eos_token_ids: tuple[int, ...] = ()


def load_generation_config(model_dir: str | Path | None) -> GenerationConfig:
    """The directory's generation_config.json, or an empty one (no file, or no directory: the built-in model).
    ValueError naming the file and the field for a value of the wrong type."""
    path = None if model_dir is None else Path(model_dir) / FILE_NAME
    if path is None or not path.is_file():
        return GenerationConfig()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path.name}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path.name}: expected a JSON object, got {type(raw).__name__}")
    sampling: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        integral = name in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise ValueError(f"{path.name}: {name} must be {'an integer' if integral else 'a number'}, got {value!r}")
        sampling[name] = -1 if name == "top_k" and value == 0 else value
    eos = raw.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos if isinstance(eos, list) else []
    if eos is not None and (not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids)):
        raise ValueError(f"{path.name}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return GenerationConfig(sampling, tuple(ids))


def write_generation_config(out_dir: str | Path, eos_token_ids: list[int], sampling: dict[str, Any]) -> Path:
    """Write `generation_config.json` as transformers saves one: the eos ids (one id as an int, several as a
    list), the default sampling fields (`SAMPLING_FIELDS`) and `do_sample` (true when the temperature samples)."""
    if unknown := sorted(set(sampling) - set(SAMPLING_FIELDS)):
        raise ValueError(f"{FILE_NAME}: unknown sampling fields {unknown}")
    raw: dict[str, Any] = {"eos_token_id": eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)}
    raw |= {"do_sample": bool(sampling.get("temperature", 0)), **sampling}
    path = Path(out_dir) / FILE_NAME
    path.write_text(json.dumps(raw, indent=2) + "\n")
    return path
