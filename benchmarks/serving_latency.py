"""Serving latency and throughput of an export under concurrent clients: ``clova-train serve`` over HTTP against the
same model answered in-process, one request after another, in one run.

Methods (same export, device, request and number of requests):

* ``clova-train serve``: the HTTP server as a user starts it (``python -m clova_train serve EXPORT --port P``, its
  own process, LitServe worker, request guard, JSON over loopback), with 1, 8, ... concurrent clients, each sending
  its share of the requests one after another. Chat requests of concurrent clients are batched into one
  ``generate`` (``--max-batch-size``, set to the largest client count); prompt-tool requests are served one at a time.
* ``in-process``: the baseline with no server: the same loader the server uses (``PromptToolServer.from_export`` /
  ``ServedToolLLM.from_export``) answering the same request in a loop in one process. Its latency is the model's
  own; the server's p50 over it is what HTTP, the guard and the queue add at one client, and its requests/s is
  what a single caller without batching gets.

Chat exports are measured without and with streaming (``--modes non-stream stream``): a streamed request's latency
is until ``data: [DONE]``, and its time to the first content chunk is reported too. ``--server-commit REV`` runs the
server from an earlier commit's package (``benchmarks/past_commit.py``), so one run compares a "before" server with
this checkout's in-process loop, and a second run without it gives the "after".

Reported per method and client count: p50 and p99 latency (ms; the 99th percentile by linear interpolation over
the requests sent, so with fewer than 100 requests it sits near the slowest), requests per second (requests over
the wall time from the first send to the last answer) and failed requests (anything but a 200). Two warm-up requests
go first and are not counted. Appended to ``benchmarks/results/serving_latency.md`` with the machine.

    python benchmarks/serving_latency.py EXPORT --request '{"images": ["a.png"], "labels": ["red", "blue"]}'
    python benchmarks/serving_latency.py LLM_EXPORT --device cuda --max-tokens 16 --clients 1 8
    python benchmarks/serving_latency.py LLM_EXPORT --modes non-stream stream --server-commit <before>
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import machine, publish  # noqa: E402

CHAT_MESSAGE = "Describe the image image/a1b2c3.png and tell me what is in it."


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` by linear interpolation between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(latencies: list[float], wall: float, failed: int, tokens: list[int] | None = None,
            first: list[float] | None = None) -> dict:
    """p50/p99 in milliseconds, requests per second and the failure count of one measured round; with ``tokens``
    (each answered request's completion tokens) their mean and the generated tokens per second."""
    result = {"p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
              "requests_per_s": (len(latencies) + failed) / wall if wall > 0 else math.nan, "failed": failed,
              "requests": len(latencies) + failed}
    if tokens:
        result["tokens_per_request"] = sum(tokens) / len(tokens)
        result["tokens_per_s"] = sum(tokens) / wall if wall > 0 else math.nan
    if first:
        result["first_p50_ms"] = percentile(first, 50) * 1e3
    return result


def write_random_lora_export(base: Path, export: Path) -> None:
    """A LoRA export of ``base`` with seeded random adapter weights (r 16, alpha 16 on q/k/v/o, the paper's recipe),
    written through ``clova-train export`` from a run directory holding only the adapter: serving time does not depend
    on how the adapter was learned, and this costs no fit (the adapter is sized on the meta device: the base is never
    loaded)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from clova_train.cli import main as clova_train
    from clova_train.tooluse.prompt_template import TEMPLATE_FILE, PromptTemplate

    run = export.parent / f"{export.name}-run"
    adapter = run / "adapter"
    adapter.mkdir(parents=True, exist_ok=True)
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM", base_model_name_or_path=str(base.resolve()))
    with torch.device("meta"):
        shapes = get_peft_model_state_dict(get_peft_model(AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(str(base))), lora))
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(tensor.shape, generator=generator) * 0.01 for name, tensor in shapes.items()},
              str(adapter / "adapter_model.safetensors"))
    lora.save_pretrained(str(adapter))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(adapter))
    (adapter / TEMPLATE_FILE).write_text(json.dumps(PromptTemplate().to_dict()), encoding="utf-8")
    if clova_train(["export", str(run), "--output", str(export)]) != 0:
        raise SystemExit(f"serving_latency: clova-train export of {run} failed (above)")


def export_kind(export: Path) -> str:
    """The package's own reading of what an export is (``lora`` or ``prompt_tool``), its error as this script's."""
    from clova_train.core.errors import ExportError
    from clova_train.serving.http import export_kind as served_kind

    try:
        return served_kind(export)
    except ExportError as err:
        raise SystemExit(f"serving_latency: {err}") from None


def endpoint_and_body(export: Path, kind: str, request: dict | None, max_tokens: int) -> tuple[str, dict]:
    """The HTTP path and JSON body one request sends."""
    if kind == "lora":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT_MESSAGE}], "max_tokens": max_tokens}
    if request is None:
        raise SystemExit("serving_latency: a prompt-tool export needs --request (the JSON its endpoint takes)")
    from clova_train.tools.prompt_server import read_tool_description

    return f"/v1/{read_tool_description(export)['tool']}", request


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read_stream(response: http.client.HTTPResponse, start: float) -> tuple[float | None, int]:
    """Read a server-sent-events reply to ``data: [DONE]``: (seconds to the first content chunk, content chunks)."""
    first, chunks = None, 0
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        try:
            delta = json.loads(data)["choices"][0].get("delta", {})
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        if delta.get("content"):
            chunks += 1
            if first is None:
                first = time.perf_counter() - start
    return first, chunks


def post(port: int, path: str, body: bytes, timeout: float,
         stream: bool = False) -> tuple[int, float, int | None, float | None]:
    """One request on its own connection: (status, seconds, completion tokens when the reply counts them (streamed:
    its content chunks), seconds to the first content chunk when streamed)."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    first = None
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if stream and response.status == 200:
            first, chunks = read_stream(response, start)
            return 200, time.perf_counter() - start, chunks, first
        payload = response.read()
        seconds = time.perf_counter() - start
    except OSError:
        return 0, time.perf_counter() - start, None, None
    finally:
        connection.close()
    tokens = None
    if response.status == 200 and path.endswith("/chat/completions"):
        try:
            tokens = int(json.loads(payload)["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            tokens = None
    return response.status, seconds, tokens, first


def healthy(port: int) -> bool:
    """Whether the server on ``port`` answers ``GET /health`` with 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def wait_healthy(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"serving_latency: the server exited ({process.returncode}) before it answered /health")
        if healthy(port):
            return
        time.sleep(0.5)
    raise SystemExit(f"serving_latency: the server did not answer /health within {timeout:.0f} s")


def load_round(port: int, path: str, body: bytes, clients: int, requests: int, timeout: float,
               stream: bool = False) -> dict:
    """``requests`` requests from ``clients`` threads, each sending its share one after another."""
    latencies: list[float] = []
    tokens: list[int] = []
    firsts: list[float] = []
    failed = [0]
    lock = threading.Lock()
    shares = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]

    def client(share: int) -> None:
        for _ in range(share):
            status, seconds, generated, first = post(port, path, body, timeout, stream)
            with lock:
                if status == 200:
                    latencies.append(seconds)
                    if generated is not None:
                        tokens.append(generated)
                    if first is not None:
                        firsts.append(first)
                else:
                    failed[0] += 1

    threads = [threading.Thread(target=client, args=(share,)) for share in shares if share]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summary(latencies, time.perf_counter() - start, failed[0], tokens, firsts)


def image_root_for(body: dict) -> str:
    """The folder ``serve --image-root`` must confine the request's server paths to: the common folder of the images
    it names (a relative name is read from the working directory, which is then the root)."""
    names = [value for key in ("image", "images", "mask") for value in
             (body.get(key) if isinstance(body.get(key), list) else [body.get(key)])
             if isinstance(value, str) and not value.startswith("data:")]
    if not names or not all(os.path.isabs(name) for name in names):
        return os.getcwd()
    return os.path.commonpath([os.path.dirname(name) for name in names])


def measure_server(args: argparse.Namespace, path: str, body: dict) -> tuple[dict[tuple[str, int], dict], float]:
    """Start ``clova-train serve`` in its own process group, load it at each client count, stop it (the whole group,
    worker included). Returns the rounds and the seconds from start to a healthy server."""
    port = free_port()
    command = [sys.executable, "-m", "clova_train", "serve", str(args.export), "--port", str(port), "--device",
               args.device, "--max-batch-size", str(max(args.clients))]
    if not path.endswith("/chat/completions") and not args.server_commit:  # servers before --image-root read any path
        command += ["--image-root", args.image_root or image_root_for(body)]
    log = (args.log_dir / "server.log").open("w") if args.log_dir else subprocess.DEVNULL
    env = dict(os.environ)
    if args.server_commit:
        import tempfile

        from past_commit import package_at

        layout = package_at(args.server_commit, Path(tempfile.mkdtemp(prefix="serving-latency-")))
        env["PYTHONPATH"] = os.pathsep.join([str(layout), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    started = time.perf_counter()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_healthy(port, server, args.start_timeout)
        ready = time.perf_counter() - started
        modes = args.modes if path.endswith("/chat/completions") else ["non-stream"]
        rounds = {}
        for mode in modes:
            payload = json.dumps({**body, "stream": True} if mode == "stream" else body).encode()
            for _ in range(2):
                status = post(port, path, payload, args.request_timeout, mode == "stream")[0]
                if status != 200:
                    raise SystemExit(f"serving_latency: the warm-up request got HTTP {status} (server log: "
                                     f"{args.log_dir / 'server.log' if args.log_dir else 'not kept; pass --log-dir'})")
            for c in args.clients:
                rounds[mode, c] = load_round(port, path, payload, c, args.requests, args.request_timeout,
                                             mode == "stream")
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait()
    return rounds, ready


def measure_in_process(args: argparse.Namespace, kind: str, body: dict) -> dict:
    """The same export loaded by the server's own loader, answering the request in a loop (no HTTP)."""
    if kind == "lora":
        from clova_train.tooluse.served_llm import ChatRequest, ServedToolLLM

        served = ServedToolLLM.from_export(args.export, device=args.device)
        request = ChatRequest(messages=body["messages"], max_tokens=body["max_tokens"])

        def answer() -> int | None:
            return served.chat_batch([request])[0].completion_tokens
    else:
        from clova_train.tools.prompt_server import PromptToolServer

        server = PromptToolServer.from_export(args.export, device=args.device)

        def answer() -> int | None:
            server.serve(dict(body))
            return None

    for _ in range(2):
        answer()
    latencies, tokens = [], []
    start = time.perf_counter()
    for _ in range(args.baseline_requests):
        began = time.perf_counter()
        generated = answer()
        if args.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        latencies.append(time.perf_counter() - began)
        if generated is not None:
            tokens.append(generated)
    return summary(latencies, time.perf_counter() - start, 0, tokens)


def row(method: str, clients: int, result: dict, chat: bool) -> str:
    first = f" {result['first_p50_ms']:,.1f} |" if "first_p50_ms" in result else " - |"
    tokens = (f" {result['tokens_per_request']:.1f} | {result['tokens_per_s']:,.1f} |{first}"
              if "tokens_per_s" in result else " - | - |" + first) if chat else ""
    return (f"| {method} | {clients} | {result['requests']} | {result['p50_ms']:,.1f} | {result['p99_ms']:,.1f} | "
            f"{result['requests_per_s']:,.2f} |{tokens} {result['failed']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="directory written by clova-train export")
    parser.add_argument("--request", default=None, help="prompt tools: the JSON request body (paths as the server sees them)")
    parser.add_argument("--device", default="cpu", help="torch device for the server and the baseline")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per client count (all clients together)")
    parser.add_argument("--baseline-requests", type=int, default=16, help="requests answered in-process")
    parser.add_argument("--max-tokens", type=int, default=16, help="chat: tokens generated per request")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds the server may take to start")
    parser.add_argument("--request-timeout", type=float, default=120, help="seconds one request may take")
    parser.add_argument("--random-lora-on", type=Path, default=None, metavar="BASE",
                        help="when EXPORT does not exist, first write there a LoRA export of random adapter weights on "
                             "this base model (a directory), through clova-train export")
    parser.add_argument("--image-root", default=None, metavar="DIR",
                        help="prompt tools: the server's --image-root (default: the common folder of the request's "
                             "images, or the working directory for relative names)")
    parser.add_argument("--modes", nargs="+", default=["non-stream"], choices=["non-stream", "stream"],
                        help="chat: measure without and/or with streaming (\"stream\": true, read to data: [DONE])")
    parser.add_argument("--server-commit", default=None, metavar="REV",
                        help="run the server from this earlier commit's package (a 'before' measurement)")
    parser.add_argument("--label", default=None, help="what the export is, for the table's heading (default: its path)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the server's log here")
    parser.add_argument("--no-record", action="store_true", help="print the table without appending it")
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.requests < 1 or args.baseline_requests < 1:
        parser.error("--clients, --requests and --baseline-requests must be at least 1")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    # a SIGTERM (gpu_check's time limit) unwinds like an error, so the server's process group is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("serving_latency: stopped (SIGTERM)"))
    made = args.random_lora_on is not None and not args.export.exists()
    if made:
        write_random_lora_export(args.random_lora_on, args.export)
    kind = export_kind(args.export)
    path, body = endpoint_and_body(args.export, kind, json.loads(args.request) if args.request else None,
                                   args.max_tokens)
    rounds, ready = measure_server(args, path, body)
    baseline = measure_in_process(args, kind, body)
    chat = kind == "lora"
    server = "clova-train serve (HTTP" + (f", {args.server_commit}" if args.server_commit else "")
    rows = [row(server + (", stream)" if mode == "stream" else ")"), clients, result, chat)
            for (mode, clients), result in rounds.items()]
    rows.append(row("in-process loop (baseline, no server)", 1, baseline, chat))
    what = (f"{args.label or args.export}: {kind.replace('_', ' ')} export"
            + (" (random adapter weights, no fit: --random-lora-on)" if made else "") + f", POST {path}"
            + (f", {args.max_tokens} new tokens per request (max_tokens; generation may stop sooner at a stop string "
               f"or EOS), server --max-batch-size {max(args.clients)}" if kind == "lora" else
               f", request {json.dumps(body)}") +
            f". The server took {ready:.1f} s from start to a healthy /health. p99 is interpolated over the requests "
            "sent (near the slowest when fewer than 100).")
    publish("serving_latency", "Serving latency benchmark results", f"{args.device}: {machine()}", what,
            ["method", "clients", "requests", "p50 ms", "p99 ms", "requests/s",
             *(["completion tokens / request", "generated tokens/s", "first token p50 ms"] if chat else []), "failed"],
            rows,
            record=not args.no_record)
    return 1 if any(r["failed"] for r in rounds.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
