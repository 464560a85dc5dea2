from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixk3.checkpoint import write_random_checkpoint
from radixk3.config import preset


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return write_random_checkpoint(preset("k3-tiny"), tmp_path_factory.mktemp("k3-tiny"), seed=1)
