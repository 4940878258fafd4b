"""Lightning datamodules of open-vocabulary grounding data (COCO / LVIS) for the LOC and SEG prompt tools.

Reading, checking and splitting the annotation file is ``clova_train.tools.grounding.coco`` (no Lightning
there: serving demos use it too); this module serves its instances in chunks and its evaluation images to
``validate`` / ``test``. Everything used is checked when the datamodule is set up, before anything is
trained, and a bad file, record or concept stops the run with one message naming it.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import DataLoader

from clova_train.core.errors import DataError
from clova_train.datamodules.prompt_tuning.chunks import PromptTuningDataModule
from clova_train.tools.grounding.coco import GroundingAnnotations, GroundingInstances, GroundingSplit
from clova_train.tools.grounding.instances import GroundedImage

__all__ = ["GroundingAnnotations", "GroundingDataModule", "GroundingInstances", "GroundingSplit",
           "SyntheticGroundingDataModule"]


class _EvalImages:
    def __init__(self, annotations: GroundingAnnotations, ids: list[int], concept: str) -> None:
        self.annotations, self.ids, self.concept = annotations, ids, concept

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[GroundedImage, str]:
        return self.annotations.grounded_image(self.ids[index]), self.concept


class GroundingDataModule(PromptTuningDataModule):
    """COCO / LVIS annotations of one concept -> per-image instances for LOC or SEG prompt tuning.

    Args:
        annotations: COCO- or LVIS-format annotation JSON.
        concept: the category to learn, by name (``"glove"``) or id.
        image_root: folder of the image files (default: ``images/`` next to the annotations, else their folder).
        max_images: training images (instances) at most (paper: 200 for LOC, 50 for SEG).
        num_val_images: held-out images the gate checks prompts on (never trained on).
        val_images_per_instance: held-out images each instance is gated on.
        num_eval_images: further held-out images for ``validate`` / ``test`` (neither trained nor gated on).
        split_seed: seed of the shuffle that splits the concept's images.
        chunk_size: instances tuned together in one training step (results do not depend on it).
        num_workers: DataLoader worker processes.
        eval_batch_size: images per evaluation batch.
    """

    def __init__(
        self,
        annotations: str,
        concept: str,
        image_root: str | None = None,
        max_images: int = 200,
        num_val_images: int = 10,
        val_images_per_instance: int = 1,
        num_eval_images: int = 0,
        split_seed: int = 0,
        chunk_size: int = 32,
        num_workers: int = 0,
        eval_batch_size: int = 8,
    ) -> None:
        super().__init__(chunk_size, num_workers)
        for name, value in (("max_images", max_images), ("val_images_per_instance", val_images_per_instance)):
            if value < 1:
                raise DataError(f"{name} must be >= 1, got {value}")
        for name, value in (("num_val_images", num_val_images), ("num_eval_images", num_eval_images)):
            if value < 0:
                raise DataError(f"{name} must be >= 0, got {value}")
        self.save_hyperparameters()
        self.annotations_path, self.concept, self.image_root = annotations, concept, image_root
        self.max_images, self.num_val_images, self.num_eval_images = max_images, num_val_images, num_eval_images
        self.val_images_per_instance, self.split_seed = val_images_per_instance, split_seed
        self.eval_batch_size = eval_batch_size
        self._annotations: GroundingAnnotations | None = None
        self._split: GroundingSplit | None = None

    def _load(self) -> tuple[GroundingAnnotations, GroundingSplit]:
        if self._annotations is None or self._split is None:
            self._annotations = GroundingAnnotations(self.annotations_path, self.image_root)
            self._split = GroundingSplit(self._annotations, self.concept, self.max_images, self.num_val_images,
                                         self.num_eval_images, self.split_seed)
        return self._annotations, self._split

    def build_instances(self) -> GroundingInstances:
        annotations, split = self._load()
        return GroundingInstances(annotations, split, self.val_images_per_instance)

    def _eval_loader(self) -> DataLoader:
        annotations, split = self._load()
        if not split.eval_ids:
            raise DataError("validate/test need data.init_args.num_eval_images > 0 (held-out images of the concept)")
        return DataLoader(_EvalImages(annotations, split.eval_ids, split.concept), batch_size=self.eval_batch_size,
                          num_workers=self.num_workers, collate_fn=list)

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader() if self.num_eval_images else []

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()


class SyntheticGroundingDataModule(GroundingDataModule):
    """:class:`GroundingDataModule` over rendered shapes in COCO format, written to ``root`` if missing.

    Args:
        root: where ``annotations.json`` and ``images/`` are (or will be) written.
        concept: the category to learn (``"<colour> <shape>"``, e.g. ``"purple circle"``).
        images: scenes of the concept to render (each with distractor shapes of other colours).
        objects_per_image: shapes per scene, the concept's included.
        image_size: side of the rendered images.
        render_seed: seed of the renderer.
        max_images: training images (instances) at most.
        num_val_images: held-out images the gate checks prompts on.
        val_images_per_instance: held-out images each instance is gated on.
        num_eval_images: further held-out images for ``validate`` / ``test``.
        split_seed: seed of the split.
        chunk_size: instances tuned together in one training step.
        num_workers: DataLoader worker processes.
        eval_batch_size: images per evaluation batch.
    """

    def __init__(
        self,
        root: str = "checkpoints/data/synthetic_grounding",
        concept: str = "purple circle",
        images: int = 40,
        objects_per_image: int = 2,
        image_size: int = 64,
        render_seed: int = 0,
        max_images: int = 200,
        num_val_images: int = 10,
        val_images_per_instance: int = 1,
        num_eval_images: int = 10,
        split_seed: int = 0,
        chunk_size: int = 32,
        num_workers: int = 0,
        eval_batch_size: int = 8,
    ) -> None:
        super().__init__(str(Path(root) / "annotations.json"), concept, None, max_images, num_val_images,
                         val_images_per_instance, num_eval_images, split_seed, chunk_size, num_workers, eval_batch_size)
        self.root = Path(root)
        self.generation = {"concept": concept, "images": images, "objects_per_image": objects_per_image,
                           "image_size": image_size, "render_seed": render_seed}

    def prepare_data(self) -> None:
        from clova_train.tools.grounding.synthetic import write_coco_scenes
        from clova_train.synthetic.shapes import generated_before, record_generation

        if not generated_before(self.root, self.generation):
            g = self.generation
            write_coco_scenes(self.root, [g["concept"]], g["images"], objects_per_image=g["objects_per_image"],
                              image_size=g["image_size"], seed=g["render_seed"])
            record_generation(self.root, self.generation)
