"""The project's imports run one way, kernels <- radixk3 <- runtime <- frontend_lang, without cycles, and the
scheduler process reaches no model code. Read from source (tests/import_graph.py): function-level imports
count, `if TYPE_CHECKING:` ones do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import PACKAGES, ImportGraph, build

ROOT = Path(__file__).resolve().parent.parent

# The package's public entry points, the one exception to "radixk3 imports no runtime": `radixk3.Engine` and
# the errors (the package's lazy __getattr__), the `radixk3` console script, `python -m radixk3.launch_server`.
ENTRY_POINTS = frozenset({"radixk3", "radixk3.cli", "radixk3.launch_server"})

# The packages each package's modules may import.
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


def _shortest_chain(graph: ImportGraph, starts: list[str], goal: str) -> list[str]:
    chains = [[goal]] if goal in starts else [chain for start in starts if (chain := graph.path(start, goal))]
    return min(chains, key=len)


def test_the_graph_counts_function_level_imports_and_skips_type_checking_ones(tmp_path: Path) -> None:
    files = {
        "kernels/__init__.py": "",
        "kernels/a.py": "from typing import TYPE_CHECKING\nimport torch.nn\nif TYPE_CHECKING:\n    import kernels.b\n"
                        "\n\ndef f():\n    from kernels.c import g\n",
        "kernels/b.py": "",
        "kernels/c.py": "from kernels import a, b\n\n\ndef g():\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = build(tmp_path)
    assert graph.edges["kernels.a"] == {"kernels.c"}  # `g` is a name in kernels.c, b only under TYPE_CHECKING
    assert graph.edges["kernels.c"] == {"kernels.a", "kernels.b"}  # `from package import module`
    assert graph.external["kernels.a"] == {"typing", "torch"}
    assert graph.cycles() == [["kernels.a", "kernels.c", "kernels.a"]]


def test_no_import_cycles(graph: ImportGraph) -> None:
    cycles = [" -> ".join(cycle) for cycle in graph.cycles()]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_imports_run_one_way(graph: ImportGraph) -> None:
    # Direct imports suffice for the layers (a chain of allowed edges stays allowed), with the entry points
    # themselves importable only by each other: anything else importing one would reach the runtime.
    upward = []
    for module in sorted(set(graph.edges) - ENTRY_POINTS):
        allowed = MAY_REACH[module.split(".")[0]]
        entry_ok = module.startswith("frontend_lang")
        upward += [f"{module} -> {dep}" for dep in sorted(graph.edges[module])
                   if dep.split(".")[0] not in allowed or (dep in ENTRY_POINTS and not entry_ok)]
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
    reached = set().union(*(graph.closure(root) for root in roots))
    chains = [_shortest_chain(graph, roots, bad) for bad in sorted(reached) if _is_model_code(graph, bad)]
    # Only where a chain first enters model code: what lies behind it follows.
    found = [" -> ".join(c) for c in chains if not any(_is_model_code(graph, m) for m in c[:-1])]
    assert not found, "the scheduler process imports model code:\n" + "\n".join(found)
