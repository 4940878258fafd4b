"""An earlier commit's package laid out as installed, for benchmarks that time this checkout against it: the source
folders from ``git archive``, with setup.cfg's ``package_dir`` folders (``models``, ``envs``, ``datamodules``) moved
inside ``clova_train``, ready for PYTHONPATH."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAPPED = ("models", "envs", "datamodules")  # installed as clova_train.<name>


def package_at(commit: str, workdir: Path) -> Path:
    """``commit``'s package laid out under ``workdir`` as installed; the folder to put on PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "clova_train", *MAPPED],
                             check=True, capture_output=True).stdout
    source, layout = workdir / f"{commit}-src", workdir / commit
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    layout.mkdir()
    os.rename(source / "clova_train", layout / "clova_train")
    for folder in MAPPED:
        os.rename(source / folder, layout / "clova_train" / folder)
    return layout
