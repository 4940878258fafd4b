"""What crosses between the sandbox worker and the training process: length-prefixed JSON, never pickle.

Every message is one JSON object behind a 4-byte big-endian length. The reader refuses a length over its limit
before reading the body, so a message can never make the reader allocate more than the limit, and a body that
is not well-formed JSON (or nests too deeply for the decoder) is a :class:`WireError`, never a crash.

Values (kept variables, tool results) are encoded by :func:`encode_value` under a :class:`Budget` that counts
elements and characters as it walks, so an amplified value (``['a' * 10**6] * 1000``: small in the worker's
memory, 1 GB once written out) is refused after the first element instead of being expanded. JSON has no
tuples, sets, non-string keys or image patches, so those are tagged objects; a plain JSON object never
appears in an encoded value, which keeps the tags unambiguous.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("!I")
MAX_DEPTH = 8
MAX_INT_DIGITS = 100


class WireError(Exception):
    """A message or value that breaks the protocol: too large, malformed, or of a type that may not cross."""


@dataclass(frozen=True)
class PatchRef:
    """An image patch as data: its image and its box (pixels, y from the bottom). What the tools receive."""

    image_id: str
    left: int
    lower: int
    right: int
    upper: int

    def __repr__(self) -> str:  # how the reasoner and the memory bank show it: the ImagePatch API's view
        return f"ImagePatch({self.left}, {self.lower}, {self.right}, {self.upper})"

    def box(self) -> list[Any]:
        return [self.image_id, self.left, self.lower, self.right, self.upper]

    @classmethod
    def from_box(cls, box: Any) -> PatchRef:
        if (not isinstance(box, list) or len(box) != 5 or not isinstance(box[0], str) or len(box[0]) > 256
                or not all(type(v) is int and abs(v) < 2**31 for v in box[1:])):
            raise WireError("malformed image patch")
        return cls(*box)


class Budget:
    """How many characters and elements an encoded value may still take."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < 0:
            raise WireError("value is larger than the sandbox's output limit")


def encode_value(value: Any, budget: Budget, patch_box: Callable[[Any], list | None] = lambda v: None,
                 depth: int = 0) -> Any:
    """A JSON-able form of plain data (and image patches, via ``patch_box``), or :class:`WireError`."""
    if depth > MAX_DEPTH:
        raise WireError("value nests too deeply")
    budget.spend(1)
    kind = type(value)  # exact types: a subclass could carry behaviour across
    if value is None or kind is bool:
        return value
    if kind is int:
        if abs(value) >= 10**MAX_INT_DIGITS:
            raise WireError(f"integer with more than {MAX_INT_DIGITS} digits")
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$f": repr(value)}
    if kind is str:
        budget.spend(len(value))
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise WireError("text with a lone surrogate (not valid Unicode text)") from None
        return value
    if kind is list:
        return [encode_value(v, budget, patch_box, depth + 1) for v in value]
    if kind is tuple:
        return {"$t": [encode_value(v, budget, patch_box, depth + 1) for v in value]}
    if kind in (set, frozenset):
        return {"$s": [encode_value(v, budget, patch_box, depth + 1) for v in value]}
    if kind is dict:
        return {"$d": [[encode_value(k, budget, patch_box, depth + 1), encode_value(v, budget, patch_box, depth + 1)]
                       for k, v in value.items()]}
    if kind is PatchRef:
        return {"$p": value.box()}
    box = patch_box(value)
    if box is not None:
        return {"$p": box}
    raise WireError(f"a value of type {kind.__name__} cannot leave the sandbox")


def decode_value(value: Any, make_patch: Callable[[list], Any] = PatchRef.from_box, depth: int = 0) -> Any:
    """The inverse of :func:`encode_value`; anything that :func:`encode_value` cannot produce is a WireError."""
    if depth > MAX_DEPTH:
        raise WireError("value nests too deeply")
    kind = type(value)
    if value is None or kind in (bool, str, float):
        return value
    if kind is int:
        if abs(value) >= 10**MAX_INT_DIGITS:
            raise WireError("integer too large")
        return value
    if kind is list:
        return [decode_value(v, make_patch, depth + 1) for v in value]
    if kind is dict and len(value) == 1:
        (tag, body), = value.items()
        if tag == "$f" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$p":
            return make_patch(body)
        if type(body) is list:
            items = [decode_value(v, make_patch, depth + 1) for v in body]
            if tag == "$t":
                return tuple(items)
            try:
                if tag == "$s":
                    return set(items)
                if tag == "$d" and all(type(pair) is list and len(pair) == 2 for pair in items):
                    return dict(items)
            except TypeError as err:  # an unhashable key or member
                raise WireError(f"malformed value: {err}") from None
    raise WireError(f"malformed value of type {kind.__name__}")


def pack(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii")
    return HEADER.pack(len(body)) + body


def parse(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode("ascii"))
    except (ValueError, RecursionError, MemoryError) as err:
        raise WireError(f"malformed message ({type(err).__name__})") from None
    if type(message) is not dict or type(message.get("op")) is not str:
        raise WireError("malformed message: not an object with an 'op'")
    return message


class Channel:
    """Messages over a connected socket: one buffered reader (usually one ``recv`` per message), size-checked.

    Args:
        sock: the connected socket.
        limit: largest message body accepted, in bytes; a larger length header is refused before its body is read.
    """

    CHUNK = 1 << 16

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self.sock, self.limit, self.buffer = sock, limit, bytearray()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(pack(message))

    def receive(self, deadline: float | None = None) -> dict[str, Any]:
        """One message; TimeoutError past ``deadline`` (monotonic), EOFError if the peer is gone, else WireError."""
        while True:
            if len(self.buffer) >= HEADER.size:
                (size,) = HEADER.unpack_from(self.buffer)
                if size > self.limit:
                    raise WireError(f"message of {size} bytes is over the limit of {self.limit}")
                end = HEADER.size + size
                if len(self.buffer) >= end:
                    body = bytes(self.buffer[HEADER.size:end])
                    del self.buffer[:end]
                    return parse(body)
            self._fill(deadline)

    def pending(self) -> bool:
        """Whether anything has arrived that no :meth:`receive` has taken yet."""
        return bool(self.buffer) or bool(select.select([self.sock], [], [], 0)[0])

    def _fill(self, deadline: float | None) -> None:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.sock.settimeout(remaining)
        chunk = self.sock.recv(self.CHUNK)
        if not chunk:
            raise EOFError("the peer closed the connection")
        self.buffer += chunk

    def close(self) -> None:
        self.sock.close()
