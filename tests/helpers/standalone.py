"""Running code as a user without clova-train would: a fresh interpreter, outside the repository, in which any
import of ``clova_train`` (or of the top-level packages it installs) fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

_BLOCKER = """
import importlib.abc, sys
class _NoClovaTrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("clova_train", "models", "envs", "datamodules"):
            raise ImportError(f"{name} is blocked: this code must run without clova-train")
        return None
sys.meta_path.insert(0, _NoClovaTrain())
"""


def run_without_package(code: str, cwd: Path, timeout: float = 300) -> Any:
    """Run ``code`` with clova-train blocked from import, in ``cwd``; it prints one JSON value last, returned here."""
    script = _BLOCKER + textwrap.dedent(code) + "\nassert not [m for m in sys.modules if m.startswith('clova_train')]\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
