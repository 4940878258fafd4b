"""One reader for the JSON, JSONL and YAML files (and texts) that this package takes from other people.

Every configuration, data file, journal, graph, export description and HTTP request body goes through here, so
that each has the same guarantees:

* only regular files are opened (a FIFO, device or directory is refused at once instead of blocking the reader),
  and a file larger than ``max_bytes`` is refused before it is read;
* text must be UTF-8: anything else is named with the file, the byte offset and the line;
* nesting deeper than ``max_depth`` is refused (Python's parsers would raise ``RecursionError``, or run out of
  stack first);
* a key written twice in one object or mapping is refused (JSON and YAML readers silently keep the last one);
* YAML is read with the safe loader only (no tags that build Python objects), and anchors/aliases may not expand
  to more than ``max_nodes`` nodes (the "billion laughs" document is a few hundred bytes).

Every failure is one :class:`~clova_train.core.errors.DataError` naming the file (or ``where`` a text came from).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

from clova_train.core.errors import DataError


@dataclass(frozen=True)
class ReadLimits:
    """Bounds a reader enforces before a value reaches the code that uses it.

    Args:
        max_bytes: largest file or text accepted (bytes, before decoding).
        max_depth: deepest nesting of lists and objects accepted (a flat record has depth 1).
        max_nodes: YAML only: most nodes the document may expand to once aliases are resolved.
        max_values: most values (lists, objects, keys and scalars) the parsed document may hold, JSON and YAML alike
            (None: not counted; a small file kind sets it so that its reader's work stays small).
        max_text: longest string (a key or a value, in characters) accepted (None: any).
        finite_only: numbers must be finite and integers within the 64-bit range (no ``NaN``, ``Infinity``,
            ``.inf`` or 5,000-digit integers).
    """

    max_bytes: int = 1 << 30
    max_depth: int = 100
    max_nodes: int = 1_000_000
    max_values: int | None = None
    max_text: int | None = None
    finite_only: bool = False

    @property
    def checks_values(self) -> bool:
        """Whether a parsed document is walked value by value (count, string length, finite numbers)."""
        return self.max_values is not None or self.max_text is not None or self.finite_only


DEFAULT_LIMITS = ReadLimits()
CONFIG_LIMITS = ReadLimits(max_bytes=64 << 20, max_depth=100, max_nodes=200_000)


def printable(path: str | os.PathLike[str]) -> str:
    """``path`` printable in any terminal: bytes of a file name that are not UTF-8 are shown escaped."""
    return os.fspath(path).encode("utf-8", "backslashreplace").decode("utf-8")


@contextmanager
def open_regular(path: str | os.PathLike[str], what: str = "file") -> Iterator[BinaryIO]:
    """``path`` opened for binary reading if it is a regular file (a symlink to one too).

    A FIFO, device, socket or directory is refused with a :class:`DataError` without blocking (opening a FIFO for
    reading waits for a writer). A missing file is a ``FileNotFoundError`` (callers word that themselves)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataError(f"{what} {printable(path)} is not a regular file")
        os.set_blocking(fd, True)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


@contextmanager
def reading(path: str | os.PathLike[str], what: str = "file") -> Iterator[BinaryIO]:
    """:func:`open_regular`, with every failure to open or read it inside the block one :class:`DataError` naming
    the file."""
    try:
        with open_regular(path, what) as handle:
            yield handle
    except FileNotFoundError as err:
        raise DataError(f"{what} not found: {printable(path)}") from err
    except IsADirectoryError as err:
        raise DataError(f"{what} {printable(path)} is not a regular file") from err
    except OSError as err:
        raise DataError(f"cannot read {what} {printable(path)}: {err.strerror or err}") from err


def read_bytes(path: str | os.PathLike[str], what: str = "file", max_bytes: int = DEFAULT_LIMITS.max_bytes) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them, or a :class:`DataError`."""
    with reading(path, what) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise DataError(f"{what} {printable(path)} is {size:,} bytes, more than the {max_bytes:,} accepted")
        # read what the file holds, not the limit: read(n) reserves n bytes before it reads any
        want = min(size, max_bytes) + 1
        data = handle.read(want)
        if len(data) == want:  # longer than fstat said: it grew, or reports no size (as /proc's files do)
            parts, total = [data], len(data)
            while total <= max_bytes and (chunk := handle.read(min(1 << 20, max_bytes + 1 - total))):
                parts.append(chunk)
                total += len(chunk)
            data = b"".join(parts)
    if len(data) > max_bytes:  # grew while being read
        raise DataError(f"{what} {printable(path)} is more than the {max_bytes:,} bytes accepted")
    return data


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as text, or a :class:`DataError` naming ``where``, the byte offset and line of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{where} is not UTF-8 (byte {err.start}, line {line}: {data[err.start:err.start + 1]!r}); "
            "re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from err


def read_text(path: str | os.PathLike[str], what: str = "file", max_bytes: int = DEFAULT_LIMITS.max_bytes) -> str:
    """The UTF-8 text of the regular file ``path`` (see :func:`read_bytes` and :func:`decode_utf8`)."""
    return decode_utf8(read_bytes(path, what, max_bytes), f"{what} {printable(path)}")


def nesting_depth(value: Any, limit: int) -> int:
    """Depth of nested lists/dicts in ``value`` (a scalar is 0), counted without recursion; stops past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest


def _check_depth(value: Any, where: str, limits: ReadLimits) -> Any:
    if limits.checks_values:
        return check_values(value, where, limits)
    if nesting_depth(value, limits.max_depth) > limits.max_depth:
        raise DataError(f"{where} is nested more than {limits.max_depth} levels deep")
    return value


def _path_text(path: tuple[Any, ...]) -> str:
    text = "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in path).lstrip(".")
    return text[:200] or "(the top level)"


def _integer_text(value: int) -> str:
    """A huge integer for a message: its first digits and how many (Python refuses ``str`` past 4,300 digits)."""
    try:
        text = str(value)
    except ValueError:
        return f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text.lstrip('-')):,} digits)"


def check_values(value: Any, where: str, limits: ReadLimits) -> Any:
    """``value`` (a parsed JSON/YAML document) if it keeps within ``limits``: nesting depth, ``max_values``,
    ``max_text`` and, with ``finite_only``, finite numbers; else one :class:`DataError` naming ``where`` and the
    place in the document (``instances[3].loss_curve[7]``). One walk without recursion, stopping at the first fault."""
    count, stack = 0, [(value, (), 0)]
    while stack:
        item, path, depth = stack.pop()
        count += 1
        # each child of a list or object counts at least once: a long one is refused before its children are stacked
        if limits.max_values is not None and count + (len(item) if isinstance(item, (dict, list, tuple)) else 0) \
                > limits.max_values:
            raise DataError(f"{where} holds more than {limits.max_values:,} values")
        if isinstance(item, dict):
            if depth + 1 > limits.max_depth:
                raise DataError(f"{where} is nested more than {limits.max_depth} levels deep")
            for key, child in item.items():
                count += 1
                if limits.max_text is not None and isinstance(key, str) and len(key) > limits.max_text:
                    raise DataError(f"{where}: a key of {len(key):,} characters at {_path_text(path)} "
                                    f"(at most {limits.max_text:,})")
                stack.append((child, (*path, str(key)[:60]), depth + 1))
        elif isinstance(item, (list, tuple)):
            if depth + 1 > limits.max_depth:
                raise DataError(f"{where} is nested more than {limits.max_depth} levels deep")
            stack.extend((child, (*path, i), depth + 1) for i, child in enumerate(item))
        elif isinstance(item, str):
            if limits.max_text is not None and len(item) > limits.max_text:
                raise DataError(f"{where}: {_path_text(path)} is a text of {len(item):,} characters "
                                f"(at most {limits.max_text:,})")
        elif limits.finite_only and isinstance(item, float) and not math.isfinite(item):
            raise DataError(f"{where}: {_path_text(path)} = {item}: must be a finite number")
        elif limits.finite_only and isinstance(item, int) and not isinstance(item, bool) \
                and not -(2**63) <= item < 2**64:
            raise DataError(f"{where}: {_path_text(path)} = {_integer_text(item)}: must be an integer within the "
                            "64-bit range")
    return value


class _DuplicateKey(ValueError):
    pass


class JSONSyntaxError(DataError):
    """A text that is not JSON at all (as opposed to JSON that breaks a limit or repeats a key)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


class _NotFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text[:20])
    return value


def _no_constant(name: str) -> float:
    raise _NotFinite(name)


def _bounded_int(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:  # what a C integer (a seed, a size) can hold
        raise _NotFinite(text[:20] + ("..." if len(text) > 20 else ""))
    return value


def parse_json(text: str | bytes, where: str, limits: ReadLimits = DEFAULT_LIMITS, finite_only: bool = False) -> Any:
    """The JSON value of ``text`` (one document), checked against ``limits``; errors name ``where``.

    ``finite_only`` (request bodies): ``NaN``, ``Infinity``, numbers too large for a float and integers outside the
    64-bit range are refused, as strict JSON readers do (files this package wrote itself may hold ``NaN`` and are
    read without it)."""
    if len(text) > limits.max_bytes:
        raise DataError(f"{where} is {len(text):,} bytes, more than the {limits.max_bytes:,} accepted")
    if isinstance(text, bytes):
        text = decode_utf8(text, where)
    # ``limits.finite_only`` is checked after parsing, by the walk that names the place of a bad number
    strict = {"parse_constant": _no_constant, "parse_float": _finite_float, "parse_int": _bounded_int} \
        if finite_only else {}
    try:
        value = json.loads(text, object_pairs_hook=_unique_pairs, **strict)
    except _NotFinite as err:
        raise DataError(f"{where} holds the number {str(err)!r}, which is not finite or is out of the 64-bit range "
                        "(JSON has no NaN or Infinity)") from None
    except _DuplicateKey as err:
        raise DataError(f"{where} has the key {str(err)!r} twice in one object") from None
    except RecursionError:
        raise DataError(f"{where} is nested more than {limits.max_depth} levels deep") from None
    except json.JSONDecodeError as err:
        raise JSONSyntaxError(f"{where} is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise DataError(f"{where} holds a value that cannot be read: {err}") from None
    return _check_depth(value, where, limits)


def read_json(path: str | os.PathLike[str], what: str = "JSON file", limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """The JSON value of the file ``path`` (see :func:`parse_json`)."""
    return parse_json(read_text(path, what, limits.max_bytes), f"{what} {printable(path)}", limits)


def iter_json_object(path: str | os.PathLike[str], what: str = "JSON file",
                     limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of each entry of the JSON object in the file ``path``, read as a stream: a file of any size
    (GQA's 1.4 GB training questions) in the memory of one entry at a time; stopping early reads no further. Each value
    is checked against ``limits.max_depth``; a file that is not one JSON object, or breaks off, is a
    :class:`DataError` naming it and the entry after the last good one."""
    import ijson

    where = f"{what} {printable(path)}"
    last, seen = None, set()
    try:
        with reading(path, what) as handle:
            if handle.read(1 << 16).lstrip()[:1] != b"{":
                raise DataError(f"{where} must be a JSON object")
            handle.seek(0)
            for key, value in ijson.kvitems(handle, "", use_float=True):
                if key in seen:
                    raise DataError(f"{where} has the key {key!r} twice in one object")
                _check_depth(value, f"{where} entry {key!r}", limits)
                seen.add(key)
                last = key
                yield key, value
    except (ijson.JSONError, ijson.IncompleteJSONError, UnicodeDecodeError) as err:
        after = f" (after entry {last!r})" if last is not None else ""
        raise JSONSyntaxError(f"{where} is not valid JSON{after}: {err}") from None


def parse_json_lines(text: str, where: str, limits: ReadLimits = DEFAULT_LIMITS) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of a JSONL text; a bad line is an error naming it."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield number, parse_json(line, f"{where} line {number}", limits)


def read_json_lines(
    path: str | os.PathLike[str], what: str = "JSONL file", limits: ReadLimits = DEFAULT_LIMITS
) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of the JSONL file ``path``."""
    return parse_json_lines(read_text(path, what, limits.max_bytes), f"{what} {printable(path)}", limits)


def parse_yaml(text: str, where: str, limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """The value of one YAML document, read with the safe loader and checked against ``limits`` before any value
    is constructed."""
    import yaml

    try:
        return check_yaml(text, where, limits, construct=True)
    except yaml.YAMLError as err:
        raise DataError(f"{where} is not valid YAML: {' '.join(str(err).split())}") from None


def check_yaml(text: str, where: str, limits: ReadLimits = DEFAULT_LIMITS, construct: bool = False) -> Any:
    """Compose one YAML document with the safe loader and check it against ``limits`` (a :class:`DataError` naming
    ``where``); its value when ``construct``. Syntax errors stay ``yaml.YAMLError`` (callers that fall back to
    plain text on them, as jsonargparse does for command-line values, keep doing so)."""
    import yaml

    if len(text) > limits.max_bytes:
        raise DataError(f"{where} is {len(text):,} characters, more than the {limits.max_bytes:,} accepted")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_tree(node, where, limits)
        if not construct:
            return None
        try:
            value = loader.construct_document(node)
            return check_values(value, where, limits) if limits.checks_values else value
        except (ValueError, TypeError, OverflowError) as err:  # a bad date, an integer of 5,000 digits, ...
            raise DataError(f"{where} holds a value that cannot be read: {err}") from None
    except RecursionError:
        raise DataError(f"{where} is nested more than {limits.max_depth} levels deep") from None
    finally:
        loader.dispose()


def _yaml_children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_yaml_tree(root: Any, where: str, limits: ReadLimits) -> None:
    """Refuse duplicate keys, too deep nesting and aliases that expand past ``max_nodes`` before constructing.

    One post-order walk over the composed node graph (an alias is the node it names, so each node is sized once):
    ``size`` is the number of values a node stands for once aliases are expanded, ``height`` its nesting."""
    import yaml

    size: dict[int, int] = {}
    height: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        children = _yaml_children(node)
        if leaving:
            if any(id(child) not in size for child in children):
                raise DataError(f"{where} has an alias inside the value it names (a recursive document)")
            size[id(node)] = 1 + sum(size[id(child)] for child in children)
            nested = isinstance(node, (yaml.MappingNode, yaml.SequenceNode))
            height[id(node)] = 1 + max((height[id(child)] for child in children), default=0) if nested else 0
            if size[id(node)] > limits.max_nodes:
                raise DataError(f"{where} expands to more than {limits.max_nodes:,} values once its aliases are resolved")
            if height[id(node)] > limits.max_depth:
                raise DataError(f"{where} is nested more than {limits.max_depth} levels deep")
            continue
        if id(node) in entered:
            continue
        entered.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys = [k for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge"]
            seen: set[str] = set()
            for key in keys:
                if key.value in seen:
                    raise DataError(f"{where} has the key {key.value!r} twice in one mapping (again at line "
                                    f"{key.start_mark.line + 1})")
                seen.add(key.value)
        stack.append((node, True))
        stack.extend((child, False) for child in children)


def read_yaml(path: str | os.PathLike[str], what: str = "YAML file", limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """The value of the YAML file ``path`` (see :func:`parse_yaml`)."""
    where = f"{what} {printable(path)}"
    return parse_yaml(read_text(path, what, limits.max_bytes), where, limits)


def read_json_object(path: str | os.PathLike[str], what: str = "JSON file", limits: ReadLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The JSON object (a ``dict``) of the file ``path``; any other JSON value is a :class:`DataError`."""
    value = read_json(path, what, limits)
    if not isinstance(value, dict):
        raise DataError(f"{what} {printable(path)} must hold a JSON object, not {type(value).__name__}")
    return value
