"""The layering rule of README "Architecture", checked with import-linter (contracts in setup.cfg).

``models/``, ``envs/`` and ``datamodules/`` install as ``clova_train.*`` through ``package_dir``, which
import-linter cannot follow on disk, so the package is mirrored into a temporary tree first.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
