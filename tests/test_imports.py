"""The project's imports run one way, kernels <- radixk3 <- runtime <- frontend_lang, without cycles, and the
scheduler process reaches no model code. Read from source (tests/import_graph.py): function-level imports
count, `if TYPE_CHECKING:` ones do not."""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import PACKAGES, ImportGraph, build

ROOT = Path(__file__).resolve().parent.parent

# The package's public entry points, the one exception to "radixk3 imports no runtime": `radixk3.Engine` and
# the errors (the package's lazy __getattr__), the `radixk3` console script, `python -m radixk3.launch_server`.
ENTRY_POINTS = frozenset({"radixk3", "radixk3.cli", "radixk3.launch_server"})

# What each package's modules may reach, through any chain of imports.
MAY_REACH = {
    "kernels": {"kernels"},
    "radixk3": {"kernels", "radixk3"},
    "runtime": {"kernels", "radixk3", "runtime"},
    "frontend_lang": set(PACKAGES),
}

# Model code: the forward pass and what runs it. Kernels count too, except torch-free leaf modules.
MODEL_CODE = ("radixk3.model", "radixk3.layers", "radixk3.attention_backend", "radixk3.forward_batch",
              "runtime.worker")
TENSOR_LIBRARIES = {"torch", "triton"}


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build(ROOT)


def _chain(graph: ImportGraph, start: str, goal: str) -> str:
    return " -> ".join(graph.path(start, goal) or [start, goal])


def test_the_graph_sees_function_level_imports_and_skips_type_checking_ones(graph: ImportGraph) -> None:
    # Sanity: radixk3's lazy __getattr__ imports the Engine inside a function; the scheduler's Req imports
    # runtime.grammar only under TYPE_CHECKING (and nowhere else).
    assert "runtime.tokenizer.engine" in graph.edges["radixk3"]
    assert "runtime.grammar" not in graph.edges["runtime.scheduler.request"]
    assert set(graph.edges) >= {"kernels.moe", "radixk3.config", "runtime.scheduler.scheduler", "frontend_lang.ir"}


def test_no_import_cycles(graph: ImportGraph) -> None:
    cycles = [" -> ".join(cycle) for cycle in graph.cycles()]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_imports_run_one_way(graph: ImportGraph) -> None:
    upward = []
    for module in sorted(graph.edges):
        if module in ENTRY_POINTS:
            continue
        allowed = MAY_REACH[module.split(".")[0]]
        upward += [_chain(graph, module, reached) for reached in sorted(graph.closure(module))
                   if reached.split(".")[0] not in allowed]
    assert not upward, "imports against kernels <- radixk3 <- runtime <- frontend_lang:\n" + "\n".join(upward)


def test_only_the_entry_points_are_exempt(graph: ImportGraph) -> None:
    # Keeps the allow-list honest: each entry point exists and does reach the runtime.
    for module in ENTRY_POINTS:
        assert any(reached.startswith("runtime.") for reached in graph.closure(module)), module


def _is_model_code(graph: ImportGraph, module: str) -> bool:
    if module.startswith(MODEL_CODE):
        return True
    if module.startswith("kernels."):
        return any(graph.external[dep] & TENSOR_LIBRARIES for dep in graph.closure(module))
    return False


def test_the_scheduler_process_reaches_no_model_code(graph: ImportGraph) -> None:
    roots = ["runtime.scheduler_main", *(m for m in sorted(graph.edges) if m.startswith("runtime.scheduler."))]
    found = {(_chain(graph, root, reached)) for root in roots for reached in graph.closure(root)
             if _is_model_code(graph, reached)}
    assert not found, "the scheduler process imports model code:\n" + "\n".join(sorted(found))
