"""Task files in the benchmarks' own formats (envs/tasks/formats.py): each format read from hand-written files laid
out as the benchmarks distribute them, its images resolved by the benchmark's naming, and every kind of bad input one
error naming the file and record, or a counted skip."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from clova_train.core.errors import DataError
from clova_train.envs.tasks.formats import TaskFiles, load_tasks


def _write(path: Path, value: object) -> str:
    path.write_text(json.dumps(value), encoding="utf-8")
    return str(path)


def _images(folder: Path, *names: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"not decoded here")
    return str(folder)


def _vqa_files(tmp_path: Path, subtype: str | None = "val2014") -> tuple[str, str]:
    questions = {"questions": [{"question_id": 11, "image_id": 42, "question": "What colour is the bus?"},
                               {"question_id": 12, "image_id": 42, "question": "How many wheels?"},
                               {"question_id": 13, "image_id": 7, "question": "Is it raining?"},
                               {"question_id": 14, "image_id": 42, "question": "Unannotated?"}]}
    if subtype:
        questions["data_subtype"] = subtype
    annotations = {"annotations": [
        {"question_id": 11, "image_id": 42, "answer_type": "other", "answers": [{"answer": "red"}] * 9 + [{"answer": "pink"}]},
        {"question_id": 12, "image_id": 42, "answer_type": "number", "answers": [{"answer": "4"}] * 10},
        {"question_id": 13, "image_id": 7, "answer_type": "yes/no", "answers": [{"answer": "no"}] * 10},
    ]}
    return _write(tmp_path / "questions.json", questions), _write(tmp_path / "annotations.json", annotations)


def test_vqa_questions_and_annotations_resolve_coco_image_names(tmp_path: Path) -> None:
    questions, annotations = _vqa_files(tmp_path)
    images = _images(tmp_path / "val2014", "COCO_val2014_000000000042.jpg")
    tasks, skipped = load_tasks(TaskFiles("vqav2", questions, images, annotations))
    assert [t.task_id for t in tasks] == ["11", "12"]
    assert tasks[0].answers == ("red",) * 9 + ("pink",) and tasks[0].answer_type == "other"
    assert tasks[1].answer_type == "number" and tasks[0].image.name == "COCO_val2014_000000000042.jpg"
    assert skipped.counts == {"image missing": 1, "no annotation for the question": 1}
    assert "first: 13" in skipped.summary()
    with pytest.raises(DataError, match=r"vqav2 task 13: its image .*COCO_val2014_000000000007.jpg is missing"):
        load_tasks(TaskFiles("vqav2", questions, images, annotations, missing_images="error"))


def test_okvqa_finds_an_image_under_its_coco_2017_name_and_stops_at_the_limit(tmp_path: Path) -> None:
    questions, annotations = _vqa_files(tmp_path)
    images = _images(tmp_path / "coco", "000000000042.jpg", "000000000007.jpg")
    tasks, _ = load_tasks(TaskFiles("okvqa", questions, images, annotations, limit=2))
    assert [t.task_id for t in tasks] == ["11", "12"] and tasks[0].image.name == "000000000042.jpg"


def test_aokvqa_keeps_direct_answers_and_choices_and_skips_a_test_record(tmp_path: Path) -> None:
    records = [
        {"split": "val", "question_id": "a1", "image_id": 5, "question": "What is the man holding?",
         "choices": ["bat", "kite", "cup", "dog"], "correct_choice_idx": 1, "direct_answers": ["kite"] * 10},
        {"split": "train", "question_id": "a2", "image_id": 5, "question": "Other split?", "choices": ["a", "b"],
         "correct_choice_idx": 0, "direct_answers": ["a"] * 10},
        {"split": "val", "question_id": "a3", "image_id": 5, "question": "Test record?", "choices": ["a", "b"]},
    ]
    path = _write(tmp_path / "aokvqa_v1p0_val.json", records)
    images = _images(tmp_path / "val2017", "000000000005.jpg")
    tasks, skipped = load_tasks(TaskFiles("aokvqa", path, images, split="val"))
    assert len(tasks) == 1 and tasks[0].choices == ("bat", "kite", "cup", "dog") and tasks[0].correct_choice == 1
    assert tasks[0].answers == ("kite",) * 10 and skipped.counts == {"no answers (a test split?)": 1}
    records[0]["correct_choice_idx"] = 4
    with pytest.raises(DataError, match=r"aokvqa file .* record 0: correct_choice_idx 4 is not an index of its 4"):
        load_tasks(TaskFiles("aokvqa", _write(tmp_path / "bad.json", records), images))


def test_gqa_questions_keyed_by_id_read_their_answer_type(tmp_path: Path) -> None:
    questions = {"201": {"imageId": "n1", "question": "Is the cup on the table?", "answer": "yes"},
                 "202": {"imageId": "n1", "question": "What is on the table?", "answer": "cup"},
                 "203": {"imageId": "n1", "question": "Submission record?"}}
    tasks, skipped = load_tasks(TaskFiles("gqa", _write(tmp_path / "val_balanced_questions.json", questions),
                                          _images(tmp_path / "images", "n1.jpg")))
    assert [(t.task_id, t.answer_type, t.answers) for t in tasks] == [("201", "yes/no", ("yes",)),
                                                                      ("202", "other", ("cup",))]
    assert skipped.total == 1


def _refcoco_files(tmp_path: Path) -> tuple[list[dict], str, str]:
    refs = [{"ref_id": 1, "ann_id": 10, "image_id": 3, "split": "testA", "category_id": 1,
             "sentences": [{"sent": "man on the left", "raw": "Man on the left."}, {"sent": "left guy"}]},
            {"ref_id": 2, "ann_id": 11, "image_id": 3, "split": "train", "sentences": [{"sent": "right guy"}]},
            {"ref_id": 3, "ann_id": 12, "image_id": 3, "split": "testA", "sentences": [{"sent": "outside"}]}]
    instances = {"images": [{"id": 3, "file_name": "COCO_train2014_000000000003.jpg", "width": 100, "height": 80}],
                 "annotations": [{"id": 10, "image_id": 3, "bbox": [5.5, 10, 20, 30]},
                                 {"id": 11, "image_id": 3, "bbox": [60, 10, 20, 30]},
                                 {"id": 12, "image_id": 3, "bbox": [90, 10, 40, 30]}]}
    images = _images(tmp_path / "train2014", "COCO_train2014_000000000003.jpg")
    return refs, _write(tmp_path / "instances.json", instances), images


@pytest.mark.parametrize("as_pickle", [False, True], ids=["json", "refs-pickle"])
def test_refcoco_expressions_carry_their_box_and_split(tmp_path: Path, as_pickle: bool) -> None:
    refs, instances, images = _refcoco_files(tmp_path)
    if as_pickle:
        path = tmp_path / "refs(unc).p"
        path.write_bytes(pickle.dumps(refs, protocol=2))
    else:
        path = Path(_write(tmp_path / "refs.json", refs))
    tasks, skipped = load_tasks(TaskFiles("refcoco", str(path), images, instances, split="testA"))
    assert [(t.task_id, t.question, t.box) for t in tasks] == [("1:0", "man on the left", (5.5, 10.0, 20.0, 30.0)),
                                                             ("1:1", "left guy", (5.5, 10.0, 20.0, 30.0))]
    assert tasks[0].answer_type == "box" and tasks[0].image_size == (100, 80)
    assert skipped.counts == {"box outside its image or empty": 1}


class _Hostile:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


def test_a_refs_pickle_that_names_a_callable_is_refused_without_running_it(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _, instances, images = _refcoco_files(tmp_path)
    path = tmp_path / "refs(unc).p"
    path.write_bytes(pickle.dumps([{"ref_id": 1, "x": _Hostile()}]))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"refcoco refs .*refs\(unc\).p is not a pickle of plain lists and dicts"):
        load_tasks(TaskFiles("refcoco", str(path), images, instances))
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(("files", "message"), [
    (lambda p: TaskFiles("vizwiz", "q.json", "images"), r"unknown task format 'vizwiz' \(known: vqav2, okvqa"),
    (lambda p: TaskFiles("okvqa", "q.json", "images"), "task format 'okvqa' needs an annotations file"),
    (lambda p: TaskFiles("gqa", str(p / "absent.json"), "images"), r"absent.json"),
    (lambda p: TaskFiles("gqa", _write(p / "q.json", {"1": {"imageId": 5, "question": "q", "answer": "a"}}), "i"),
     r"gqa questions .*q.json question 1: 'imageId' is a int, it must be a str"),
    (lambda p: TaskFiles("vqav2", _write(p / "q.json", {"questions": [{"question_id": "11"}]}),
                         "i", _write(p / "a.json", {"annotations": []})),
     r"vqav2 questions .*q.json record 0: 'question_id' is a str, it must be a int"),
    (lambda p: TaskFiles("vqav2", _write(p / "q.json", {"questions": []}), "i", _write(p / "a.json", [])),
     r"vqav2 annotations .*a.json must be an object with a 'annotations' list"),
    (lambda p: TaskFiles("aokvqa", _write(p / "q.json", [{"question_id": "x"}]), "i"),
     r"record 0: 'choices' is missing, it must be a list"),
], ids=["unknown-format", "no-annotations", "missing-file", "bad-field", "bad-vqa-field", "bad-annotations-file",
        "missing-field"])
def test_bad_task_files_are_one_error_naming_the_file_and_record(tmp_path: Path, files, message: str) -> None:
    with pytest.raises(DataError, match=message):
        load_tasks(files(tmp_path))


def test_a_large_file_without_one_usable_task_says_what_it_skipped(tmp_path: Path) -> None:
    """200,000 GQA records whose images are all absent: one error counting them, in seconds."""
    records = {str(i): {"imageId": f"n{i}", "question": "q", "answer": "yes"} for i in range(200_000)}
    path = _write(tmp_path / "train_all_questions.json", records)
    with pytest.raises(DataError, match=r"gave no usable gqa task: 200,000 records skipped: image missing \(first: 0"):
        load_tasks(TaskFiles("gqa", path, str(tmp_path / "images")))


def test_the_offline_benchmark_reads_back_through_the_real_formats(tmp_path: Path) -> None:
    """The shapes world written as GQA (training ids), OK-VQA (held-out ids) and RefCOCO files: each set reads back
    with the world's own answers, and a referred object's box holds its colour in the rendered image."""
    from PIL import Image

    from clova_train.envs.common.world import make_task
    from clova_train.envs.common.world import RGB
    from clova_train.envs.tasks.offline import write_offline_benchmark

    train_ids, eval_ids = [1, 2, 3, 4, 6, 7], [0, 5, 10]
    files = write_offline_benchmark(tmp_path, train_ids, eval_ids)
    gqa, _ = load_tasks(files["gqa-train"])
    assert [int(t.task_id) for t in gqa] == train_ids
    assert all(t.answers == (make_task(int(t.task_id)).answer,) for t in gqa)
    okvqa, skipped = load_tasks(files["okvqa-eval"])
    assert [int(t.task_id) for t in okvqa] == eval_ids and skipped.total == 0
    assert all(len(t.answers) == 10 and t.answers[0] == make_task(int(t.task_id)).answer for t in okvqa)
    assert {t.answer_type for t in okvqa} <= {"yes/no", "number", "other"}
    refs_train, _ = load_tasks(files["refcoco-train"])
    refs_val, _ = load_tasks(files["refcoco-val"])
    assert refs_train and refs_val and {t.image.name for t in refs_val} <= {t.image.name for t in okvqa}
    checked = 0
    for task in refs_train + refs_val:
        x, y, w, h = task.box
        colour = task.question.split()[1]
        scene = make_task(int(task.image.stem.rsplit("_", 1)[1]))
        top = scene.objects[-1]  # drawn last: nothing covers its centre
        if (top.colour, top.shape) == tuple(task.question.split()[1:]):
            with Image.open(task.image) as image:
                pixel = image.convert("RGB").getpixel((int(x + w / 2), int(y + h / 2)))
            assert max(abs(a - b) for a, b in zip(pixel, RGB[colour])) < 40, (task, pixel)
            checked += 1
    assert checked >= 3
    with pytest.raises(ValueError, match="training ids must be the world's training tasks"):
        write_offline_benchmark(tmp_path / "bad", [0], [5])


def test_the_offline_benchmark_writes_either_set_in_either_format(tmp_path: Path) -> None:
    """GQA for both sets (train and testdev files), OK-VQA for both (train2014 and val2014 files, the training images
    named as the train2014 questions file's subtype says); each set reads back with the world's answers."""
    from clova_train.envs.common.world import make_task
    from clova_train.envs.tasks.offline import write_offline_benchmark

    train_ids, eval_ids = [1, 2, 3], [5, 10]
    gqa = write_offline_benchmark(tmp_path / "gqa", train_ids, eval_ids, scale=1, train_format="gqa",
                                  eval_format="gqa")
    okvqa = write_offline_benchmark(tmp_path / "okvqa", train_ids, eval_ids, scale=1, train_format="okvqa",
                                    eval_format="okvqa")
    assert Path(gqa["gqa-eval"].questions).name == "testdev_balanced_questions.json"
    assert Path(okvqa["okvqa-train"].questions).name == "OpenEnded_mscoco_train2014_questions.json"
    for files, key, ids in ((gqa, "gqa-train", train_ids), (gqa, "gqa-eval", eval_ids),
                            (okvqa, "okvqa-train", train_ids), (okvqa, "okvqa-eval", eval_ids)):
        tasks, skipped = load_tasks(files[key])
        assert sorted(int(t.task_id) for t in tasks) == ids and skipped.total == 0, key  # GQA: keys sorted as text
        assert all(t.answers[0] == make_task(int(t.task_id)).answer for t in tasks), key
    assert {t.image.name for t in load_tasks(okvqa["okvqa-train"])[0]} == {
        f"COCO_train2014_{i:012d}.jpg" for i in train_ids}
    refs, _ = load_tasks(okvqa["refcoco-train"])
    assert refs and all(t.image.name.startswith("COCO_train2014_") for t in refs)
    with pytest.raises(ValueError, match="eval_format must be one of gqa, okvqa"):
        write_offline_benchmark(tmp_path / "bad", train_ids, eval_ids, eval_format="vqav2")


def test_gqa_questions_are_streamed_so_a_limit_stops_reading_and_a_broken_tail_names_the_last_good_entry(
        tmp_path: Path) -> None:
    """GQA's training questions (1.4 GB) exceed a whole-file read: the file is read entry by entry, so a limit stops
    before a damaged part it never reaches, and reading it all names where it broke off."""
    images = _images(tmp_path / "images", "img.jpg")
    entries = ",".join(f'"{i}": {{"imageId": "img", "question": "Is it red?", "answer": "yes"}}' for i in range(2000))
    path = tmp_path / "train_balanced_questions.json"
    path.write_text("{" + entries + ', "2000": {"imageId": "img", "quest', encoding="utf-8")  # cut off mid-record
    tasks, _ = load_tasks(TaskFiles("gqa", str(path), images, limit=3))
    assert [t.task_id for t in tasks] == ["0", "1", "2"]
    with pytest.raises(DataError, match=r"gqa questions .*train_balanced_questions.json is not valid JSON \(after "
                                        r"entry '1999'\)"):
        load_tasks(TaskFiles("gqa", str(path), images))


@pytest.mark.parametrize(("text", "message"), [
    ('[{"imageId": "img", "question": "q", "answer": "a"}]', "must be a JSON object"),
    ('{"1": {"imageId": "img", "question": "q", "answer": "a"}, "1": {}}', "has the key '1' twice"),
    ('{"1": ' + "[" * 150 + "]" * 150 + "}", "nested more than 100 levels deep"),
])
def test_a_streamed_gqa_file_that_is_not_an_object_of_records_is_one_error(tmp_path: Path, text: str,
                                                                           message: str) -> None:
    path = tmp_path / "q.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError, match=message):
        load_tasks(TaskFiles("gqa", str(path), _images(tmp_path / "images", "img.jpg")))
