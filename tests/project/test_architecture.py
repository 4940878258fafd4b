"""The layering rule of docs/architecture.md, checked with import-linter (contracts in setup.cfg).

``models/``, ``envs/`` and ``datamodules/`` install as ``clova_train.*`` through ``package_dir``, which
import-linter cannot follow on disk, so the package is mirrored into a temporary tree first.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAPPED = ("models", "envs", "datamodules")


def mirror_package(target: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "clova_train", target / "clova_train", ignore=skip)
    for name in MAPPED:
        shutil.copytree(REPO / name, target / "clova_train" / name, ignore=skip)
    shutil.copy(REPO / "setup.cfg", target / "setup.cfg")
    return target


def test_import_contracts_hold(tmp_path: Path) -> None:
    root = mirror_package(tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", "setup.cfg"], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


def test_contract_catches_a_layer_violation(tmp_path: Path) -> None:
    """The check is live: a foundation module importing a LightningModule breaks it."""
    root = mirror_package(tmp_path)
    pool = root / "clova_train" / "core" / "pool.py"
    pool.write_text(pool.read_text() + "\nfrom clova_train.models import prompt_tuning  # noqa\n")
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", "setup.cfg"], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "clova_train.core is not allowed to import clova_train.models" in result.stdout.replace("\n", " ")


LOOSE_MODULES = {"clova_train", "clova_train.cli", "clova_train.__main__"}


GRAPH_SCRIPT = """
import json, sys
import grimp
graph = grimp.build_graph("clova_train", cache_dir=None)
json.dump({m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
          | {"__packages__": sorted(m for m in graph.modules if graph.find_children(m))}, sys.stdout)
"""


class ImportGraph:
    """Who imports whom inside ``clova_train``, built by grimp in a fresh interpreter on the mirrored tree (this
    process has the installed package imported already)."""

    def __init__(self, edges: dict[str, list[str]], packages: list[str]) -> None:
        self.edges = {module: set(imported) for module, imported in edges.items()}
        self.modules = set(edges)
        self.packages = set(packages)

    def find_modules_directly_imported_by(self, module: str) -> set[str]:
        return self.edges[module]


def _graph(tmp_path: Path) -> ImportGraph:
    import json

    root = mirror_package(tmp_path)
    result = subprocess.run([sys.executable, "-c", GRAPH_SCRIPT], cwd=root, capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr[-2000:]
    edges = json.loads(result.stdout)
    packages = edges.pop("__packages__")
    assert any(m.startswith("clova_train.envs.") for m in edges), "grimp read the installed package, not the mirror"
    return ImportGraph(edges, packages)


def _layer_packages() -> set[str]:
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    layers = config["importlinter:contract:layers"]["layers"]
    return {f"clova_train.{name.strip()}" for line in layers.splitlines() for name in line.replace("|", ":").split(":") if name.strip()}


def test_every_module_sits_in_a_named_layer(tmp_path: Path) -> None:
    """The contract names packages only (plus the two loose entry modules), and every module is inside one of them:
    a new top-level module or package fails here until it is given a layer."""
    graph = _graph(tmp_path)
    named = _layer_packages()
    assert named - {"clova_train.cli", "clova_train.__main__"} <= graph.packages, \
        "the contract names a module where a package is expected"
    uncovered = sorted(m for m in graph.modules
                       if m not in LOOSE_MODULES and not any(m == p or m.startswith(p + ".") for p in named))
    assert not uncovered, f"modules outside every layer of setup.cfg's contract: {uncovered}"
    loose = sorted(m for m in graph.modules if m.count(".") == 1 and m not in graph.packages)
    assert set(loose) <= LOOSE_MODULES, f"loose modules at the top of clova_train/: {loose}"


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (function-level imports included)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative Tarjan: the graph is deep enough for recursion limits
        nonlocal counter
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles(tmp_path: Path) -> None:
    """No two modules import each other, directly or round a longer loop, even through imports inside functions."""
    assert _cycles(_graph(tmp_path)) == []


def test_cycle_finder_is_live() -> None:
    class Graph:
        modules = {"a", "b", "c"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}}

        def find_modules_directly_imported_by(self, module: str) -> set[str]:
            return self.edges[module]

    assert _cycles(Graph()) == [["a", "b", "c"]]
