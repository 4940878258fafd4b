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
