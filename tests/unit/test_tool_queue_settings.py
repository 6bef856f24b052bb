"""``OUTBOX_TOOL_QUEUES``: what it accepts, and a clear refusal, naming the variable,
for everything else."""

from __future__ import annotations

import pytest

from outbox.broker import Topology
from outbox.errors import ConfigurationError
from outbox.settings import Settings, load_settings
from outbox.tool_queues import binding_key, parse_tool_queues, queue_of


def test_groups_are_read_in_order_with_spaces_and_empty_parts_ignored() -> None:
    groups = parse_tool_queues(
        " outbox.pay = send_refund , charge_card ; ; outbox.mail=send_email;"
    )
    assert groups == {
        "outbox.pay": ("send_refund", "charge_card"),
        "outbox.mail": ("send_email",),
    }
    assert queue_of(groups, "charge_card", "outbox.operations") == "outbox.pay"
    assert queue_of(groups, "lookup", "outbox.operations") == "outbox.operations"


def test_nothing_configured_is_no_group_and_todays_topology() -> None:
    assert parse_tool_queues("") == {}
    settings = Settings()
    assert settings.tool_queue_groups == {}
    topology = Topology.from_settings(settings)
    assert topology.tool_queues == ()
    assert topology.consumed == settings.queue
    assert topology.depth_labels() == [
        ("operations", settings.queue),
        ("dead_letter", settings.dead_letter_queue),
    ]


def test_each_group_queue_gets_a_depth_label_of_its_own_name() -> None:
    topology = Topology.from_settings(Settings(tool_queues="q.pay=send_refund;q.mail=send_email"))
    assert [label for label, _ in topology.depth_labels()] == [
        "operations",
        "dead_letter",
        "q.pay",
        "q.mail",
    ]


def test_a_binding_takes_every_version_of_its_tool_and_no_other_tool() -> None:
    # A topic '*' is one word: 'a.*' matches 'a.v1', never 'a.b.v1' (tool 'a.b').
    assert binding_key("billing.refund") == "billing.refund.*"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("outbox.pay", "has no '='"),
        ("outbox.pay=send_refund;outbox.mail=send_refund", "tool 'send_refund' is in queue"),
        ("outbox.pay=send_refund,send_refund", "twice in it"),
        ("outbox.pay=send_refund;outbox.pay=charge_card", "named twice"),
        ("outbox.pay=", "has no tools"),
        ("=send_refund", "not a queue name"),
        ("amq.pay=send_refund", "not a queue name"),
        ("out box=send_refund", "not a queue name"),
        ("outbox.pay=Send_Refund", "not a tool name"),
        ("outbox.pay=send..refund", "not a tool name"),
        ("outbox.pay=send_refund.", "not a tool name"),
        ("outbox.pay=send#", "not a tool name"),
        ("operations=send_refund", "a label the queue-depth gauge"),
    ],
)
def test_bad_groups_are_refused_naming_the_variable_and_the_problem(text: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_settings(tool_queues=text)
    message = str(refused.value)
    assert "OUTBOX_TOOL_QUEUES" in message
    assert says in message


@pytest.mark.parametrize("name", ["outbox.operations", "outbox.operations.dead"])
def test_a_group_cannot_reuse_the_default_or_the_dead_letter_queue(name: str) -> None:
    with pytest.raises(ConfigurationError, match="a group's queue is a queue of its own"):
        load_settings(tool_queues=f"{name}=send_refund")


def test_a_consumer_reads_the_default_queue_or_a_named_group() -> None:
    groups = "q.pay=send_refund"
    assert Topology.from_settings(Settings(tool_queues=groups, consume_queue="q.pay")).consumed == (
        "q.pay"
    )
    default = Settings(tool_queues=groups, consume_queue="outbox.operations")
    assert Topology.from_settings(default).consumed == "outbox.operations"
    with pytest.raises(ConfigurationError, match=r"OUTBOX_CONSUME_QUEUE 'q\.mail' is neither"):
        load_settings(tool_queues=groups, consume_queue="q.mail")
