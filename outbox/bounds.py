"""How large and how deep a stored value may be, and how every reader decodes one.

Every value a role can write is hostile (docs/design.md section 7): a login holding only
``outbox_agent`` chooses the input of its decisions and the attributes of its
``agent.completed`` events, a consumer login chooses results and references. So the
numbers here are enforced twice, by the Python that writes and by schema.sql's
triggers, and a unit test keeps the two in step. Readers still decode every stored
JSON value through :func:`load`, because a row may predate these bounds or come from
the tables' owner: a value too large, too deep or malformed becomes a small marker
object (:func:`unreadable`) instead of an exception, so one hostile row is counted and
quarantined while the rows beside it are read as usual.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from psycopg import postgres
from psycopg.abc import AdaptContext, Buffer
from psycopg.pq import Format
from psycopg.types.json import JsonbBinaryLoader, JsonBinaryLoader, JsonbLoader, JsonLoader

# Objects and arrays inside one another, the outermost value being level 1. Real tool
# inputs and event attributes stay far below; deeper values exhaust recursion in JSON
# parsers, serializers and templates long before they reach a size limit.
MAX_JSON_DEPTH = 64

# A tool input, in its canonical (RFC 8785) form: what record_decision refuses above.
MAX_INPUT_BYTES = 256 * 1024
# The database's own ceiling on an input, measured on jsonb's text form: that form puts
# a space after every comma and colon and writes numbers in full, so it is longer than
# the canonical one. The consumer still refuses any input whose canonical form exceeds
# MAX_INPUT_BYTES (a row that only the SQL path could have written), so nothing larger
# than record_decision accepts is ever executed.
MAX_STORED_INPUT_TEXT = 1024 * 1024
# An event's attributes (jsonb text), whoever writes them.
MAX_ATTRIBUTES_TEXT = 64 * 1024
# An agent.completed event's attributes: the agent's own words, namespaced and small.
MAX_AGENT_ATTRIBUTES_TEXT = 4 * 1024
AGENT_ATTRIBUTE_KEY = re.compile(r"^agent\.[a-z][a-z0-9_]{0,63}$")
# A provider's result, as stored on the operation (jsonb text). A larger one is replaced
# by a marker, never refused: the effect it reports has happened and must be recorded.
MAX_RESULT_TEXT = 64 * 1024
MAX_PROVIDER_REFERENCE = 500
# A provider callback's event id (its deduplication key): printable ASCII without a
# space, as providers' ids are (evt_…, msg_…, UUIDs). What a callback reports as the
# provider's reference is refused beyond MAX_PROVIDER_REFERENCE or with a control
# character, never cut: a cut reference would match another effect's.
CALLBACK_EVENT_ID = re.compile(r"^[!-~]{1,255}$")
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# How long a decision waits for a lock another session holds (a LOCK TABLE, a
# transaction holding the same decision key) before it is refused, nothing written
# (DecisionBlocked): the default, and the longest outbox_record_decision accepts.
DECISION_LOCK_TIMEOUT = 5.0
MAX_DECISION_LOCK_TIMEOUT = 60.0
# The longest a person's grant may last; the database refuses a later expiry.
MAX_APPROVAL_TTL = timedelta(days=7)
# What a reader decodes at all: above every bound the database keeps, so only a row
# written before them (or by the tables' owner) meets it.
READ_LIMIT_BYTES = 2 * 1024 * 1024

# The one key of the marker object a value that cannot be read is replaced by.
UNREADABLE = "outbox.unreadable"


def unreadable(reason: str, size: int) -> dict[str, Any]:
    """The marker that stands for a stored value no reader should parse: why (too_large,
    too_deep, malformed, not_an_object) and how many bytes it had."""
    return {UNREADABLE: {"reason": reason, "bytes": size}}


def is_unreadable(value: object) -> bool:
    return isinstance(value, Mapping) and UNREADABLE in value


def unreadable_reason(value: object) -> str | None:
    if not is_unreadable(value):
        return None
    assert isinstance(value, Mapping)
    detail = value[UNREADABLE]
    return str(detail.get("reason", "malformed")) if isinstance(detail, Mapping) else "malformed"


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` levels deep (``value`` is level 1)."""
    # Iterative on purpose: a recursive walk would overflow on the very value it checks.
    # Level by level: the containers of one level are all at the same depth, so no
    # (item, depth) pair is built per value, and scalars cost one type test.
    level = [value]
    depth = 1
    while level:
        below: list[Any] = []
        for item in level:
            # Scalars by a set lookup: the Mapping ABC's instance check is the slow part.
            if type(item) in _SCALARS:
                continue
            if isinstance(item, Mapping):
                children: Any = item.values()
            elif isinstance(item, list | tuple):
                children = item
            else:
                continue
            if depth > limit:
                return True
            below.extend(children)
        level = below
        depth += 1
    return False


_SCALARS = frozenset({str, int, float, bool, type(None)})


def load(data: str | bytes) -> Any:
    """Decode stored JSON, or return the :func:`unreadable` marker: never raises.

    The size is checked before parsing; the depth after, since the parser itself stops a
    pathological nesting cleanly (RecursionError) and anything it returns is walked
    iteratively. Integers longer than Python converts (ValueError) are malformed too.
    """
    size = len(data)
    if size > READ_LIMIT_BYTES:
        return unreadable("too_large", size)
    try:
        value = json.loads(data)
    except RecursionError:
        return unreadable("too_deep", size)
    except ValueError:
        return unreadable("malformed", size)
    if nested_deeper_than(value, MAX_JSON_DEPTH):
        return unreadable("too_deep", size)
    return value


def object_or_unreadable(value: object) -> object:
    """For a model field that holds a JSON object: anything else stored there (an array,
    a string, a number) becomes the marker, so the row can still be shown and counted."""
    if value is None or isinstance(value, dict):
        return value
    return unreadable("not_an_object", 0)


def bounded_result(result: Mapping[str, Any]) -> dict[str, Any]:
    """A provider's result as it will be stored: itself, or the marker when it is too
    large, too deep or not JSON. Never raises: the effect it reports has happened."""
    try:
        as_dict = dict(result)
        if nested_deeper_than(as_dict, MAX_JSON_DEPTH):
            return unreadable("too_deep", 0)
        # jsonb's text form spaces its separators as json.dumps does by default, and
        # writes non-ASCII as UTF-8: this is the length the database measures, or less.
        text = json.dumps(as_dict, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return unreadable("malformed", 0)
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_RESULT_TEXT:
        return unreadable("too_large", len(encoded))
    # Postgres's jsonb holds neither a NUL nor half of a surrogate pair: either would
    # fail the write that records a confirmed effect.
    if holds_nul_escape(encoded) or _has_lone_surrogate(text):
        return unreadable("malformed", len(encoded))
    return as_dict


def bounded_reference(reference: str | None) -> str | None:
    """A provider's reference as it will be stored: at most MAX_PROVIDER_REFERENCE
    characters, with no NUL and no half of a surrogate pair (Postgres text holds
    neither: either would fail the write that records a confirmed effect, every time
    it is tried). A lone surrogate becomes ``?``."""
    if reference is None:
        return None
    cleaned = reference.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    if len(cleaned) > MAX_PROVIDER_REFERENCE:
        return cleaned[: MAX_PROVIDER_REFERENCE - 1] + "…"
    return cleaned


# A NUL in any string, key or value, is written as the escape \u0000 in JSON text, and
# nothing else is: JSON has backslashes only inside strings, where \\ is an escaped
# backslash, so a \u0000 is a NUL's escape exactly when an even number of backslashes
# (none included) stands before it.
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def holds_nul_escape(json_text: bytes) -> bool:
    """Whether JSON text holds a NUL character (which Postgres cannot store)."""
    # The substring test is C speed and almost always false; the pattern settles the rest.
    return b"\\u0000" in json_text and _NUL_ESCAPE.search(json_text) is not None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _BoundedJsonLoader(JsonLoader):
    _loads = staticmethod(load)


class _BoundedJsonbLoader(JsonbLoader):
    _loads = staticmethod(load)


class _BoundedJsonBinaryLoader(JsonBinaryLoader):
    _loads = staticmethod(load)


class _BoundedJsonbBinaryLoader(JsonbBinaryLoader):
    _loads = staticmethod(load)

    def load(self, data: Buffer) -> Any:
        # Postgres's binary jsonb is a version byte (1) and the text form; any other
        # version is a value this reader cannot decode, not a reason to fail the rows.
        if not data or data[0] != 1:
            return unreadable("malformed", len(data))
        return load(bytes(data[1:]))


_JSON_OID = postgres.types["json"].oid
_JSONB_OID = postgres.types["jsonb"].oid


def bind(context: AdaptContext) -> None:
    """Decode json and jsonb through :func:`load` on this cursor or connection only.

    On a connection the runtime opened for itself (a daemon's), once at connect: its
    cursors inherit the loaders, and each statement saves the ~8 us of registering
    four loaders on a fresh cursor (:func:`bound`)."""
    adapters = context.adapters
    adapters.register_loader(_JSON_OID, _BoundedJsonLoader)
    adapters.register_loader(_JSONB_OID, _BoundedJsonbLoader)
    adapters.register_loader(_JSON_OID, _BoundedJsonBinaryLoader)
    adapters.register_loader(_JSONB_OID, _BoundedJsonbBinaryLoader)


def bound(context: AdaptContext) -> bool:
    """Whether ``context`` decodes jsonb through :func:`load` already (:func:`bind`)."""
    return context.adapters.get_loader(_JSONB_OID, Format.BINARY) is _BoundedJsonbBinaryLoader
