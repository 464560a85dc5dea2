"""The project's import graph, read from source with `ast` (nothing is imported): which project modules each
module imports, at module level or inside a function (both run, sooner or later), leaving out imports under
`if TYPE_CHECKING:` (they never run); and the third-party top-level packages each module imports.

Edges go to the module named, not to its parent packages (Python runs a parent's `__init__` first, but an
import of `a.b` never re-enters `a` half-initialised through that edge); `from a.b import c` imports the
submodule `a.b.c` when there is one, else `a.b`.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("radixk3", "kernels", "runtime", "frontend_lang")


@dataclass(frozen=True, repr=False)
class ImportGraph:
    edges: dict[str, frozenset[str]]  # project module -> project modules it imports
    external: dict[str, frozenset[str]]  # project module -> top-level third-party/stdlib packages it imports

    def __repr__(self) -> str:  # short, for pytest's failure reports
        return f"ImportGraph({len(self.edges)} modules)"

    def closure(self, start: str) -> set[str]:
        """Every project module that importing `start` can run (itself included)."""
        seen, todo = {start}, [start]
        while todo:
            for dep in self.edges[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    def path(self, start: str, goal: str) -> list[str] | None:
        """A shortest import chain start -> ... -> goal (with goal == start: a shortest cycle through start)."""
        prev: dict[str, str] = {}
        todo = deque([start])
        while todo:
            mod = todo.popleft()
            for dep in sorted(self.edges[mod]):
                if dep == goal:
                    chain = [dep, mod]
                    while chain[-1] != start:
                        chain.append(prev[chain[-1]])
                    return chain[::-1]
                if dep not in prev and dep != start:
                    prev[dep] = mod
                    todo.append(dep)
        return None

    def cycles(self) -> list[list[str]]:
        """One shortest cycle through each module that lies on a cycle, deduplicated (a -> b -> a once)."""
        found: dict[frozenset[str], list[str]] = {}
        for mod in sorted(self.edges):
            cycle = self.path(mod, mod)
            if cycle is not None:
                found.setdefault(frozenset(cycle), cycle)
        return list(found.values())


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the project's packages."""
    files = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):  # a package absent under root has no modules
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_imports(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The Import/ImportFrom nodes among `nodes` and below that can run: all but an `if TYPE_CHECKING:` body's."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _run_imports(node.orelse)
        else:
            yield from _run_imports(ast.iter_child_nodes(node))


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names `node` may import: each `import a.b`; for `from a.b import c`, `a.b.c` and `a.b`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        # Relative: `.` is this module's package (the module itself when it is a package's __init__).
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _top_packages(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The top-level packages an absolute import names (a relative one stays inside the project)."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    return [node.module.split(".")[0]] if node.level == 0 and node.module else []


def build(root: Path) -> ImportGraph:
    files = module_files(root)
    edges, external = {}, {}
    for module, path in files.items():
        deps: set[str] = set()
        outside: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _run_imports(tree.body):
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                base, *submodules = names
                # `from a.b import c` reaches a.b.c when that is a module, else the name c defined in a.b.
                project = [name for name in submodules if name in files]
                if len(project) < len(submodules) and base in files:
                    project.append(base)
            else:
                project = [name for name in names if name in files]
            deps.update(project)
            outside.update(top for top in _top_packages(node) if top not in PACKAGES)
        deps.discard(module)
        edges[module] = frozenset(deps)
        external[module] = frozenset(outside)
    return ImportGraph(edges, external)
