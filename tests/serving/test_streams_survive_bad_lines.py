"""``serve --stdin`` / ``--request`` and ``predict`` answer every good line, report each bad one in its place, and
exit non-zero at the end when any failed; a request's ``output`` goes inside the output folder or is refused."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clova_train.cli import main
from clova_train.core.errors import DataError
from clova_train.core.pool import PromptPool
from clova_train.serving.predict import answer_lines, confined_output, numbered_lines
from clova_train.tools.recipes import tool_recipes
from helpers.conformance import build_tool

REPO = Path(__file__).resolve().parents[2]


def echo(request: dict[str, Any]) -> dict[str, Any]:
    """A stand-in tool: replies with the request, fails on ``{"boom": ...}`` as a buggy model would."""
    if "boom" in request:
        raise RuntimeError("the model broke")
    if "refused" in request:
        raise DataError("the tool refuses this request")
    return {"echo": request}


def stream(*lines: bytes) -> list[tuple[int, str | DataError]]:
    return list(numbered_lines(io.BytesIO(b"\n".join(lines) + b"\n"), "request line", max_bytes=256))


@pytest.fixture
def output_dir(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


def test_each_bad_line_is_answered_with_its_error_and_the_good_ones_are_answered(tmp_path: Path,
                                                                                 output_dir: Path) -> None:
    outside = tmp_path / "victim.txt"
    outside.write_text("keep me")
    (output_dir / "escape").symlink_to(tmp_path)
    lines = stream(b'{"n": 1}', b"{oops", b'["not", "an", "object"]', b'{"n": "caf\xff"}', b"x" * 300, b"",
                   b'{"boom": 1}', b'{"refused": 1}', json.dumps({"output": str(outside)}).encode(),
                   b'{"output": "../victim.txt"}', b'{"output": "escape/victim.txt"}', b'{"output": 3}',
                   b'{"output": "sub/new.png"}', b'{"n": 2}')
    answers = list(answer_lines(echo, lines, output_dir, "request line"))
    assert [a.number for a in answers] == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14]  # the blank line 6 skipped
    good = {a.number: a.reply for a in answers if a.error is None}
    assert good == {1: {"echo": {"n": 1}}, 13: {"echo": {"output": str(output_dir.resolve() / "sub" / "new.png")}},
                    14: {"echo": {"n": 2}}}
    errors = {a.number: a.error for a in answers if a.error is not None}
    assert "request line 2 is not valid JSON" in errors[2]
    assert "request line 3 must be a JSON object" in errors[3]
    assert "request line 4 is not UTF-8" in errors[4]
    assert "request line 5 is longer than the 256 bytes accepted" in errors[5]
    assert errors[7] == "the tool failed on this request: RuntimeError: the model broke"
    assert errors[8] == "the tool refuses this request"
    for number in (9, 10, 11, 12):
        assert "'output'" in errors[number] and "output folder" in errors[number], errors[number]
    assert "through a symbolic link" in errors[11]
    assert outside.read_text() == "keep me"


def test_a_long_line_is_skipped_whole_and_the_next_line_is_read(tmp_path: Path) -> None:
    lines = list(numbered_lines(io.BytesIO(b"y" * 300 + b"\n" + b'{"n": 1}\n' + b"z" * 300), "line", max_bytes=64))
    assert [n for n, _ in lines] == [1, 2, 3]
    assert isinstance(lines[0][1], DataError) and lines[1][1] == '{"n": 1}\n' and isinstance(lines[2][1], DataError)


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.png", "a/../../x.png", "", ".", 7, None, "bad\udcff.png"])
def test_outputs_outside_the_output_folder_are_refused_with_one_message(output_dir: Path, name: object) -> None:
    with pytest.raises(DataError, match="'output'") as caught:
        confined_output({"output": name}, output_dir)
    assert "output folder" in str(caught.value)


def test_requests_without_output_are_left_alone(output_dir: Path) -> None:
    assert confined_output({"images": ["/data/a.png"]}, output_dir) == {"images": ["/data/a.png"]}


@pytest.fixture(scope="module")
def tiny_clip_export(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight tiny CLIP with an empty pool (the unmodified tool): the smallest export serve reads."""
    recipe = tool_recipes()["clip"]
    tool = build_tool(recipe, tiny_models(recipe.tiny_model))
    directory = tmp_path_factory.mktemp("tiny-clip-export")
    PromptPool(tool.pool_spec()).save(directory / "pool.safetensors")
    (directory / "tool.json").write_text(json.dumps(tool.describe()), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    path = tmp_path_factory.mktemp("images") / "red.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(path)
    return path


def test_serve_stdin_answers_the_good_lines_around_a_bad_one(tiny_clip_export: Path, image: Path,
                                                            tmp_path: Path) -> None:
    good = json.dumps({"images": [str(image)], "labels": ["red", "blue"]})
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    lines = [good, "{oops", json.dumps({"images": [str(image)], "labels": ["red"], "output": str(victim)}),
             json.dumps({"images": [str(tmp_path / "missing.png")], "labels": ["red"]}), good]
    done = subprocess.run([sys.executable, "-m", "clova_train", "serve", str(tiny_clip_export), "--stdin",
                           "--output-dir", str(tmp_path / "out")],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(replies) == 5
    assert replies[0] == replies[4] and replies[0]["labels"] == [replies[0]["labels"][0]] and "error" not in replies[0]
    assert [r["error"]["line"] for r in replies[1:4]] == [2, 3, 4]
    assert "request line 2 is not valid JSON" in done.stderr
    assert "request line 3: 'output'" in done.stderr and "request line 4:" in done.stderr
    assert "3 of 5 requests failed (request line 2, 3, 4)" in done.stderr
    assert "Traceback" not in done.stderr and victim.read_text() == "keep me"


def test_serve_request_refuses_an_output_outside_the_output_dir(tiny_clip_export: Path, image: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    victim = tmp_path / "victim.png"
    victim.write_text("keep me")
    good = json.dumps({"images": [str(image)], "labels": ["red", "blue"]})
    bad = json.dumps({"images": [str(image)], "labels": ["red"], "output": str(victim)})
    assert main(["serve", str(tiny_clip_export), "--request", bad, "--request", good,
                 "--output-dir", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    first, second = [json.loads(line) for line in out.splitlines()]
    assert first["error"]["line"] == 1 and "relative path" in first["error"]["message"] and "labels" in second
    assert "--request 1: 'output'" in err and victim.read_text() == "keep me"


def test_predict_answers_every_good_jsonl_line_and_reports_each_bad_one(tiny_clip_export: Path, image: Path,
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    requests = tmp_path / "requests.jsonl"
    good = json.dumps({"images": [str(image)], "labels": ["red", "blue"]}).encode()
    requests.write_bytes(b"\n".join([good, b"{oops", b'{"images": ["caf\xff.png"]}', b'"text"',
                                     json.dumps({"images": [str(image)], "labels": ["red"],
                                                 "output": "/etc/x.png"}).encode(), good]) + b"\n")
    out = tmp_path / "preds.jsonl"
    assert main(["predict", str(tiny_clip_export), "--inputs", str(requests), "-o", str(out)]) == 1
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["line"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert "output" in lines[0] and lines[0]["output"] == lines[5]["output"]
    assert [("error" in line) for line in lines] == [False, True, True, True, True, False]
    assert lines[1]["input"] is None and "line 2 is not valid JSON" in lines[1]["error"]
    assert "line 3 is not UTF-8" in lines[2]["error"] and "must be a JSON object" in lines[3]["error"]
    assert "'output'" in lines[4]["error"]
    err = capsys.readouterr().err
    assert "4 of 6 inputs failed" in err and "line 2: " in err and "line 5: " in err


def test_serve_stdin_names_a_lora_export_as_the_wrong_kind(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--request``/``--stdin`` answer prompt-tool requests: a chat export is named as such (not as a prompt-tool
    export missing its tool.json)."""
    from clova_train.core.manifest import write_manifest
    from helpers.hostile_lora_export import write_tiny_lora_export

    export = write_tiny_lora_export(tmp_path / "export")
    write_manifest(export, "lora", {"run": "r"})
    assert main(["serve", str(export), "--request", "{}"]) == 2
    error = capsys.readouterr().err
    assert "is a LoRA (chat) export" in error and "tool.json" not in error and "Traceback" not in error, error
