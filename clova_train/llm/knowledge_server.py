"""Serve a local JSON knowledge file over the web-search protocol of :mod:`clova_train.llm.search`, offline.

The knowledge file is ``{"image_search": {query: answer, ...}, "text_search": {query: answer, ...}}``;
``GET /image_search?q=<query>`` replies ``{"results": [answer]}``, or ``{"results": []}`` for an unknown query.
Queries are matched lower-cased with whitespace collapsed. The server listens on 127.0.0.1 only (the standard
library's ``http.server``, one thread per request).

Point an AVIS config at it::

    python -m clova_train.llm.knowledge_server knowledge.json --port 8765
    # env.web.image_search_url: http://127.0.0.1:8765/image_search
    # env.web.text_search_url:  http://127.0.0.1:8765/text_search

(the offline world's own knowledge base is written by
:func:`clova_train.envs.avis.world.write_knowledge_file`). Keep the port fixed between a recorded and a replayed
run: the URLs are part of every cached search's key.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from clova_train.core.errors import DataError
from clova_train.core.safe_files import CONFIG_LIMITS, printable, read_json_object
from clova_train.llm.search import SEARCH_KINDS

MAX_QUERY_BYTES = 8192


def normalise_query(query: str) -> str:
    """How the server matches queries: lower-cased, whitespace collapsed."""
    return " ".join(str(query).lower().split())


def check_knowledge(knowledge: Any, where: str = "knowledge") -> dict[str, dict[str, str]]:
    """``knowledge`` as ``{kind: {normalised query: answer}}``; anything else is a :class:`DataError` naming
    ``where``."""
    if not isinstance(knowledge, dict):
        raise DataError(f"{where} must be a JSON object {{\"image_search\": {{...}}, \"text_search\": {{...}}}}")
    unknown = sorted(set(knowledge) - set(SEARCH_KINDS))
    if unknown:
        raise DataError(f"{where}: unknown section {unknown[0]!r} (sections: {', '.join(SEARCH_KINDS)})")
    table: dict[str, dict[str, str]] = {}
    for kind in SEARCH_KINDS:
        section = knowledge.get(kind, {})
        if not isinstance(section, dict) or not all(isinstance(v, str) for v in section.values()):
            raise DataError(f"{where}.{kind} must map each query to its answer (text)")
        table[kind] = {normalise_query(q): a for q, a in section.items()}
    return table


def load_knowledge(path: str | Path) -> dict[str, dict[str, str]]:
    """The knowledge file ``path``, checked (see :func:`check_knowledge`)."""
    return check_knowledge(read_json_object(path, "knowledge file", CONFIG_LIMITS), f"knowledge file {printable(path)}")


class KnowledgeServer:
    """A thread serving ``knowledge`` on ``127.0.0.1:port`` (0: an ephemeral port); a context manager.

    Attributes:
        requests: searches answered (every GET, known or not).
    """

    def __init__(self, knowledge: dict[str, Any], port: int = 0, host: str = "127.0.0.1") -> None:
        self.knowledge = check_knowledge(knowledge)
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner.requests += 1
                parts = urlsplit(self.path)
                kind = parts.path.strip("/")
                if kind not in owner.knowledge or len(parts.query) > MAX_QUERY_BYTES:
                    self._reply(404, {"error": f"unknown search {kind[:40]!r} (use /{' or /'.join(SEARCH_KINDS)})"})
                    return
                query = parse_qs(parts.query).get("q", [""])[0]
                answer = owner.knowledge[kind].get(normalise_query(query))
                self._reply(200, {"results": [answer] if answer is not None else []})

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (quiet)
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.host, self.port = host, int(self.server.server_address[1])
        self._thread: threading.Thread | None = None

    def url(self, kind: str) -> str:
        """The endpoint of ``kind`` (``image_search`` or ``text_search``)."""
        return f"http://{self.host}:{self.port}/{kind}"

    def start(self) -> KnowledgeServer:
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="knowledge-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port."""
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join()
            self._thread = None
        self.server.server_close()

    def __enter__(self) -> KnowledgeServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m clova_train.llm.knowledge_server FILE [--port N]``: serve FILE until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("knowledge", help="JSON knowledge file")
    parser.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0: any free one)")
    args = parser.parse_args(argv)
    server = KnowledgeServer(load_knowledge(args.knowledge), args.port)
    print(f"serving {args.knowledge}: {server.url('image_search')} and {server.url('text_search')}", flush=True)
    try:
        server.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server.server_close()


if __name__ == "__main__":
    main()
