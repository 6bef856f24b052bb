"""Text fit for a terminal and for a logfmt line: whatever a user, an agent or a
provider chose is escaped so it can neither act on a terminal nor start a forged line."""

from __future__ import annotations

import re

_BARE = re.compile(r"^[A-Za-z0-9_.:/@+-]+$")

Scalar = str | int | float | bool | None

# What a terminal acts on rather than shows: C0 and C1 controls (ESC starts a sequence
# that can move the cursor, clear the screen or retitle the window; C1 0x9b is a
# one-byte CSI), DEL, the bidirectional overrides that reorder what is displayed, and
# the Unicode line and paragraph separators. Escaped as JSON would escape them, so
# escaped JSON text stays valid JSON.
_CONTROLS = {
    **{chr(code): f"\\u{code:04x}" for code in [*range(0x20), *range(0x7F, 0xA0)]},
    **{
        chr(code): f"\\u{code:04x}"
        for code in [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    },
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}
_PRINTABLE = str.maketrans(_CONTROLS)
# Quoted values stay on one line: a value must never be able to start a forged line.
_ESCAPES = str.maketrans({**_CONTROLS, "\\": "\\\\", '"': '\\"'})


def printable(value: object) -> str:
    """``value`` as text safe to print on an operator's terminal: every control
    character escaped, everything else (accents, emoji, quotes) as it is.

    For human-readable output of anything a user, an agent or a provider chose (run
    ids, names, reasons, error text, inputs); JSON output needs no more than JSON's own
    escaping. Backslashes are left alone so that escaped JSON stays JSON: the output
    cannot act on the terminal, though a literal ``\\u001b`` reads like an escaped one.
    """
    return str(value).translate(_PRINTABLE)


def logfmt_key(key: str) -> str:
    """A key as a logfmt line shows it: bare when it is a plain word, quoted and escaped
    as a value would be otherwise (a key with a space or an = could forge a field)."""
    return key if _BARE.fullmatch(key) else logfmt_value(key)


def logfmt_value(value: Scalar) -> str:
    text = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    if _BARE.fullmatch(text):
        return text
    escaped = text.translate(_ESCAPES)
    return f'"{escaped}"'
