"""CLOVA's closed loop: reflection parsing, collectors, demonstrations, the journal, pausing on a failing
backend, and a loop killed during a fit that resumes to the same pools, demonstrations and report."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from clova_train.closedloop import (
    ClosedLoop, CollectionRequest, Demonstration, DemonstrationPool, FitResult, FolderImageSource,
    GroundingCollector, ImageCollector, Journal, LoopPaused, LoopTool, Templates, Trace, VqaCollector,
    parse_local_verdict, parse_reflection, read_tasks,
)
from clova_train.closedloop import world
from clova_train.closedloop.inference import ToolCall
from clova_train.closedloop.pool_check import HeldOutClassification, HeldOutErrors
from clova_train.closedloop.toolapi import VisualTools
from clova_train.core.errors import DataError
from clova_train.core.pool import PromptPool
from clova_train.llm.backends import BackendError, ChatBackend, HashingEmbedder, OpenAIChatBackend
from clova_train.synthetic.shapes import render_scene
from clova_train.tools.base import PromptTool
from clova_train.tools.prompt_server import PromptToolServer
from helpers.common import REPO

TOOLS = ("CLASSIFY", "LOC", "VQA")


# ----------------------------------------------------------------------------------------------- reflection
@pytest.mark.parametrize("reply, location, concept", [
    ("CLASSIFY\nConcept: Purple\nReason: the circle is purple.", "CLASSIFY", "purple"),  # after the prefilled label
    ("Error Location: classify\nConcept: 'orange'.\nReason: x", "CLASSIFY", "orange"),
    ("  error location : LOC \n concept: red circle", "LOC", "red circle"),
    ("program\nReason: the program counts instead of comparing", "program", ""),
])
def test_reflection_replies_that_name_a_location(reply: str, location: str, concept: str) -> None:
    critique = parse_reflection(reply, TOOLS)
    assert (critique.location, critique.concept, critique.problem) == (location, concept, "")
    assert critique.tool == (location if location in TOOLS else None)


@pytest.mark.parametrize("reply, words", [
    ("Error Location: DETECTOR\nConcept: cat", ["DETECTOR", "not a tool"]),  # an unknown tool
    ("I am not sure what went wrong here.", ["not a tool"]),
    ("", ["no error location"]),
    ("Error Location: CLASSIFY\nReason: wrong colour", ["names no concept"]),
])
def test_reflection_replies_that_cannot_be_used_are_recorded_not_raised(reply: str, words: list[str]) -> None:
    critique = parse_reflection(reply, TOOLS)
    assert critique.tool is None and critique.reply == reply
    assert all(w in critique.problem for w in words), critique.problem


def test_local_reflection_verdicts() -> None:
    assert parse_local_verdict("Yes.", TOOLS, 2) is None
    found = parse_local_verdict("no\nError Location: CLASSIFY\nConcept: orange\nReason: it is orange", TOOLS, 3)
    assert (found.tool, found.concept, found.step) == ("CLASSIFY", "orange", 3)
    assert "neither yes nor no" in parse_local_verdict("maybe", TOOLS, 1).problem
    assert "not where" in parse_local_verdict("No.", TOOLS, 1).problem


def test_templates_are_files_a_user_can_override(tmp_path: Path) -> None:
    (tmp_path / "plan.txt").write_text("PLAN FOR $instruction\n$correct_examples$incorrect_examples")
    templates = Templates(tmp_path)
    assert templates.render("plan", instruction="x", correct_examples="", incorrect_examples="") == "PLAN FOR x\n"
    assert templates.texts["program"] == Templates().texts["program"]  # the others stay the packaged ones
    (tmp_path / "program.txt").write_text("$instruction $image_bytes")
    with pytest.raises(DataError, match=r"program.txt uses unknown field\(s\) \['image_bytes'\]"):
        Templates(tmp_path)


# ----------------------------------------------------------------------------------------------- collectors
def _png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def image_source(tmp_path: Path) -> Path:
    root = tmp_path / "source"
    for label, count in (("purple", 10), ("red", 4), ("blue", 4), ("red_circle", 3)):
        (root / label).mkdir(parents=True)
        for k in range(count):
            (root / label / f"{k:02d}.png").write_bytes(_png((k * 20, 10, 200)))
    return root


def _request(concept: str, index: int = 0, task=None, trace=None) -> CollectionRequest:
    return CollectionRequest("CLASSIFY", concept, index, task, trace)


def test_image_collector_writes_concept_folders_and_takes_new_images_each_time(image_source: Path, tmp_path: Path) -> None:
    collector = ImageCollector(FolderImageSource(image_source), ["purple", "red", "blue", "green"], train_images=3,
                               val_images=2, negatives_per_label=1)
    first = collector.collect(_request("purple", 0), tmp_path / "c0")
    assert not first.skipped and first.items == 3
    assert sorted(p.name for p in (tmp_path / "c0/purple/val").iterdir()) == ["c00-000.png", "c00-001.png"]
    assert sorted(p.name for p in (tmp_path / "c0/purple/train").iterdir()) == ["c00-002.png", "c00-003.png", "c00-004.png"]
    assert {p.name for p in (tmp_path / "c0").iterdir()} == {"purple", "red", "blue"}  # green has no images: left out
    assert first.fit_arguments == {"data.init_args.root": str(tmp_path / "c0"), "data.init_args.concepts": ["purple"]}
    second = collector.collect(_request("purple", 1), tmp_path / "c1")
    assert second.items == 3 and second.data_hash != first.data_hash  # the next five images of the source
    assert sorted(p.name for p in (tmp_path / "c1/purple/train").iterdir())[0] == "c01-002.png"
    assert collector.collect(_request("purple", 2), tmp_path / "c2").skipped  # 10 images: none left for a third
    # a concept with a space maps to the concept-folder name
    assert not collector.collect(_request("red circle", 0), tmp_path / "rc").skipped


def test_image_collector_records_a_skip_for_a_concept_the_source_lacks(image_source: Path, tmp_path: Path) -> None:
    collected = ImageCollector(FolderImageSource(image_source), ["purple", "red"]).collect(_request("pink"), tmp_path / "x")
    assert "no images" in collected.skipped and "'pink'" in collected.skipped and not collected.fit_arguments


def test_image_collector_names_an_unreadable_image(image_source: Path, tmp_path: Path) -> None:
    (image_source / "purple" / "00.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"source 'purple' image 0: not a readable image"):
        ImageCollector(FolderImageSource(image_source), ["purple", "red"]).collect(_request("purple"), tmp_path / "x")


def test_grounding_collector_writes_the_concepts_images_from_a_coco_file(tmp_path: Path) -> None:
    from clova_train.tools.grounding.coco import GroundingAnnotations

    (tmp_path / "images").mkdir()
    images, annotations = [], []
    for i in range(5):
        Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(tmp_path / "images" / f"{i}.png")
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": 32, "height": 32})
        annotations.append({"id": 10 + i, "image_id": i + 1, "category_id": 1 if i < 3 else 2,
                            "bbox": [2, 2, 10, 10], "area": 100, "iscrowd": 0})
    categories = [{"id": 1, "name": "horse"}, {"id": 2, "name": "dog"}]
    (tmp_path / "ann.json").write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    collector = GroundingCollector(tmp_path / "ann.json", images_per_collection=2)
    collected = collector.collect(_request("Horse"), tmp_path / "out")
    assert collected.items == 2 and collected.fit_arguments["data.init_args.concept"] == "horse"
    subset = GroundingAnnotations(collected.fit_arguments["data.init_args.annotations"])
    assert sorted(subset.coco.imgs) == [1, 2] and all(subset.image_file(i).is_file() for i in (1, 2))
    assert collector.collect(_request("horse", 1), tmp_path / "out1").items == 1  # the third horse image
    assert "no images (left)" in collector.collect(_request("horse", 2), tmp_path / "out2").skipped
    assert "no category named 'zebra'" in collector.collect(_request("zebra"), tmp_path / "out3").skipped


class _Answers(ChatBackend):
    def __init__(self, reply: str) -> None:
        self.reply, self.prompts = reply, []

    def identity(self) -> dict:
        return {"kind": "test"}

    def chat(self, messages: list) -> str:
        self.prompts.append(messages[-1]["content"])
        return self.reply


def test_vqa_collector_writes_the_inferred_answer_for_the_failed_question(tmp_path: Path) -> None:
    from clova_train.closedloop.tasks import LoopTask
    from clova_train.tools.vqa.records import read_records

    Image.new("RGB", (64, 64), (0, 0, 255)).save(tmp_path / "scene.png")
    task = LoopTask("t1", "Is the sky blue?", tmp_path / "scene.png", answer="yes")
    trace = Trace("t1", task.instruction, "plan", "code", "ok", "", "no", False,
                  [ToolCall("LOC", "find", ["sky"], [[0, 32, 64, 64]], [0, 0, 64, 64]),
                   ToolCall("VQA", "simple_query", ["what colour is the sky?"], "green", [0, 32, 64, 64])])
    llm = _Answers("blue\n(because the answer is yes)")
    collected = VqaCollector(llm, Templates()).collect(CollectionRequest("VQA", "sky", 0, task, trace), tmp_path / "vqa")
    records = read_records(Path(collected.fit_arguments["data.init_args.records"]))
    assert records[0]["question"] == records[0]["val_question"] == "what colour is the sky?"
    assert records[0]["answer"] == records[0]["val_answer"] == "blue"
    assert Image.open(tmp_path / "vqa" / "region.png").size == (64, 32)  # the region the program asked about
    assert "Its answer: green" in llm.prompts[0] and "The correct answer is yes" in llm.prompts[0]
    no_vqa = Trace("t1", task.instruction, "", "", "ok", "", "no", False, [])
    assert VqaCollector(llm, Templates()).collect(CollectionRequest("VQA", "sky", 0, task, no_vqa), tmp_path / "v2").skipped


# ----------------------------------------------------------------------------------------------- demonstrations, journal
def test_demonstration_retrieval_returns_the_most_similar_of_each_kind_and_verdict(tmp_path: Path) -> None:
    pool = DemonstrationPool(HashingEmbedder(256))
    pool.add(Demonstration("program", True, "What colour is the circle?", "A"))
    pool.add(Demonstration("program", True, "Are the square and the circle the same colour?", "B"))
    pool.add(Demonstration("program", False, "What colour is the square?", "C", critique="CLASSIFY missed purple"))
    pool.add(Demonstration("plan", True, "What colour is the circle?", "P"))
    assert not pool.add(Demonstration("plan", True, "What colour is the circle?", "P"))  # stored once
    good, bad = pool.retrieve("program", "What colour is the triangle?", correct=1, incorrect=2)
    assert [e.text for e in good] == ["A"] and [e.text for e in bad] == ["C"]
    good, _ = pool.retrieve("program", "Are the triangle and the circle the same colour?", 2, 0)
    assert [e.text for e in good] == ["B", "A"]
    assert pool.counts() == {"plan_correct": 1, "plan_incorrect": 0, "program_correct": 2, "program_incorrect": 1}
    again = DemonstrationPool.load(pool.save(tmp_path / "d.json"), HashingEmbedder(256))
    assert again.examples == pool.examples


def test_journal_drops_a_line_cut_off_by_a_kill(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.jsonl")
    journal.append("a", x=1)
    journal.append("b", x=2)
    with open(tmp_path / "j.jsonl", "a") as handle:
        handle.write('{"event": "c", "x"')  # the kill came mid-write
    reopened = Journal(tmp_path / "j.jsonl")
    assert [e["event"] for e in reopened.events()] == ["a", "b"] and reopened.last("b")["x"] == 2
    reopened.append("c", x=3)
    assert [e["event"] for e in Journal(tmp_path / "j.jsonl").events()] == ["a", "b", "c"]
    (tmp_path / "j.jsonl").write_text('{"event": "a"}\nnot json\n{"event": "b"}\n')
    with pytest.raises(DataError, match=r"j.jsonl:2: not a journal event"):
        Journal(tmp_path / "j.jsonl")


@pytest.mark.parametrize("line, words", [
    (b"[" * 200 + b"]" * 200, "nested more than"),
    (b'{"event": "b", "x": "\xff"}', "not UTF-8"),
    (b'["event", "b"]', "an object with an 'event' field"),
    (b'{"x": 1}', "an object with an 'event' field"),
])
def test_journal_refuses_a_whole_last_line_that_is_not_an_event(tmp_path: Path, line: bytes, words: str) -> None:
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"event": "a"}\n' + line + b"\n")  # it ends in its newline: not cut off by a kill
    with pytest.raises(DataError, match=r"j.jsonl:2: not a journal event") as caught:
        Journal(path)
    assert words in str(caught.value)
    assert path.read_bytes().endswith(line + b"\n")  # left as it was


def test_journal_keeps_a_whole_last_event_that_lacks_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text('{"event": "a", "x": 1}\n{"event": "b", "x": "\u00e9"}')  # written by hand, or cut just before the end
    journal = Journal(path)
    assert [e["event"] for e in journal.events()] == ["a", "b"] and journal.last("b")["x"] == "\u00e9"
    journal.append("c")
    assert [e["event"] for e in Journal(path).events()] == ["a", "b", "c"]
    path.write_bytes(b'{"event": "a"}\n{"event": "b", "x": "\xff')  # torn inside a multi-byte character
    assert [e["event"] for e in Journal(path).events()] == ["a"]
    assert path.read_bytes() == b'{"event": "a"}\n'


def test_task_files_are_checked_line_by_line(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    good = {"id": "1", "instruction": "What colour?", "image": "a.png", "feedback": {"answer": "red"}}
    (tmp_path / "t.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "2", "feedback": {"comment": "wrong face"}}))
    tasks = read_tasks(tmp_path / "t.jsonl")
    assert tasks[0].feedback == "The correct answer is red" and tasks[1].feedback == "wrong face"
    for bad, message in (({**good, "image": "b.png"}, "t2.jsonl:1: image not found"),
                         ({**good, "feedback": "red"}, "t2.jsonl:1: feedback must be"),
                         ({k: v for k, v in good.items() if k != "instruction"}, "t2.jsonl:1: missing field 'instruction'")):
        (tmp_path / "t2.jsonl").write_text(json.dumps(bad))
        with pytest.raises(DataError, match=message):
            read_tasks(tmp_path / "t2.jsonl")


# ----------------------------------------------------------------------------------------------- the offline world
def test_scripted_reflection_finds_the_misread_concept(tmp_path: Path) -> None:
    root = world.prepare_world(tmp_path / "w", train_tasks=6, test_tasks=2, images_per_concept=4, mislabel_rate=0.5)
    tasks = read_tasks(root / "train_tasks.jsonl")
    assert len(tasks) == 6 and all(t.answer for t in tasks)
    assert sorted(p.name for p in (root / "image_source").iterdir()) == sorted(world.LABELS)
    llm, templates = world.ScriptedLoopLLM(), Templates()
    steps = ("Step1 LOC: find('circle') on region [0, 0, 128, 64] -> [[0, 0, 64, 64]]\n"
             "Step2 CLASSIFY: verify_property('circle', 'red') on region [0, 0, 64, 64] -> False\n"
             "Step3 CLASSIFY: verify_property('circle', 'blue') on region [0, 0, 64, 64] -> True")
    fields = dict(instruction="What colour is the circle?", caption="a purple circle and a red square",
                  feedback="The correct answer is purple", answer="blue", plan="", program="", steps=steps)
    critique = parse_reflection(llm.chat([{"role": "user", "content": templates.render("global_reflection", **fields)}]), TOOLS)
    assert (critique.tool, critique.concept) == ("CLASSIFY", "purple")
    local = {k: fields[k] for k in ("instruction", "caption", "feedback", "answer")}
    for index, expected in ((2, None), (3, "purple")):
        step = steps.splitlines()[index - 1].replace(f"Step{index}", f"Step{index}", 1)
        prompt = templates.render("local_reflection", total=3, checked="", index=index, step=step, **local)
        verdict = parse_local_verdict(llm.chat([{"role": "user", "content": prompt}]), TOOLS, index)
        assert (verdict.concept if verdict else None) == expected


# ----------------------------------------------------------------------------------------------- the loop
class _FlakyLLM(world.ScriptedLoopLLM):
    """The scripted LLM, failing like a server that went away on calls ``failing`` (1-based)."""

    def __init__(self, failing: set[int]) -> None:
        self.failing, self.calls = failing, 0

    def chat(self, messages: list) -> str:
        self.calls += 1
        if self.calls in self.failing:
            raise BackendError("LLM backend http://llm: 503 Service Unavailable (after 3 retries)")
        return super().chat(messages)


class _FailAfterFit(world.ScriptedLoopLLM):
    """Fails the first LLM call after the learner's first fit: the loop stops between a fit and the retry."""

    def __init__(self, learner: "_PoolLearner") -> None:
        self.learner, self.failed = learner, False

    def chat(self, messages: list) -> str:
        if self.learner.fits and not self.failed:
            self.failed = True
            raise BackendError("LLM backend http://llm: timed out after 60 s")
        return super().chat(messages)


class _PoolLearner:
    """A learner without Lightning: each fit 'accepts' one random prompt per call, seeded by the data folder."""

    def __init__(self, tool: PromptTool) -> None:
        self.tool, self.fits = tool, []

    def fit(self, tool: str, concept: str, fit_arguments: dict, output_dir: Path) -> FitResult:
        self.fits.append((tool, concept))
        output_dir.mkdir(parents=True, exist_ok=True)
        pool = PromptPool(self.tool.pool_spec())
        seed = sum(map(ord, str(output_dir.name)))
        generator = torch.Generator().manual_seed(seed)
        pool.add(concept, torch.randn(1, self.tool.feature_dim, generator=generator),
                 torch.randn(1, *self.tool.prompt_shape, generator=generator) * 0.01, [f"{output_dir.name}"])
        return FitResult(str(pool.save(output_dir / "pool.safetensors")), {"tried": 1, "accepted": 1, "rejected": 0})


def _loop(run_dir: Path, clip: PromptTool, llm: ChatBackend, learner: _PoolLearner, source: Path) -> ClosedLoop:
    labels = list(world.LABELS)
    server = PromptToolServer(clip, PromptPool(clip.pool_spec()))
    tools = {"CLASSIFY": LoopTool("CLASSIFY", server, ImageCollector(FolderImageSource(source), labels, 2, 1, 1))}
    return ClosedLoop(run_dir, llm, HashingEmbedder(), tools,
                      lambda task, servers: VisualTools(task, world.AnnotationLocator(), servers["CLASSIFY"], labels, 1.0),
                      world.AnnotationCaptioner(), learner, labels)


@pytest.fixture(scope="module")
def small_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return world.prepare_world(tmp_path_factory.mktemp("loop-world"), train_tasks=10, test_tasks=6, images_per_concept=8)


@pytest.mark.parametrize("failure", ["mid-task", "right after a fit"])
def test_a_failing_backend_pauses_the_loop_and_a_rerun_continues(failure: str, small_world: Path, tiny_clip_dir: Path,
                                                                 tmp_path: Path) -> None:
    clip = PromptTool.from_description({"class_path": "clova_train.tools.clip.tool.PromptedClip",
                                        "init_args": {"model_name": f"local-dir:{tiny_clip_dir}", "pretrained": None}})
    tasks = read_tasks(small_world / "train_tasks.jsonl")
    straight = _loop(tmp_path / "straight", clip, world.ScriptedLoopLLM(), _PoolLearner(clip), small_world / "image_source")
    expected = straight.train(tasks)
    straight.close()
    assert expected["tasks"]["unsolved"] + expected["tasks"]["solved_after_learning"] > 0  # something was learned
    learner = _PoolLearner(clip)
    flaky = _FlakyLLM({7, 8, 9}) if failure == "mid-task" else _FailAfterFit(learner)
    paused = _loop(tmp_path / "paused", clip, flaky, learner, small_world / "image_source")
    with pytest.raises(LoopPaused, match=r"paused at task .*(503 Service Unavailable|timed out).*rerun the same command"):
        paused.train(tasks)
    paused.close()
    journal = Journal(tmp_path / "paused" / "journal.jsonl")
    assert journal.last("paused") is not None and len(journal.events("task_done")) < len(tasks)
    resumed = _loop(tmp_path / "paused", clip, world.ScriptedLoopLLM(), learner, small_world / "image_source")
    assert resumed.train(tasks) == expected
    resumed.close()
    def decisions(run: str) -> list[tuple]:
        return [(e["event"], e.get("task"), e.get("phase"), e.get("kind"), e.get("added"))
                for e in Journal(tmp_path / run / "journal.jsonl").events() if e["event"] != "paused"]

    assert decisions("paused") == decisions("straight")  # the same attempts, reflections, collections and fits
    fits_done = Journal(tmp_path / "paused" / "journal.jsonl").events("fit_done")
    assert len(learner.fits) == len(fits_done) == len(Journal(tmp_path / "straight" / "journal.jsonl").events("fit_done"))


# The client's time limit per call: long enough that a healthy reply on a busy machine (the suite runs DDP
# subprocesses beside this test; 0.3 s timed out there) is never taken for the ``timeout`` failure.
TIMEOUT_S = 2.0


class _ChatServer:
    """An OpenAI-compatible chat endpoint that answers as the scripted LLM and, from its ``fail_from``-th
    request on, fails as a real server does: ``503``, a ``malformed`` reply, or no reply in time (``timeout``)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests, self.fail_from, self.failure = 0, None, "503"
        owner, scripted = self, world.ScriptedLoopLLM()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests += 1
                failing = owner.fail_from is not None and owner.requests >= owner.fail_from
                if failing and owner.failure == "timeout":
                    time.sleep(TIMEOUT_S * 2.5)
                    return  # the client has given up: no reply to write
                if failing and owner.failure == "503":
                    self.send_response(503)
                    self.end_headers()
                    return
                reply = ({"choices": []} if failing and owner.failure == "malformed"
                         else {"choices": [{"message": {"role": "assistant", "content": scripted.chat(body["messages"])}}]})
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def backend(self) -> ChatBackend:
        return OpenAIChatBackend(self.url, "scripted", api_key="none", timeout_s=TIMEOUT_S, max_retries=1,
                                 backoff_s=0.01)


@pytest.mark.parametrize("failure", ["503", "malformed", "timeout"])
def test_a_failing_http_llm_pauses_the_loop_with_its_state_and_a_rerun_continues(
        failure: str, small_world: Path, tiny_clip_dir: Path, tmp_path: Path) -> None:
    clip = PromptTool.from_description({"class_path": "clova_train.tools.clip.tool.PromptedClip",
                                        "init_args": {"model_name": f"local-dir:{tiny_clip_dir}", "pretrained": None}})
    tasks = read_tasks(small_world / "train_tasks.jsonl")
    server = _ChatServer()
    try:
        straight = _loop(tmp_path / "straight", clip, server.backend(), _PoolLearner(clip), small_world / "image_source")
        expected = straight.train(tasks)
        straight.close()
        calls = server.requests
        server.requests, server.fail_from, server.failure = 0, calls // 2, failure
        learner = _PoolLearner(clip)
        paused = _loop(tmp_path / "paused", clip, server.backend(), learner, small_world / "image_source")
        with pytest.raises(LoopPaused, match=rf"paused at task .*{server.url}.*rerun the same command"):
            paused.train(tasks)
        paused.close()
        saved = Journal(tmp_path / "paused" / "journal.jsonl").events()
        assert 0 < len([e for e in saved if e["event"] == "task_done"]) < len(tasks)
        server.fail_from = None
        resumed = _loop(tmp_path / "paused", clip, server.backend(), learner, small_world / "image_source")
        assert resumed.train(tasks) == expected
        resumed.close()
    finally:
        server.server.shutdown()
    assert Journal(tmp_path / "paused" / "journal.jsonl").events()[:len(saved)] == saved  # nothing rewritten
    assert len(learner.fits) == len(Journal(tmp_path / "straight" / "journal.jsonl").events("fit_done"))


def test_held_out_classification_counts_each_distinct_image_once_over_collections(tiny_clip_dir: Path, tmp_path: Path) -> None:
    clip = PromptTool.from_description({"class_path": "clova_train.tools.clip.tool.PromptedClip",
                                        "init_args": {"model_name": f"local-dir:{tiny_clip_dir}", "pretrained": None}})
    server = PromptToolServer(clip, PromptPool(clip.pool_spec()))
    labels = ["red", "blue", "purple"]
    def draw(colour: str, k: int) -> np.ndarray:
        return render_scene([(colour, "circle")], size=32, rng=np.random.default_rng(k)).image
    files: dict[tuple[str, str], np.ndarray] = {}
    for collection, concept in (("purple-00", "purple"), ("purple-01", "purple")):
        for label in labels:  # the negatives are the same images in both collections, the concept's are new
            for k in range(2):
                seed = labels.index(label) * 10 + k + (100 * int(collection[-1]) if label == concept else 0)
                files[(f"{collection}/{label}/val/{k:03d}.png", label)] = draw(label, seed)
        (tmp_path / collection / concept / "train").mkdir(parents=True)  # train images are not held out
        Image.fromarray(draw(concept, 999)).save(tmp_path / collection / concept / "train" / "000.png")
    for (name, _), pixels in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(tmp_path / name)
    check = HeldOutClassification(labels)
    result = check.errors(server, [tmp_path / "purple-00", tmp_path / "purple-01"])
    distinct = {name for name, _ in files if name.startswith("purple-00") or "/purple/" in name}
    assert result.images == len(distinct) == 8  # 2 + 2 purple, the 4 negatives once
    images = torch.stack([torch.from_numpy(files[(n, l)]).permute(2, 0, 1).float() / 255 for n, l in files
                          if n in distinct])
    expected, _ = server.classify(images, labels)
    truths = [l for n, l in files if n in distinct]
    assert result.errors == sum(e != t for e, t in zip(expected, truths)) == len(result.wrong)


class _ScriptedCheck:
    """A pool check whose verdict per fit is given: ``improves[k]`` says whether the k-th checked fit lowers errors."""

    def __init__(self, improves: list[bool]) -> None:
        self.improves, self.calls = improves, 0

    def errors(self, server: PromptToolServer, directories: list[Path]) -> HeldOutErrors:
        self.calls += 1
        fit, trial = divmod(self.calls - 1, 2)  # called for the pool as it is, then with the fit merged
        better = self.improves[fit % len(self.improves)]
        return HeldOutErrors(5 - (trial if better else 0), 10)


@pytest.mark.parametrize("pool_validation", [True, False])
def test_a_fit_joins_the_pool_only_if_the_served_pool_makes_fewer_held_out_errors(
        pool_validation: bool, small_world: Path, tiny_clip_dir: Path, tmp_path: Path) -> None:
    clip = PromptTool.from_description({"class_path": "clova_train.tools.clip.tool.PromptedClip",
                                        "init_args": {"model_name": f"local-dir:{tiny_clip_dir}", "pretrained": None}})
    tasks = read_tasks(small_world / "train_tasks.jsonl")

    def loop(check: _ScriptedCheck) -> ClosedLoop:
        built = _loop(tmp_path / "run", clip, world.ScriptedLoopLLM(), _PoolLearner(clip), small_world / "image_source")
        built.tools["CLASSIFY"].pool_check = check
        built.settings.pool_validation = pool_validation
        return built

    first = loop(_ScriptedCheck([False, True]))
    report = first.train(tasks)
    pool = first.tools["CLASSIFY"].server.pool
    first.close()
    fits = Journal(tmp_path / "run" / "journal.jsonl").events("fit_done")
    assert len(fits) >= 2
    merged = [e["merged"] for e in fits]
    assert merged == ([k % 2 == 1 for k in range(len(fits))] if pool_validation else [True] * len(fits))
    assert all((e["pool_check"] is not None) == pool_validation for e in fits)
    assert sum(pool.num_prompts(c) for c in pool.concepts) == sum(merged)  # one prompt per fit (_PoolLearner)
    entry_totals = {k: sum(e[k] for e in report["learned"].values()) for k in ("fits", "merged_fits", "prompts_in_pool")}
    assert entry_totals == {"fits": len(fits), "merged_fits": sum(merged), "prompts_in_pool": sum(merged)}
    resumed = loop(_ScriptedCheck([False]))  # rebuilt from the journal: the same pool, nothing re-checked
    again = resumed.tools["CLASSIFY"].server.pool
    assert resumed.train(tasks) == report and resumed.tools["CLASSIFY"].pool_check.calls == 0
    assert {c: again.num_prompts(c) for c in again.concepts} == {c: pool.num_prompts(c) for c in pool.concepts}
    resumed.close()


@pytest.mark.parametrize("option, message", [
    ("--tools={}", "the loop needs CLASSIFY"),
    ('--tools={"CLASSIFY": {"fit_config": "configs/quickstart/loop_clip_fit.yaml"}, '
     '"SEG": {"fit_config": "configs/quickstart/loop_clip_fit.yaml", "collector": "grounding"}}',
     "tools.SEG: the loop's program API"),
    ('--tools={"CLASSIFY": {"fit_config": "no/such/fit.yaml"}}', "tools.CLASSIFY.fit_config: file not found: no/such/fit.yaml"),
    ("--program_timeout_s=0", "program_timeout_s: must be a positive number of seconds"),
    ("--world.mislabel_rate=1.5", "world.mislabel_rate: 1.5 is not in [0, 1)"),
    ("--cache_mode=sometimes", "cache_mode: 'sometimes' is not record, replay or off"),
    ("--max_collections_per_concept=0", "max_collections_per_concept: must be >= 1"),
    ("--tasks=TASKS", "TASKS:2: missing field 'feedback'"),
    ("--llm.kind=gpt", "llm.kind"),
])
def test_bad_loop_configs_fail_with_one_message_before_anything_is_written(
        option: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from helpers.common import run_fit

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "instruction": "What colour is the circle?", "image": "a.png",
                                 "feedback": {"answer": "red"}}) + "\n" + json.dumps({"id": "b", "instruction": "x", "image": "b.png"}) + "\n")
    run_dir, world_root = tmp_path / "run", tmp_path / "world"
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    option, message = option.replace("TASKS", str(tasks)), message.replace("TASKS", str(tasks))
    code = run_fit("loop", "--config", str(REPO / "configs/quickstart/loop.yaml"), f"--run_dir={run_dir}",
                   f"--world.root={world_root}", option)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err[-2000:]
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err
    assert not run_dir.exists() and (not world_root.exists() or option.startswith("--tasks"))


def _loop_config(tmp_path: Path, tiny_clip_dir: Path, world_root: Path, run_dir: Path) -> Path:
    fit = yaml.safe_load((REPO / "configs/quickstart/loop_clip_fit.yaml").read_text())
    tool_args = fit["model"]["init_args"]["tool"]["init_args"]
    tool_args.update(model_name=f"local-dir:{tiny_clip_dir}", num_prompt_tokens=4)
    fit["model"]["init_args"]["steps"] = 4
    fit["data"]["init_args"].update(negatives_per_instance=2, val_negatives_per_instance=2, chunk_size=4)
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(fit))
    loop = yaml.safe_load((REPO / "configs/quickstart/loop.yaml").read_text())
    loop["run_dir"] = str(run_dir)
    loop["tools"]["CLASSIFY"].update(fit_config=str(tmp_path / "fit.yaml"), train_images=2, val_images=1,
                                      negatives_per_label=1)
    loop["max_collections_per_concept"] = 1
    loop["world"].update(root=str(world_root), train_tasks=10, test_tasks=6, images_per_concept=8, mislabel_rate=0.0)
    path = tmp_path / f"loop-{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(loop))
    return path


def _outcome(run_dir: Path) -> tuple:
    from clova_train.core.run_manifest import read_run_manifest

    assert read_run_manifest(run_dir).kind == "closed_loop" and not read_run_manifest(run_dir).legacy
    pool = PromptPool.load(run_dir / "pools" / "CLASSIFY.safetensors")
    tensors = {c: [t.tolist() for t in pool.entry(c)[:2]] for c in pool.concepts}
    return (tensors, json.loads((run_dir / "demonstrations.json").read_text()),
            json.loads((run_dir / "report.json").read_text()), json.loads((run_dir / "evaluation_after.json").read_text()))


@pytest.mark.slow
def test_a_loop_killed_during_a_fit_resumes_to_the_same_result(small_world: Path, tiny_clip_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    straight = _loop_config(tmp_path, tiny_clip_dir, small_world, tmp_path / "straight")
    done = subprocess.run([sys.executable, "-m", "clova_train", "loop", "--config", str(straight)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "test accuracy before training" in done.stdout
    fits = Journal(tmp_path / "straight" / "journal.jsonl").events("fit_done")
    assert len(fits) >= 2, "the tiny world should make the loop fit at least twice"

    killed_dir = tmp_path / "killed"
    config = _loop_config(tmp_path, tiny_clip_dir, small_world, killed_dir)
    process = subprocess.Popen([sys.executable, "-m", "clova_train", "loop", "--config", str(config)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    journal_path = killed_dir / "journal.jsonl"
    while time.monotonic() < deadline:  # kill it while its second fit runs (after the first one was merged)
        events = [json.loads(line) for line in journal_path.read_text().splitlines()] if journal_path.exists() else []
        started = [e for e in events if e["event"] == "fit_started"]
        if len(started) >= 2 and len([e for e in events if e["event"] == "fit_done"]) < len(started):
            time.sleep(1.0)
            break
        time.sleep(0.05)
    else:
        process.kill()
        pytest.fail("the loop never started a second fit")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    journal = Journal(journal_path)
    assert len(journal.events("fit_done")) < len(journal.events("fit_started"))  # it died inside a fit
    resumed = subprocess.run([sys.executable, "-m", "clova_train", "loop", "--config", str(config)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _outcome(killed_dir) == _outcome(tmp_path / "straight")
    decisions = [[(e["event"], e.get("task"), e.get("phase"), e.get("kind"), e.get("added"))
                  for e in Journal(run / "journal.jsonl").events() if e["event"] != "fit_started"]
                 for run in (killed_dir, tmp_path / "straight")]
    assert decisions[0] == decisions[1]
    keys = [e["key"] for e in Journal(journal_path).events("fit_done")]
    assert len(keys) == len(set(keys)) == len(fits)  # nothing trained twice


def test_http_image_source_reads_a_search_endpoint_and_refuses_bad_replies(tmp_path: Path) -> None:
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlparse

    from clova_train.closedloop import HttpImageSource, SourceUnavailable

    replies = {"purple": json.dumps({"images": [base64.b64encode(_png((128, 0, 128))).decode()] * 5}),
               "broken": '{"images": ["not base64!"]}', "html": "<html>busy</html>"}

    class Search(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            query = parse_qs(urlparse(self.path).query)
            body = replies.get(query["q"][0])
            if body is None:
                self.send_error(503)
                return
            if query["q"][0] == "purple":
                offset, count = int(query["offset"][0]), int(query["count"][0])
                body = json.dumps({"images": json.loads(body)["images"][offset:offset + count]})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Search)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = HttpImageSource(f"http://127.0.0.1:{server.server_port}/search", timeout_s=5)
        assert len(source.search("purple", 3, 0)) == 3 and len(source.search("purple", 3, 3)) == 2
        for query, message in (("broken", "malformed reply"), ("html", "malformed reply"), ("down", "503")):
            with pytest.raises(SourceUnavailable, match=message):
                source.search(query, 2, 0)
        assert issubclass(SourceUnavailable, BackendError)  # so the loop pauses on it rather than crashing
        collected = ImageCollector(source, ["purple"], 2, 1, 1).collect(_request("purple"), tmp_path / "c")
        assert "no images of any other label" in collected.skipped
    finally:
        server.shutdown()


class _FakeServer:
    """Stands in for the LOC and VQA servers: records the region it was given."""

    def __init__(self) -> None:
        self.regions = []

    def detect(self, images: list, concept: str) -> list:
        self.regions.append(tuple(images[0].shape))
        return [{"boxes": [[2.0, 4.0, 12.0, 10.0]], "scores": [0.9], "prompted": False}]

    def answer(self, images: list, questions: list) -> list:
        self.regions.append(tuple(images[0].shape))
        return ["blue"]


def test_server_backed_loc_and_vqa_convert_regions_and_boxes(tmp_path: Path) -> None:
    from clova_train.closedloop.tasks import LoopTask
    from clova_train.closedloop.toolapi import ServerLocator
    from clova_train.sandbox import PatchRef

    Image.new("RGB", (64, 48)).save(tmp_path / "scene.png")
    task = LoopTask("t", "Where is the cat?", tmp_path / "scene.png", answer="left")
    loc, vqa = _FakeServer(), _FakeServer()
    patch = PatchRef("t", 8, 16, 40, 48)  # x 8..40, y (from the bottom) 16..48: the image's top 32 rows
    # the detector's (x0, y0, x1, y1) top-down box in the region -> (left, lower, right, upper) in the image
    assert ServerLocator(loc).find(task, patch, "cat") == [(10, 38, 20, 44)]
    assert loc.regions == [(3, 32, 32)]
    tools = VisualTools(task, ServerLocator(loc), None, ["red"], vqa=vqa)  # type: ignore[arg-type]
    assert tools.simple_query(patch, "what colour is it?") == "blue" and vqa.regions == [(3, 32, 32)]
