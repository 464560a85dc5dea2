"""Kernel tests: make this folder's helper modules (seeded inputs) importable by name."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
