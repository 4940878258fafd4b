"""VQA records (JSON or JSONL) for the BLIP VQA prompt tuner.

A record is ``{"image", "question", "answer"}`` with optional ``"id"``, ``"val_question"`` /
``"val_answer"`` (the question the prompt must fix and its gold answer; default: the question itself and
``answer``) and ``"correct"`` (``true``: the tool already answers it right; stored with a zero prompt, not
tuned). ``answer`` is what the closed loop inferred. Image paths are relative to the records file unless
absolute. Each record is one instance (id: its ``"id"`` or ``<file name>:<record number>``).

Every record and image is checked when the datamodule is set up, before anything is trained: a malformed
line, a missing field, an empty question or answer, or a missing or unreadable image stops the run with
one message naming the file and the record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from clova_train.core.errors import DataError
from clova_train.datamodules.prompt_tuning.chunks import PromptTuningDataModule
from clova_train.tools.vqa.tool import VqaInstance
from clova_train.tools.images import check_image, load_image_uint8
from clova_train.tools.vqa.records import read_records, record_image

class VqaRecords:
    """Map-style dataset of :class:`VqaInstance`, one per record."""

    def __init__(self, path: Path, image_root: Path | None) -> None:
        self.records = read_records(path)
        self.instance_ids: list[str] = []
        self.images: list[Path] = []
        for number, record in enumerate(self.records, 1):
            image = record_image(path, record["image"], image_root)
            if not image.is_file():
                raise DataError(f"{record['_where']}: image not found: {image}")
            check_image(image)
            self.images.append(image)
            self.instance_ids.append(self._unique_id(record.get("id") or f"{path.name}:{number}", record["_where"]))

    def _unique_id(self, instance_id: str, where: str) -> str:
        if instance_id in self.instance_ids:
            raise DataError(f"{where}: instance id {instance_id!r} is already that of record "
                            f"{self.instance_ids.index(instance_id) + 1} (a record without an 'id' is named "
                            "<file name>:<record number>)")
        return instance_id

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> VqaInstance:
        record = self.records[index]
        return VqaInstance(
            instance_id=self.instance_ids[index], concept=None, keep_unchanged=bool(record.get("correct", False)),
            image=load_image_uint8(self.images[index]), question=record["question"], answer=record["answer"],
            val_question=record.get("val_question", record["question"]),
            val_answer=record.get("val_answer", record["answer"]), source=record["_where"],
        )


class _EvalRecords:
    def __init__(self, path: Path, image_root: Path | None) -> None:
        self.records = read_records(path)
        self.images = [record_image(path, r["image"], image_root) for r in self.records]
        for record, image in zip(self.records, self.images):
            if not image.is_file():
                raise DataError(f"{record['_where']}: image not found: {image}")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.records[index]
        return {"image": load_image_uint8(self.images[index]), "question": record["question"], "answer": record["answer"]}


def collate_eval(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "images": [item["image"] for item in items],
        "questions": [item["question"] for item in items],
        "answers": [item["answer"] for item in items],
    }


class VqaRecordDataModule(PromptTuningDataModule):
    """VQA records -> per-instance chunks for BLIP VQA prompt tuning, and evaluation batches.

    Args:
        records: JSON list or JSONL file of training records (see module docstring).
        eval_records: records (image, question, gold answer) for ``validate`` and ``test``: never trained on.
        image_root: folder relative image paths are resolved against (default: each records file's folder).
        chunk_size: instances tuned together in one training step (results do not depend on it).
        num_workers: DataLoader worker processes.
        eval_batch_size: questions per evaluation batch.
    """

    def __init__(
        self,
        records: str,
        eval_records: str | None = None,
        image_root: str | None = None,
        chunk_size: int = 32,
        num_workers: int = 0,
        eval_batch_size: int = 32,
    ) -> None:
        super().__init__(chunk_size, num_workers)
        self.save_hyperparameters()
        self.records_path = Path(records)
        self.eval_records = Path(eval_records) if eval_records else None
        self.image_root = Path(image_root) if image_root else None
        self.eval_batch_size = eval_batch_size

    def build_instances(self) -> VqaRecords:
        return VqaRecords(self.records_path, self.image_root)

    def _eval_loader(self) -> DataLoader:
        if self.eval_records is None:
            raise DataError("validate/test of the VQA tool need data.init_args.eval_records (image, question, answer)")
        return DataLoader(_EvalRecords(self.eval_records, self.image_root), batch_size=self.eval_batch_size,
                          num_workers=self.num_workers, collate_fn=collate_eval)

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader() if self.eval_records is not None else []

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()


class SyntheticVqaDataModule(VqaRecordDataModule):
    """:class:`VqaRecordDataModule` over synthetic shape questions, written to ``root`` if missing.

    Args:
        root: where ``train.jsonl``, ``eval.jsonl`` and ``images/`` are (or will be) written.
        learn_colours: colours whose images get training records (their true colour as the answer).
        known_colours: colours whose records are marked ``correct`` (zero prompts in the pool).
        images_per_colour: training images per colour.
        wrong_answers: records per learned colour whose inferred answer is wrong (the gate must reject).
        eval_per_colour: evaluation images per colour.
        render_size: side of the rendered images.
        render_seed: seed of the renderer.
        chunk_size: instances tuned together in one training step.
        num_workers: DataLoader worker processes.
        eval_batch_size: questions per evaluation batch.
    """

    def __init__(
        self,
        root: str = "checkpoints/data/synthetic_vqa",
        learn_colours: list[str] = ["orange", "purple"],  # noqa: B006 (shown in --help)
        known_colours: list[str] = ["red", "green", "blue", "yellow"],  # noqa: B006
        images_per_colour: int = 6,
        wrong_answers: int = 2,
        eval_per_colour: int = 10,
        render_size: int = 32,
        render_seed: int = 0,
        chunk_size: int = 32,
        num_workers: int = 0,
        eval_batch_size: int = 32,
    ) -> None:
        root_path = Path(root)
        super().__init__(str(root_path / "train.jsonl"), str(root_path / "eval.jsonl"), None, chunk_size,
                         num_workers, eval_batch_size)
        self.root = root_path
        self.generation = {
            "learn_colours": list(learn_colours), "known_colours": list(known_colours),
            "images_per_colour": images_per_colour, "wrong_answers": wrong_answers,
            "eval_per_colour": eval_per_colour, "render_size": render_size, "render_seed": render_seed,
        }

    def prepare_data(self) -> None:
        from clova_train.synthetic.shapes import generated_before, record_generation
        from clova_train.tools.vqa.synthetic import write_vqa_records

        if not generated_before(self.root, self.generation):
            g = self.generation
            write_vqa_records(self.root, g["learn_colours"], g["known_colours"], g["images_per_colour"],
                              g["wrong_answers"], g["eval_per_colour"], g["render_size"], g["render_seed"])
            record_generation(self.root, self.generation)
