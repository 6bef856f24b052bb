"""``OUTBOX_TOOL_QUEUES``: a quorum queue per tool, or per group of tools.

One quorum queue has one Raft leader, and every message of the deployment goes
through it. Naming groups (``queue=tool,tool;queue=tool``) gives each its own queue,
and so its own leader, which RabbitMQ places on the node the declaration came through
(or as its ``queue_leader_locator`` says). ``outbox migrate --broker`` declares them;
:mod:`outbox.broker` says how the messages reach them without ever reaching two queues.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# A tool's routing key is ``<tool>.v<version>``; a group's binding is ``<tool>.*``, one
# word after the tool's. A name with an empty word (``a..b``) or a trailing dot would
# make that binding match another tool's keys, so a grouped tool's words are non-empty.
GROUPED_TOOL = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z0-9_-]+)*$")
MAX_TOOL_NAME = 64
# RabbitMQ allows 255 bytes and reserves ``amq.``; these names also become metric labels
# (the queue-depth gauge), so they stay short and plain.
QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,119}$")
# The queue-depth gauge's labels for the default and the dead-letter queue.
RESERVED_LABELS = frozenset({"operations", "dead_letter"})

FORM = (
    "queue=tool,tool;queue=tool (e.g. "
    "outbox.payments=send_refund,charge_card;outbox.email=send_email)"
)


def parse_tool_queues(text: str) -> dict[str, tuple[str, ...]]:
    """The groups ``text`` names: queue name -> its tools, in the order written. Empty
    text is no group (every tool on ``OUTBOX_QUEUE``, as before). Raises ``ValueError``
    with a sentence that names the problem and the form expected."""
    groups: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for number, part in enumerate((p.strip() for p in text.split(";")), start=1):
        if not part:
            continue
        queue, equals, listed = part.partition("=")
        queue = queue.strip()
        if not equals:
            raise ValueError(f"group {number} has no '=': write {FORM}")
        if not QUEUE_NAME.match(queue) or queue.startswith("amq."):
            raise ValueError(
                f"group {number}: {queue!r} is not a queue name this setting takes (letters, "
                "digits, '_', '.', ':', '-', at most 120, not starting with 'amq.')"
            )
        if queue in RESERVED_LABELS:
            raise ValueError(
                f"group {number}: {queue!r} is a label the queue-depth gauge gives the "
                "default or the dead-letter queue; choose another name"
            )
        if queue in groups:
            raise ValueError(f"queue {queue!r} is named twice; list all its tools once")
        tools = tuple(tool.strip() for tool in listed.split(",") if tool.strip())
        if not tools:
            raise ValueError(f"queue {queue!r} has no tools: write {FORM}")
        for tool in tools:
            if len(tool) > MAX_TOOL_NAME or not GROUPED_TOOL.match(tool):
                raise ValueError(
                    f"queue {queue!r}: {tool!r} is not a tool name (lower case, digits, '_', "
                    "'-', words separated by single dots, at most 64)"
                )
            if tool in owner:
                where = "twice in it" if owner[tool] == queue else f"also in {owner[tool]!r}"
                raise ValueError(
                    f"tool {tool!r} is in queue {queue!r} and {where}: one queue a tool"
                )
            owner[tool] = queue
        groups[queue] = tools
    return groups


def tool_queue_problems(
    text: str, queue: str, dead_letter_queue: str, consume_queue: str | None
) -> list[str]:
    """What is wrong with ``OUTBOX_TOOL_QUEUES`` (``text``), alone or beside the other
    queue settings, in sentences that name the variable."""
    try:
        groups = parse_tool_queues(text)
    except ValueError as problem:
        return [f"OUTBOX_TOOL_QUEUES: {problem}"]
    problems = [
        f"OUTBOX_TOOL_QUEUES names {name!r}, which is {variable}: a group's queue is a "
        "queue of its own"
        for name, variable in (
            (queue, "OUTBOX_QUEUE"),
            (dead_letter_queue, "OUTBOX_DEAD_LETTER_QUEUE"),
        )
        if name in groups
    ]
    if consume_queue is not None and consume_queue != queue and consume_queue not in groups:
        named = ", ".join(groups) or "none"
        problems.append(
            f"OUTBOX_CONSUME_QUEUE {consume_queue!r} is neither OUTBOX_QUEUE nor a queue of "
            f"OUTBOX_TOOL_QUEUES (those are: {named}); a consumer reads a queue "
            "`outbox migrate --broker` declared"
        )
    return problems


def binding_key(tool: str) -> str:
    """The topic binding that takes every version of ``tool`` (``<tool>.v<n>``) and no
    other tool's key: ``*`` is exactly one word, and a tool's own words are never empty."""
    return f"{tool}.*"


def queue_of(groups: Mapping[str, tuple[str, ...]], tool: str, default: str) -> str:
    """The queue ``tool``'s messages go to."""
    for queue, tools in groups.items():
        if tool in tools:
            return queue
    return default
