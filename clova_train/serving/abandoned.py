"""Requests whose client went away, told by the HTTP process to the worker generating them.

LitServe's worker loop keeps generating a request after its client disconnected (it knows nothing of the
connection), which holds the worker, and every request queued behind it, until the reply is complete. The HTTP side
marks such a request here (an empty file named by a random token the request carries) and the worker's stopping
criteria look for the mark after every decoding step, so an abandoned request stops within one step. Marks live in
the server's own temporary directory, removed with it.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

_TOKEN = re.compile(r"[0-9a-f]{32}")


class AbandonedRequests:
    """Marks shared by the HTTP process and the workers of one server (see the module docstring).

    Args:
        directory: where the marks are written (created if missing; the server's temporary directory).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def new_token() -> str:
        """A token for one request, unguessable by other clients."""
        return secrets.token_hex(16)

    def mark(self, token: str) -> None:
        """Record that ``token``'s client went away."""
        if _TOKEN.fullmatch(token):
            (self.directory / token).touch()

    def is_abandoned(self, token: str) -> bool:
        """Whether ``token``'s client went away (the mark is consumed: ask once per request, then remember)."""
        path = self.directory / token
        if not _TOKEN.fullmatch(token) or not path.exists():
            return False
        path.unlink(missing_ok=True)
        return True
