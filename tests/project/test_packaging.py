"""What a non-editable install ships: every package of the source tree is listed in setup.cfg (a package left out is
importable from a checkout and missing from the wheel, as a subpackage once was); the built wheel holds the package
and nothing else, and requires exactly what it imports."""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def _source_packages() -> set[str]:
    """Dotted names of every folder holding an __init__.py, mapped through setup.cfg's package_dir."""
    roots = {}
    for line in _setup_cfg()["options"]["package_dir"].strip().splitlines():
        name, _, folder = (part.strip() for part in line.partition("="))
        roots[folder] = name
    found = set()
    for folder, name in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((name, *relative)))
    return found


def test_every_source_package_is_listed_for_the_wheel() -> None:
    listed = {line.strip() for line in _setup_cfg()["options"]["packages"].strip().splitlines()}
    missing = sorted(_source_packages() - listed)
    assert not missing, f"packages missing from setup.cfg [options] packages (absent from a wheel install): {missing}"
    stale = sorted(listed - _source_packages())
    assert not stale, f"setup.cfg lists packages with no folder: {stale}"


# Requirements the package needs at run time without importing them itself.
USED_WITHOUT_IMPORT = {
    "tensorboard": "the configs' TensorBoardLogger, which Lightning imports by class path",
    "python-multipart": "FastAPI's parser of the HTTP API's multipart uploads",
}
# Scaffolding that must stay out of the wheel: benchmark-only builders and probes, tests, benchmarks.
NOT_SHIPPED = ("real_size", "benchmarks/", "tests/", "conftest")


def _requirement_name(line: str) -> str:
    return re.split(r"[\s;<>=!~\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_the_wheel_ships_only_the_package_and_requires_what_it_imports(tmp_path: Path) -> None:
    """Build the wheel from a copy of the sources (as pip would), then read it: no scaffolding among its files, and
    its requirements are exactly the third-party distributions its modules import, plus the two used by name."""
    import importlib.metadata
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "setup.py", "README.md", "clova_train", "models", "envs", "datamodules"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("clova_train-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
        metadata = archive.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    shipped = [f for f in files if not f.startswith("clova_train-")]
    assert shipped and all(f.startswith("clova_train/") for f in shipped), sorted(set(f.split("/")[0] for f in shipped))
    assert not [f for f in shipped if any(part in f for part in NOT_SHIPPED)]
    assert any(f.startswith("clova_train/envs/worlds/") and f.endswith(".yaml") for f in shipped)  # package data
    assert "clova_train/py.typed" in shipped  # type checkers read the package's annotations (PEP 561)
    assert any(f.startswith("clova_train/tools/clip/") and f.endswith("recipe.py") for f in shipped)  # tool folders
    required = {_requirement_name(line.split(":", 1)[1]) for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}

    distributions = importlib.metadata.packages_distributions()
    imported = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in shipped:
            if not name.endswith(".py"):
                continue
            for node in ast.walk(ast.parse(archive.read(name).decode())):
                modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                           [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for module in modules:
                    top = module.split(".")[0]
                    if top != "clova_train" and top not in sys.stdlib_module_names:
                        imported |= {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
    assert imported - required == set(), f"imported but not required: {sorted(imported - required)}"
    assert required - imported == set(USED_WITHOUT_IMPORT), (
        f"required but never imported: {sorted(required - imported - set(USED_WITHOUT_IMPORT))}")
