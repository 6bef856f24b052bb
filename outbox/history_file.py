"""An archived operation's evidence, checked without a database: the chain of its events
recomputed in Python exactly as ``outbox_event_hash`` (schema.sql) computes it, its head
compared, and the checkpoint digest of a day (docs/operating.md, "History retention").

``outbox history export`` writes one file per day of history, JSON lines: a first line
``{"checkpoint": {...}}`` (the day, how many operations and events, the digest, who
recorded it and when, and since schema version 14 the row's id, seq and hash in the
checkpoint chain), then one line per operation as its ``history`` row holds it, each
written as Postgres printed it. ``outbox ops verify --archive FILE`` reads it back here.

The hash covers an event's attributes in jsonb's own text form: keys sorted by length
and then bytes, ``", "`` and ``": "`` between items, strings escaped as Postgres escapes
them, numbers as written. :func:`jsonb_text` rebuilds that form from the parsed line
(numbers parsed as :class:`~decimal.Decimal`, so none is rounded).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_TAG = b"outbox.event.v1"
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


class ArchiveUnreadable(Exception):
    """The file is not an export: what is wrong, and on which line."""


def _string(text: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def jsonb_text(value: Any) -> str:
    """``value`` (parsed with :func:`load_line`) in the text form Postgres gives jsonb."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(jsonb_text(item) for item in value) + "]"
    if isinstance(value, dict):
        keys = sorted(value, key=lambda key: (len(key.encode()), key.encode()))
        return "{" + ", ".join(f"{_string(key)}: {jsonb_text(value[key])}" for key in keys) + "}"
    raise TypeError(f"no jsonb form for a {type(value).__name__}")


def load_line(line: str) -> Any:
    """One JSON line, its numbers exact."""
    return json.loads(line, parse_float=Decimal)


def _microseconds(text: str) -> int:
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (moment - _EPOCH) // timedelta(microseconds=1)


def event_hash(operation_id: UUID, event: dict[str, Any], prev_hash: bytes | None) -> bytes:
    """The hash ``outbox_event_hash`` gives an archived event (its ``events`` entry)."""
    name = str(event["name"]).encode()
    form = (
        _TAG
        + operation_id.bytes
        + struct.pack(
            ">qiq", int(event["id"]), int(event["seq"]), _microseconds(event["created_at"])
        )
        + struct.pack(">i", len(prev_hash) if prev_hash is not None else -1)
        + (prev_hash or b"")
        + struct.pack(">i", len(name))
        + name
        + jsonb_text(event["attributes"]).encode()
    )
    return hashlib.sha256(form).digest()


@dataclass(frozen=True)
class ArchivedLink:
    """One place where an archived operation's evidence disagrees with its chain; the
    reasons are those of :class:`outbox.store.BrokenLink`."""

    operation_id: UUID
    event_id: int | None
    reason: str


def broken_links(row: dict[str, Any]) -> list[ArchivedLink]:
    """Every broken link of one archived operation (a ``history`` row, parsed)."""
    operation_id = UUID(str(row["operation_id"]))
    broken: list[ArchivedLink] = []
    previous: bytes | None = None
    events = list(row["events"])
    for position, event in enumerate(events, start=1):
        stored_prev = bytes.fromhex(event["prev_hash"]) if event.get("prev_hash") else None
        if stored_prev != previous or int(event["seq"]) != position:
            broken.append(ArchivedLink(operation_id, int(event["id"]), "prev_mismatch"))
        if event_hash(operation_id, event, stored_prev).hex() != event.get("hash"):
            broken.append(ArchivedLink(operation_id, int(event["id"]), "hash_mismatch"))
        previous = bytes.fromhex(event["hash"]) if event.get("hash") else None
    if not events or events[0]["name"] != "operation.prepared":
        first = int(events[0]["id"]) if events else None
        broken.append(ArchivedLink(operation_id, first, "missing_birth"))
    count = int(row["event_count"])
    if count > len(events):
        broken.append(ArchivedLink(operation_id, None, "missing_tail"))
    elif count < len(events) or (events and row["last_hash"] != events[-1].get("hash")):
        broken.append(ArchivedLink(operation_id, int(events[-1]["id"]), "anchor_mismatch"))
    return broken


# Lines of a day per block of its digest: outbox_history_digest_block() in schema.sql.
DIGEST_BLOCK = 100_000


def digest(heads: Iterable[tuple[UUID, int, str | None]], block: int = DIGEST_BLOCK) -> str:
    """The checkpoint digest of ``(operation id, events, last hash)`` heads, as
    ``outbox_history_day`` and ``history_checkpoints`` define it: the heads' lines in
    operation id order, in blocks of ``block``; one block's digest is the SHA-256 of its
    lines joined by newlines, and a longer day's the SHA-256 of its blocks' digests (hex,
    joined by newlines). One string of a whole day's lines is what Postgres could not
    build past 1 GB; a block's is about 10 MB."""
    ordered = list(heads)
    if any(a[0] >= b[0] for a, b in itertools.pairwise(ordered)):
        ordered.sort(key=lambda head: head[0])
    blocks: list[str] = []
    for start in range(0, len(ordered), block):
        lines = (
            f"{operation_id} {events} {last_hash or '-'}"
            for operation_id, events, last_hash in ordered[start : start + block]
        )
        blocks.append(hashlib.sha256("\n".join(lines).encode()).hexdigest())
    if len(blocks) == 1:
        return blocks[0]
    return hashlib.sha256("\n".join(blocks).encode()).hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint row says left (or was exported) of one day; an export written
    since schema version 14 also names the row (id) and its place in the checkpoint
    chain (seq, its hash), which only the database can confirm."""

    settled_on: date
    operations: int
    events: int
    digest: str
    id: int | None = None
    seq: int | None = None
    hash: str | None = None


@dataclass(frozen=True)
class ArchiveReport:
    """What ``ops verify --archive`` found in one export."""

    checkpoint: Checkpoint
    operations_checked: int
    events_checked: int
    broken: tuple[ArchivedLink, ...]
    computed_digest: str

    @property
    def digest_matches(self) -> bool:
        return (
            self.computed_digest == self.checkpoint.digest
            and self.operations_checked == self.checkpoint.operations
            and self.events_checked == self.checkpoint.events
        )

    @property
    def intact(self) -> bool:
        return not self.broken and self.digest_matches


def _lines(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        with path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                if line.strip():
                    yield number, load_line(line)
    except (OSError, UnicodeDecodeError) as error:
        raise ArchiveUnreadable(f"{path}: cannot be read ({type(error).__name__})") from None
    except json.JSONDecodeError as error:
        raise ArchiveUnreadable(f"{path}: line {error.lineno} is not JSON") from None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def verify_archive(path: Path, block: int = DIGEST_BLOCK) -> ArchiveReport:
    """Recompute every chain in an export and the digest of its checkpoint line (in
    blocks of ``block`` lines; a test's are small)."""
    lines = _lines(path)
    try:
        number, first = next(lines)
        head = first["checkpoint"]
        checkpoint = Checkpoint(
            date.fromisoformat(head["settled_on"]),
            int(head["operations"]),
            int(head["events"]),
            str(head["digest"]),
            id=_optional_int(head.get("id")),
            seq=_optional_int(head.get("seq")),
            hash=str(head["hash"]) if head.get("hash") is not None else None,
        )
    except StopIteration:
        raise ArchiveUnreadable(f"{path}: empty, no checkpoint line") from None
    except (KeyError, TypeError, ValueError):
        raise ArchiveUnreadable(f"{path}: the first line is not a checkpoint") from None
    broken: list[ArchivedLink] = []
    heads: list[tuple[UUID, int, str | None]] = []
    events = 0
    for number, row in lines:
        try:
            broken.extend(broken_links(row))
            heads.append(
                (UUID(str(row["operation_id"])), int(row["event_count"]), row["last_hash"])
            )
            events += int(row["event_count"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ArchiveUnreadable(f"{path}: line {number} is not an archived operation") from None
    computed = digest(heads, block)
    if computed != checkpoint.digest and len(heads) > block:
        # An export written before schema version 16 hashed its day in one block.
        flat = digest(heads, len(heads))
        if flat == checkpoint.digest:
            computed = flat
    return ArchiveReport(checkpoint, len(heads), events, tuple(broken), computed)
