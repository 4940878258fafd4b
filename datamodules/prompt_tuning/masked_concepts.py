"""Masked concept images for the REPLACE (Stable Diffusion inpainting) prompt tuner.

Layout: ``root/<concept>/*.png|jpg|...`` with the mask of each image's concept region in
``root/<concept>/masks/<same file name>`` (white = the region showing the concept), or, with explicit
splits, ``root/<concept>/train/`` and ``root/<concept>/val/``, each with its own ``masks/``. The folder
name is the concept (``orange_circle`` is the words "orange circle"). Without explicit splits, the files
are sorted by name and the first ``val_per_concept`` are held out for the gate (never trained on).

Every training image is one instance (:class:`~clova_train.tools.replace.tool.ReplaceInstance`) with
id ``"<concept>/<file name>"``, gated on every held-out image of its concept. Images found on the web come
without masks: ``missing_mask: full`` treats such an image as all concept (the whole image is repainted).

Every file is checked at set-up, before any training: an unreadable image, a mask without its image, a
mask of another size than its image and an empty mask each stop the run with one message naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from clova_train.core.errors import DataError
from clova_train.datamodules.prompt_tuning.chunks import PromptTuningDataModule
from clova_train.datamodules.prompt_tuning.concept_folders import ConceptSplit, concept_folders, split_concept
from clova_train.tools.images import IMAGE_SUFFIXES
from clova_train.tools.replace.tool import MaskedImage, ReplaceInstance, concept_words, load_masked_image

MASKS_FOLDER = "masks"


def mask_path(image: Path) -> Path:
    """Where the mask of ``image`` lives: ``<its folder>/masks/<its name>``."""
    return image.parent / MASKS_FOLDER / image.name


class MaskedConceptInstances:
    """Map-style dataset: one :class:`ReplaceInstance` per training image of the learned concepts."""

    def __init__(self, splits: list[ConceptSplit], masks: dict[Path, Path | None]) -> None:
        self.masks = masks
        self.items = [(split, path) for split in splits for path in split.train]
        self.instance_ids = [f"{split.concept}/{path.name}" for split, path in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def _load(self, path: Path) -> MaskedImage:
        return load_masked_image(path, self.masks[path])

    def __getitem__(self, index: int) -> ReplaceInstance:
        split, path = self.items[index]
        return ReplaceInstance(
            instance_id=self.instance_ids[index], concept=split.concept, words=concept_words(split.concept),
            train=self._load(path), val=[self._load(p) for p in split.val],
        )


class MaskedConceptDataModule(PromptTuningDataModule):
    """Masked concept folders -> per-instance chunks for REPLACE textual inversion (module docstring).

    Args:
        root: folder with one sub-folder of images (and their ``masks/``) per concept.
        concepts: concepts to learn (default: every sub-folder of ``root``).
        val_per_concept: held-out images per concept when there is no explicit train/ and val/ split.
        missing_mask: an image without a mask is an ``error``, or its ``full`` image is the concept's region.
        chunk_size: instances tuned together in one training step (results do not depend on it).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        root: str,
        concepts: list[str] | None = None,
        val_per_concept: int = 2,
        missing_mask: Literal["error", "full"] = "error",
        chunk_size: int = 8,
        num_workers: int = 0,
    ) -> None:
        super().__init__(chunk_size, num_workers)
        if missing_mask not in ("error", "full"):
            raise DataError(f"missing_mask must be 'error' or 'full', got {missing_mask!r}")
        if val_per_concept < 1:
            raise DataError(f"val_per_concept must be >= 1 (the gate needs held-out images), got {val_per_concept}")
        self.root = Path(root)
        self.concepts = concepts
        self.val_per_concept = val_per_concept
        self.missing_mask = missing_mask
        self.splits: list[ConceptSplit] = []

    def _checked_masks(self, split: ConceptSplit) -> dict[Path, Path | None]:
        """Each image's mask (``None``: the full image), every pair loaded once to check it."""
        masks: dict[Path, Path | None] = {}
        for path in (*split.train, *split.val):
            found = mask_path(path)
            if not found.is_file():
                if self.missing_mask == "error":
                    raise DataError(f"mask not found for {path}: expected {found} (or set missing_mask: full)")
                found = None
            load_masked_image(path, found)
            masks[path] = found
        for folder in {p.parent for p in (*split.train, *split.val)}:
            if (folder / MASKS_FOLDER).is_dir():
                for orphan in sorted((folder / MASKS_FOLDER).iterdir()):
                    if orphan.suffix.lower() in IMAGE_SUFFIXES and not (folder / orphan.name).is_file():
                        raise DataError(f"image not found: {folder / orphan.name} (its mask {orphan} exists)")
        return masks

    def build_instances(self) -> MaskedConceptInstances:
        if not self.root.is_dir():
            raise DataError(f"masked concept root folder not found: {self.root}")
        names = self.concepts
        if names is None:
            names = sorted(p.name for p in concept_folders(self.root) if not p.name.startswith("."))
            if not names:
                raise DataError(f"masked concept root {self.root} has no concept sub-folders")
        self.splits = [split_concept(self.root / name, self.val_per_concept) for name in names]
        masks: dict[Path, Path | None] = {}
        for split in self.splits:
            if not concept_words(split.concept):
                raise DataError(f"concept folder {self.root / split.concept} has no words in its name")
            masks.update(self._checked_masks(split))
        return MaskedConceptInstances(self.splits, masks)


class SyntheticMaskedConceptDataModule(MaskedConceptDataModule):
    """:class:`MaskedConceptDataModule` over rendered shapes with box masks, written to ``root`` if missing.

    Args:
        root: where the synthetic masked concept folders are (or will be) written.
        synthetic_concepts: ``"<colour>_<shape>"`` concepts to render.
        images_per_concept: images rendered per concept (``val_per_concept`` of them are held out).
        render_size: side of the rendered images.
        render_seed: seed of the renderer.
        **kwargs: the arguments of :class:`MaskedConceptDataModule`.
    """

    def __init__(
        self,
        root: str = "checkpoints/data/synthetic_masked_concepts",
        synthetic_concepts: list[str] = ["orange_circle"],  # noqa: B006 (shown in --help)
        images_per_concept: int = 10,
        render_size: int = 16,
        render_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(root, **kwargs)
        self.synthetic_concepts = list(synthetic_concepts)
        self.generation = {"concepts": self.synthetic_concepts, "images_per_concept": images_per_concept,
                           "render_size": render_size, "render_seed": render_seed}

    def prepare_data(self) -> None:
        from clova_train.tools.replace.synthetic import write_masked_concepts
        from clova_train.synthetic.shapes import generated_before, record_generation

        if not generated_before(self.root, self.generation):
            g = self.generation
            missing = [c for c in g["concepts"] if not (self.root / c).is_dir()]
            write_masked_concepts(self.root, missing, g["images_per_concept"], g["render_size"], g["render_seed"])
            record_generation(self.root, self.generation)
