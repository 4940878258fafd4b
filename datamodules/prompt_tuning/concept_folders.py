"""Concept image folders for the CLIP SELECT / CLASSIFY prompt tuner.

Layout: ``root/<concept>/*.png|jpg|jpeg|webp``. The folder name is the concept (``red_circle`` is the
text "red circle"). Which images validate is explicit and they are never trained on:

* if ``root/<concept>/train/`` and ``root/<concept>/val/`` exist, they are the splits;
* otherwise the files are sorted by name and the first ``val_per_concept`` validate (the paper uses the
  first of 7 crawled images), the rest train.

Every training image of a learned concept is one instance with its own prompt: a
:class:`~clova_train.tools.clip.tool.ClipInstance` with id ``"<concept>/<file name>"``, the concept and its
distinct negative concepts as candidates, the positive image then ``K`` negative training images, and the
held-out positives of the concept and held-out negatives for the gate.

Negative concepts are the other concepts under ``root`` plus, when given, the concepts under
``negatives_root`` (same layout; those are never learned).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from clova_train.core.errors import DataError
from clova_train.datamodules.prompt_tuning.chunks import PromptTuningDataModule
from clova_train.tools.clip.tool import ClipInstance
from clova_train.tools.images import IMAGE_SUFFIXES, check_image, list_images, load_image, text_named

__all__ = ["ConceptFolderDataModule", "SyntheticConceptDataModule", "check_image", "list_images", "load_image"]


TEST_SEED_OFFSET = 7_919  # rendered test images use render_seed + this: never the training images' seed


@dataclass(frozen=True)
class ConceptSplit:
    """The train and validation images of one concept."""

    concept: str
    train: tuple[Path, ...]
    val: tuple[Path, ...]


def split_concept(folder: Path, val_per_concept: int) -> ConceptSplit:
    """Split one concept folder (see module docstring)."""
    if not folder.is_dir():
        raise DataError(f"concept folder not found: {folder}")
    train_dir, val_dir = folder / "train", folder / "val"
    if train_dir.is_dir() and val_dir.is_dir():
        train, val = list_images(train_dir), list_images(val_dir)
    else:
        files = list_images(folder)
        if not files:
            raise DataError(f"concept folder {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        if len(files) <= val_per_concept:
            raise DataError(
                f"concept folder {folder} has {len(files)} image(s); val_per_concept={val_per_concept} "
                "leaves none to train on"
            )
        val, train = files[:val_per_concept], files[val_per_concept:]
    if not train or not val:
        raise DataError(f"concept folder {folder} needs at least one training and one validation image")
    return ConceptSplit(folder.name, tuple(train), tuple(val))


def concept_folders(root: Path) -> list[Path]:
    """The concept sub-folders of ``root``; a folder whose name is not UTF-8 text cannot name a concept and is
    skipped with a warning counting such folders."""
    return text_named((p for p in root.iterdir() if p.is_dir()), root, "concept folder")


def _instance_rng(seed: int, instance_id: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{instance_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _spread_sample(rng: random.Random, files: dict[str, tuple[Path, ...]], count: int) -> list[tuple[Path, str]]:
    """``count`` (file, concept) pairs spread over the concepts: a random image of each concept (in random order)
    before a second of any, so a prompt meets every negative concept it can (one it never meets, it may learn to
    pull to its own concept)."""
    remaining = {c: rng.sample(list(paths), len(paths)) for c, paths in files.items()}
    chosen: list[tuple[Path, str]] = []
    while len(chosen) < count and any(remaining.values()):
        for concept in rng.sample(sorted(remaining), len(remaining)):
            if remaining[concept] and len(chosen) < count:
                chosen.append((remaining[concept].pop(), concept))
    return chosen


def _noisy_label(seed: int, instance_id: str, concept: str, learned: list[str], label_noise: float) -> str:
    """``concept``, or with probability ``label_noise`` another learned concept (a mislabelled training image;
    seeded by the instance, on a stream of its own so the choice of negatives does not change)."""
    rng = _instance_rng(seed, f"label-noise:{instance_id}")
    wrong = [c for c in learned if c != concept]
    if wrong and rng.random() < label_noise:
        return rng.choice(wrong)
    return concept


class ConceptInstances:
    """Map-style dataset: one item per training image of the learned concepts (see module docstring)."""

    def __init__(
        self,
        learned: list[ConceptSplit],
        negatives: list[ConceptSplit],
        image_size: int,
        negatives_per_instance: int,
        val_negatives_per_instance: int,
        max_negative_concepts: int | None,
        seed: int,
        label_noise: float = 0.0,
        spread_negatives: bool = False,
    ) -> None:
        self.image_size = image_size
        self.items: list[dict[str, Any]] = []
        by_name = {s.concept: s for s in learned + negatives}
        learned_names = [s.concept for s in learned]
        for source in learned:
            for path in source.train:
                instance_id = f"{source.concept}/{path.name}"
                split = by_name[_noisy_label(seed, instance_id, source.concept, learned_names, label_noise)]
                others = sorted(name for name in by_name if name != split.concept)
                rng = _instance_rng(seed, instance_id)
                neg_concepts = others
                if max_negative_concepts is not None and len(others) > max_negative_concepts:
                    neg_concepts = sorted(rng.sample(others, max_negative_concepts))
                if spread_negatives:
                    train_negs = _spread_sample(rng, {c: by_name[c].train for c in neg_concepts}, negatives_per_instance)
                    val_negs = _spread_sample(rng, {c: by_name[c].val for c in neg_concepts}, val_negatives_per_instance)
                else:
                    train_pool = [(p, c) for c in neg_concepts for p in by_name[c].train]
                    val_pool = [(p, c) for c in neg_concepts for p in by_name[c].val]
                    train_negs = rng.sample(train_pool, min(negatives_per_instance, len(train_pool)))
                    val_negs = rng.sample(val_pool, min(val_negatives_per_instance, len(val_pool)))
                self.items.append(
                    {
                        "instance_id": instance_id,
                        "concept": split.concept,
                        "candidates": [split.concept, *neg_concepts],
                        "image_files": [path, *(p for p, _ in train_negs)],
                        "labels": [split.concept, *(c for _, c in train_negs)],
                        "val_files": [*split.val, *(p for p, _ in val_negs)],
                        "val_labels": [split.concept] * len(split.val) + [c for _, c in val_negs],
                    }
                )
        self.instance_ids = [item["instance_id"] for item in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> ClipInstance:
        item = self.items[index]
        return ClipInstance(
            instance_id=item["instance_id"],
            concept=item["concept"],
            candidates=list(item["candidates"]),
            images=torch.stack([load_image(p, self.image_size) for p in item["image_files"]]),
            labels=list(item["labels"]),
            val_images=torch.stack([load_image(p, self.image_size) for p in item["val_files"]]),
            val_labels=list(item["val_labels"]),
            val_files=[str(p) for p in item["val_files"]],
        )


class LabelledImages:
    """Map-style dataset of (image, concept) pairs, e.g. the held-out images of every concept."""

    def __init__(self, files: list[tuple[Path, str]], image_size: int) -> None:
        self.files = files
        self.image_size = image_size
        self.names = sorted({concept for _, concept in files})

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, concept = self.files[index]
        return {"image": load_image(path, self.image_size), "label": concept, "file": str(path)}


class _WithNames:
    """Collate labelled images into ``{"images", "labels", "files", "names"}`` (names: every label of the dataset)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "images": torch.stack([item["image"] for item in items]),
            "labels": [item["label"] for item in items],
            "files": [item["file"] for item in items],
            "names": list(self.names),
        }


class ConceptFolderDataModule(PromptTuningDataModule):
    """Concept image folders -> per-instance chunks for CLIP prompt tuning.

    Args:
        root: folder with one sub-folder of images per concept.
        concepts: concepts to learn (default: every sub-folder of ``root``); the others act as negatives.
        negatives_root: optional folder of negative-only concepts, same layout.
        val_per_concept: held-out images per concept when there is no explicit train/ and val/ split.
        negatives_per_instance: negative training images tuned with each instance's prompt.
        val_negatives_per_instance: held-out negative images in each instance's validation gate.
        spread_negatives: draw both kinds of negatives spread over the negative concepts (an image of each
            before a second of any) instead of uniformly from all their images: a prompt that never meets a
            concept may learn to pull it to its own.
        max_negative_concepts: cap on the negative concept texts per instance (default: all).
        image_size: side length images are resized to when loaded.
        chunk_size: instances tuned together in one training step (results do not depend on it).
        num_workers: DataLoader worker processes.
        seed: seed for the per-instance choice of negatives.
        eval_batch_size: images per batch in ``validate`` (the held-out split, which the gate also used)
            and ``test`` (every image under ``test_root``).
        test_root: optional concept folders of test images never used in training or gating.
        label_noise: share of training images given a wrong label (another learned concept), to measure what
            the validation gate does with noisy collected data (CLOVA Table 4); their gates still validate on
            the labelled concept's clean held-out images.
    """

    def __init__(
        self,
        root: str,
        concepts: list[str] | None = None,
        negatives_root: str | None = None,
        val_per_concept: int = 1,
        negatives_per_instance: int = 3,
        val_negatives_per_instance: int = 3,
        max_negative_concepts: int | None = None,
        image_size: int = 224,
        chunk_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        eval_batch_size: int = 64,
        test_root: str | None = None,
        label_noise: float = 0.0,
        spread_negatives: bool = False,
    ) -> None:
        super().__init__(chunk_size, num_workers)
        if not 0.0 <= label_noise < 1.0:
            raise DataError(f"label_noise must be in [0, 1), got {label_noise}")
        self.label_noise = label_noise
        self.spread_negatives = spread_negatives
        self.save_hyperparameters()
        self.eval_batch_size = eval_batch_size
        self.test_root = Path(test_root) if test_root else None
        self.splits: list[ConceptSplit] = []
        self.root = Path(root)
        self.concepts = concepts
        self.negatives_root = Path(negatives_root) if negatives_root else None
        self.val_per_concept = val_per_concept
        self.negatives_per_instance = negatives_per_instance
        self.val_negatives_per_instance = val_negatives_per_instance
        self.max_negative_concepts = max_negative_concepts
        self.image_size = image_size
        self.seed = seed

    def _splits(self, root: Path, names: list[str] | None, what: str) -> list[ConceptSplit]:
        if not root.is_dir():
            raise DataError(f"{what} folder not found: {root}")
        if names is None:
            names = sorted(p.name for p in concept_folders(root))
            if not names:
                raise DataError(f"{what} folder {root} has no concept sub-folders")
        splits = [split_concept(root / name, self.val_per_concept) for name in names]
        for split in splits:
            for path in (*split.train, *split.val):
                check_image(path)
        return splits

    def build_instances(self) -> ConceptInstances:
        learned = self._splits(self.root, self.concepts, "concept root")
        learned_names = {s.concept for s in learned}
        negatives = []
        if self.concepts is not None:
            others = sorted(p.name for p in concept_folders(self.root) if p.name not in learned_names)
            negatives += self._splits(self.root, others, "concept root") if others else []
        if self.negatives_root is not None:
            negatives += self._splits(self.negatives_root, None, "negatives root")
        if len({s.concept for s in learned + negatives}) < 2:
            raise DataError(
                f"{self.root}: prompt tuning needs at least one negative concept besides "
                f"{sorted(learned_names)} (add another concept folder or a negatives_root)"
            )
        self.splits = learned + negatives
        return ConceptInstances(
            learned,
            negatives,
            self.image_size,
            self.negatives_per_instance,
            self.val_negatives_per_instance,
            self.max_negative_concepts,
            self.seed,
            self.label_noise,
            self.spread_negatives,
        )

    def _eval_loader(self, dataset: LabelledImages) -> DataLoader:
        return DataLoader(
            dataset, batch_size=self.eval_batch_size, num_workers=self.num_workers, collate_fn=_WithNames(dataset.names)
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._eval_loader(
            LabelledImages([(p, s.concept) for s in self.splits for p in s.val], self.image_size)
        )

    def test_dataloader(self) -> DataLoader:
        if self.test_root is None:
            raise DataError("clova-train test needs data.init_args.test_root (concept folders of test images)")
        if not self.test_root.is_dir():
            raise DataError(f"test root folder not found: {self.test_root}")
        files = []
        for folder in sorted(concept_folders(self.test_root)):
            for path in list_images(folder):
                check_image(path)
                files.append((path, folder.name))
        if not files:
            raise DataError(f"test root {self.test_root} holds no images")
        return self._eval_loader(LabelledImages(files, self.image_size))


class SyntheticConceptDataModule(ConceptFolderDataModule):
    """:class:`ConceptFolderDataModule` over rendered shapes, written to ``root`` if it is missing.

    Args:
        root: where the synthetic concept folders are (or will be) written.
        synthetic_concepts: concepts to render, ``"<colour>"`` or ``"<colour>_<shape>"``.
        images_per_concept: images rendered per concept.
        render_size: side of the rendered images.
        render_seed: seed of the renderer.
        test_images_per_concept: if > 0 and no ``test_root`` is given, render this many test images per concept
            (with a seed the training images never use) into ``<root>_test``, the ``test_root`` of ``clova-train
            test``; hundreds resolve differences of a few points.
        **kwargs: the arguments of :class:`ConceptFolderDataModule`.
    """

    def __init__(
        self,
        root: str = "checkpoints/data/synthetic_concepts",
        synthetic_concepts: list[str] = ["red", "green", "blue", "yellow"],  # noqa: B006 (shown in --help)
        images_per_concept: int = 7,
        render_size: int = 64,
        render_seed: int = 0,
        test_images_per_concept: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(root, **kwargs)
        self.synthetic_concepts = list(synthetic_concepts)
        self.images_per_concept = images_per_concept
        self.render_size = render_size
        self.render_seed = render_seed
        self.test_images_per_concept = test_images_per_concept
        self.rendered_test_root: Path | None = None
        if test_images_per_concept > 0 and self.test_root is None:
            self.rendered_test_root = self.test_root = Path(f"{self.root}_test")

    def render_parameters(self) -> dict[str, Any]:
        return {
            "images_per_concept": self.images_per_concept,
            "render_size": self.render_size,
            "render_seed": self.render_seed,
        }

    def prepare_data(self) -> None:
        self._render(self.root, self.render_parameters())
        if self.rendered_test_root is not None:
            self._render(self.rendered_test_root, {"images_per_concept": self.test_images_per_concept,
                                                   "render_size": self.render_size,
                                                   "render_seed": self.render_seed + TEST_SEED_OFFSET})

    def _render(self, root: Path, parameters: dict[str, Any]) -> None:
        """Render the concepts missing under ``root`` with ``parameters`` (refused if it holds other ones)."""
        from clova_train.synthetic.shapes import generated_before, record_generation
        from clova_train.tools.clip.synthetic import write_concept_folders

        generated_before(root, parameters)
        missing = [c for c in self.synthetic_concepts if not (root / c).is_dir()]
        if missing:
            write_concept_folders(root, missing, parameters["images_per_concept"], parameters["render_size"],
                                  seed=parameters["render_seed"])
        record_generation(root, parameters)
