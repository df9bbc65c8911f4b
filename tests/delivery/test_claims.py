"""Claims against rows another transaction holds (two connections)."""

from __future__ import annotations

import threading

import pytest
from django.db import connections, transaction
from django.test import skipUnlessDBFeature
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.relay import fan_out
from outbox_app.store.gateway import Gateway
from outbox_app.subscribers import Handler
from tests.testapp.events import Step

pytestmark = pytest.mark.django_db(transaction=True)

ORDERED = Handler(name="ord", event_types=frozenset({"Step"}), ordered=True)
UNORDERED = Handler(name="any", event_types=frozenset({"Step"}))


def held(row_id: int):
    """Lock one delivery row in another connection until released."""
    locked, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                list(Delivery.objects.select_for_update().filter(id=row_id))
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(30)
    return release, thread


@skipUnlessDBFeature("has_select_for_update_skip_locked")
@pytest.mark.engine("rows")  # a delivery row's claim
def test_a_locked_head_is_skipped_and_does_not_promote_the_next_row():
    with transaction.atomic():
        for position in range(3):
            publish(Step(position=position), aggregate=("shop.Cart", "1"))
    fan_out(subscribers=[ORDERED, UNORDERED])
    rows = Delivery.objects.for_subscribers(["ord"]).order_by("event_id")
    head = rows.first()
    unordered_head = Delivery.objects.filter(subscriber="any").order_by("id")[0]

    def claim(subscriber):
        _, contexts = Gateway().claim(
            subscriber.stored_names,
            limit=10,
            lease_seconds=60,
            worker="b",
            now=timezone.now(),
            ordered=subscriber.ordered,
            event_types=subscriber.event_types,
        )
        return [c.delivery_id for c in contexts]

    release, thread = held(head.id)
    release_other, other = held(unordered_head.id)
    try:
        assert claim(ORDERED) == []  # not the locked head, nor its successor
        ids = claim(UNORDERED)
        assert len(ids) == 2 and unordered_head.id not in ids  # skipped, not waited
    finally:
        release.set()
        release_other.set()
        thread.join()
        other.join()
    assert claim(ORDERED) == [head.id]


def test_an_ordered_claim_probes_each_candidate_by_index():
    """The ordered claim's two NOT EXISTS run as index probes per candidate on
    every database, whatever its statistics say. PostgreSQL needs the fence:
    as anti-joins, a never-analyzed table got a nested loop rescanning every
    unfinished row per candidate (56 s per claim at 7,780 rows;
    bench/RESULTS.md, "Ordered claims"); MariaDB and SQLite plan dependent
    subqueries by themselves."""
    from django.db import connection

    from outbox_app.store.sql import dialect

    vendor = connection.vendor
    # MariaDB weighs a full scan of a few rows against an index on statistics
    # that InnoDB recalculates in the background: on three rows of one
    # aggregate either is cheap, and which it took varied from run to run.
    # A hundred aggregates make the probe the plan, as on any real table.
    carts = 101 if vendor == "mysql" else 1
    with transaction.atomic():
        for cart in range(1, carts + 1):
            for position in range(3):
                publish(Step(position=position), aggregate=("shop.Cart", str(cart)))
    fan_out(subscribers=[ORDERED])
    # The claim's statement: the candidates, and the byte budget around them.
    candidates = dialect("default").claim_ids(1, True, 1)
    now = dialect("default").datetime_param(timezone.now())
    explain = "EXPLAIN QUERY PLAN" if vendor == "sqlite" else "EXPLAIN"
    with connection.cursor() as cursor:
        if vendor == "mysql":  # statistics of these rows, not earlier tests'
            for model in (Delivery, OutboxEvent):
                cursor.execute(f"ANALYZE TABLE {model._meta.db_table}")
                cursor.fetchall()
        cursor.execute(f"{explain} {candidates}", ["ord", now, "Step", 500, 2**40, 1])
        rows = cursor.fetchall()
    if vendor == "postgresql":
        plan = "\n".join(row[0] for row in rows)
        assert "Anti Join" not in plan, plan
        subplans = [
            line for line in plan.splitlines() if line.strip().startswith("SubPlan")
        ]
        assert len(subplans) == 2, plan
        assert "Seq Scan" not in plan, plan
    elif vendor == "mysql":  # id, select_type, table, type, possible_keys, key
        probes = [row for row in rows if row[1] == "DEPENDENT SUBQUERY"]
        assert {row[2] for row in probes} == {"u", "e"}, rows
        # Any access by a key is a probe (ref, eq_ref, range, and the
        # index_subquery that MariaDB's exists_to_in rewrite may choose);
        # "ALL" and "index" read the whole table or index per candidate.
        assert all(row[3] not in ("ALL", "index") and row[5] for row in probes), [
            (row[2], row[3], row[5])
            for row in probes  # table, access, key
        ]
    else:
        details = [row[3] for row in rows]
        assert details.count("CORRELATED SCALAR SUBQUERY 1") == 1, details
        assert details.count("CORRELATED SCALAR SUBQUERY 2") == 1, details
        for table in ("u", "e"):
            assert any(d.startswith(f"SEARCH {table} USING INDEX") for d in details)
