"""The loop's append-only journal: one JSON object per line, flushed and fsynced before the loop goes on.

Everything the loop decides (a task's trace, a reflection, collected data, a fit started and finished, a
demonstration added) is an event here, and the loop's state is what replaying the events gives. A killed loop
therefore resumes where it stopped: events that were written are never redone, and work that was cut off
(a fit without its ``fit_done``) is done again. A final line cut off by the kill (without its newline, and not a
whole JSON event) is the only kind of damage an append can leave; it is dropped when the journal is opened, and
said so. A whole final event that lacks only its newline (written by hand, or cut off just before it) is kept. Any
other line that is not an event, the last one included when it ends in its newline, is an error naming it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from clova_train.core.errors import DataError
from clova_train.core.safe_files import parse_json, read_bytes

log = logging.getLogger(__name__)


class Journal:
    """Append-only JSON-lines event log at ``path`` (created with its folder when missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._events: list[dict[str, Any]] = self._read()

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        data = read_bytes(self.path, "journal")
        lines = data.split(b"\n")
        torn = lines[-1] != b""  # the last line lacks its newline: an append may have been cut off in it
        if not torn:  # the file ends with its last event's newline (or is empty)
            lines.pop()
        events, good_bytes = [], 0
        for number, line in enumerate(lines, 1):
            cut_off = torn and number == len(lines)
            try:
                event = parse_json(line, "the line")
            except DataError as err:
                if cut_off:
                    break
                raise DataError(f"{self.path}:{number}: not a journal event ({err}); the journal was edited by hand?") from None
            if not isinstance(event, dict) or "event" not in event:
                if cut_off:
                    break
                raise DataError(f"{self.path}:{number}: not a journal event (an object with an 'event' field)")
            events.append(event)
            good_bytes += len(line) + 1
        if good_bytes == len(data) + 1:  # a whole last event that lacks only its newline: kept, newline added
            with open(self.path, "ab") as handle:
                handle.write(b"\n")
        elif good_bytes != len(data):
            log.warning("%s: dropped an event cut off by an interruption (%d bytes)", self.path, len(data) - good_bytes)
            with open(self.path, "r+b") as handle:
                handle.truncate(good_bytes)
        return events

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event durably and return it."""
        record = {"event": event, **fields}
        line = json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self._events.append(record)
        return record

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Events of kind ``event`` (all when ``None``) whose fields equal ``match``, in order."""
        return [e for e in self._events if (event is None or e["event"] == event)
                and all(e.get(k) == v for k, v in match.items())]

    def last(self, event: str, **match: Any) -> dict[str, Any] | None:
        found = self.events(event, **match)
        return found[-1] if found else None

    def __len__(self) -> int:
        return len(self._events)
