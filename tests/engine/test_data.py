"""Synthetic generator, concept-folder splits and the pending-chunk loader."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from clova_train.datamodules import ConceptFolderDataModule, PendingChunks, SyntheticConceptDataModule
from clova_train.synthetic.shapes import render_scene
from clova_train.tools.clip.synthetic import write_concept_folders
from clova_train.core.errors import DataError


def test_scene_labels_boxes_and_masks_agree() -> None:
    scene = render_scene([("red", "square"), ("blue", "circle")], size=64, rng=np.random.default_rng(0))
    assert scene.image.shape == (64, 64, 3) and len(scene.objects) == 2
    for obj in scene.objects:
        x0, y0, x1, y1 = obj.box
        ys, xs = np.nonzero(obj.mask)
        assert xs.min() >= x0 and xs.max() <= x1 and ys.min() >= y0 and ys.max() <= y1
        inside = scene.image[obj.mask].mean(0)
        assert inside.argmax() == {"red": 0, "blue": 2}[obj.colour]
    square = next(o for o in scene.objects if o.shape == "square")
    assert square.mask.sum() == (square.box[2] - square.box[0] + 1) * (square.box[3] - square.box[1] + 1)
    assert ("What colour is the square?", "red") in scene.qa_pairs and ("How many shapes are there?", "2") in scene.qa_pairs


def test_concept_folders_are_deterministic(tmp_path: Path) -> None:
    a = write_concept_folders(tmp_path / "a", ["red", "green_circle"], images_per_concept=3, image_size=16, seed=3)
    b = write_concept_folders(tmp_path / "b", ["green_circle"], images_per_concept=3, image_size=16, seed=3)
    assert sorted(p.name for p in (a / "red").iterdir()) == ["red_000.png", "red_001.png", "red_002.png"]
    for name in ("green_circle_000.png", "green_circle_002.png"):
        assert (a / "green_circle" / name).read_bytes() == (b / "green_circle" / name).read_bytes()
    with pytest.raises(ValueError, match="synthetic concept 'pink'"):
        write_concept_folders(tmp_path / "c", ["pink"])


def test_validation_images_are_never_trained_on(concept_root: Path) -> None:
    dm = ConceptFolderDataModule(str(concept_root), image_size=16, val_per_concept=2, negatives_per_instance=5)
    dm.setup()
    instances = dm.instances
    assert len(instances) == 4 * 4  # 6 images per concept, 2 validate
    val_files = {f for item in instances.items for f in item["val_files"]}
    train_files = {f for item in instances.items for f in item["image_files"]}
    assert not val_files & train_files
    for item in instances.items:
        assert item["candidates"][0] == item["concept"]
        assert len(set(item["candidates"])) == len(item["candidates"])  # distinct negative texts
        assert all(label != item["concept"] for label in item["labels"][1:])
        assert item["val_labels"][:2] == [item["concept"]] * 2
        assert [p.name for p in item["val_files"][:2]] == [f"{item['concept']}_000.png", f"{item['concept']}_001.png"]
    sample = instances[0]
    assert sample.images.shape == (6, 3, 16, 16) and float(sample.images.max()) <= 1.0


def test_negatives_spread_over_concepts_and_label_noise_flips_to_learned_ones(concept_root: Path) -> None:
    spread = ConceptFolderDataModule(str(concept_root), image_size=16, val_per_concept=2, negatives_per_instance=3,
                                     val_negatives_per_instance=3, spread_negatives=True)
    spread.setup()
    for item in spread.instances.items:  # 3 other concepts, 3 negatives: one of each
        assert sorted(item["labels"][1:]) == sorted(c for c in ("blue", "green", "purple", "red") if c != item["concept"])
        assert sorted(item["val_labels"][2:]) == sorted(item["labels"][1:])

    noisy = ConceptFolderDataModule(str(concept_root), concepts=["red", "green", "blue"], image_size=16,
                                    val_per_concept=2, negatives_per_instance=3, label_noise=0.5,
                                    spread_negatives=True)
    noisy.setup()
    flipped = [item for item in noisy.instances.items if not item["instance_id"].startswith(item["concept"] + "/")]
    assert 2 <= len(flipped) <= 10  # about half of 12
    for item in flipped:
        folder = item["instance_id"].split("/")[0]
        assert item["concept"] in {"red", "green", "blue"} - {folder}  # another learned concept, never purple
        assert item["image_files"][0].parent.name == folder  # the image is still the folder's
        assert item["val_labels"][:2] == [item["concept"]] * 2  # gated on the labelled concept's clean images
        assert {p.parent.name for p in item["val_files"][:2]} == {item["concept"]}
    clean = {i["instance_id"]: i for i in spread.instances.items}
    kept = [i for i in noisy.instances.items if i not in flipped]
    assert kept and all(clean[i["instance_id"]]["concept"] == i["concept"] for i in kept)
    with pytest.raises(DataError, match="label_noise"):
        ConceptFolderDataModule(str(concept_root), label_noise=1.0)


def test_explicit_train_val_split(concept_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(concept_root, root)
    red = root / "red"
    (red / "train").mkdir()
    (red / "val").mkdir()
    for image in sorted(red.glob("*.png")):
        shutil.move(image, red / ("val" if image.name.endswith("005.png") else "train") / image.name)
    dm = ConceptFolderDataModule(str(root), concepts=["red"], image_size=16, val_per_concept=2)
    dm.setup()
    assert [i["instance_id"] for i in dm.instances.items] == [f"red/red_00{k}.png" for k in range(5)]
    assert dm.instances.items[0]["val_files"][0].name == "red_005.png"


def test_negatives_root_supplies_negative_concepts(concept_root: Path, tmp_path: Path) -> None:
    negatives = write_concept_folders(tmp_path / "neg", ["orange"], images_per_concept=3, image_size=16)
    dm = ConceptFolderDataModule(str(concept_root), concepts=["red"], negatives_root=str(negatives), image_size=16)
    dm.setup()
    assert dm.instances.items[0]["candidates"] == ["red", "blue", "green", "orange", "purple"]
    assert all(i["concept"] == "red" for i in dm.instances.items)


def test_too_few_images_and_single_concept_are_explained(concept_root: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="has 6 image\\(s\\); val_per_concept=6 leaves none to train on"):
        ConceptFolderDataModule(str(concept_root), val_per_concept=6).setup()
    lonely = tmp_path / "lonely"
    shutil.copytree(concept_root / "red", lonely / "red")
    with pytest.raises(DataError, match="needs at least one negative concept"):
        ConceptFolderDataModule(str(lonely)).setup()


def test_synthetic_datamodule_renders_once(tmp_path: Path) -> None:
    dm = SyntheticConceptDataModule(str(tmp_path / "syn"), synthetic_concepts=["red", "blue"], images_per_concept=3,
                                    render_size=16, image_size=16)
    dm.prepare_data()
    first = (tmp_path / "syn" / "red" / "red_000.png").stat().st_mtime_ns
    dm.prepare_data()
    assert (tmp_path / "syn" / "red" / "red_000.png").stat().st_mtime_ns == first
    dm.setup()
    assert len(dm.instances) == 4


class FakeInstances:
    def __init__(self, n: int) -> None:
        self.instance_ids = [f"i{k}" for k in range(n)]

    def __len__(self) -> int:
        return len(self.instance_ids)

    def __getitem__(self, index: int) -> dict:
        return {"instance_id": self.instance_ids[index]}


def test_pending_chunks_skip_finished_and_split_ranks_evenly() -> None:
    data = FakeInstances(11)
    finished = {"i0", "i1", "i5"}
    per_rank = [list(PendingChunks(data, 3, lambda: finished, rank=r, world_size=2)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])  # equal step counts: the ranks meet in collectives
    seen = [item["instance_id"] for chunks in per_rank for chunk in chunks for item in chunk]
    assert sorted(seen) == sorted(set(data.instance_ids) - finished)
    assert per_rank[1][-1] == []  # 3 chunks over 2 ranks: rank 1 pads with an empty chunk


def test_pending_chunks_have_the_length_lightning_counts_on_every_rank() -> None:
    """The length is the epoch's batch count as Lightning counts it: on resume, the chunks the killed run had
    trained in the epoch (restored by Lightning as done) plus those still pending; the same on every rank."""
    data = FakeInstances(11)
    finished: set[str] = set()
    chunks = PendingChunks(data, 3, lambda: finished)
    assert chunks.pending_chunk_count() == len(chunks) == len(list(chunks)) == 4
    finished |= {"i0", "i1", "i2", "i3"}  # a resumed run: only the remaining instances are yielded...
    done = 2  # ...after the two chunks its checkpoint counts
    chunks = PendingChunks(data, 3, lambda: finished, chunks_done=lambda: done)
    assert len(list(chunks)) == chunks.pending_chunk_count() == 3
    assert len(chunks) == done + 3
    per_rank = [PendingChunks(data, 3, lambda: finished, rank=r, world_size=2, chunks_done=lambda: 1) for r in range(2)]
    assert [c.pending_chunk_count() for c in per_rank] == [len(list(c)) for c in per_rank] == [2, 2]
    assert [len(c) for c in per_rank] == [3, 3]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_chunk_loader_yields_exactly_its_length(workers: int) -> None:
    """Through a DataLoader, with workers too: Lightning ends the epoch at ``len(loader)`` batches."""
    from torch.utils.data import DataLoader

    from clova_train.datamodules.prompt_tuning.chunks import keep_chunk

    instances = []
    for rank in range(3):
        chunks = PendingChunks(FakeInstances(13), 2, frozenset, rank=rank, world_size=3)
        loader = DataLoader(chunks, batch_size=None, collate_fn=keep_chunk, num_workers=workers)
        batches = list(loader)
        assert len(loader) == len(batches) == 3  # 7 chunks over 3 ranks: 3 each, ranks 1 and 2 pad
        instances.append(sum(map(len, batches)))
    assert instances == [5, 4, 4]


def test_synthetic_root_rendered_differently_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "syn")
    SyntheticConceptDataModule(root, synthetic_concepts=["red", "blue"], images_per_concept=3, render_size=16).prepare_data()
    other = SyntheticConceptDataModule(root, synthetic_concepts=["red", "blue"], images_per_concept=5, render_size=16)
    with pytest.raises(DataError, match="'images_per_concept': 3.*not.*'images_per_concept': 5.*remove it or choose another"):
        other.prepare_data()


def test_synthetic_test_set_is_rendered_beside_the_training_root(tmp_path: Path) -> None:
    dm = SyntheticConceptDataModule(root=str(tmp_path / "concepts"), synthetic_concepts=["red", "blue"],
                                    images_per_concept=3, image_size=16, val_per_concept=1, test_images_per_concept=4)
    dm.prepare_data()
    test_root = tmp_path / "concepts_test"
    assert dm.test_root == test_root
    assert sorted(p.name for p in (test_root / "red").iterdir()) == [f"red_00{k}.png" for k in range(4)]
    training = (tmp_path / "concepts" / "red" / "red_000.png").read_bytes()
    assert (test_root / "red" / "red_000.png").read_bytes() != training  # another seed: other images
    batch = next(iter(dm.test_dataloader()))
    assert len(batch["files"]) == 8 and set(batch["labels"]) == {"red", "blue"}
