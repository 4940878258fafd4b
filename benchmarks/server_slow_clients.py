"""Good clients' latency while many slow clients hold connections open: ``clova-train serve`` with N connections
that each sent part of a request's headers and then nothing (slowloris), against the same server with none.

Method: the server is started as a user starts it (``python -m clova_train serve EXPORT --port P``, its own process
group) with its open-file soft limit set to ``--fd-limit`` (1024, the usual default; the hard limit is left as it
is, or set to the same with ``--fd-hard-limit-too``, so the server cannot raise it). For each slow-connection count N, N sockets connect and send ``POST /v1/<tool> HTTP/1.1`` and one header line,
then hold; ``--clients`` good clients then send ``--requests`` complete requests between them (one CLIP/tool request
with its image as a ``data:`` URL, so no server file is named), each on a new connection, with a
``--request-timeout`` per request. Reported per N: p50 and p99 latency of the good requests (ms; 99th percentile by
linear interpolation), how many failed (no 200 within the timeout, refused or reset) and how many of the N slow
connections the server had closed by the end. ``--server-commit REV`` runs the server from an earlier commit's
package (``benchmarks/past_commit.py``) for the "before". Appended to ``benchmarks/results/server_slow_clients.md``
with the machine.

    python benchmarks/server_slow_clients.py checkpoints/quickstart_clip/export --slow 0 1000 1100
    python benchmarks/server_slow_clients.py EXPORT --server-commit <before> --slow 0 1000
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import machine, publish  # noqa: E402
from serving_latency import free_port, percentile, wait_healthy  # noqa: E402


def tiny_png() -> str:
    """A 32x32 red PNG as a ``data:`` URL."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (220, 20, 20)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def open_slow(port: int, count: int, path: str) -> list[socket.socket]:
    """``count`` connections that each sent a request line and one header line, and will send nothing more."""
    opened = []
    for _ in range(count):
        sock = socket.socket()
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
        except OSError:
            sock.close()
            continue
        opened.append(sock)
    return opened


def still_open(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the server has not closed (a closed one reads as end of file or a reset)."""
    alive = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            alive += sock.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
    return alive


def good_round(port: int, path: str, body: bytes, clients: int, requests: int, timeout: float) -> tuple[list[float], int]:
    """Latencies (s) of the requests answered 200 and the count of the others."""
    latencies: list[float] = []
    failed = [0]
    lock = threading.Lock()

    def client(share: int) -> None:
        for _ in range(share):
            started = time.perf_counter()
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
                connection.request("POST", path, body, {"Content-Type": "application/json"})
                status = connection.getresponse().status
                connection.close()
            except OSError:
                status = None
            with lock:
                if status == 200:
                    latencies.append(time.perf_counter() - started)
                else:
                    failed[0] += 1

    threads = [threading.Thread(target=client, args=(requests // clients + (i < requests % clients),))
               for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, failed[0]


def limited_files(limit: int, hard_too: bool):  # noqa: ANN201 (a preexec function)
    def apply() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        soft = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, soft if hard_too else hard))
    return apply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="a prompt-tool export (CLIP: checkpoints/quickstart_clip/export)")
    parser.add_argument("--slow", type=int, nargs="+", default=[0, 1000], help="slow-connection counts")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--request-timeout", type=float, default=10.0)
    parser.add_argument("--fd-limit", type=int, default=1024, help="the server's open-file soft limit")
    parser.add_argument("--fd-hard-limit-too", action="store_true",
                        help="set the hard open-file limit to --fd-limit as well (the server cannot raise it)")
    parser.add_argument("--server-commit", default=None, help="run the server of this commit (the 'before')")
    parser.add_argument("--label", default=None, help="what the table calls this server (default: the commit)")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--record", action="store_true", help="append the table to the results file")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the slow sockets
    tool = json.loads((args.export / "tool.json").read_text()).get("tool", "clip")
    path = f"/v1/{tool}"
    body = json.dumps({"images": [tiny_png()], "labels": ["red", "blue"]}).encode()
    port = free_port()
    env = dict(os.environ)
    if args.server_commit:
        from past_commit import package_at

        layout = package_at(args.server_commit, Path(tempfile.mkdtemp(prefix="server-slow-clients-")))
        env["PYTHONPATH"] = os.pathsep.join([str(layout), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    label = args.label or (f"before ({args.server_commit})" if args.server_commit else "this checkout")
    server = subprocess.Popen([sys.executable, "-m", "clova_train", "serve", str(args.export), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                              preexec_fn=limited_files(args.fd_limit, args.fd_hard_limit_too))
    rows = []
    try:
        wait_healthy(port, server, args.start_timeout)
        good_round(port, path, body, 1, 2, args.request_timeout)  # warm-up
        for count in args.slow:
            slow = open_slow(port, count, path)
            time.sleep(1.0)
            latencies, failed = good_round(port, path, body, args.clients, args.requests, args.request_timeout)
            alive = still_open(slow)
            for sock in slow:
                sock.close()
            p50, p99 = (percentile(latencies, q) * 1000 for q in (50, 99))
            rows.append(f"| {label} | {count} ({len(slow)} connected) | {p50:.1f} | {p99:.1f} | {failed} / "
                        f"{args.requests} | {alive} |")
            time.sleep(1.0)
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    limit = f"soft and hard limit {args.fd_limit}" if args.fd_hard_limit_too else f"soft limit {args.fd_limit}"
    what = (f"`{args.export}` served on 127.0.0.1, server open-file {limit}; N slow connections "
            f"each sent a request line and one header, then nothing; {args.clients} good clients sent "
            f"{args.requests} CLIP requests (image as a data: URL), {args.request_timeout:g} s timeout each.")
    publish("server_slow_clients", "Good clients' latency while slow clients hold connections",
            f"cpu: {machine()}", what, ["server", "slow connections", "p50 ms", "p99 ms", "failed", "slow still open"],
            rows, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
