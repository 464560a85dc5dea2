"""The README's Layout table names every module of the project, and every path it names exists.

A row's first code span is a path from the repository root; the bare names after it sit in the same folder; a
span ending in `/` names a whole folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("radixk3", "runtime", "kernels", "frontend_lang", "bench")


def layout_paths() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        first_cell = row.split(" | ")[0]
        spans = re.findall(r"`([^`]+)`", first_cell)
        folder = spans[0].rsplit("/", 1)[0] + "/" if "/" in spans[0].rstrip("/") else ""
        for span in spans:
            named.add(span if "/" in span else folder + span)
    return named


def test_every_named_path_exists() -> None:
    missing = sorted(p for p in layout_paths() if not (ROOT / p).exists())
    assert not missing, f"README Layout names paths that do not exist: {missing}"


def test_every_module_is_named() -> None:
    named = layout_paths()
    folders = tuple(p for p in named if p.endswith("/"))
    modules = sorted(
        str(f.relative_to(ROOT)) for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py") if f.name != "__init__.py"
    )
    unnamed = [m for m in modules if m not in named and not m.startswith(folders)]
    assert not unnamed, f"README Layout does not name: {unnamed}"
