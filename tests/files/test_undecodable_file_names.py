"""File names whose bytes are not UTF-8 (``b'bad\\xff.png'`` on Linux): the image and concept folder loaders skip
them with one warning that counts them, never a raw ``UnicodeEncodeError`` from an instance id, hash or report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from PIL import Image

from clova_train.datamodules import ConceptFolderDataModule
from clova_train.serving.predict import requests_from_folder
from clova_train.tools.images import SkippedNameWarning, list_images

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="file names are bytes on Linux (macOS refuses them)")


def image(path: bytes, colour: tuple[int, int, int]) -> None:
    Image.new("RGB", (8, 8), colour).save(os.fsdecode(path))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    base = os.fsencode(tmp_path)
    for concept, colour in ((b"red", (250, 0, 0)), (b"blue", (0, 0, 250)), (b"gr\xffen", (0, 250, 0))):
        os.mkdir(base + b"/" + concept)
        for name in (b"a.png", b"b.png", b"c.png"):
            image(base + b"/" + concept + b"/" + name, colour)
    for name in (b"z\xff.png", b"\xfe\xfd.jpg", b"a\xc3(.png"):  # last: a broken two-byte sequence
        image(base + b"/red/" + name, (240, 0, 0))
    return tmp_path


def test_images_with_undecodable_names_are_skipped_and_counted(root: Path) -> None:
    with pytest.warns(SkippedNameWarning, match=r"skipped 3 images whose name is not UTF-8 text \(first: b'"):
        found = list_images(root / "red")
    assert [p.name for p in found] == ["a.png", "b.png", "c.png"]


def test_concept_folder_data_skips_them_with_a_warning(root: Path) -> None:
    data = ConceptFolderDataModule(str(root), image_size=8, val_per_concept=1, chunk_size=2)
    with pytest.warns(SkippedNameWarning) as caught:
        instances = data.build_instances()
    messages = " ".join(str(w.message) for w in caught)
    assert "skipped 1 concept folder" in messages and "skipped 3 images" in messages
    ids = [item["instance_id"] for item in instances.items]
    assert sorted(ids) == ["blue/b.png", "blue/c.png", "red/b.png", "red/c.png"]
    for text in ids:
        text.encode("utf-8")


def test_predict_over_a_folder_skips_them(root: Path) -> None:
    with pytest.warns(SkippedNameWarning):
        requests = list(requests_from_folder(root / "red", "images", {"labels": ["red"]}))
    assert [Path(r["images"][0]).name for r in requests] == ["a.png", "b.png", "c.png"]
