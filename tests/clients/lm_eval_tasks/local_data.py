"""The tasks' data, read from the jsonl files beside this module (no download): lm-eval's `custom_dataset` hook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets


def load(data_file: str, **_: Any) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (Path(__file__).parent / data_file).read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
