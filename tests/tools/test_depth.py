"""The frozen depth tool (HYDRA's ``compute_depth``): the tiny Depth Anything saved and loaded back through
``DepthEstimator.from_pretrained``, depth maps at the image's size, box medians, refused requests, and
``clova-train serve`` of a depth model directory at ``/v1/depth``."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clova_train.core.errors import DataError, ExportError, ModelError
from clova_train.serving.http import export_kind
from clova_train.tools.depth import DepthEstimator, check_depth_model_dir, depth_model_type
from clova_train.tools.depth.tiny import make_tiny_depth_anything

WIDTH, HEIGHT = 70, 50


@pytest.fixture(scope="module")
def depth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_depth_anything(tmp_path_factory.mktemp("tiny-depth") / "depth-anything")


@pytest.fixture(scope="module")
def estimator(depth_dir: Path) -> DepthEstimator:
    return DepthEstimator.from_pretrained(depth_dir)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pixels = np.random.default_rng(0).integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("depth-images") / "scene.png"
    Image.fromarray(pixels).save(path)
    return path


def test_the_tiny_model_saves_and_loads_back_with_its_direction(depth_dir: Path, estimator: DepthEstimator) -> None:
    assert {p.name for p in depth_dir.iterdir()} == {"config.json", "model.safetensors", "preprocessor_config.json"}
    assert depth_model_type(depth_dir) == check_depth_model_dir(depth_dir) == "depth_anything"
    assert type(estimator.model).__name__ == "DepthAnythingForDepthEstimation"
    assert estimator.larger_is_nearer  # a relative head: disparity
    assert not any(p.requires_grad for p in estimator.model.parameters()) and not estimator.model.training
    again = DepthEstimator.from_pretrained(str(depth_dir), larger_is_nearer=False)
    assert not again.larger_is_nearer  # the caller's word overrides the architecture's


def test_depth_maps_have_the_images_own_size_whatever_it_is_given_as(estimator: DepthEstimator,
                                                                     image_file: Path) -> None:
    depth = estimator.depth_map(image_file)
    assert depth.shape == (HEIGHT, WIDTH) and depth.dtype == torch.float32 and torch.isfinite(depth).all()
    assert depth.std() > 0  # the redrawn head: not one value everywhere
    pixels = np.asarray(Image.open(image_file).convert("RGB"))
    torch.testing.assert_close(estimator.depth_map(torch.from_numpy(pixels.copy()).permute(2, 0, 1)), depth)
    assert estimator.depth_map(np.zeros((3, 7, 3), np.uint8)).shape == (3, 7)  # not read as channels-first


def test_serve_answers_one_median_per_box_and_one_for_the_whole_image(estimator: DepthEstimator,
                                                                     image_file: Path) -> None:
    depth = estimator.depth_map(image_file)
    boxes = [[0, 0, 10, 10], [60.5, 40, 500, 500], [3, 4, 3, 4]]  # the second clipped, the third one pixel
    reply = estimator.serve({"image": str(image_file), "boxes": boxes})
    assert reply["larger_is_nearer"] is True
    expected = [depth[0:10, 0:10].median(), depth[40:50, 60:70].median(), depth[4, 3]]
    assert reply["depths"] == pytest.approx([float(v) for v in expected])
    whole = float(depth.median())
    assert estimator.serve({"image": str(image_file)})["depths"] == pytest.approx([whole])
    assert estimator.serve({"image": str(image_file), "boxes": []})["depths"] == pytest.approx([whole])
    json.dumps(reply)  # plain JSON values


@pytest.mark.parametrize("change, words", [
    ({"boxes": [[0, 0, 5, 5], [80, 0, 90, 10]]}, "'boxes[1]' = [80.0, 0.0, 90.0, 10.0] lies outside the 70x50 image"),
    ({"boxes": [[0, 0, "5", 5]]}, "'boxes[0]' must be four finite numbers"),
    ({"boxes": [[0, 0, 5]]}, "'boxes[0]' must be four finite numbers"),
    ({"boxes": [[0, 0, float("nan"), 5]]}, "'boxes[0]' must be four finite numbers"),
    ({"boxes": [[True, 0, 5, 5]]}, "'boxes[0]' must be four finite numbers"),
    ({"boxes": [[5, 0, 1, 5]]}, "'boxes[0]' = [5, 0, 1, 5] has x1 < x0"),
    ({"boxes": {"x0": 1}}, "'boxes' must be a list"),
    ({"image": 3}, "'image' must be the path of an image file"),
    ({"box": [[0, 0, 1, 1]]}, "'box' is not known to the depth tool"),
])
def test_bad_requests_get_one_data_error_naming_the_field(estimator: DepthEstimator, image_file: Path,
                                                         change: dict, words: str) -> None:
    with pytest.raises(DataError) as caught:
        estimator.serve({"image": str(image_file), **change})
    assert words in str(caught.value)


def test_a_missing_image_file_is_a_data_error_naming_it(estimator: DepthEstimator, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"image not found: {tmp_path / 'gone.png'}"):
        estimator.serve({"image": str(tmp_path / "gone.png"), "boxes": [[0, 0, 1, 1]]})


def test_a_directory_without_a_depth_model_is_refused_naming_it(depth_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match=f"{other} holds a 'llama' model, not a depth-estimation model"):
        DepthEstimator.from_pretrained(other)
    with pytest.raises(ModelError, match=f"{tmp_path} has no config.json"):
        DepthEstimator.from_pretrained(tmp_path)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((depth_dir / "config.json").read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelError, match="has no safetensors weights"):
        DepthEstimator.from_pretrained(pickled)
    assert depth_model_type(other) is None and depth_model_type(tmp_path) is None


def test_a_model_of_unknown_direction_must_say_it(depth_dir: Path, tmp_path: Path) -> None:
    from clova_train.tools.depth.estimator import larger_is_nearer_for

    class Config:
        model_type = "chmv2"

    assert larger_is_nearer_for(Config()) is None
    Config.larger_is_nearer = False
    assert larger_is_nearer_for(Config()) is False
    metric = tmp_path / "metric"
    metric.mkdir()
    config = json.loads((depth_dir / "config.json").read_text())
    (metric / "config.json").write_text(json.dumps({**config, "larger_is_nearer": False}))
    (metric / "model.safetensors").write_bytes((depth_dir / "model.safetensors").read_bytes())
    (metric / "preprocessor_config.json").write_bytes((depth_dir / "preprocessor_config.json").read_bytes())
    assert DepthEstimator.from_pretrained(metric).larger_is_nearer is False


def test_export_kind_serves_a_depth_model_and_still_refuses_other_directories(depth_dir: Path,
                                                                              tmp_path: Path) -> None:
    assert export_kind(depth_dir) == "depth"
    with pytest.raises(ExportError, match=f"{tmp_path} is not an export: .* is neither a run nor an export"):
        export_kind(tmp_path)


def test_the_depth_folder_is_no_prompt_tool() -> None:
    from clova_train.tools.recipes import tool_recipes

    recipes = tool_recipes()
    assert "depth" not in recipes
    assert not any("depth" in recipe.tool for recipe in recipes.values())


def post(url: str, body: object) -> tuple[int, dict]:
    """The status and JSON reply of a POST (an error status too)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _png_data_url(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def test_clova_train_serve_answers_depth_requests_at_v1_depth(depth_dir: Path, image_file: Path,
                                                              estimator: DepthEstimator) -> None:
    """A server process on the tiny model's directory: server paths and data: URLs answered as in this process, a bad
    box and an unreadable image each a 400 naming it, in OpenAI's error shape."""
    from helpers.serving import serving

    with serving([str(depth_dir), "--image-root", str(image_file.parent)]) as (base, server):
        body = {"image": str(image_file), "boxes": [[0, 0, 10, 10], [20, 20, 70, 50]]}
        status, reply = post(base + "/v1/depth", body)
        assert status == 200, reply
        assert reply["depths"] == pytest.approx(estimator.serve(body)["depths"], abs=1e-5)
        assert reply["larger_is_nearer"] is True
        sent = {"image": _png_data_url(np.asarray(Image.open(image_file).convert("RGB")))}
        status, reply = post(base + "/v1/depth", sent)
        assert status == 200 and reply["depths"] == pytest.approx(estimator.serve({"image": str(image_file)})["depths"],
                                                                  abs=1e-5)
        status, reply = post(base + "/v1/depth", {"image": str(image_file), "boxes": [[100, 0, 110, 10]]})
        assert status == 400 and "'boxes[0]'" in reply["error"]["message"] and "outside" in reply["error"]["message"]
        status, reply = post(base + "/v1/depth", {"image": str(image_file.parent / "nonexistent.png")})
        assert status == 400 and "nonexistent.png' cannot be used" in reply["error"]["message"]
        status, reply = post(base + "/v1/depth", {"image": "/etc/hostname"})  # outside --image-root
        assert status == 400 and "outside the server's --image-root" in reply["error"]["message"]
        _stops_on_sigterm(base, server)


def _stops_on_sigterm(base: str, server) -> None:
    """This export kind too (issue 52): SIGTERM to the server's own process stops it and every process it started,
    exit code 0, and frees its port (tests/serving/test_http_serving.py checks the others, twice in a row)."""
    import os
    import signal
    import socket
    import time

    from helpers.serving import process_group

    os.kill(server.pid, signal.SIGTERM)
    assert server.wait(timeout=45) == 0
    assert "stopped (SIGTERM)" in server.stdout.read()
    deadline = time.monotonic() + 10
    while process_group(server.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process_group(server.pid) == [], "a worker outlived its server"
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(base.rsplit(":", 1)[1])))  # the port is free again

