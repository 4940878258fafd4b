"""The server stays up and answers 4xx for any bad request (issue 32, part 2).

Two levels: :class:`RequestGuard` driven directly as an ASGI app (every body, encoding, header and key case, no
network), then the real ``clova-train serve`` on 127.0.0.1 with an API key and small limits: hostile files named as
images (FIFO, device, directory, missing, not an image, over the pixel limit) all get one and the same 400, errors
come in OpenAI's shape, and a bounded load test (8 clients x 50 requests, good and bad mixed) ends with no error.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import statistics
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clova_train.serving.guard import RequestGuard, RequestLimits, error_body, longest_list
from helpers.serving import serving

KEY = "s3cret-key"


# ------------------------------------------------------------------------------------------------ the guard alone
class Echo:
    """The app behind the guard: records what reached it and echoes the body."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict, bytes]] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope, body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body or b"{}"})


def call(guard: RequestGuard, body: bytes | list[bytes] = b"", headers: dict[str, str] | None = None,
         path: str = "/v1/clip", method: str = "POST") -> tuple[int, dict]:
    chunks = body if isinstance(body, list) else [body]
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    pending = list(chunks)
    sent: list[dict] = []

    async def receive() -> dict:
        if not pending:
            return {"type": "http.disconnect"}
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(payload or b"{}")


def guarded(api_key: str | None = KEY, **limits) -> tuple[RequestGuard, Echo]:
    app = Echo()
    return RequestGuard(app, api_key, RequestLimits(**{"max_body_bytes": 4096, "max_list_items": 8, **limits})), app


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def assert_openai_error(status: int, reply: dict, expected_status: int, words: str) -> None:
    assert status == expected_status, reply
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    assert reply["error"]["code"] == expected_status and words in reply["error"]["message"], reply


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"}])
def test_v1_requires_the_bearer_key(headers: dict) -> None:
    guard, app = guarded()
    assert_openai_error(*call(guard, b'{"a": 1}', headers), 401, "API key")
    assert not app.seen


def test_health_stays_open_and_the_right_key_passes() -> None:
    guard, app = guarded()
    assert call(guard, path="/health", method="GET")[0] == 200
    assert call(guard, b'{"a": 1}', AUTH) == (200, {"a": 1})


def test_no_key_configured_means_no_key_needed() -> None:
    guard, _ = guarded(api_key=None)
    assert call(guard, b'{"a": 1}')[0] == 200


@pytest.mark.parametrize("body, words", [
    (b"", "empty"), (b"   \n", "empty"), (b"{oops", "not valid JSON"), (b'{"a": 1} trailing', "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested more than"), (b'{"a": 1, "a": 2}', "twice"),
    (b'{"a": "caf\xe9"}', "not UTF-8"), (b"\xff\xfe{\x00}\x00", "not UTF-8"), (b"NaN" * 3, "not finite"),
    (b'{"temperature": NaN}', "not finite"), (b"[1e999]", "not finite"), (b"[-Infinity]", "not finite"),
    (b"[" + b"9" * 5000 + b"]", "cannot be read"), (b'{"seed": 1000000000000000000000000000000}', "64-bit range"),
])
def test_malformed_bodies_get_400(body: bytes, words: str) -> None:
    guard, app = guarded(max_body_bytes=1 << 20)
    assert_openai_error(*call(guard, body, AUTH), 400, words)
    assert not app.seen


@pytest.mark.parametrize("content_type", ["", "text/plain", "application/x-www-form-urlencoded", "application/json; charset=utf-8"])
def test_json_is_accepted_whatever_the_content_type(content_type: str) -> None:
    guard, app = guarded()
    headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": content_type} if content_type else {})}
    assert call(guard, b'{"images": ["a.png"]}', headers) == (200, {"images": ["a.png"]})
    scope = app.seen[0][0]
    assert dict(scope["headers"])[b"content-type"] == b"application/json"


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "b0undary") -> tuple[bytes, dict[str, str]]:
    """A multipart/form-data body of ``(name, filename or None, content)`` parts, and its headers."""
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        kind = "Content-Type: image/png\r\n" if filename else ""
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n{kind}\r\n".encode() + content + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, {**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_multipart_uploads_become_the_json_request_with_data_urls() -> None:
    guard, app = guarded()
    body, headers = multipart([("images", "a.png", b"\x89PNG-a"), ("images", "b.png", b"\x89PNG-b"),
                               ("labels", None, b'["red", "blue"]'), ("concept", None, b"purple"), ("seed", None, b"3")])
    status, seen = call(guard, body, headers)
    assert status == 200 and seen == {"images": ["data:image/png;base64,iVBORy1h", "data:image/png;base64,iVBORy1i"],
                                      "labels": ["red", "blue"], "concept": "purple", "seed": 3}
    body, headers = multipart([("images", "a.png", b"x")])
    assert call(guard, body, headers)[1] == {"images": ["data:image/png;base64,eA=="]}  # a list even when sent once
    body, headers = multipart([("question", None, b"[draft] what colour?"), ("concept", None, b"007"),
                               ("note", None, "\u00b2".encode())])
    assert call(guard, body, headers)[1] == {"question": "[draft] what colour?", "concept": "007", "note": "\u00b2"}


@pytest.mark.parametrize("field, words", [
    (b"[" * 40 + b"]" * 40, "form field 'labels' is nested more than"), (b"1" * 5000, "form field 'labels' holds a value"),
    (b"[NaN]", "not finite"), (b'{"a": 1, "a": 2}', "twice"),
])
def test_form_fields_are_parsed_as_strictly_as_json_bodies(field: bytes, words: str) -> None:
    guard, app = guarded(max_body_bytes=1 << 20)
    body, headers = multipart([("images", "a.png", b"x"), ("labels", None, field)])
    status, reply = call(guard, body, headers)
    assert status == 400 and words in reply["error"]["message"] and not app.seen, reply


@pytest.mark.parametrize("body, words", [
    (b"--x\r\n", "cannot be parsed"), (b"--b0undary--\r\n", "no fields"), (b"garbage", "cannot be parsed"),
])
def test_malformed_multipart_gets_400(body: bytes, words: str) -> None:
    guard, app = guarded()
    status, reply = call(guard, body, {**AUTH, "Content-Type": "multipart/form-data; boundary=b0undary"})
    assert status == 400 and words in reply["error"]["message"] and not app.seen, reply


@pytest.mark.parametrize("split", [1, 3])
def test_oversized_bodies_get_413_declared_or_streamed(split: int) -> None:
    guard, app = guarded()
    body = json.dumps({"x": "y" * 5000}).encode()
    chunks = [body[i::split] for i in range(split)] if split > 1 else [body]
    assert_openai_error(*call(guard, chunks, AUTH), 413, "more than")
    assert_openai_error(*call(guard, b"{}", {**AUTH, "Content-Length": "999999999"}), 413, "more than")
    assert_openai_error(*call(guard, b"{}", {**AUTH, "Content-Length": "-5"}), 400, "Content-Length")
    assert not app.seen


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_count_their_decompressed_size(encoding: str) -> None:
    guard, app = guarded()
    pack = gzip.compress if encoding == "gzip" else zlib.compress
    assert call(guard, pack(b'{"a": [1, 2]}'), {**AUTH, "Content-Encoding": encoding}) == (200, {"a": [1, 2]})
    bomb = pack(b'{"x": "' + b"0" * 3_000_000 + b'"}')
    assert len(bomb) < 4096  # small on the wire
    assert_openai_error(*call(guard, bomb, {**AUTH, "Content-Encoding": encoding}), 413, "decompressed")
    assert_openai_error(*call(guard, b"not compressed", {**AUTH, "Content-Encoding": encoding}), 400, encoding)
    assert_openai_error(*call(guard, pack(b'{"a": 1}')[:-6], {**AUTH, "Content-Encoding": encoding}), 400, encoding)
    assert len(app.seen) == 1


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip"])
def test_other_encodings_get_415(encoding: str) -> None:
    guard, _ = guarded()
    assert_openai_error(*call(guard, b"{}", {**AUTH, "Content-Encoding": encoding}), 415, "Content-Encoding")


@pytest.mark.parametrize("body", [{"images": ["a"] * 9}, {"messages": [{"content": [0] * 50}]}, [[1]] * 20])
def test_long_lists_anywhere_get_413(body: object) -> None:
    guard, app = guarded(max_body_bytes=1 << 20)
    assert_openai_error(*call(guard, json.dumps(body).encode(), AUTH), 413, "items")
    assert not app.seen


def test_longest_list_names_its_place() -> None:
    assert longest_list({"a": [1, 2], "b": {"c": [1, 2, 3]}}) == (3, "b.c")


def test_lone_surrogate_escapes_reach_the_app_as_well_formed_text() -> None:
    guard, app = guarded()
    assert call(guard, b'{"q": "a\\ud800b"}', AUTH)[0] == 200
    app.seen[0][1].decode("utf-8")


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_list_items"):
        RequestLimits(max_list_items=0)
    assert error_body(404, "x")["error"]["type"] == "not_found_error"


# ------------------------------------------------------------------------------------------------ the real server
def request(url: str, body: bytes | None, headers: dict[str, str], timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            raw = reply.read()
            return reply.status, json.loads(raw) if raw.startswith((b"{", b"[")) else {"text": raw.decode()}
    except urllib.error.HTTPError as err:
        raw = err.read()
        return err.code, json.loads(raw) if raw else {}


@pytest.fixture(scope="module")
def server(clip_export: Path, tmp_path_factory: pytest.TempPathFactory):
    """The CLIP export served with an API key (from a key file, off the command line) and small limits."""
    key_file = tmp_path_factory.mktemp("key") / "api.key"
    key_file.write_text(KEY + "\n")
    args = [str(clip_export), "--max-list-items", "16", "--max-body-bytes", "65536", "--max-image-pixels", "250000",
            "--max-request-pixels", "300000", "--output-dir", str(tmp_path_factory.mktemp("served")),
            "--api-key-file", str(key_file), "--image-root", str(tmp_path_factory.getbasetemp())]
    with serving(args) as (base, process):
        assert KEY not in " ".join(process.args)  # nothing in the process list gives the key away
        yield base, process


def test_the_api_key_comes_from_a_file_the_environment_or_the_option(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from clova_train.cli import served_api_key
    from clova_train.core.errors import ClovaTrainError

    key_file = tmp_path / "api.key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("CLOVA_TRAIN_API_KEY", "from-env")
    assert served_api_key(None, str(key_file)) == "from-file"
    assert served_api_key(None, None) == "from-env"
    assert served_api_key("given", None) == "given"
    monkeypatch.delenv("CLOVA_TRAIN_API_KEY")
    assert served_api_key(None, None) is None
    for text, problem in (("", "one line"), ("a\nb\n", "one line"), ("a\x07b", "one line")):
        key_file.write_text(text)
        with pytest.raises(ClovaTrainError, match=problem):
            served_api_key(None, str(key_file))
    with pytest.raises(ClovaTrainError, match="API key file not found"):
        served_api_key(None, str(tmp_path / "missing"))
    with pytest.raises(ClovaTrainError, match="not both"):
        served_api_key("given", str(key_file))


def classify(base: str, images: list[str], headers: dict[str, str] | None = None) -> tuple[int, dict]:
    body = json.dumps({"images": images, "labels": ["red", "purple"]}).encode()
    return request(base + "/v1/clip", body, AUTH if headers is None else headers)


@pytest.fixture(scope="module")
def hostile_images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from PIL import Image

    root = tmp_path_factory.mktemp("hostile-images")
    os.mkfifo(root / "fifo.png")
    (root / "folder.png").mkdir()
    (root / "text.png").write_text("not an image")
    Image.new("L", (600, 600)).save(root / "huge.png")  # 360,000 pixels > the server's 250,000
    (root / "link-to-fifo.png").symlink_to(root / "fifo.png")
    (root / "dangling.png").symlink_to(root / "nowhere.png")
    return {"fifo": str(root / "fifo.png"), "directory": str(root / "folder.png"),
            "missing": str(root / "missing.png"), "not an image": str(root / "text.png"),
            "over the pixel limit": str(root / "huge.png"), "symlink to a FIFO": str(root / "link-to-fifo.png"),
            "dangling symlink": str(root / "dangling.png")}


def test_every_unusable_image_gets_the_same_400_without_blocking(server, hostile_images: dict[str, str]) -> None:
    base, process = server
    messages = {}
    for kind, path in hostile_images.items():
        started = time.monotonic()
        status, reply = classify(base, [path])
        assert status == 400 and time.monotonic() - started < 30, (kind, reply)
        messages[kind] = reply["error"]["message"].replace(repr(path), "<name>")
    assert len(set(messages.values())) == 1, messages  # a client learns nothing about which files exist
    outside = {}
    for path in ("/dev/zero", "/etc/hostname", "/no/such/file.png"):  # outside --image-root: refused from the name
        status, reply = classify(base, [path])
        assert status == 400, reply
        outside[path] = reply["error"]["message"]
    assert len(set(outside.values())) == 1 and "--image-root" in outside["/etc/hostname"], outside
    assert process.poll() is None


def test_the_server_answers_bad_requests_in_openai_shape(server, concept_root: Path) -> None:
    base, _ = server
    good = str(concept_root / "red" / "red_000.png")
    assert classify(base, [good])[0] == 200
    assert_openai_error(*classify(base, [good], {"Content-Type": "application/json"}), 401, "API key")
    assert_openai_error(*request(base + "/v1/clip", b"{oops", AUTH), 400, "not valid JSON")
    assert_openai_error(*request(base + "/v1/clip", b"", AUTH), 400, "empty")
    assert_openai_error(*request(base + "/v1/clip", gzip.compress(b" " * 10_000_000), {**AUTH, "Content-Encoding": "gzip"}),
                        413, "decompressed")
    assert_openai_error(*classify(base, [good] * 17), 413, "items")
    assert_openai_error(*request(base + "/v1/clip", json.dumps({"images": [good]}).encode(), AUTH), 400, "labels")
    status, reply = request(base + "/v1/clip", json.dumps({"images": [good], "labels": ["red"]}).encode(),
                            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and reply["labels"] == ["red"]  # curl -d's default content type
    assert request(base + "/health", None, {})[0] == 200


@pytest.mark.parametrize("image, words", [
    ("data:image/png;base64,@@@", "request field 'images'[0] is a data: URL whose base64 data is malformed"),
    ("data:text/plain;base64,aGk=", "request field 'images'[0] is a data: URL of 'text/plain', not an image"),
    ("data:image/png;base64", "request field 'images'[0] is not a valid data: URL"),
    ("data:image/png;base64,", "request field 'images'[0] is an empty data: URL"),
    ("data:image/png;base64,aGVsbG8=", "request field 'images'[0] is not a readable image of at most 250,000 pixels"),
])
def test_bad_data_url_images_get_400_naming_the_field(server, image: str, words: str) -> None:
    base, process = server
    assert_openai_error(*classify(base, [image]), 400, words)
    assert process.poll() is None


def test_images_over_the_request_pixel_budget_get_413_before_decoding(server, tmp_path: Path) -> None:
    """Two 1-bit 400 x 400 images: each under the per-image limit, together over the request's 300,000 pixels."""
    import base64
    import io

    from PIL import Image

    canvas = io.BytesIO()
    Image.new("1", (400, 400)).save(canvas, format="PNG")  # a few hundred bytes for 160,000 pixels
    url = "data:image/png;base64," + base64.b64encode(canvas.getvalue()).decode()
    base, process = server
    assert classify(base, [url])[0] == 200
    assert_openai_error(*classify(base, [url, url]), 413, "more than 300,000 pixels together")
    icon = io.BytesIO()
    Image.new("RGB", (16, 16)).save(icon, format="ICO")  # a format PIL reads, but not one a client may send
    ico = "data:image/x-icon;base64," + base64.b64encode(icon.getvalue()).decode()
    assert_openai_error(*classify(base, [ico]), 400, "request field 'images'[0] is not a readable image of at most "
                                                     "250,000 pixels in one of the formats accepted (PNG, JPEG")
    assert process.poll() is None


def test_an_upload_over_the_pixel_limit_is_refused_and_a_good_one_served(server, concept_root: Path) -> None:
    import io

    from PIL import Image

    base, _ = server
    huge = io.BytesIO()
    Image.new("L", (600, 600)).save(huge, format="PNG")
    body, headers = multipart([("images", "big.png", huge.getvalue()), ("labels", None, b'["red", "purple"]')])
    assert_openai_error(*request(base + "/v1/clip", body, headers), 400, "request field 'images'[0] is not a readable")
    good = (concept_root / "red" / "red_000.png").read_bytes()
    body, headers = multipart([("images", "red.png", good), ("labels", None, b'["red", "purple"]')])
    status, reply = request(base + "/v1/clip", body, headers)
    assert status == 200 and reply["labels"] == ["red"], reply


@pytest.mark.slow
def test_bounded_load_no_errors(server, concept_root: Path, hostile_images: dict[str, str]) -> None:
    """8 clients x 20 requests on 127.0.0.1, every fifth one hostile: each gets its expected status, none fails (the
    server under longer load is benchmarks/server_slow_clients.py's and serving_latency.py's)."""
    base, process = server
    good = [str(p) for p in sorted((concept_root / "red").glob("*.png"))[:2]]
    bad = [hostile_images["fifo"], hostile_images["missing"], hostile_images["dangling symlink"]]

    def client(number: int) -> list[tuple[int, int, float]]:
        results = []
        for k in range(20):
            hostile = (number + k) % 5 == 0
            started = time.perf_counter()
            status, _ = classify(base, [bad[k % len(bad)]] if hostile else good)
            results.append((400 if hostile else 200, status, time.perf_counter() - started))
        return results

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(client, range(8)) for r in rs]
    wrong = [(expected, got) for expected, got, _ in results if expected != got]
    latencies = sorted(seconds for _, _, seconds in results)
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\nload test: {len(results)} requests, 8 clients, p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    assert not wrong and len(results) == 160
    assert process.poll() is None


# ------------------------------------------------------------------------------------------------ output paths
def test_a_symlink_inside_the_output_dir_cannot_send_writes_outside(tmp_path: Path) -> None:
    from fastapi import HTTPException

    from clova_train.serving.http import served_output_path

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "escape").symlink_to(elsewhere)
    (out / "file.png").symlink_to(elsewhere / "x.png")
    (out / "inside").symlink_to(out)
    for name in ("escape/x.png", "escape/deeper/x.png", "file.png"):
        with pytest.raises(HTTPException) as caught:
            served_output_path(out, name)
        assert caught.value.status_code == 400 and "outside" in caught.value.detail
    assert served_output_path(out, "inside/x.png") == out.resolve() / "inside" / "x.png"


@pytest.mark.parametrize("name, words", [
    (".", "names the server's --output-dir itself"),
    ("sub", "is a folder on the server"),
    ("sub/", "is a folder on the server"),
    ("afile.png/x.png", "'afile.png' is a file, not a folder"),
    ("x" * 300 + ".png", "is too long"),
    ("a/" * 600 + "x.png", "is too long"),
])
def test_outputs_that_cannot_be_a_written_file_are_refused(tmp_path: Path, name: str, words: str) -> None:
    from fastapi import HTTPException

    from clova_train.serving.http import served_output_path

    (tmp_path / "sub").mkdir()
    (tmp_path / "afile.png").write_bytes(b"x")
    with pytest.raises(HTTPException) as caught:
        served_output_path(tmp_path, name)
    assert caught.value.status_code == 400 and caught.value.detail.startswith("'output'") and words in caught.value.detail
    assert served_output_path(tmp_path, "sub/new/x.png") == tmp_path.resolve() / "sub" / "new" / "x.png"


@pytest.mark.parametrize("name", [".", "x" * 300])
def test_the_server_answers_an_unwritable_output_with_400(server, concept_root: Path, name: str) -> None:
    base, process = server
    body = {"images": [str(concept_root / "red" / "red_000.png")], "labels": ["red"], "output": name}
    assert_openai_error(*request(base + "/v1/clip", json.dumps(body).encode(), AUTH), 400, "'output'")
    assert process.poll() is None
