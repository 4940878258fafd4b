"""Data files, configs and replies from other hands (issue 32, part 4): one safe reader for JSON/JSONL/YAML with depth
and size limits, duplicate keys refused, YAML aliases bounded and non-UTF-8 named with file and byte offset; data
checked before a native library sees it (COCO coordinates and RLE runs, record lengths before tokenising, task field
types); lone surrogates in LLM replies made well-formed before parsing. Every case ends in one clear error naming
the file, quickly, and never in a RecursionError, a hang, a crash or minutes of memory growth."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from clova_train.cli import main
from clova_train.core.errors import ClovaTrainError, DataError
from clova_train.core.safe_files import (
    ReadLimits, nesting_depth, parse_json, parse_yaml, read_bytes, read_json, read_json_lines, read_text, read_yaml,
)

REPO = Path(__file__).resolve().parents[2]


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def deep_json(depth: int, kind: str) -> str:
    if kind == "lists":
        return "[" * depth + "]" * depth
    if kind == "objects":
        return '{"a": ' * depth + "1" + "}" * depth
    return '{"a": [' * ((depth + 1) // 2) + "1" + "]}" * ((depth + 1) // 2)  # mixed


def deep_yaml(depth: int, kind: str) -> str:
    if kind == "flow":
        return "[" * depth + "]" * depth
    if kind == "block":
        return "".join(" " * i + "a:\n" for i in range(depth)) + " " * depth + "b: 1\n"
    return "".join(" " * (2 * i) + "- \n" for i in range(depth)) + " " * (2 * depth) + "- 1\n"


# ------------------------------------------------------------------------------------------------ the reader
@pytest.mark.parametrize("kind", ["lists", "objects", "mixed"])
@pytest.mark.parametrize("depth", [101, 5_000, 200_000])
def test_deep_json_is_refused_naming_the_source(kind: str, depth: int) -> None:
    with pytest.raises(DataError, match="nested more than 100 levels"):
        parse_json(deep_json(depth, kind), "the file f.json")


@pytest.mark.parametrize("kind", ["flow", "block", "sequence"])
@pytest.mark.parametrize("depth", [101, 3_000])
def test_deep_yaml_is_refused(kind: str, depth: int) -> None:
    with pytest.raises(DataError, match="nested more than 100 levels"):
        parse_yaml(deep_yaml(depth, kind), "the file f.yaml")


def test_nesting_within_the_limit_reads() -> None:
    assert nesting_depth(parse_json(deep_json(100, "lists"), "x"), 1000) == 100
    assert parse_yaml(deep_yaml(50, "block"), "x") is not None


@pytest.mark.parametrize("text", ['{"a": 1, "a": 2}', '[{"x": {"k": 1, "k": 1}}]', '{"a": {"b": 1}, "a": {"c": 2}}'])
def test_duplicate_json_keys_are_refused(text: str) -> None:
    with pytest.raises(DataError, match="twice"):
        parse_json(text, "f.json")


@pytest.mark.parametrize("text", ["a: 1\nb: 2\na: 3\n", "top:\n  x: 1\n  x: 2\n", "- {k: 1, k: 2}\n", "? a\n: 1\na: 2\n"])
def test_duplicate_yaml_keys_are_refused_with_their_line(text: str) -> None:
    with pytest.raises(DataError, match="twice in one mapping"):
        parse_yaml(text, "f.yaml")


@pytest.mark.parametrize("parse, text", [
    (parse_json, "[" + "1" * 5000 + "]"), (parse_yaml, "a: " + "1" * 5000), (parse_yaml, "a: 2001-13-45"),
    (parse_yaml, "a: !!int abc"), (parse_yaml, "a: !!float xyz"),
])
def test_values_python_cannot_build_are_one_error(parse, text: str) -> None:
    with pytest.raises(DataError, match="holds a value that cannot be read"):
        parse(text, "v.yaml")


def test_a_config_value_python_cannot_build_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "big.yaml"
    config.write_text((REPO / "configs" / "quickstart" / "controller_dqn.yaml").read_text() + "\nnote: " + "9" * 5000 + "\n")
    assert main(["controller", "fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_yaml_merge_keys_still_work() -> None:
    assert parse_yaml("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 5\n", "f")["d"] == {"x": 5, "y": 2}


@pytest.mark.parametrize("text", [
    billion_laughs(),
    billion_laughs(levels=4, width=1200),  # few levels, wide
    "a: &a " + "[" + ", ".join(["x"] * 2000) + "]\n" + "b: [" + ", ".join(["*a"] * 2000) + "]\n",  # quadratic
])
def test_alias_bombs_are_refused_at_once(text: str) -> None:
    started = time.perf_counter()
    with pytest.raises(DataError, match="once its aliases are resolved"):
        parse_yaml(text, "bomb.yaml")
    assert time.perf_counter() - started < 5


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(DataError, match="recursive|nested"):
        parse_yaml("&a [*a, 1]\n", "r.yaml")


def test_yaml_never_builds_python_objects() -> None:
    with pytest.raises(DataError, match="not valid YAML"):
        parse_yaml("!!python/object/apply:os.system ['echo pwned']\n", "t.yaml")


def test_non_utf8_is_named_with_file_byte_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin.json"
    path.write_bytes(b'{"a": "ok",\n "b": "caf\xe9"}')
    with pytest.raises(DataError, match=r"latin.json is not UTF-8 \(byte 22, line 2"):
        read_json(path, "data file")


@pytest.mark.parametrize("special", ["fifo", "directory", "device"])
def test_special_files_are_refused_without_blocking(special: str, tmp_path: Path) -> None:
    path = tmp_path / "special.json"
    if special == "fifo":
        os.mkfifo(path)
    elif special == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_json(path, "data file")
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001
            outcome.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert outcome, "the reader blocked"
    assert isinstance(outcome[0], DataError) and "not a regular file" in str(outcome[0])


def test_files_over_the_size_limit_are_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"x": "y" * 1000}) + "\n")
    with pytest.raises(DataError, match="more than the 100 accepted"):
        list(read_json_lines(path, "records", ReadLimits(max_bytes=100)))


def test_a_read_allocates_what_the_file_holds_not_the_limit(tmp_path: Path) -> None:
    """Under a 512 MiB address-space limit (a small worker, a container), a 9-byte JSON reads with the default 1 GiB
    limit; a file that grows past what fstat said is still read whole, up to the limit, and refused past it."""
    import subprocess
    import sys

    small = tmp_path / "small.json"
    small.write_text('{"a": 1}\n')
    probe = (
        "import resource, sys\n"
        "from clova_train.core.safe_files import read_bytes, read_json\n"
        "resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))\n"
        "assert read_bytes(sys.argv[1]) == b'{\"a\": 1}\\n'\n"
        "assert read_json(sys.argv[1], 'config') == {'a': 1}\n"
        "print('read')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(small)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "read", done.stderr[-2000:]

    # /proc's files report size 0: they are read to their end all the same, and the limit still holds
    status = read_bytes("/proc/self/status", "status")
    assert status.startswith(b"Name:") and len(status) > 100
    with pytest.raises(DataError, match="more than the 10 bytes accepted"):
        read_bytes("/proc/self/status", "status", max_bytes=10)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data file not found: .*nope.yaml"):
        read_yaml(tmp_path / "nope.yaml", "data file")
    with pytest.raises(DataError, match="not found"):
        read_text(tmp_path / "nope.txt")


# ------------------------------------------------------------------------------------------------ every reader
HOSTILE_TEXTS = {
    "deep": lambda fmt: deep_json(50_000, "lists") if fmt == "json" else deep_yaml(3_000, "flow"),
    "duplicate": lambda fmt: '{"a": 1, "a": 2}' if fmt == "json" else "a: 1\na: 2\n",
    "latin1": lambda fmt: '{"a": "caf\xe9"}',
}


def _write(path: Path, case: str, fmt: str) -> Path:
    text = HOSTILE_TEXTS[case](fmt)
    path.write_bytes(text.encode("latin-1") if case == "latin1" else text.encode())
    return path


def _jsonl(path: Path, case: str) -> Path:
    """A JSONL file whose first line is hostile."""
    good = json.dumps({"id": "t1", "instruction": "hi", "image": "a.png", "feedback": {"answer": "x"},
                       "question": "q", "answer": "a", "output": "o"})
    text = HOSTILE_TEXTS[case]("json").replace("\n", " ")
    path.write_bytes((text.encode("latin-1") if case == "latin1" else text.encode()) + b"\n" + (good + "\n").encode())
    return path


def _readers():
    from clova_train.closedloop.journal import Journal
    from clova_train.closedloop.tasks import read_tasks
    from clova_train.datamodules.tool_llm.tool_instructions import load_records
    from clova_train.envs.avis.transition_graph import load_graph
    from clova_train.tools.grounding.coco import GroundingAnnotations
    from clova_train.tools.prompt_server import read_tool_description
    from clova_train.tools.vqa.records import read_records

    def tool_json(tmp: Path, case: str) -> None:
        _write(tmp / "tool.json", case, "json")
        read_tool_description(tmp)

    return {
        "tool.json": tool_json,
        "journal": lambda tmp, case: Journal(_journal(tmp, case)),
        "task file": lambda tmp, case: read_tasks(_jsonl(tmp / "tasks.jsonl", case)),
        "VQA records (JSON)": lambda tmp, case: read_records(_write(tmp / "vqa.json", case, "json")),
        "VQA records (JSONL)": lambda tmp, case: read_records(_jsonl(tmp / "vqa.jsonl", case)),
        "LoRA records (JSON)": lambda tmp, case: load_records(_write(tmp / "lora.json", case, "json")),
        "LoRA records (JSONL)": lambda tmp, case: load_records(_jsonl(tmp / "lora.jsonl", case)),
        "COCO annotations": lambda tmp, case: GroundingAnnotations(_write(tmp / "coco.json", case, "json")),
        "transition graph (YAML)": lambda tmp, case: load_graph(str(_write(tmp / "graph.yaml", case, "yaml"))),
        "transition graph (JSON)": lambda tmp, case: load_graph(str(_write(tmp / "graph.json", case, "json"))),
    }


def _journal(tmp: Path, case: str) -> Path:
    path = tmp / "journal.jsonl"
    event = json.dumps({"event": "start"})
    text = HOSTILE_TEXTS[case]("json").replace("\n", " ")
    body = text.encode("latin-1") if case == "latin1" else text.encode()
    path.write_bytes(body + b"\n" + event.encode() + b"\n")  # the hostile line is not the (possibly torn) last one
    return path


@pytest.mark.parametrize("case", sorted(HOSTILE_TEXTS))
@pytest.mark.parametrize("reader", sorted(_readers()))
def test_every_reader_refuses_hostile_text_in_one_clear_error(reader: str, case: str, tmp_path: Path) -> None:
    started = time.perf_counter()
    with pytest.raises(ClovaTrainError) as caught:
        _readers()[reader](tmp_path, case)
    message = str(caught.value)
    assert tmp_path.name in message, message  # names the file
    expected = {"deep": "nested more than", "duplicate": "twice", "latin1": "not UTF-8"}[case]
    assert expected in message, message
    assert time.perf_counter() - started < 10


def _config_text(case: str) -> str:
    shipped = (REPO / "configs" / "quickstart" / "clip_prompt.yaml").read_text()
    return {
        "alias bomb": shipped + "\nextra_note:\n" + "".join("  " + line + "\n" for line in billion_laughs().splitlines()),
        "duplicate key": shipped + "\ntrainer:\n  max_epochs: 3\n",
        "deep": shipped + "\nnote: " + "[" * 5_000 + "]" * 5_000 + "\n",
    }[case]


@pytest.mark.parametrize("command", [["fit"], ["controller", "fit"], ["loop"]])
@pytest.mark.parametrize("case", ["alias bomb", "duplicate key", "deep"])
def test_hostile_configs_fail_in_one_line_naming_the_file(command: list[str], case: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "hostile.yaml"
    config.write_text(_config_text(case))
    started = time.perf_counter()
    assert main([*command, "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hostile.yaml" in err, err
    assert time.perf_counter() - started < 20


@pytest.mark.parametrize("command", [["fit"], ["controller", "fit"], ["loop"]])
@pytest.mark.parametrize("text, words", [
    ("trainer:\n\tmax_epochs: 3\n", "found character '\\t' that cannot start any token at line 2, column 1; YAML "
                                       "indents with spaces, never tabs"),
    ("trainer: [1, 2\n", "expected ',' or ']', but got '<stream end>' at line 2, column 1"),
    ("a: b: c\n", "mapping values are not allowed here at line 1, column 5"),
])
def test_broken_yaml_configs_fail_in_one_line_naming_the_file_and_place(command: list[str], text: str, words: str,
                                                                        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text(text)
    assert main([*command, "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"clova-train: error: config file {config} is not valid YAML: {words}", err


def test_command_line_values_are_checked_too(capsys: pytest.CaptureFixture) -> None:
    assert main(["controller", "fit", "--config", str(REPO / "configs" / "quickstart" / "controller_dqn.yaml"),
                 "--train.output_dir", "{a: 1, a: 2}"]) == 2
    assert "twice" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ COCO before pycocotools
def _coco(tmp: Path, annotation: dict) -> Path:
    from PIL import Image

    (tmp / "images").mkdir()
    Image.new("RGB", (32, 24)).save(tmp / "images" / "a.png")
    data = {"images": [{"id": 1, "file_name": "a.png", "height": 24, "width": 32}],
            "categories": [{"id": 1, "name": "thing"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 10], **annotation}]}
    path = tmp / "coco.json"
    path.write_text(json.dumps(data))
    return path


def _rle_string(mask: np.ndarray) -> str:
    from pycocotools import mask as mask_utils

    return mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))["counts"].decode()


@pytest.mark.parametrize("annotation, message", [
    ({"bbox": [float("nan"), 2, 10, 10]}, "finite"),
    ({"bbox": [2, 2, float("inf"), 10]}, "finite"),
    ({"bbox": [2, 2, "10", 10]}, "finite"),
    ({"bbox": [True, 2, 10, 10]}, "finite"),
    ({"segmentation": [[1, 1, float("nan"), 3, 5, 5]]}, "finite"),
    ({"segmentation": [[1, 1, 3, float("-inf"), 5, 5]]}, "finite"),
    ({"segmentation": [[1, 1, "3", 3, 5, 5]]}, "finite"),
    ({"segmentation": [[1, 1, [3], 3, 5, 5]]}, "finite"),
    ({"segmentation": {"size": [24, 32], "counts": [10, 2 ** 40]}}, "adding up"),
    ({"segmentation": {"size": [24, 32], "counts": [-5, 773]}}, "adding up"),
    ({"segmentation": {"size": [24, 32], "counts": [10.5, 757.5]}}, "integers"),
    ({"segmentation": {"size": [24, 32], "counts": "\x7f\x7f"}}, "compressed RLE"),
    ({"segmentation": {"size": [24, 32], "counts": "0" * 20 + "Q"}}, "compressed RLE|adding up"),
    ({"segmentation": {"size": [24, 32]}}, "RLE without counts"),
    ({"segmentation": {"size": [24.0, 32], "counts": [768]}}, "RLE size"),
])
def test_coco_values_are_checked_before_pycocotools(annotation: dict, message: str, tmp_path: Path) -> None:
    from clova_train.tools.grounding.coco import GroundingAnnotations

    annotations = GroundingAnnotations(_coco(tmp_path, annotation))
    with pytest.raises(DataError, match=message):
        annotations.grounded_image(1)


def test_an_oversized_rle_string_is_refused(tmp_path: Path) -> None:
    """A compressed RLE of a bigger image: pycocotools would decode past the end of this image's buffer."""
    from clova_train.tools.grounding.coco import GroundingAnnotations

    big = np.zeros((240, 320), dtype=bool)
    big[10:200, 5:300] = True
    annotations = GroundingAnnotations(_coco(tmp_path, {"segmentation": {"size": [24, 32], "counts": _rle_string(big)}}))
    with pytest.raises(DataError, match="adding up to the image's 768 pixels"):
        annotations.grounded_image(1)


@pytest.mark.parametrize("seed", range(5))
def test_valid_rle_strings_decode_as_pycocotools_does(seed: int, tmp_path: Path) -> None:
    from clova_train.tools.grounding.coco import GroundingAnnotations, compressed_rle_counts

    mask = np.random.default_rng(seed).random((24, 32)) > 0.6
    counts = _rle_string(mask)
    runs = compressed_rle_counts(counts)
    assert runs is not None and sum(runs) == mask.size
    decoded = np.repeat(np.arange(len(runs)) % 2, runs).astype(bool).reshape(32, 24).T  # column-major runs
    np.testing.assert_array_equal(decoded, mask)
    image = GroundingAnnotations(_coco(tmp_path, {"segmentation": {"size": [24, 32], "counts": counts}})).grounded_image(1)
    np.testing.assert_array_equal(image.masks[0].numpy(), mask)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["images"][0].update(height=10 ** 9), "height must be an integer"),
    (lambda d: d["images"][0].update(width=float("nan")), "width must be an integer"),
    (lambda d: d["images"][0].update(id=None), "id must be"),
    (lambda d: d["annotations"][0].update(id=[1]), "id must be"),
])
def test_coco_image_records_are_typed(edit, message: str, tmp_path: Path) -> None:
    from clova_train.tools.grounding.coco import GroundingAnnotations

    path = _coco(tmp_path, {})
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(DataError, match=message):
        GroundingAnnotations(path)


# ------------------------------------------------------------------------------------------------ records, tasks, replies
class NoTokenizer:
    """Stands in for a tokenizer that must not be called: a 200 MB record aborts a real one (SIGABRT)."""

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bcd": 1, "<s>": 2}

    def __call__(self, *args, **kwargs):
        raise AssertionError("the record was tokenised")


def test_a_huge_record_is_reported_too_long_without_tokenising() -> None:
    from clova_train.datamodules.tool_llm.tool_instructions import encode_record, max_characters
    from clova_train.tooluse.prompt_template import PromptTemplate

    tokenizer = NoTokenizer()
    bound = max_characters(tokenizer, 512)
    assert bound == 4 * 3 * 512
    record = {"instruction": "x" * 20_000_000, "input": "", "output": "Thought: y"}
    reason = encode_record(tokenizer, PromptTemplate(), record, 512, bound)
    assert isinstance(reason, str) and reason.startswith("too long")


def test_the_character_bound_never_drops_a_record_that_fits() -> None:
    """A text that tokenises within max_length is always under the bound (the quickstart's byte-level BPE with its
    added whole tokens, on worst-case texts made of its longest entries)."""
    from clova_train.datamodules.tool_llm.tool_instructions import max_characters
    from clova_train.quickstart.tiny_llama import tiny_bpe_tokenizer, tool_corpus, tool_llama_tokens

    texts, _ = tool_corpus(0)
    tokenizer = tiny_bpe_tokenizer(texts[:200], whole_tokens=tool_llama_tokens())
    for entry in sorted(tokenizer.get_vocab(), key=len)[-5:]:
        text = tokenizer.convert_tokens_to_string([entry]) * 50
        tokens = len(tokenizer(text)["input_ids"])
        assert len(text) <= max_characters(tokenizer, tokens)


@pytest.mark.parametrize("image, message", [(3, "image must be a file path"), (None, "image must be a file path"),
                                            (["a.png"], "image must be a file path"), ("", "image must be a file path")])
def test_task_fields_are_typed(image: object, message: str, tmp_path: Path) -> None:
    from clova_train.closedloop.tasks import read_tasks

    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "t1", "instruction": "what?", "image": image, "feedback": {"answer": "x"}}) + "\n")
    with pytest.raises(DataError, match=f"tasks.jsonl:1: {message}"):
        read_tasks(path)


@pytest.mark.parametrize("task_id", [True, "3", 1.5, -1, [1]])
def test_reset_options_are_typed(task_id: object) -> None:
    from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv

    env = ReasoningLoopEnv(ReasoningLoopConfig())
    with pytest.raises(DataError, match="task_id must be a non-negative integer"):
        env.reset(options={"task_id": task_id})


def test_lone_surrogates_in_planner_and_coder_replies_never_leave_env_step() -> None:
    from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
    from clova_train.llm.backends import ChatBackend

    class SurrogateLLM(ChatBackend):
        def identity(self) -> dict:
            return {"kind": "surrogates"}

        def chat(self, messages: list[dict]) -> str:
            if "Write Python code" in messages[-1]["content"]:
                return "```python\nfinal_answer = '\ud800 two \udfff'\n```"
            return "\n".join(f"{i + 1}. [0.{i + 1}] count the \ud83d circles \udc00" for i in range(5))

    env = ReasoningLoopEnv(ReasoningLoopConfig(max_iterations=3), llm=SurrogateLLM())
    env.reset(seed=0)
    for action in (0, 5, 1, 2):
        _, reward, terminated, truncated, info = env.step(action)
        assert np.isfinite(reward)
        json.dumps(info).encode("utf-8")  # well-formed all the way out
        if terminated or truncated:
            break


def test_a_reply_that_is_not_text_is_one_backend_error() -> None:
    from clova_train.llm.backends import BackendError, ChatBackend, ask

    class Broken(ChatBackend):
        def identity(self) -> dict:
            return {}

        def chat(self, messages: list[dict]) -> str:
            return None  # type: ignore[return-value]

    with pytest.raises(BackendError, match="replied with NoneType"):
        ask(Broken(), [{"role": "user", "content": "hi"}])


def test_predict_fields_are_json_or_plain_text_but_never_hostile_json() -> None:
    from clova_train.serving.predict import parse_fields

    assert parse_fields(['labels=["red", "blue"]', "question=what colour is it?", "concept=dog"]) == {
        "labels": ["red", "blue"], "question": "what colour is it?", "concept": "dog"}
    with pytest.raises(DataError, match="--field labels has the key 'a' twice"):
        parse_fields(['labels={"a": 1, "a": 2}'])
    with pytest.raises(DataError, match="--field labels is nested more than"):
        parse_fields(["labels=" + "[" * 500 + "]" * 500])
