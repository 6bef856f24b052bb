"""Input fingerprints: SHA-256 over the RFC 8785 (JCS) canonical form of an intent.

The fingerprint identifies *what* was decided, independent of how the agent spelled
it: key order, number formatting (``1.0`` vs ``1``, ``1e21``) and unicode escapes are
canonicalized by JCS, so equal inputs always hash equal. The tool name and version are
part of the hashed bytes, so the same input to another tool is another intent.
"""

from __future__ import annotations

import hashlib
import math
from json.encoder import encode_basestring
from typing import Any

import rfc8785
from pydantic import BaseModel

from outbox.errors import InputRejected

SANITIZED_LENGTH = 12
# JSON's interoperable integers (RFC 8785 section 3.2.2.3 defers to I-JSON): the range
# rfc8785 accepts, and so the one the fast path below serializes itself.
_MAX_SAFE_INTEGER = 2**53 - 1


class _Defer(Exception):
    """The fast canonicalizer met something it leaves to the rfc8785 package."""


def canonical_json(value: Any) -> bytes:
    """RFC 8785 canonical bytes of a JSON value; refuses what JSON cannot hold exactly."""
    fast = _fast_canonical_json(value)
    if fast is not None:
        return fast
    return rfc8785_canonical_json(value)


def rfc8785_canonical_json(value: Any) -> bytes:
    """:func:`canonical_json` by the ``rfc8785`` package alone: the path every value the
    fast serializer defers takes, and the reference the fast one is tested against."""
    try:
        return rfc8785.dumps(value)
    except rfc8785.IntegerDomainError:
        raise InputRejected(
            "input holds an integer outside the interoperable JSON range (|n| > 2**53 - 1); "
            "send it as a string",
            problems=["integer out of range"],
        ) from None
    except rfc8785.FloatDomainError:
        raise InputRejected(
            "input holds NaN or Infinity, which JSON cannot represent",
            problems=["non-finite number"],
        ) from None
    except RecursionError:
        # rfc8785 recurses once per level; inputs are depth-checked before this.
        raise InputRejected(
            "input is nested too deep to canonicalize", problems=["input nested too deep"]
        ) from None
    except rfc8785.CanonicalizationError as exc:
        raise InputRejected(
            f"input cannot be canonicalized as JSON ({type(exc).__name__})",
            problems=[type(exc).__name__],
        ) from None


def intent_fingerprint(tool_name: str, tool_version: int, input_json: Any) -> str:
    """Hex SHA-256 of ``<name>/v<version>\\n`` followed by the JCS form of the input."""
    return canonical_fingerprint(tool_name, tool_version, canonical_json(input_json))


def canonical_fingerprint(tool_name: str, tool_version: int, canonical: bytes) -> str:
    """:func:`intent_fingerprint` from input already in canonical form: recording a
    decision needs those bytes for its size check too, and canonicalizes only once."""
    return hashlib.sha256(f"{tool_name}/v{tool_version}\n".encode() + canonical).hexdigest()


def model_fingerprint(tool_name: str, tool_version: int, model: BaseModel) -> str:
    return intent_fingerprint(tool_name, tool_version, model.model_dump(mode="json"))


def sanitized(fingerprint: str) -> str:
    """A short prefix for logs and events: enough to correlate with the operation row."""
    return fingerprint[:SANITIZED_LENGTH]


# The fast path. rfc8785's pure-Python serializer writes every token to a BytesIO and
# escapes each string with a regular expression; for the values pydantic's JSON mode
# produces (exact dict, list, str, int, float, bool, None) the same bytes come from the
# json module's C string escaper and one UTF-8 encode at the end. It agrees with rfc8785
# byte for byte (tests/unit/test_canonical_json.py checks that on generated values) and
# raises on whatever it does not handle, which canonical_json then hands to rfc8785.


def _fast_canonical_json(value: Any) -> bytes | None:
    """The canonical bytes, or None for anything the fast path does not handle itself
    (another type, a subclass, an integer or float JSON cannot hold, a surrogate, nesting
    deep enough to exhaust the recursion): rfc8785 then answers, or raises exactly as it
    always has, with no exception of this attempt chained to its own."""
    parts: list[str] = []
    try:
        _serialize(value, parts)
        # UTF-8 refuses lone surrogates, as rfc8785 does.
        return "".join(parts).encode("utf-8")
    except (_Defer, UnicodeEncodeError, RecursionError):
        return None


def _serialize(value: Any, parts: list[str]) -> None:
    # Exact types only: a subclass (a str Enum, a bool-like int) may serialize otherwise.
    kind = type(value)
    append = parts.append
    if kind is dict:
        if not value:
            append("{}")
            return
        keys = list(value)
        ascii_keys = True
        for key in keys:
            if type(key) is not str:
                raise _Defer("a key that is not exactly a str")
            if not key.isascii():
                ascii_keys = False
        if ascii_keys:
            # ASCII: code point order is UTF-16 code unit order.
            keys.sort()
        else:
            # Section 3.2.3 sorts by UTF-16 code units, where a non-BMP character (a
            # surrogate pair) sorts before U+E000-U+FFFF; code point order would not.
            keys.sort(key=_utf16_units)
        separator = "{"
        for key in keys:
            append(separator)
            append(encode_basestring(key))
            append(":")
            separator = ","
            # Strings and safe integers, the usual members, inline: a call per member
            # would cost as much as serializing it.
            item = value[key]
            kind = type(item)
            if kind is str:
                append(encode_basestring(item))
            elif kind is int and -_MAX_SAFE_INTEGER <= item <= _MAX_SAFE_INTEGER:
                append(int.__repr__(item))
            else:
                _serialize(item, parts)
        append("}")
    elif kind is list:
        if not value:
            append("[]")
            return
        separator = "["
        for item in value:
            append(separator)
            separator = ","
            kind = type(item)
            if kind is str:
                append(encode_basestring(item))
            elif kind is int and -_MAX_SAFE_INTEGER <= item <= _MAX_SAFE_INTEGER:
                append(int.__repr__(item))
            else:
                _serialize(item, parts)
        append("]")
    elif kind is str:
        # The json module escapes exactly what RFC 8785 section 3.2.2.2 escapes: the
        # quote, the backslash, the short forms \b \f \n \r \t and other controls
        # as lowercase \u00xx; everything else, DEL and non-ASCII included, stays as is.
        append(encode_basestring(value))
    elif kind is int:
        if not -_MAX_SAFE_INTEGER <= value <= _MAX_SAFE_INTEGER:
            raise _Defer("an integer outside the interoperable range")
        append(int.__repr__(value))
    elif value is None:
        append("null")
    elif value is True:
        append("true")
    elif value is False:
        append("false")
    elif kind is float:
        append(_ecmascript_number(value))
    else:
        raise _Defer(f"a {kind.__name__}")


def _utf16_units(key: str) -> bytes:
    # Big-endian, so that bytes compare as the code units do.
    return key.encode("utf-16-be")


def _ecmascript_number(number: float) -> str:
    """ECMAScript's Number::toString (ECMA-262 7.1.12.1), as RFC 8785 section 3.2.2.3
    requires: the shortest digits that round-trip, which is what Python's repr gives,
    laid out as an integer below 1e21, as a fixed fraction down to 1e-6, else as
    ``d.ddde+n``."""
    if not math.isfinite(number):
        raise _Defer("NaN or Infinity")
    if number == 0:
        return "0"  # -0 included
    if number < 0:
        return "-" + _ecmascript_number(-number)
    mantissa, _, exponent = repr(number).partition("e")
    whole, _, fraction = mantissa.partition(".")
    # The value is 0.<digits> x 10**point, digits without leading or trailing zeros.
    if exponent:
        digits = (whole + fraction).rstrip("0")
        point = int(exponent) + len(whole)
    elif whole != "0":
        digits = (whole + fraction).rstrip("0")
        point = len(whole)
    else:
        significant = fraction.lstrip("0")
        digits = significant.rstrip("0")
        point = len(significant) - len(fraction)
    count = len(digits)
    if count <= point <= 21:
        return digits + "0" * (point - count)
    if 0 < point <= 21:
        return digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return "0." + "0" * -point + digits
    power = point - 1
    sign = "+" if power >= 0 else "-"
    head = digits[0] + ("." + digits[1:] if count > 1 else "")
    return f"{head}e{sign}{abs(power)}"
