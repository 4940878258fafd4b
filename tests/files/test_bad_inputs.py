"""A corpus of bad inputs a new user hits: each gives one clear error naming the culprit, no traceback, and
nothing partial written (images, pool files and metadata, LoRA data encodings, config values, existing pools)."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from clova_train.core.errors import DataError, PoolError
from clova_train.core.pool import PoolSpec, PromptPool
from clova_train.tools.images import check_image, load_image, load_image_uint8
from helpers.common import fit_args, run_fit

SPEC = PoolSpec("clip", "clip:abc", (2, 3), 4)


# ---------------------------------------------------------------------------------------------- images
def png_bytes(width: int, height: int, bit_depth: int, pixels: bytes) -> bytes:
    """A truecolour PNG written by hand: the header says what it likes, the data is ``pixels`` compressed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, bit_depth, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b"")


def png_with_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width`` x ``height`` (with a token IDAT): a decompression bomb's shape."""
    path.write_bytes(png_bytes(width, height, 8, b"\0" * 16))
    return path


@pytest.mark.parametrize("size", [(20000, 20000), (100000, 3000)])
def test_decompression_bomb_is_refused_naming_the_file(tmp_path: Path, size: tuple[int, int]) -> None:
    path = png_with_header(tmp_path / "huge.png", *size)
    for read in (check_image, load_image_uint8, lambda p: load_image(p, 32)):
        with pytest.raises(DataError, match=r"huge\.png is too large to decode safely"):
            read(path)


def test_16_bit_greyscale_is_scaled_not_saturated(tmp_path: Path) -> None:
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    pixels = load_image_uint8(tmp_path / "deep.png")
    assert pixels.shape == (3, 32, 32)
    expected = torch.from_numpy(np.round(ramp / 257).astype(np.uint8))
    assert torch.equal(pixels[0], expected) and torch.equal(pixels[1], expected)
    assert 0 < float(pixels.float().mean()) < 255  # not clipped to white


def test_16_bit_rgb_png_keeps_its_colours(tmp_path: Path) -> None:
    path = tmp_path / "rgb16.png"
    # PIL writes no 16-bit RGB; build the PNG by hand: one red-ish pixel row, 16 bits per channel.
    pixels = np.zeros((4, 4, 3), dtype=">u2")
    pixels[..., 0] = 50000
    pixels[..., 2] = 10000
    path.write_bytes(png_bytes(4, 4, 16, b"".join(b"\0" + row.tobytes() for row in pixels)))
    red, green, blue = load_image_uint8(path)[:, 0, 0].tolist()
    assert abs(red - 50000 / 257) <= 1 and green == 0 and abs(blue - 10000 / 257) <= 1


@pytest.mark.parametrize("content", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\0" * 20])
def test_unreadable_image_names_the_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "bad.png").write_bytes(content)
    with pytest.raises(DataError, match=r"unreadable image .*bad\.png"):
        check_image(tmp_path / "bad.png")


def test_non_utf8_file_names_open_and_folders_skip_them_printably(concept_root: Path, tmp_path: Path) -> None:
    """A path whose bytes are not UTF-8 opens (the OS gives bytes); a folder listing skips such names with one warning
    that shows them escaped (they would become instance ids and report lines; tests/files/test_undecodable_file_names.py
    covers the loaders)."""
    import os

    from clova_train.tools.images import SkippedNameWarning, list_images

    root = tmp_path / "concepts"
    shutil.copytree(concept_root, root)
    folder = os.fsencode(root / "red")
    good = folder + b"/caf\xe9.png"  # latin-1 bytes: not UTF-8
    shutil.copyfile(root / "red" / "red_000.png", os.fsdecode(good))
    assert load_image_uint8(Path(os.fsdecode(good))).shape[0] == 3
    with open(folder + b"/\xff\xfe-broken.png", "wb") as handle:
        handle.write(b"junk")
    with pytest.warns(SkippedNameWarning, match=r"skipped 2 images .*first: b'"):
        listed = list_images(root / "red")
    assert all(name.name.isprintable() for name in listed) and len(listed) == len(list_images(concept_root / "red"))


# ---------------------------------------------------------------------------------------------- pools
def write_pool(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path), metadata={"clova_train.pool": json.dumps(meta)})
    return path


def good_meta() -> dict:
    return {"format_version": 1, "tool": "clip", "model_identity": "clip:abc", "prompt_shape": [2, 3], "feature_dim": 4,
            "concepts": [{"name": "red", "num_prompts": 2, "instance_ids": ["a", "b"]}]}


def good_tensors() -> dict[str, torch.Tensor]:
    return {"concept.0.features": torch.randn(2, 4), "concept.0.prompts": torch.randn(2, 2, 3)}


def test_the_corpus_baseline_pool_loads(tmp_path: Path) -> None:
    pool = PromptPool.load(write_pool(tmp_path / "p.safetensors", good_meta(), good_tensors()), expected=SPEC)
    assert pool.concepts == ["red"] and len(pool) == 2


def _without(key: str):
    return lambda meta: {k: v for k, v in meta.items() if k != key}


def _concept_without(key: str):
    return lambda meta: {**meta, "concepts": [{k: v for k, v in meta["concepts"][0].items() if k != key}]}


@pytest.mark.parametrize("edit, message", [
    (_without("concepts"), "missing 'concepts'"),
    (_without("feature_dim"), "missing 'feature_dim'"),
    (_concept_without("instance_ids"), "concept 'red' needs 'instance_ids'"),
    (_concept_without("name"), r"concepts\[0\] must be an object with a string 'name'"),
    (lambda m: {**m, "feature_dim": "4"}, "'feature_dim' must be a positive integer, got '4'"),
    (lambda m: {**m, "feature_dim": 4.5}, "'feature_dim' must be a positive integer"),
    (lambda m: {**m, "feature_dim": True}, "'feature_dim' must be a positive integer"),
    (lambda m: {**m, "prompt_shape": [2, -3]}, "'prompt_shape' must be a list of positive integers"),
    (lambda m: {**m, "concepts": {"red": 1}}, "'concepts' must be a list"),
    (lambda m: {**m, "tool": None}, "'tool' must be a non-empty string"),
    (lambda m: {**m, "concepts": [{**m["concepts"][0], "instance_ids": ["a", "a"]}]}, "lists an instance id twice"),
    (lambda m: {**m, "concepts": [{**m["concepts"][0], "instance_ids": ["a", 2]}]}, "needs 'instance_ids', a list of strings"),
    (lambda m: {**m, "concepts": [{**m["concepts"][0], "instance_ids": ["a"]}]}, "1 instance ids given for 2 prompts"),
    (lambda m: ["not", "a", "dict"], "malformed metadata"),
])
def test_malformed_pool_metadata_names_the_field(tmp_path: Path, edit, message: str) -> None:
    path = write_pool(tmp_path / "p.safetensors", edit(good_meta()), good_tensors())
    with pytest.raises(PoolError, match=message) as caught:
        PromptPool.load(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("name, index, value", [
    ("concept.0.prompts", (1, 0, 2), float("nan")), ("concept.0.features", (0, 3), float("inf")),
    ("concept.0.features", (1, 1), float("-inf")),
])
def test_pools_with_non_finite_values_do_not_load_or_merge(tmp_path: Path, name: str, index: tuple, value: float) -> None:
    tensors = good_tensors()
    tensors[name][index] = value
    path = write_pool(tmp_path / "p.safetensors", good_meta(), tensors)
    kind = name.rsplit(".", 1)[1]
    with pytest.raises(PoolError, match=f"{kind} of concept 'red' hold NaN or infinite values \\(entry {index[0]}\\)"):
        PromptPool.load(path)
    pool = PromptPool(SPEC)
    with pytest.raises(PoolError, match="NaN or infinite"):
        pool.add("red", tensors["concept.0.features"], tensors["concept.0.prompts"], ["a", "b"])
    assert len(pool) == 0


@pytest.mark.parametrize("cut", [0, 8, 100])
def test_truncated_pool_file_is_named(tmp_path: Path, cut: int) -> None:
    path = write_pool(tmp_path / "p.safetensors", good_meta(), good_tensors())
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(PoolError, match="corrupted or unreadable"):
        PromptPool.load(path)


# ---------------------------------------------------------------------------------------------- LoRA data
def test_latin1_instruction_file_names_file_line_and_byte(tmp_path: Path) -> None:
    from clova_train.datamodules.tool_llm.tool_instructions import load_records

    path = tmp_path / "train.jsonl"
    lines = [json.dumps({"instruction": "ok", "output": "fine"}), json.dumps({"instruction": "caf\u00e9", "output": "x"}, ensure_ascii=False)]
    path.write_bytes("\n".join(lines).encode("latin-1"))
    with pytest.raises(DataError, match=r"train\.jsonl is not UTF-8 \(byte \d+, line 2"):
        load_records(path)


@pytest.mark.parametrize("field", ["instruction", "input", "output"])
def test_lone_surrogate_names_the_record_and_field(tmp_path: Path, field: str) -> None:
    from clova_train.datamodules.tool_llm.tool_instructions import load_records

    record = {"instruction": "i", "input": "", "output": "o"}
    record[field] = "bad \ud800 text"
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"instruction": "a", "output": "b"}, record]))  # json escapes the surrogate as \ud800
    with pytest.raises(DataError, match=f"data.json: record 1: '{field}' holds a lone surrogate"):
        load_records(path)
    records, skipped = load_records(path, skip_invalid=True)
    assert len(records) == 1 and skipped[0][0] == 1


# ---------------------------------------------------------------------------------------------- VQA records
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_vqa_records_sharing_an_id_name_the_file_the_records_and_the_id(tmp_path: Path, suffix: str) -> None:
    from clova_train.tools.vqa.records import read_records

    records = [{"id": "q1", "image": "a.png", "question": "what?", "answer": "red"},
               {"id": "q2", "image": "b.png", "question": "what?", "answer": "blue"},
               {"id": "q1", "image": "c.png", "question": "which?", "answer": "green"}]
    path = tmp_path / f"vqa{suffix}"
    path.write_text("\n".join(json.dumps(r) for r in records) if suffix == ".jsonl" else json.dumps(records))
    where = ("line", "record")[suffix == ".json"]
    with pytest.raises(DataError, match=rf"vqa{suffix}, {where} 3: id 'q1' is already the id of {where} 1"):
        read_records(path)


def test_a_vqa_id_that_repeats_another_records_default_id_is_refused(tmp_path: Path) -> None:
    from clova_train.datamodules.prompt_tuning.vqa_records import VqaRecords

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    records = [{"image": "a.png", "question": "what?", "answer": "red"},
               {"id": "train.jsonl:1", "image": "a.png", "question": "which?", "answer": "red"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    with pytest.raises(DataError, match=r"train.jsonl, line 2: instance id 'train.jsonl:1' is already that of record 1"):
        VqaRecords(tmp_path / "train.jsonl", None)


# ---------------------------------------------------------------------------------------------- config values
def clova_stderr(err: str) -> str:
    """stderr without the '--- Logging error ---' blocks that logging prints when an earlier test's captured
    stream was closed under one of Lightning's log handlers (a pytest artifact, not the CLI's output)."""
    blocks = err.split("--- Logging error ---")
    kept = [blocks[0]] + [b.split("Arguments: ()", 1)[-1] for b in blocks[1:]]
    return "".join(kept)


@pytest.mark.parametrize("option, message", [
    ("--model.init_args.steps=-5", "steps must be >= 1, got -5"),
    ("--model.init_args.lr=-1", "lr must be a positive number, got -1.0"),
    ("--model.init_args.lr=0", "lr must be a positive number, got 0.0"),
    ("--data.init_args.chunk_size=0", "chunk_size must be >= 1, got 0"),
    ("--model.init_args.early_stop_every=-1", "early_stop_every must be >= 0"),
    ("--trainer.accelerator=gpu", "trainer configuration: No supported gpu backend found"),
])
def test_bad_config_values_fail_before_anything_is_written(
    tiny_clip_dir: Path, concept_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture, option: str, message: str
) -> None:
    run_dir = tmp_path / "run"
    code = run_fit(*fit_args(tiny_clip_dir, concept_root, run_dir), option)
    err = clova_stderr(capsys.readouterr().err)
    assert code == 2 and message in err and "Traceback" not in err, err[-2000:]
    assert len([line for line in err.splitlines() if line.startswith("clova-train: error:")]) == 1
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "pool.safetensors").exists()


def test_on_existing_pool_error_is_checked_before_training(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    shared = write_pool(tmp_path / "shared.safetensors", good_meta(), good_tensors())
    before = shared.read_bytes()
    code = run_fit(*fit_args(tiny_clip_dir, concept_root, tmp_path / "run", f"--model.init_args.pool_path={shared}",
                             "--model.init_args.on_existing_pool=error"))
    assert code == 2 and "already exists (on_existing_pool='error')" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists() and shared.read_bytes() == before


def test_corrupt_existing_pool_blocks_merge_up_front_but_not_overwrite(
    tiny_clip_dir: Path, concept_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shared = tmp_path / "shared.safetensors"
    shared.write_bytes(b"this is not a safetensors file")
    merge = fit_args(tiny_clip_dir, concept_root, tmp_path / "merge", f"--model.init_args.pool_path={shared}")
    assert run_fit(*merge) == 2
    assert "corrupted or unreadable" in capsys.readouterr().err
    assert not (tmp_path / "merge" / "checkpoints").exists()
    overwrite = fit_args(tiny_clip_dir, concept_root, tmp_path / "overwrite", f"--model.init_args.pool_path={shared}",
                         "--model.init_args.on_existing_pool=overwrite")
    assert run_fit(*overwrite) == 0
    assert PromptPool.load(shared).concepts == PromptPool.load(tmp_path / "overwrite" / "pool.safetensors").concepts
