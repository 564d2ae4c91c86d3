"""The house's layering, read from the source: no import cycles (function-level imports included), no import that
points up a layer, and the core (selective/) imports nothing of the project."""

from __future__ import annotations

import ast
from pathlib import Path

import lcsb_cli

PACKAGE = Path(lcsb_cli.__file__).resolve().parent
# a module may import modules of its own layer or of lower ones; a module's layer is that of the longest
LAYERS = [
    # name below lcsb_cli that the table holds (run.checkpoint before run)
    {"selective", "errors", "atomic", "window", "paths", "runtime", "host"},
    {"recipe", "recipe_schema", "recipe_yaml"},
    {
        "methods",
        "objectives",
        "model",
        "data",
        "backends",
        "report",
        "run.checkpoint",
        "run.distributed",
        "run.divergence",
        "run.rundir",
        "run.summary",
    },
    {"run", "evaluate", "bench", "generate", "chat"},
    {"cli", "__main__"},
]


def module_name(path: Path) -> str:
    parts = ["lcsb_cli", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports() -> dict[str, set[str]]:
    """Every module of the package -> the project modules it imports anywhere in its body."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.startswith("lcsb_cli")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.startswith("lcsb_cli"):
                    origin = node.module
                else:
                    continue
                for alias in node.names:
                    targets.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in files else origin)
        graph[name] = {target for target in targets if target in files and target != name}
    return graph


def layer_of(module: str) -> int:
    parts = module.split(".")[1:]
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        for index, names in enumerate(LAYERS):
            if name in names:
                return index
    # lcsb_cli/__init__.py: above everything
    return len(LAYERS)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_has_a_layer():
    unplaced = [m for m in project_imports() if m != "lcsb_cli" and layer_of(m) == len(LAYERS)]
    assert not unplaced, unplaced


def test_no_file_over_400_lines():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long


def test_no_import_cycles():
    assert find_cycle(project_imports()) is None, " -> ".join(find_cycle(project_imports()))


def test_imports_point_down_only():
    upward = [f"{a} -> {b}" for a, targets in project_imports().items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, upward


def test_the_core_imports_nothing_of_the_project():
    graph = project_imports()
    outside = {
        b
        for a, targets in graph.items()
        if a.startswith("lcsb_cli.selective")
        for b in targets
        if not b.startswith("lcsb_cli.selective")
    }
    assert not outside, outside


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a made-up graph with both defects is caught."""
    graph = {"lcsb_cli.recipe": {"lcsb_cli.run.engine"}, "lcsb_cli.run.engine": {"lcsb_cli.recipe"}}
    assert find_cycle(graph) == ["lcsb_cli.recipe", "lcsb_cli.run.engine", "lcsb_cli.recipe"]
    assert layer_of("lcsb_cli.run.engine") > layer_of("lcsb_cli.recipe")
    assert layer_of("lcsb_cli.run.engine") > layer_of("lcsb_cli.run.checkpoint") > layer_of("lcsb_cli.recipe")
