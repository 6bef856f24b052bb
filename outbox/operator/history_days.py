"""``outbox history verify --days`` / ``--day D``: each day history holds against what
its checkpoints recorded (docs/operating.md, "History retention").

The checkpoint chain proves the checkpoints were not changed; it says nothing of the
rows they describe. A day's rows are counted and hashed again here and compared with the
sums of its archived checkpoints, and with the digest of its newest export (or of its
only archive batch): a row deleted, added or rewritten in a partition, or a partition
dropped without its checkpoint, shows. Reads every row of the days it checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Any

from outbox import store
from outbox.history_file import DIGEST_BLOCK
from outbox.store import Plan

# The most operations a day's one-block digest (before schema version 16) could cover: at
# about 105 bytes a line, more exceed Postgres's 1 GB bound on a value.
FLAT_DIGEST_MOST = 10_000_000

MATCHES = "matches"
MISMATCH = "mismatch"
MISSING = "missing"
NOT_COMPARED = "not_compared"


@dataclass(frozen=True)
class DayVerdict:
    """One day: what its checkpoints recorded, what its rows hold, and the verdict."""

    record: store.DayRecord
    held: store.DayDigest | None
    """What the partition holds now; None when it is not attached or was not read."""
    verdict: str
    problems: tuple[str, ...]
    digest_compared_with: int | None
    """The checkpoint whose digest the day's was compared with, if any."""

    @property
    def failed(self) -> bool:
        return self.verdict in (MISMATCH, MISSING)


def verify_days(day: date | None) -> Plan[list[DayVerdict]]:
    """Each day (``day`` alone, or every one history holds or should hold) against its
    checkpoints."""
    records = yield from store.day_records(day)
    verdicts = []
    for record in records:
        if not record.attached:
            verdicts.append(
                DayVerdict(
                    record,
                    None,
                    MISSING,
                    (
                        f"its partition is gone and no drop was recorded: "
                        f"{record.archived_operations} operation(s) and "
                        f"{record.archived_events} event(s) that its checkpoints recorded "
                        "moving into it left without a checkpoint",
                    ),
                    None,
                )
            )
        elif record.drop_recorded:
            # Its drop stopped after the checkpoint, or an operation settled that day was
            # archived after it: the checkpoints no longer state what the rows should be.
            verdicts.append(DayVerdict(record, None, NOT_COMPARED, (), None))
        else:
            held = yield from store.day_digest(record.settled_on)
            if record.newest_id is None and (held.operations, held.events) == (0, 0):
                continue  # a partition made ahead of its day: nothing in it, nothing recorded
            recorded = record.recorded_digest
            if (
                recorded is not None
                and recorded[1] != held.digest
                and DIGEST_BLOCK < held.operations <= FLAT_DIGEST_MOST
            ):
                # Exported before schema version 16, whose digest was one block.
                flat = yield from store.day_digest(record.settled_on, flat=True)
                if flat.digest == recorded[1]:
                    held = flat
            verdicts.append(_compare(record, held))
    return verdicts


def _compare(record: store.DayRecord, held: store.DayDigest) -> DayVerdict:
    problems = []
    if (held.operations, held.events) != (record.archived_operations, record.archived_events):
        problems.append(
            f"it holds {held.operations} operation(s) and {held.events} event(s); its archived "
            f"checkpoints recorded {record.archived_operations} and {record.archived_events}"
        )
    problems.extend(
        f"export checkpoint #{checkpoint_id} states other counts than had been archived before it"
        for checkpoint_id in record.exports_disagreeing
    )
    recorded = record.recorded_digest
    if recorded is not None and recorded[1] != held.digest:
        problems.append(
            f"its digest {held.digest} is not checkpoint #{recorded[0]}'s {recorded[1]}"
        )
    return DayVerdict(
        record,
        held,
        MISMATCH if problems else MATCHES,
        tuple(problems),
        recorded[0] if recorded is not None else None,
    )


def day_text(verdict: DayVerdict) -> str:
    record = verdict.record
    day = f"day {record.settled_on.isoformat()}"
    if verdict.verdict == NOT_COMPARED:
        return (
            f"{day}: not compared, a drop was recorded and the day is still attached "
            "(`outbox history drop` finishes a drop that stopped)"
        )
    if verdict.failed:
        return f"{day}: {verdict.verdict.upper()}, " + "; ".join(verdict.problems)
    held = verdict.held
    assert held is not None
    digest = (
        f"digest matches checkpoint #{verdict.digest_compared_with}"
        if verdict.digest_compared_with is not None
        else "no checkpoint states the whole day's digest (moved in several batches since "
        "its last export): counts only"
    )
    return (
        f"{day}: {held.operations} operation(s), {held.events} event(s), as its checkpoints "
        f"record; {digest}"
    )


def day_json(verdict: DayVerdict) -> dict[str, Any]:
    record, held = verdict.record, verdict.held
    return {
        "settled_on": record.settled_on.isoformat(),
        "verdict": verdict.verdict,
        "problems": list(verdict.problems),
        "operations": held.operations if held is not None else None,
        "events": held.events if held is not None else None,
        "recorded_operations": record.archived_operations,
        "recorded_events": record.archived_events,
        "digest_compared_with": verdict.digest_compared_with,
    }
