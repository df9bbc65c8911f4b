"""A tick's events are read by ranges and lists of transaction ids (the
PostgreSQL dialect's ``tick_params``), and walked by
``pg_visible_in_snapshot``: both select exactly the transactions visible in
the tick and not in the last one, for any history of transactions."""

from __future__ import annotations

import random

import pytest
from django.db import connection

from outbox_app.store.sql import dialect

pytestmark = [pytest.mark.only_database("postgresql"), pytest.mark.django_db]


def snapshot(history: dict[int, tuple[int, int | None]], at: int) -> str:
    """The ``pg_snapshot`` text at time ``at`` of ``history`` (xid -> when it
    began, when it ended or None)."""
    begun = [x for x, (began, _) in history.items() if began < at]
    running = sorted(x for x in begun if history[x][1] is None or history[x][1] >= at)
    xmax = max(begun, default=99) + 1
    xmin = running[0] if running else xmax
    return f"{xmin}:{xmax}:{','.join(map(str, running))}"


@pytest.mark.parametrize("seed", range(40))
def test_the_tick_s_ranges_select_what_its_snapshots_do(seed):
    rng = random.Random(seed)
    history: dict[int, tuple[int, int | None]] = {}
    for step, xid in enumerate(range(100, 140)):
        # Each transaction begins in id order; some end soon, some late, some
        # never (still running at the last tick).
        ends = rng.choice([None, step + 1, step + rng.randint(1, 30)])
        history[xid] = (step, ends)
    first = rng.randint(0, 30)
    prev, cur = snapshot(history, first), snapshot(history, rng.randint(first, 45))
    d = dialect("default")
    xids = list(history)
    ranges = d._in_tick(walk=False).replace("e.txid", "x")
    walk = d._in_tick(walk=True).replace("e.txid", "x")
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT x::text, {ranges}, {walk} FROM unnest(%s::xid8[]) x",
            [
                *d.tick_params(prev, cur, walk=False),
                *d.tick_params(prev, cur, walk=True),
                "{" + ",".join(map(str, xids)) + "}",
            ],
        )
        rows = cursor.fetchall()
    assert len(rows) == len(xids)
    assert [(x, a) for x, a, _ in rows] == [(x, b) for x, _, b in rows], (prev, cur)


def test_a_tick_taken_inside_a_transaction_does_not_see_it_committed():
    """PostgreSQL's snapshots count their own transaction as committed; a
    tick must not, or the events that transaction writes after it would be
    taken as read."""
    d = dialect("default")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_xact_id()")  # take an id
        own = cursor.fetchone()[0]
        # A later transaction elsewhere commits: the snapshot's xmax passes
        # this one's id, which PostgreSQL then leaves out of its running list.
        other = connection.copy()
        try:
            with other.cursor() as elsewhere:
                elsewhere.execute("SELECT pg_current_xact_id()")
        finally:
            other.close()
        tick = d.current_tick(cursor)
        cursor.execute(
            "SELECT pg_visible_in_snapshot(%s, %s::pg_snapshot)", [own, tick]
        )
        assert cursor.fetchone()[0] is False, tick
