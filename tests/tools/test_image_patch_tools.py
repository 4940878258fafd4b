"""The ``ImagePatch`` tools on this package's exports (clova_train.tools.image_patch, clova_train.tools.tool_clients):
boxes between a patch and the whole image, CLASSIFY / VQA / LOC through real tiny exports, data: URLs in process,
the HTTP client against stub servers (a reply, an error body, a refused connection, a timeout), a failing tool as a
failed program, the config's checks and its one client per process."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from clova_train.core.errors import ToolServiceError
from clova_train.sandbox import PatchRef, Sandbox
from clova_train.tools.image_patch import (NO_DEPTH, UNKNOWN, ImagePatchTools, ImageToolsConfig, close_clients,
                                           crop_around, png_data_url)
from clova_train.tools.prompt_server import PromptToolServer
from clova_train.tools.tool_clients import (CLASSIFY, DEPTH, LOC, VQA, HttpToolClient, LocalToolClient,
                                            MemoizedToolClient)
from helpers.tool_exports import write_tiny_exports
from helpers.serving import free_port

WIDTH, HEIGHT = 64, 48
LABELS = ["red", "green", "blue", "purple"]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64 x 48 image whose every pixel differs (so a wrong crop shows)."""
    x, y = np.meshgrid(np.arange(WIDTH), np.arange(HEIGHT))
    pixels = np.stack([x * 4, y * 5, (x + y) % 256], axis=-1).astype(np.uint8)
    path = tmp_path_factory.mktemp("image") / "scene.png"
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def exports(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Exports of the random-weight tiny CLIP, OWL-ViT and BLIP VQA, by role."""
    return write_tiny_exports(tiny_models, tmp_path_factory.mktemp("exports"))


@pytest.fixture(scope="module")
def local(exports: dict[str, Path]) -> LocalToolClient:
    return LocalToolClient.load(loc=exports[LOC], classify=exports[CLASSIFY], vqa=exports[VQA])


def pixels_of(data_url: str) -> np.ndarray:
    header, _, payload = data_url.partition(",")
    assert header == "data:image/png;base64"
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB"))


def saved(pixels: np.ndarray, path: Path) -> str:
    Image.fromarray(pixels).save(path)
    return str(path)


class Recording:
    """A client answering each role with a canned reply (or a function of the request), recording the requests."""

    def __init__(self, **replies: Any) -> None:
        self.replies, self.requests = replies, []
        self.roles = frozenset(replies)

    def request(self, role: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.requests.append((role, payload))
        reply = self.replies[role]
        return reply(payload) if callable(reply) else reply

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------- boxes and patches
def test_find_maps_a_box_in_the_patch_to_the_whole_image_with_y_from_the_bottom(image: Path) -> None:
    client = Recording(LOC={"boxes": [[2.0, 4.0, 12.0, 10.0], [-5.0, 20.0, 90.0, 31.6]], "scores": [0.9, 0.8]})
    tools = ImagePatchTools(image, client, LABELS)
    patch = PatchRef("t", 8, 16, 40, 48)  # x 8..40, y (from the bottom) 16..48: the image's top 32 rows
    # the detector's top-down (x0, y0, x1, y1) in the 32 x 32 region -> (left, lower, right, upper) in the image; a box
    # past the region is clipped to the image
    assert tools.find(patch, " cat ") == [(10, 38, 20, 44), (3, 16, 64, 28)]
    role, request = client.requests[0]
    assert role == LOC and request["concept"] == "cat"
    np.testing.assert_array_equal(pixels_of(request["image"]), np.asarray(Image.open(image))[0:32, 8:40])
    # a patch reaching past the image is the image's part of it, never empty
    tools.find(PatchRef("t", -10, -10, 1000, 5), "cat")
    assert pixels_of(client.requests[1][1]["image"]).shape == (5, WIDTH, 3)
    tools.find(PatchRef("t", 70, 60, 60, 50), "cat")
    assert pixels_of(client.requests[2][1]["image"]).shape == (1, 1, 3)
    assert tools.exists(patch, "cat")
    assert not ImagePatchTools(image, Recording(LOC={"boxes": []}), LABELS).exists(patch, "cat")


def test_find_through_a_real_owlvit_export_is_the_detection_of_the_patch_pixels(image: Path, local: LocalToolClient,
                                                                               tmp_path: Path) -> None:
    tools = ImagePatchTools(image, local, LABELS)
    patch = PatchRef("t", 8, 16, 40, 48)
    region = saved(np.asarray(Image.open(image))[0:32, 8:40], tmp_path / "region.png")
    direct = local.servers[LOC].serve({"image": region, "concept": "cat"})["boxes"]
    expected = [(round(8 + x0), round(HEIGHT - y1), round(8 + x1), round(HEIGHT - y0)) for x0, y0, x1, y1 in direct]
    assert expected and tools.find(patch, "cat") == expected


# ----------------------------------------------------------------------------------------- CLASSIFY, VQA, DEPTH, LLM
def test_verify_property_asks_a_real_clip_export_about_crops_around_the_found_objects(
        image: Path, exports: dict[str, Path], tmp_path: Path) -> None:
    clip = PromptToolServer.from_export(exports[CLASSIFY])
    loc_boxes = {"boxes": [[10.0, 10.0, 20.0, 22.0]]}
    sent = []

    class Classify:
        def serve(self, request: dict) -> dict:
            sent.append(request)
            return clip.serve(request)

    class Locate:
        def serve(self, request: dict) -> dict:
            return loc_boxes

    client = LocalToolClient({LOC: Locate(), CLASSIFY: Classify()})
    tools = ImagePatchTools(image, client, LABELS, crop_margin=2.0)
    box = (10, HEIGHT - 22, 20, HEIGHT - 10)  # the found box in the image, y from the bottom
    x0, y0, x1, y1 = crop_around(box, HEIGHT, WIDTH, 2.0)
    assert (x0, y0, x1, y1) == (3, 4, 27, 28)  # a 24-pixel square (twice the box's longer side) around its centre
    crop = saved(np.asarray(Image.open(image))[y0:y1, x0:x1], tmp_path / "crop.png")
    predicted = clip.serve({"images": [crop], "labels": LABELS})["labels"][0]
    whole = PatchRef("t", 0, 0, WIDTH, HEIGHT)
    assert tools.verify_property(whole, "ball", predicted.upper())  # matched to the label whatever its case
    assert sent[-1]["labels"] == LABELS
    other = next(label for label in LABELS if label != predicted)
    assert not tools.verify_property(whole, "ball", other)
    tools.verify_property(whole, "ball", "teal")  # an attribute outside the labels joins them for that call
    assert sent[-1]["labels"] == [*LABELS, "teal"] and tools.labels == LABELS
    calls = len(sent)
    loc_boxes["boxes"] = []
    assert not tools.verify_property(whole, "ball", predicted) and len(sent) == calls  # nothing found: not asked


def test_data_urls_in_process_give_the_answers_of_file_paths(image: Path, local: LocalToolClient) -> None:
    url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    for role, request in ((CLASSIFY, {"images": [str(image)], "labels": LABELS}),
                          (VQA, {"image": str(image), "question": "what colour is it?"}),
                          (LOC, {"image": str(image), "concept": "cat"})):
        field = "images" if role == CLASSIFY else "image"
        as_url = {**request, field: [url] if role == CLASSIFY else url}
        assert local.request(role, as_url) == local.request(role, request), role


def test_simple_query_depth_and_llm_query(image: Path, local: LocalToolClient, tmp_path: Path) -> None:
    patch = PatchRef("t", 8, 16, 40, 48)
    region = saved(np.asarray(Image.open(image))[0:32, 8:40], tmp_path / "region.png")
    question = "what colour is it?"
    expected = local.servers[VQA].serve({"image": region, "question": question})["answer"]
    asked = []
    tools = ImagePatchTools(image, local, LABELS, llm=lambda prompt: asked.append(prompt) or "Paris")
    assert tools.simple_query(patch, question) == expected
    assert tools.llm_query(None, "capital of France?") == "Paris" and asked == ["capital of France?"]
    assert tools.llm_query(patch, "What city is the Louvre in?") == "Paris"  # the question alone, as in ViperGPT
    assert asked[-1] == "What city is the Louvre in?"
    assert tools.compute_depth(patch) == NO_DEPTH  # without a DEPTH tool

    class Depth:  # the depth estimator's request and reply
        larger_is_nearer = False

        def serve(self, request: dict) -> dict:
            self.request = request
            self.pixels = np.asarray(Image.open(request["image"]))  # a data: URL, written to a file for the call
            return {"depths": [3.5], "larger_is_nearer": self.larger_is_nearer}

    depth = Depth()
    with_depth = ImagePatchTools(image, LocalToolClient({DEPTH: depth}), LABELS)
    assert with_depth.compute_depth(patch) == 3.5
    assert depth.request["boxes"] == [[8, 0, 40, 32]]  # the patch's pixels, top-down, in the whole image
    np.testing.assert_array_equal(depth.pixels, np.asarray(Image.open(image)))  # the whole image
    assert not Path(depth.request["image"]).exists()  # removed after the call
    depth.larger_is_nearer = True  # a disparity: negated, so that larger is still farther
    assert with_depth.compute_depth(patch) == -3.5
    assert with_depth.simple_query(patch, question) == UNKNOWN and with_depth.llm_query(None, "?") == UNKNOWN
    with pytest.raises(ToolServiceError, match="no LOC tool is loaded"):
        with_depth.find(patch, "cat")


def test_malformed_replies_and_failing_tools_are_tool_errors(image: Path) -> None:
    patch = PatchRef("t", 0, 0, WIDTH, HEIGHT)
    with pytest.raises(ToolServiceError, match="boxes"):
        ImagePatchTools(image, Recording(LOC={"boxes": [[1, 2, 3, float("nan")]]}), LABELS).find(patch, "cat")
    with pytest.raises(ToolServiceError, match="one finite number"):
        ImagePatchTools(image, Recording(DEPTH={"depths": ["far"]}), LABELS).compute_depth(patch)

    class Broken:
        def serve(self, request: dict) -> dict:
            raise RuntimeError("CUDA out of memory")

    with pytest.raises(ToolServiceError, match=r"VQA tool \(my-export\) failed: RuntimeError: CUDA out of memory"):
        ImagePatchTools(image, LocalToolClient({VQA: Broken()}, {VQA: "my-export"}), LABELS).simple_query(patch, "?")


# ----------------------------------------------------------------------------------------------- HTTP
class Stub:
    """A tool server on 127.0.0.1 (a thread): answers each path with ``(status, body)`` from ``replies``, records
    what it was sent."""

    def __init__(self, replies: dict[str, tuple[int, Any]], delay_s: float = 0.0) -> None:
        self.replies, self.received = replies, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.received.append((self.path, dict(self.headers), body))
                time.sleep(delay_s)
                status, reply = stub.replies.get(self.path, (404, {"error": {"message": "no such endpoint"}}))
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client gave up (the timeout test)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub({"/v1/owlvit_loc": (200, {"boxes": [[2, 4, 12, 10]], "scores": [0.9]}),
                   "/v1/clip": (200, {"labels": ["red"], "scores": [[0.9, 0.1]]}),
                   "/v1/blip_vqa": (400, {"error": {"message": "request field 'question' must be a non-empty string",
                                                    "type": "invalid_request_error", "param": None, "code": 400}}),
                   "/v1/depth": (200, b"<html>not json</html>")})
    yield server
    server.close()


def test_http_client_posts_each_role_to_its_endpoint_with_images_inline(image: Path, stub: Stub,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_TOOLS_KEY", "s3cret")
    client = HttpToolClient(stub.url + "/", {LOC: "owlvit_loc", CLASSIFY: "clip"}, api_key="s3cret", timeout_s=10)
    tools = ImagePatchTools(image, client, LABELS)
    assert tools.verify_property(PatchRef("t", 8, 16, 40, 48), "ball", "red")
    (loc_path, loc_headers, loc_body), (clip_path, _, clip_body) = stub.received
    assert (loc_path, clip_path) == ("/v1/owlvit_loc", "/v1/clip")
    assert loc_headers["Authorization"] == "Bearer s3cret" and loc_body["concept"] == "ball"
    assert pixels_of(loc_body["image"]).shape == (32, 32, 3) and clip_body["labels"] == LABELS
    # a request naming a file sends the file's bytes (the server may not share this disk)
    assert client.request(CLASSIFY, {"images": [str(image)], "labels": ["red"]})["labels"] == ["red"]
    assert base64.b64decode(stub.received[-1][2]["images"][0].partition(",")[2]) == image.read_bytes()
    assert "s3cret" not in repr(client)


def test_http_errors_name_the_role_the_url_and_the_reason(image: Path, stub: Stub) -> None:
    client = HttpToolClient(stub.url, {VQA: "blip_vqa", DEPTH: "depth"}, timeout_s=10)
    with pytest.raises(ToolServiceError, match=rf"VQA tool at {stub.url}/v1/blip_vqa: HTTP 400: request field "
                                               r"'question' must be a non-empty string"):
        client.request(VQA, {"image": str(image), "question": ""})
    with pytest.raises(ToolServiceError, match=r"DEPTH tool at .*/v1/depth: the reply is not valid JSON"):
        client.request(DEPTH, {"image": str(image)})
    with pytest.raises(ToolServiceError, match="no LOC tool is configured"):
        client.request(LOC, {"image": str(image), "concept": "cat"})
    refused = HttpToolClient(f"http://127.0.0.1:{free_port()}", {LOC: "owlvit_loc"}, timeout_s=5)
    with pytest.raises(ToolServiceError,
                       match=r"LOC tool at http://127\.0\.0\.1:\d+/v1/owlvit_loc: connection refused"):
        refused.request(LOC, {"image": str(image), "concept": "cat"})
    slow = Stub({"/v1/clip": (200, {"labels": ["red"]})}, delay_s=2.0)
    try:
        with pytest.raises(ToolServiceError, match=r"CLASSIFY tool at .*/v1/clip: no answer within 0.3 s"):
            HttpToolClient(slow.url, {CLASSIFY: "clip"}, timeout_s=0.3).request(CLASSIFY, {"images": [], "labels": []})
    finally:
        slow.close()


def test_a_failing_tool_is_a_failed_program_not_a_crash(image: Path) -> None:
    refused = HttpToolClient(f"http://127.0.0.1:{free_port()}", {LOC: "owlvit_loc"}, timeout_s=5)
    tools = ImagePatchTools(image, refused, LABELS)
    with Sandbox(timeout_s=20) as sandbox:
        result = sandbox.run("final_answer = len(image_patch.find('cat'))", {}, tools, "t", (WIDTH, HEIGHT))
    assert result.status == "error"
    assert "find failed: ToolServiceError" in result.error and "connection refused" in result.error


# ----------------------------------------------------------------------------------------------- the config
def test_http_client_reads_the_endpoints_from_the_exports(exports: dict[str, Path]) -> None:
    client = HttpToolClient.for_exports("http://tools:8000", exports[LOC], exports[CLASSIFY], exports[VQA],
                                        "depth-model")
    assert client.endpoints == {LOC: "owlvit_loc", CLASSIFY: "clip", VQA: "blip_vqa", DEPTH: "depth"}
    assert client.url(CLASSIFY) == "http://tools:8000/v1/clip"


def test_config_problems_name_every_bad_value(exports: dict[str, Path], tmp_path: Path) -> None:
    assert ImageToolsConfig().problems("tools") == []
    complete = ImageToolsConfig(loc=str(exports[LOC]), classify=str(exports[CLASSIFY]), vqa=str(exports[VQA]))
    assert complete.problems() == []
    bad = ImageToolsConfig(loc=str(exports[CLASSIFY]), classify=str(tmp_path / "missing"),
                           depth=str(tmp_path / "nodepth"), labels=["red", "Red"], crop_margin=0.5, timeout_s=0,
                           device="gpu0", top_k=0)
    problems = bad.problems("env.tasks.tools")
    expected = [
        f"env.tasks.tools.loc = '{exports[CLASSIFY]}': {exports[CLASSIFY]} is an export of 'clip', which does not "
        "serve 'detect': LOC needs an export of a tool that does",
        f"env.tasks.tools.classify = '{tmp_path / 'missing'}': export directory not found: {tmp_path / 'missing'}",
        "env.tasks.tools.labels = ['red', 'Red']: must be a non-empty list of distinct, non-empty labels",
        "env.tasks.tools.crop_margin = 0.5: must be a number >= 1",
        "env.tasks.tools.timeout_s = 0: must be a number > 0",
        "env.tasks.tools.device = 'gpu0': must be a torch device (cpu, cuda, cuda:1, ...)",
        "env.tasks.tools.top_k = 0: must be an integer >= 1 or null",
    ]
    depth_problem = problems.pop(2)
    assert depth_problem.startswith(f"env.tasks.tools.depth = '{tmp_path / 'nodepth'}': ") and "not found" in depth_problem
    assert problems == expected
    remote = ImageToolsConfig(classify=str(exports[CLASSIFY]), server_url="tools:8000").problems()
    assert remote == [f"classify = '{exports[CLASSIFY]}': needs loc too (verify_property classifies the objects LOC "
                      "finds)",
                      "server_url = 'tools:8000': must be null (tools in this process) or an http:// or https:// URL "
                      "of a clova-train serve"]


def test_equal_configs_share_one_client_per_process(exports: dict[str, Path]) -> None:
    try:
        first = ImageToolsConfig(loc=str(exports[LOC]), classify=str(exports[CLASSIFY]), labels=["red"])
        same = ImageToolsConfig(loc=f"{exports[LOC]}/", classify=str(exports[CLASSIFY]), crop_margin=3.0)
        assert isinstance(first.client().client, LocalToolClient) and first.client() is same.client()
        assert first.client().roles == {LOC, CLASSIFY}
        other = ImageToolsConfig(classify=str(exports[CLASSIFY]), loc=str(exports[LOC]), top_k=3)
        assert other.client() is not first.client()
        remote = ImageToolsConfig(loc=str(exports[LOC]), server_url="http://127.0.0.1:9")
        assert isinstance(remote.client().client, HttpToolClient)
        assert remote.client() is ImageToolsConfig(**vars(remote)).client()
        tools = same.tools(Path("scene.png"))
        assert tools.client is first.client() and tools.crop_margin == 3.0
        with pytest.raises(Exception, match="bad ImagePatch tool settings: crop_margin = 0"):
            ImageToolsConfig(crop_margin=0).client()
    finally:
        close_clients()


# Not a learning claim: the marker keeps it out of `make test` (its time budget); a real server, 8 s idle on 2 cores
@pytest.mark.learning
def test_a_live_clova_train_serve_answers_as_the_in_process_tools(exports: dict[str, Path], local: LocalToolClient,
                                                                 image: Path) -> None:
    from helpers.serving import serving

    with serving([str(exports[CLASSIFY]), str(exports[VQA])]) as (base, _):
        remote = HttpToolClient.for_exports(base, classify=exports[CLASSIFY], vqa=exports[VQA], timeout_s=60)
        request = {"images": [str(image)], "labels": LABELS}
        assert remote.request(CLASSIFY, request)["labels"] == local.request(CLASSIFY, request)["labels"]
        patch = PatchRef("t", 8, 16, 40, 48)
        assert (ImagePatchTools(image, remote, LABELS).simple_query(patch, "what is it?")
                == ImagePatchTools(image, local, LABELS).simple_query(patch, "what is it?"))


class CountingClient:
    """A client that answers every request with a fresh list and counts what it was asked."""

    roles = frozenset({CLASSIFY})

    def __init__(self) -> None:
        self.asked = 0

    def request(self, role: str, payload: dict) -> dict:
        self.asked += 1
        return {"labels": ["red"] * len(payload.get("images", [])), "call": self.asked}

    def close(self) -> None:
        pass


def test_repeated_inline_requests_are_answered_from_memory_and_paths_never_are(image: Path) -> None:
    counting = CountingClient()
    memo = MemoizedToolClient(counting, max_entries=2)
    crop = png_data_url(np.zeros((4, 4, 3), dtype=np.uint8))
    first = memo.request(CLASSIFY, {"images": [crop], "labels": ["red", "blue"]})
    first["labels"].append("tampered")  # a caller changing its answer does not change the remembered one
    again = memo.request(CLASSIFY, {"labels": ["red", "blue"], "images": [crop]})
    assert counting.asked == 1 and again == {"labels": ["red"], "call": 1} and (memo.hits, memo.misses) == (1, 1)
    assert memo.request(CLASSIFY, {"images": [crop], "labels": ["blue", "red"]})["call"] == 2  # another question
    for _ in range(2):  # a file's content may change between calls: never remembered
        memo.request(CLASSIFY, {"images": [str(image)], "labels": ["red"]})
    assert counting.asked == 4
    other = png_data_url(np.ones((4, 4, 3), dtype=np.uint8))
    memo.request(CLASSIFY, {"images": [other], "labels": ["red"]})  # a third answer: the oldest is dropped
    assert memo.request(CLASSIFY, {"images": [crop], "labels": ["red", "blue"]})["call"] == 6


def test_the_config_wraps_its_client_in_memory_unless_told_not_to(exports: dict[str, Path]) -> None:
    remembering = ImageToolsConfig(vqa=str(exports[VQA]))
    forgetting = ImageToolsConfig(vqa=str(exports[VQA]), remembered_answers=0)
    try:
        assert isinstance(remembering.client(), MemoizedToolClient)
        assert isinstance(forgetting.client(), LocalToolClient)
        assert "remembered_answers = -1: must be an integer >= 0" in " ".join(
            ImageToolsConfig(remembered_answers=-1).problems())
    finally:
        close_clients()
