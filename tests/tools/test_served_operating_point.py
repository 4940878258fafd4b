"""A prompt pool is served at the operating point its export carries (issue 55 point 3, issue 52 point 4).

The calibration step writes the margin it chose on validation data into the export's ``tool.json``;
``PromptToolServer.from_export`` serves with it, an explicit override wins, and BLIP VQA's ``answer_margin`` is applied
when answering and chosen from validation records only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clova_train.core.errors import DataError, ExportError
from clova_train.core.pool import PromptPool
from clova_train.core.run_manifest import POOL_FILE, TOOL_FILE
from clova_train.tools.base import NoPrompt
from clova_train.tools.operating_point import NEVER, RECORD_KEY, operating_point_record, write_operating_point
from clova_train.tools.prompt_server import PromptToolServer


def _export(tool, concept: str | None, directory: Path, prompts: int = 3, scale: float = 1.0) -> Path:
    """An export directory of ``tool`` with ``prompts`` random prompts for ``concept`` (no training run)."""
    generator = torch.Generator().manual_seed(0)
    pool = PromptPool(tool.pool_spec())
    pool.add(concept, torch.randn(prompts, tool.feature_dim, generator=generator),
             scale * torch.randn(prompts, *tool.prompt_shape, generator=generator))
    directory.mkdir()
    pool.save(directory / POOL_FILE)
    (directory / TOOL_FILE).write_text(json.dumps(tool.describe()))
    return directory


@pytest.fixture(scope="module")
def clip_tool(tiny_models):
    from clova_train.tools.clip.tool import PromptedClip

    return PromptedClip(f"local-dir:{tiny_models('clip')}", None, num_prompt_tokens=2, prompt_depth=1)


@pytest.fixture(scope="module")
def vqa_tool(tiny_blip_dir):
    from clova_train.tools.vqa.tool import BlipVqa

    return BlipVqa(str(tiny_blip_dir), num_prompt_tokens=2, max_answer_tokens=3, top_k=1)


def test_the_clip_export_serves_at_its_calibrated_margin_and_an_override_wins(clip_tool, tmp_path: Path,
                                                                             one_torch_thread: None) -> None:
    from clova_train.tools.clip.margin import classify_forwards, decide

    export = _export(clip_tool, "purple", tmp_path / "export", scale=5.0)
    write_operating_point(export, "classify_margin", 0.275,
                          operating_point_record("classify_margin", 0.275, "rendered validation images", 1200))
    written = json.loads((export / TOOL_FILE).read_text())
    assert written["init_args"]["classify_margin"] == 0.275 and written[RECORD_KEY]["validation_items"] == 1200
    server = PromptToolServer.from_export(export)
    assert server.tool.classify_margin == 0.275
    images, labels = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(1)), ["purple", "red", "blue"]
    forwards = classify_forwards(server, images, labels)
    assert torch.equal(server.classify(images, labels)[1].argmax(-1), decide(server.tool, forwards, 0.275))
    never = PromptToolServer.from_export(export, classify_margin=NEVER)  # the override wins over the file
    assert never.tool.classify_margin == NEVER
    assert torch.equal(never.classify(images, labels)[1].argmax(-1), forwards.unprompted.argmax(-1))
    with pytest.raises(ExportError, match="answer_margin"):
        PromptToolServer.from_export(export, answer_margin=0.1)  # CLIP has no such margin: refused before loading


def test_vqa_serves_the_prompted_answer_only_where_it_wins_by_the_exported_margin(vqa_tool, tmp_path: Path,
                                                                                  one_torch_thread: None) -> None:
    from clova_train.tools.vqa.tool import served_answers

    plain, prompted = ["yellow", "orange", "red"], ["orange", "orange", "purple"]
    confidence = torch.tensor([0.9, 0.2, 0.5]), torch.tensor([0.95, 0.8, 0.6])
    assert served_answers(plain, confidence[0], prompted, confidence[1], 0.0) == ["orange", "orange", "purple"]
    assert served_answers(plain, confidence[0], prompted, confidence[1], 0.2) == ["yellow", "orange", "red"]
    assert served_answers(plain, confidence[0], prompted, confidence[1], NEVER) == plain

    export = _export(vqa_tool, None, tmp_path / "export", prompts=2, scale=3.0)
    assert json.loads((export / TOOL_FILE).read_text())["init_args"]["answer_margin"] is None  # the paper's rule
    write_operating_point(export, "answer_margin", NEVER, operating_point_record("answer_margin", NEVER, "test", 3))
    assert json.loads((export / TOOL_FILE).read_text())["init_args"]["answer_margin"] == NEVER
    tool = vqa_tool
    server = PromptToolServer(tool, PromptPool.load(export / POOL_FILE))  # from_export's server, without the reload
    tool.answer_margin = NEVER
    images = [torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
              for k in range(3)]
    questions = ["what colour is the circle?"] * 3
    with torch.no_grad():
        embeds = tool.image_embeddings(tool.pixel_values(images))
        encoded = tool.encode_questions(embeds, *tool.tokenize_questions(questions))
        answers = tool.both_answers(encoded, server.prompts_for(None, embeds.mean(1)))
    assert server.answer(images, questions) == answers[0]  # never: the unmodified answers
    tool.answer_margin = 0.0
    assert server.answer(images, questions) == served_answers(*answers, 0.0)
    tool.answer_margin = None
    assert server.answer(images, questions) == answers[2]  # the paper's rule: the prompted answers always
    with pytest.raises(ExportError, match="classify_margin"):
        PromptToolServer.from_export(export, classify_margin=0.1)  # refused before the model loads


def test_the_loader_puts_an_override_in_place_of_the_exported_margin(tmp_path: Path) -> None:
    from clova_train.tools.prompt_server import with_served_margins

    description = {"tool": "blip_vqa", "class_path": "clova_train.tools.vqa.tool.BlipVqa",
                   "init_args": {"model_name": "m", "answer_margin": 0.3}}
    assert with_served_margins(description, tmp_path, {"answer_margin": None}) is description
    assert with_served_margins(description, tmp_path, {"answer_margin": 0.1})["init_args"]["answer_margin"] == 0.1
    assert description["init_args"]["answer_margin"] == 0.3  # the file's description is left as it was
    with pytest.raises(ExportError, match="init_args must be an object"):
        with_served_margins({**description, "init_args": [1]}, tmp_path, {"answer_margin": 0.1})


def test_the_vqa_margin_is_chosen_on_validation_records_only(tmp_path: Path) -> None:
    from clova_train.tools.vqa.margin import AnswerForwards, calibrate_export, choose_answer_margin
    from clova_train.tools.vqa.synthetic import write_vqa_records

    # 300 yellow questions the tool knows: a prompt turns 30 of them into "orange" with a confidence 0.1 above the
    # unmodified one's; 300 orange questions it gets wrong: the prompt fixes them with a confidence 0.3 above.
    gold = ["yellow"] * 300 + ["orange"] * 300
    plain = ["yellow"] * 300 + ["yellow"] * 300
    prompted = ["orange"] * 30 + ["yellow"] * 270 + ["orange"] * 300
    plain_conf = torch.full((600,), 0.5)
    prompted_conf = torch.cat([torch.full((30,), 0.6), torch.full((270,), 0.5), torch.full((300,), 0.8)])
    margin, table = choose_answer_margin(AnswerForwards(gold, plain, plain_conf, prompted, prompted_conf))
    assert 0.1 <= margin < 0.3  # yellow kept (the bound holds only above 0.1), orange fixed
    assert table[0.0]["taken_bound"]["yellow"] > 0.02 >= table[margin]["taken_bound"]["yellow"]

    root = write_vqa_records(tmp_path / "data", ["orange"], ["yellow"], images_per_colour=1, wrong_answers=0,
                             eval_per_colour=2, image_size=16, seed=0)
    test_records = root / "eval.jsonl"
    from clova_train.tools.vqa.demo import read_eval_records

    with pytest.raises(DataError, match="test images"):  # refused before any model loads
        calibrate_export(tmp_path / "no-export", read_eval_records(test_records), "the test records",
                         held_out=[test_records])


def test_serve_applies_a_margin_flag_to_the_exports_that_take_it(clip_tool, vqa_tool, tmp_path: Path) -> None:
    """``serve --classify-margin`` / ``--answer-margin``: each served export gets the margins its tool takes; a margin
    no served export takes is one error naming the flag."""
    from clova_train.core.errors import ExportError
    from clova_train.serving.http import build_apis

    clip = _export(clip_tool, "purple", tmp_path / "clip")
    vqa = _export(vqa_tool, "orange", tmp_path / "vqa")
    apis = build_apis([str(clip), str(vqa)], None, None, 1, 0.0,
                      margins={"classify_margin": 0.4, "answer_margin": None})
    assert [api.margins for api in apis] == [{"classify_margin": 0.4}, {}]
    with pytest.raises(ExportError, match="--answer-margin"):
        build_apis([str(clip)], None, None, 1, 0.0, margins={"answer_margin": 0.1})
    with pytest.raises(ExportError, match="--detection-margin"):
        build_apis([str(clip), str(vqa)], None, None, 1, 0.0, margins={"detection_margin": 0.1})


@pytest.fixture(scope="module")
def loc_tool(tiny_owlvit_dir):
    from clova_train.tools.loc.tool import OwlVitLoc

    # a threshold this low keeps every stored prompt and finds boxes on any image: every image is prompted
    return OwlVitLoc(str(tiny_owlvit_dir), num_prompt_tokens=2, score_threshold=1e-4)


def test_loc_serves_the_prompted_detections_only_where_they_win_by_the_exported_margin(
        loc_tool, tmp_path: Path, one_torch_thread: None) -> None:
    from clova_train.tools.loc.tool import detection_confidence, served_prompted

    export = _export(loc_tool, "purple circle", tmp_path / "export", prompts=2, scale=3.0)
    assert json.loads((export / TOOL_FILE).read_text())["init_args"]["detection_margin"] is None  # the paper's rule
    server = PromptToolServer(loc_tool, PromptPool.load(export / POOL_FILE))
    images = [torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
              for k in range(4)]
    with torch.no_grad():
        both = loc_tool.both_detections(server, images, "purple circle")
        assert all(prompted is not None for _, prompted in both)
        assert [(p, False) for p, _ in both] == [(d, d.pop("prompted")) for d in loc_tool.detect(NoPrompt(), images, "purple circle")]
        for margin, expected in ((None, [True] * 4), (NEVER, [False] * 4),
                                 (0.0, [served_prompted(detection_confidence(q), detection_confidence(p), 0.0)
                                        for p, q in both])):
            loc_tool.detection_margin = margin
            served = server.detect(images, "purple circle")
            assert [s["prompted"] for s in served] == expected
            assert [{k: s[k] for k in ("boxes", "scores")} for s in served] == [q if e else p for (p, q), e in
                                                                                   zip(both, expected)]
        loc_tool.detection_margin = 0.0  # the images run together are served as each would be alone
        alone = [server.detect([image], "purple circle")[0] for image in images]
        together = server.detect(images, "purple circle")
        assert [a["prompted"] for a in alone] == [t["prompted"] for t in together]
        for a, t in zip(alone, together):
            assert torch.allclose(torch.tensor(a["scores"]), torch.tensor(t["scores"]), atol=1e-5)
            assert torch.allclose(torch.tensor(a["boxes"]), torch.tensor(t["boxes"]), atol=1e-3)
        loc_tool.max_candidates = 1  # each image's one most similar stored prompt, kept (threshold ~0)
        stored_features, stored_prompts = server.candidates("purple circle")
        queries, mask = loc_tool._query_embeddings(["purple circle"])
        embedded = loc_tool.embed_tokens(loc_tool.pixel_values(images))
        features = loc_tool.image_features(embedded)
        chosen = loc_tool.prompts_for_images(server, "purple circle", embedded, features, queries, mask)
        nearest = torch.nn.functional.cosine_similarity(features[:, None], stored_features[None], dim=-1).argmax(1)
        assert all(torch.allclose(c, stored_prompts[int(k)]) for c, k in zip(chosen, nearest))
        loc_tool.max_candidates = None
    loc_tool.detection_margin = None
    write_operating_point(export, "detection_margin", 0.2, operating_point_record("detection_margin", 0.2, "test", 3))
    assert PromptToolServer.check_export(export, None)["init_args"]["detection_margin"] == 0.2
    with pytest.raises(ExportError, match="answer_margin"):
        PromptToolServer.from_export(export, answer_margin=0.1)  # LOC has no such margin: refused before loading
    from clova_train.tools.loc.tool import OwlVitLoc
    from clova_train.core.errors import ModelError

    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ModelError, match="detection_margin"):
            OwlVitLoc.__init__(object.__new__(OwlVitLoc), "unused", detection_margin=bad)


def _forwards(found_lost: int = 30, found_kept: int = 270, missed_fixed: int = 300):
    """Validation forwards: images the detector finds, of which the prompt loses ``found_lost`` at a confidence 0.1
    above the unmodified one's; images it misses that the prompt finds at a confidence 0.3 above."""
    from clova_train.tools.loc.margin import DetectionForwards

    found = found_lost + found_kept
    plain_found = torch.tensor([True] * found + [False] * missed_fixed)
    prompted_found = torch.tensor([False] * found_lost + [True] * found_kept + [True] * missed_fixed)
    plain_conf = torch.full((found + missed_fixed,), 0.4, dtype=torch.float64)
    prompted_conf = torch.cat([torch.full((found_lost,), 0.5), torch.full((found_kept,), 0.4),
                               torch.full((missed_fixed,), 0.7)]).double()
    return DetectionForwards(plain_found, plain_conf, prompted_found, prompted_conf)


def test_the_loc_margin_keeps_the_found_images_and_is_never_without_enough_of_them() -> None:
    from clova_train.tools.loc.margin import NOT_PROMPTED, DetectionForwards, choose_detection_margin

    margin, table = choose_detection_margin(_forwards(), "purple circle")
    assert 0.1 <= margin < 0.3  # the found images kept (the bound holds only above 0.1), the missed ones fixed
    group = "purple circle, found without prompts"
    assert table[0.0]["taken_bound"][group] > 0.02 >= table[margin]["taken_bound"][group]
    assert table[margin]["accuracy"] == 1.0
    # too few found images to show the bound: never prompted, whatever the prompts do
    assert choose_detection_margin(_forwards(0, 100, 300), "purple circle")[0] == NEVER
    # an image the pool keeps no prompt for is answered by the unmodified detector at every margin
    forwards = DetectionForwards(torch.tensor([True]), torch.tensor([0.2], dtype=torch.float64), torch.tensor([False]),
                                 torch.tensor([NOT_PROMPTED], dtype=torch.float64))
    assert bool(forwards.served_found(0.0)[0])


class _CountingLoc:
    """A stand-in LOC tool: image k is found without prompts when k is even; the pool prompts every image."""

    name = "owlvit_loc"

    def __init__(self) -> None:
        self.seen = 0

    def both_detections(self, lookup, images, concept, other_queries=(), plain_needed=True):
        self.seen += len(images)
        return [({"boxes": [], "scores": [0.3]}, {"boxes": [], "scores": [0.35]}) for _ in images]

    def found(self, detections, image, concept) -> bool:
        return image.k % 2 == 0 if detections["scores"] == [0.3] else True


def test_loc_validation_stops_once_enough_found_images_are_read() -> None:
    from types import SimpleNamespace

    from clova_train.tools.loc.margin import gather_forwards

    tool = _CountingLoc()
    server = SimpleNamespace(tool=tool)
    batches = ([SimpleNamespace(image=None, k=k) for k in range(start, start + 50)] for start in range(0, 10_000, 50))
    forwards = gather_forwards(server, "purple circle", batches, needed=60)
    assert len(forwards) == 150 and int(forwards.plain_found.sum()) == 75 and tool.seen == 150  # three batches
    capped = gather_forwards(server, "purple circle", ([SimpleNamespace(image=None, k=1)] * 50 for _ in range(9)),
                             needed=60, max_images=120)
    assert len(capped) == 120  # never found: stops at the cap


def test_loc_validation_images_never_include_the_runs_evaluation_images(tmp_path: Path) -> None:
    import yaml

    from clova_train.tools.grounding.synthetic import write_coco_scenes
    from clova_train.tools.grounding.validation import annotated_validation_images, rendered_validation_batches
    from clova_train.tools.loc.margin import main

    root = write_coco_scenes(tmp_path / "scenes", ["purple circle"], 12, objects_per_image=2, image_size=32, seed=0)
    export = tmp_path / "export"
    export.mkdir()
    data = {"root": str(root), "concept": "purple circle", "images": 12, "image_size": 32, "render_seed": 3,
            "num_val_images": 2, "num_eval_images": 4, "max_images": 6}
    (export / "config.yaml").write_text(yaml.safe_dump({"data": {"init_args": data}}))
    with pytest.raises(DataError, match="evaluation images"):
        annotated_validation_images(export, root / "annotations.json")
    other = write_coco_scenes(tmp_path / "other", ["purple circle"], 5, objects_per_image=2, image_size=32, seed=9)
    concept, images = annotated_validation_images(export, other / "annotations.json")
    assert concept == "purple circle" and len(images) == 5
    concept, batches = rendered_validation_batches(export, tmp_path / "validation", 3)
    first, second = next(batches), next(batches)
    assert len(first) == len(second) == 3 and not torch.equal(first[0].image, second[0].image)
    from clova_train.tools.grounding.coco import GroundingAnnotations

    run = GroundingAnnotations(root / "annotations.json")
    run_images = [run.grounded_image(i).image for i in run.images_of(run.category_id("purple circle"))]
    assert not any(torch.equal(a.image, b) for a in first + second for b in run_images)
    assert main([str(tmp_path / "no-export")]) == 1  # one error line, no traceback


def test_a_loc_export_is_calibrated_on_a_validation_file_and_serves_at_the_margin(
        loc_tool, tmp_path: Path, one_torch_thread: None, capsys) -> None:
    import yaml

    from clova_train.tools.grounding.synthetic import write_coco_scenes
    from clova_train.tools.loc.margin import main

    root = write_coco_scenes(tmp_path / "scenes", ["purple circle"], 8, objects_per_image=2, image_size=32, seed=0)
    export = _export(loc_tool, "purple circle", tmp_path / "export", prompts=2, scale=3.0)
    data = {"root": str(root), "concept": "purple circle", "num_val_images": 2, "num_eval_images": 2, "max_images": 4}
    (export / "config.yaml").write_text(yaml.safe_dump({"data": {"init_args": data}}))
    other = write_coco_scenes(tmp_path / "other", ["purple circle"], 6, objects_per_image=2, image_size=32, seed=5)
    assert main([str(export), "--validation-annotations", str(other / "annotations.json")]) == 0
    out = capsys.readouterr().out
    written = json.loads((export / TOOL_FILE).read_text())
    assert written["init_args"]["detection_margin"] == NEVER  # 6 images cannot show the 2% bound: never prompted
    assert written[RECORD_KEY]["validation_items"] == 6 and "detection_margin 1" in out
    assert PromptToolServer.from_export(export).tool.detection_margin == NEVER
    assert main([str(export), "--validation-annotations", str(root / "annotations.json")]) == 1  # the run's test
