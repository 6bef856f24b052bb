"""The fast canonicalizer in outbox.fingerprint agrees with the rfc8785 package byte for
byte, and canonical_json answers, or raises, exactly as it did when it was rfc8785 alone.

Fingerprints are stored and compared across versions (the consumer recomputes them from
the stored input), so a canonical form that drifted by one byte would turn every
recorded decision into tampering: these properties are what allows the fast path.
"""

from __future__ import annotations

import enum
import math
import struct
from typing import Any

import pytest
import rfc8785
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox.bounds import holds_nul_escape
from outbox.errors import InputRejected
from outbox.fingerprint import (
    _fast_canonical_json,
    canonical_json,
    intent_fingerprint,
    rfc8785_canonical_json,
)

MAX_SAFE_INTEGER = 2**53 - 1


def outcome(function: Any, value: Any) -> tuple[str, object]:
    """The bytes, or the error's class, message and problems: what a caller can observe."""
    try:
        return ("bytes", function(value))
    except InputRejected as exc:
        return ("rejected", (str(exc), exc.problems))
    except Exception as exc:  # e.g. UnicodeEncodeError for a lone surrogate in a key
        return ("raised", type(exc))


def float_from_bits(bits: int) -> float:
    value: float = struct.unpack(">d", bits.to_bytes(8, "big"))[0]
    return value


# Characters where canonical forms differ: the ones JSON escapes, DEL and the line
# separators it does not, the top of the BMP (U+E000-U+FFFF sort after surrogate pairs in
# UTF-16), non-BMP characters, lone surrogates (Python allows them; UTF-8 does not), and
# the backslash, 'u' and '0' that spell an escaped NUL in the canonical text.
TRICKY_CHARACTERS = st.sampled_from(
    [
        *'\x00\x01\x08\t\n\x0b\x0c\r\x1f\x7f"\\/u0aA\u2028\u2029',
        "\u00e9",
        "\u20ac",
        "\ud7ff",
        "\ud800",
        "\udbff",
        "\udc00",
        "\udfff",
        "\ue000",
        "\ufb33",
        "\ufeff",
        "\uffff",
        "\U00010000",
        "\U0001f600",
        "\U0010ffff",
    ]
)
ANY_CHARACTER = st.characters(exclude_categories=())  # surrogates included
STRINGS = st.text(TRICKY_CHARACTERS, max_size=8) | st.text(ANY_CHARACTER, max_size=8)
# Keys drawn from ASCII, the top of the BMP and beyond it, so that their UTF-16 and code
# point orders disagree (and lone surrogates, which rfc8785 refuses).
KEYS = (
    st.text(max_size=4)
    | st.text(
        st.characters(min_codepoint=0xE000, max_codepoint=0xFFFF)
        | st.characters(min_codepoint=0x10000)
        | st.characters(max_codepoint=0x7F),
        max_size=3,
    )
    | st.text(TRICKY_CHARACTERS, max_size=3)
)
SPECIAL_FLOATS = st.sampled_from(
    [
        0.0,
        -0.0,
        5e-324,
        -5e-324,
        2.2250738585072014e-308,
        1.7976931348623157e308,
        1e21,
        1e-7,
        1e-6,
        9.999999999999999e20,
        999999999999999900000.0,
        1e16,
        9007199254740992.0,
        9007199254740993.0,
        0.1,
        1 / 3,
        math.nan,
        math.inf,
        -math.inf,
    ]
)
FLOATS = (
    st.floats()  # NaN, infinities, -0.0 and subnormals included
    | SPECIAL_FLOATS
    | st.integers(min_value=0, max_value=2**64 - 1).map(float_from_bits)
)
INTEGERS = st.integers(
    min_value=-(2**70), max_value=2**70
) | st.sampled_from(  # beyond 2**53 as well: rfc8785 refuses those
    [MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, MAX_SAFE_INTEGER + 1, -MAX_SAFE_INTEGER - 1, 0]
)
SCALARS = st.none() | st.booleans() | INTEGERS | FLOATS | STRINGS
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(KEYS, children, max_size=5),
    max_leaves=30,
)


class Colour(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Label(enum.StrEnum):
    URGENT = "urgent"


class Subdict(dict[str, Any]):
    pass


# Values pydantic's JSON mode never produces, which the fast path leaves to rfc8785:
# tuples, subclasses, enums, non-str keys, bytes and other objects.
ODD_VALUES = st.sampled_from(
    [
        (1, "a"),
        Level.HIGH,
        Label.URGENT,
        Colour.RED,
        Subdict(b=1, a=2),
        {1: "int key"},
        {"a": 1, 2: "mixed keys"},
        {None: 1},
        b"bytes",
        object(),
        [1, 2.5, (3,)],
    ]
)
MIXED_VALUES = st.recursive(
    SCALARS | ODD_VALUES,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(KEYS, children, max_size=4)
        | st.tuples(children, children)
    ),
    max_leaves=12,
)


@settings(max_examples=1000)
@given(JSON_VALUES)
@example({"\ufb33": 1, "\U0001f600": 2, "\ue000": 3, "a": 4})
@example({"\ud800": 1})
@example(["\ud83d\ude00"])  # a surrogate pair spelled as two code points
@example([2**53, -(2**53), 10**30])
@example([math.nan, math.inf, -0.0, 1e21, 1e-7, 5e-324])
def test_fast_path_agrees_with_rfc8785_byte_for_byte(value: Any) -> None:
    fast = _fast_canonical_json(value)
    expected = outcome(rfc8785.dumps, value)

    if fast is not None:
        assert ("bytes", fast) == expected
    else:
        # Not vacuous: of plain JSON values the fast path leaves to rfc8785 only those
        # rfc8785 refuses (big integers, NaN and infinities, lone surrogates).
        assert expected[0] == "raised"
    assert outcome(canonical_json, value) == outcome(rfc8785_canonical_json, value)


@settings(max_examples=500)
@given(MIXED_VALUES)
def test_values_the_fast_path_leaves_alone_canonicalize_as_before(value: Any) -> None:
    fast = _fast_canonical_json(value)

    if fast is not None:
        assert ("bytes", fast) == outcome(rfc8785.dumps, value)
    assert outcome(canonical_json, value) == outcome(rfc8785_canonical_json, value)


@settings(max_examples=1000)
@given(FLOATS)
def test_numbers_agree_with_rfc8785(number: float) -> None:
    fast = _fast_canonical_json([number, -number])

    if math.isfinite(number):
        assert fast == rfc8785.dumps([number, -number])
    else:
        assert fast is None
    assert outcome(canonical_json, number) == outcome(rfc8785_canonical_json, number)


def holds_nul(value: Any) -> bool:
    """Whether any string of a JSON value, key or value, holds a NUL: the walk that
    holds_nul_escape replaces."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    return False


NUL_PRONE_TEXT = st.text(st.sampled_from(["\x00", "\\", "u", "0", "a", '"']), max_size=10)
NUL_PRONE_VALUES = st.recursive(
    NUL_PRONE_TEXT | st.integers(min_value=0, max_value=100) | st.none(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(NUL_PRONE_TEXT, children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=500)
@given(NUL_PRONE_VALUES)
@example({"note": "C:\\u0000\\logs"})
@example({"note": "\\\x00"})
@example({"k\x00": 1})
def test_nul_found_in_canonical_bytes_exactly_when_a_string_holds_one(value: Any) -> None:
    assert holds_nul_escape(canonical_json(value)) == holds_nul(value)


# Fingerprints computed by the rfc8785-only implementation, before the fast path: they
# must never change, or recorded operations would stop matching their inputs.
RECORDED_FINGERPRINTS: list[tuple[str, int, Any, str]] = [
    (
        "send_refund",
        1,
        {"payment_id": "pay_1", "amount_cents": 1250, "currency": "EUR", "reason": ""},
        "fd3cf1aa039d3f32a692c983e6980d950e4bbdf52026a0cbae1cb2622b446bef",
    ),
    (
        "send_refund",
        3,
        {"to": "cus_1", "amount": 10.0},
        "b3918445462952f476644061cb7796f4b1f1587af6d397d9f8731f43b26d048a",
    ),
    (
        "open_ticket",
        1,
        {"title": "Printer on fire", "body": 'Floor 3, "urgent"\n\tsee photo'},
        "7ce36635d532c417496d9e8d64569cc26e82ff3b5f54ee34f00453b8f35686e0",
    ),
    (  # RFC 8785 section 3.2.4's example
        "lookup",
        1,
        {
            "numbers": [333333333.3333333, 1e30, 4.5, 0.002, 1e-27],
            "string": '\u20ac$\x0f\nA\'B"\\\\"/',
            "literals": [None, True, False],
        },
        "518f71d3d7270eda437fad9f06479b809abb891bdd0de9d2da2748837ac85730",
    ),
    (  # RFC 8785 section 3.2.3's sorting example
        "lookup",
        1,
        {
            "\u20ac": "Euro Sign",
            "\r": "Carriage Return",
            "\ufb33": "Hebrew Letter Dalet With Dagesh",
            "1": "One",
            "\U0001f600": "Emoji: Grinning Face",
            "\u0080": "Control",
            "\u00f6": "Latin Small Letter O With Diaeresis",
        },
        "88bec8e856bfbcc36f5630e40f723ad5eb72fa84ea420814d32d015a711904b9",
    ),
    (
        "lookup",
        1,
        {
            "name": "Zo\u00eb pays \u20ac5 \U0001f600",
            "ctl": "a\u0001b\u001fc\td\ne",
            "del": "\x7f",
            "ls": "\u2028\u2029",
        },
        "5606f8cb999d3bed840928e6250a23209b6d928ea1035ac9da3cbb3e56df7097",
    ),
    (
        "lookup",
        2,
        {
            "n": [
                0,
                -0.0,
                5e-324,
                -5e-324,
                1.7976931348623157e308,
                9007199254740991,
                -9007199254740991,
                1e21,
                1e-7,
                1e-6,
                123456789012345680000.0,
                0.1,
                1e16,
                2.5e-5,
            ]
        },
        "430910a04bf9eba1cc106cbc197830081adf5a3df75c416b907aa3e29c279cde",
    ),
    (
        "lookup",
        1,
        {"data": {"a": [], "b": {}, "c": [[{"d": None}]]}, "": "empty key"},
        "40dcbf27607947037a800e612811cf9e98d4fa4b43115aab0f688f25d592d364",
    ),
]


@pytest.mark.parametrize(("tool", "version", "tool_input", "expected"), RECORDED_FINGERPRINTS)
def test_fingerprints_recorded_before_the_fast_path_are_unchanged(
    tool: str, version: int, tool_input: Any, expected: str
) -> None:
    assert _fast_canonical_json(tool_input) is not None  # the fast path computed it
    assert intent_fingerprint(tool, version, tool_input) == expected
