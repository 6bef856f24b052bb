from __future__ import annotations

import hashlib
import json
import random
import re
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from outbox.errors import InputRejected
from outbox.fingerprint import canonical_json, intent_fingerprint, model_fingerprint

MAX_SAFE_INTEGER = 2**53 - 1


def ieee_double(hex_bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(hex_bits))[0]
    return value


# RFC 8785 Appendix B: IEEE 754 bit patterns and their required JSON text.
RFC8785_APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize(("hex_bits", "expected"), RFC8785_APPENDIX_B)
def test_numbers_serialize_as_rfc8785_appendix_b(hex_bits: str, expected: str) -> None:
    assert canonical_json(ieee_double(hex_bits)) == expected.encode()


@pytest.mark.parametrize(
    ("number", "expected"),
    [
        (1e21, "1e+21"),
        (-0.0, "0"),
        (1e-7, "1e-7"),
        (0.000001, "0.000001"),
        (333333333.33333329, "333333333.3333333"),
        (1e30, "1e+30"),
        (4.50, "4.5"),
        (2e-3, "0.002"),
        (0.000000000000000000000000001, "1e-27"),
        (1e20, "100000000000000000000"),
        (1.0, "1"),
    ],
)
def test_number_forms_follow_rfc8785_section_3_2_2_3(number: float, expected: str) -> None:
    assert canonical_json(number) == expected.encode()


def test_rfc8785_section_3_2_4_example_canonicalizes_exactly() -> None:
    source = (
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        ' "literals": [null, true, false]}'
    )
    expected = (
        '{"literals":[null,true,false],'
        '"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    ).encode()

    assert canonical_json(json.loads(source)) == expected


def test_keys_sort_by_utf16_code_units_as_in_rfc8785_section_3_2_3() -> None:
    value = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    # The emoji is a surrogate pair (0xD83D 0xDE00) in UTF-16, so it sorts before
    # U+FB33 although its code point is larger.
    expected = (
        '{"\\r":"Carriage Return",'
        '"1":"One",'
        '"\u0080":"Control",'
        '"\u00f6":"Latin Small Letter O With Diaeresis",'
        '"\u20ac":"Euro Sign",'
        '"\U0001f600":"Emoji: Grinning Face",'
        '"\ufb33":"Hebrew Letter Dalet With Dagesh"}'
    ).encode("utf-8")

    assert canonical_json(value) == expected


def test_unicode_is_raw_utf8_and_only_control_characters_are_escaped() -> None:
    value = {"name": "Zo\u00eb pays \u20ac5 \U0001f600", "ctl": "a\u0001b\u001fc\td\ne"}

    expected = (
        '{"ctl":"a\\u0001b\\u001fc\\td\\ne","name":"Zo\u00eb pays \u20ac5 \U0001f600"}'
    ).encode("utf-8")

    assert canonical_json(value) == expected


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_rejected_with_the_reason(number: float) -> None:
    with pytest.raises(InputRejected) as info:
        canonical_json({"amount": [1, {"nested": number}]})

    assert "NaN or Infinity" in str(info.value)
    assert "JSON cannot represent" in str(info.value)


@pytest.mark.parametrize("number", [MAX_SAFE_INTEGER + 1, -(MAX_SAFE_INTEGER + 1), 10**30])
def test_integers_beyond_the_safe_range_are_rejected_with_the_fix(number: int) -> None:
    with pytest.raises(InputRejected) as info:
        canonical_json({"amount": number})

    message = str(info.value)
    assert "2**53 - 1" in message
    assert "send it as a string" in message


@pytest.mark.parametrize("number", [MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER])
def test_integers_at_the_edge_of_the_safe_range_are_accepted(number: int) -> None:
    assert canonical_json(number) == str(number).encode()


def test_fingerprint_is_64_lowercase_hex() -> None:
    fingerprint = intent_fingerprint("send_refund", 1, {"amount": 10})

    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)


def test_fingerprint_hashes_name_version_prefix_then_canonical_input() -> None:
    tool_input = {"to": "cus_1", "amount": 10.0}
    canonical = b'{"amount":10,"to":"cus_1"}'

    expected = hashlib.sha256(b"send_refund/v3\n" + canonical).hexdigest()

    assert intent_fingerprint("send_refund", 3, tool_input) == expected


def test_same_input_to_another_tool_or_version_is_another_intent() -> None:
    tool_input = {"amount": 10, "to": "cus_1"}

    base = intent_fingerprint("send_refund", 1, tool_input)

    assert intent_fingerprint("send_payout", 1, tool_input) != base
    assert intent_fingerprint("send_refund", 2, tool_input) != base
    assert intent_fingerprint("send_refund", 1, dict(tool_input)) == base


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=24,
)
JSON_OBJECTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=6)


def shuffled_keys(value: Any, rng: random.Random) -> Any:
    """The same JSON value, every object rebuilt with its keys inserted in random order."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {key: shuffled_keys(value[key], rng) for key in keys}
    if isinstance(value, list):
        return [shuffled_keys(item, rng) for item in value]
    return value


def ints_as_floats(value: Any) -> Any:
    """The same JSON value with every integer spelled as a float (1 -> 1.0)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        return {key: ints_as_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [ints_as_floats(item) for item in value]
    return value


@given(JSON_OBJECTS, st.randoms(use_true_random=False))
def test_fingerprint_ignores_key_insertion_order(
    tool_input: dict[str, Any], rng: random.Random
) -> None:
    reordered = shuffled_keys(tool_input, rng)

    assert intent_fingerprint("lookup", 1, reordered) == intent_fingerprint("lookup", 1, tool_input)


@given(JSON_OBJECTS)
def test_fingerprint_treats_integral_floats_as_the_same_number(tool_input: dict[str, Any]) -> None:
    respelled = ints_as_floats(tool_input)

    assert intent_fingerprint("lookup", 1, respelled) == intent_fingerprint("lookup", 1, tool_input)


class RefundLine(BaseModel):
    sku: str
    quantity: int


class RefundOrder(BaseModel):
    customer_id: str
    amount: float
    currency: str
    lines: list[RefundLine]
    labels: dict[str, str]


REFUND_LINES = st.fixed_dictionaries(
    {"sku": st.text(max_size=8), "quantity": st.integers(min_value=-1000, max_value=1000)}
)
REFUND_ORDERS = st.fixed_dictionaries(
    {
        "customer_id": st.text(max_size=12),
        "amount": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**6), 10**6),
        "currency": st.sampled_from(["EUR", "USD", "JPY"]),
        "lines": st.lists(REFUND_LINES, max_size=3),
        "labels": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=4),
    }
)


@given(REFUND_ORDERS, st.randoms(use_true_random=False))
def test_equal_models_from_differently_ordered_dicts_fingerprint_equal(
    order: dict[str, Any], rng: random.Random
) -> None:
    first = RefundOrder.model_validate(order)
    second = RefundOrder.model_validate(shuffled_keys(order, rng))

    assert first == second
    assert model_fingerprint("send_refund", 2, first) == model_fingerprint("send_refund", 2, second)


def test_a_value_nested_past_the_recursion_limit_is_rejected_as_input() -> None:
    value: object = 1
    for _ in range(5_000):
        value = [value]

    with pytest.raises(InputRejected) as info:
        canonical_json(value)

    assert "nested too deep" in str(info.value)
