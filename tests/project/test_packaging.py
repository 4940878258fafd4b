"""What a non-editable install ships: every package of the source tree is listed in setup.cfg (a package left out is
importable from a checkout and missing from the wheel, as clova_train.quickstart.real_size once was)."""

from __future__ import annotations

import configparser
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
