"""The house's layering, read from the source: no import cycles (function-level imports included), no import that
points up a layer, and the core (selective/) imports nothing of the project."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import lcsb_cli

PACKAGE = Path(lcsb_cli.__file__).resolve().parent
# a module may import modules of its own layer or of lower ones; a module's layer is its top-level package's
LAYERS = [
    {"selective", "errors", "atomic", "window", "paths", "runtime", "host"},
    {"recipe"},
    {"methods", "objectives", "model", "data", "backends", "display", "rundir"},
    {"run", "evaluate", "bench", "generate", "chat", "export"},
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
    top = module.split(".")[1] if "." in module else None
    # lcsb_cli/__init__.py: above everything
    return next((index for index, names in enumerate(LAYERS) if top in names), len(LAYERS))


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
    assert layer_of("lcsb_cli.run.engine") > layer_of("lcsb_cli.rundir.checkpoint") > layer_of("lcsb_cli.recipe")


def test_a_library_import_leaves_logging_and_warnings_to_the_entry_point():
    """`import lcsb_cli` (and what a script imports to train) attaches no log handler and changes no warning display
    or filter of lcsb's, yet already keeps hub kernels out; the `lcsb` entry point (lcsb_cli.cli) takes stderr."""
    probe = (
        "import logging, os, warnings; show = warnings.showwarning; import lcsb_cli, lcsb_cli.run.engine; "
        "ours = any('lr_scheduler' in str(f[1]) for f in warnings.filters); "
        "print(logging.getLogger().handlers == [], warnings.showwarning is show, not ours, "
        "os.environ.get('USE_HUB_KERNELS')); import lcsb_cli.cli; "
        "print(logging.getLogger().handlers != [], warnings.showwarning is not show)"
    )
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["True", "True", "True", "NO", "True", "True"]


def test_architectures_layer_table_is_the_tests():
    """docs/ARCHITECTURE.md's table of layers says what may import what; it must be this test's table."""
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| (\d) \| (.+) \|$", text, flags=re.MULTILINE)
    documented = [{name.strip().replace("\\_", "_") for name in names.split(",")} for _, names in rows]
    assert [int(layer) for layer, _ in rows] == list(range(len(LAYERS)))
    assert documented == LAYERS
