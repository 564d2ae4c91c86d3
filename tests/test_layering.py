"""The house's layering, read from the source: no import cycles (function-level imports included), no import that
points up a layer, and the core (selective/) imports nothing of the project."""

from __future__ import annotations

import ast
from pathlib import Path

import lcsb_cli

PACKAGE = Path(lcsb_cli.__file__).resolve().parent
LAYERS = [  # a module may import modules of its own layer or of lower ones (by its first name under lcsb_cli)
    {"selective", "errors", "atomic", "window"},
    {"recipe"},
    {"methods", "models", "gguf_in", "gguf_out", "streamed", "memory", "losses", "data", "backends", "report",
     "checkpoint", "distributed", "divergence", "summary"},
    {"engine", "per_user", "overnight", "rundir", "resume", "evaluate", "bench", "bench_workers", "export"},
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
    top = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if top in names) if top != "__init__" else len(LAYERS)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
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
    assert all(layer_of(module) <= len(LAYERS) for module in project_imports())


def test_no_import_cycles():
    assert find_cycle(project_imports()) is None, " -> ".join(find_cycle(project_imports()))


def test_imports_point_down_only():
    upward = [f"{a} -> {b}" for a, targets in project_imports().items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, upward


def test_the_core_imports_nothing_of_the_project():
    graph = project_imports()
    outside = {b for a, targets in graph.items() if a.startswith("lcsb_cli.selective") for b in targets
               if not b.startswith("lcsb_cli.selective")}
    assert not outside, outside


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a made-up graph with both defects is caught."""
    graph = {"lcsb_cli.recipe": {"lcsb_cli.engine"}, "lcsb_cli.engine": {"lcsb_cli.recipe"}}
    assert find_cycle(graph) == ["lcsb_cli.engine", "lcsb_cli.recipe", "lcsb_cli.engine"]
    assert layer_of("lcsb_cli.engine") > layer_of("lcsb_cli.recipe")
