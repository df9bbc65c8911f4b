"""Event ids: UUIDv7, monotonic in a process, never ahead of the clock."""

import subprocess
import sys
import time
import uuid

from outbox_app.events.ids import _uuid7


def test_ids_are_uuid7_and_strictly_increasing():
    ids = [_uuid7() for _ in range(50_000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert {i.version for i in ids} == {7}
    assert {i.variant for i in ids} == {uuid.RFC_4122}


def test_a_burst_does_not_run_ahead_of_the_clock():
    """A process that just made many ids must not hand out ids that sort after
    the ones another process makes a moment later."""
    burst = [_uuid7() for _ in range(50_000)]
    assert (burst[-1].int >> 80) <= time.time_ns() // 1_000_000
    later = subprocess.run(
        [
            sys.executable,
            "-c",
            "from outbox_app.events.ids import _uuid7; print(_uuid7())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert burst[-1] < uuid.UUID(later)
