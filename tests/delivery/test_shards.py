"""Shards: several databases, one outbox each.

An event published on several aliases is written once per alias under one
id, in each alias's own transaction; each alias's relay delivers its copy, in
publish order per aggregate for ordered subscribers, and the handler's
context names the alias. The aliases are ``default`` and every ``shardN`` of
tests/settings.py (``OUTBOX_TEST_SHARDS``: e.g. a second PostgreSQL database
and a MariaDB one beside a PostgreSQL ``default``).
"""

from __future__ import annotations

import datetime
from contextlib import ExitStack, contextmanager

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import transaction
from django.utils import timezone

from outbox_app import (
    InvalidEvent,
    OutboxEvent,
    OutboxRequiresActiveTransaction,
    publish,
)
from outbox_app.relay import relay_once
from tests.testapp.events import Step
from tests.testapp.models import SideEffect

#: Every database of the run: default first, then the shards.
ALIASES = list(settings.DATABASES)
SHARD = ALIASES[-1]
CART = ("shop.Cart", "c")

pytestmark = pytest.mark.django_db(transaction=True, databases=ALIASES)


@contextmanager
def atomic(*aliases: str):
    """``transaction.atomic`` on each alias, nested in the order given (so
    the last one commits first)."""
    with ExitStack() as stack:
        for alias in aliases:
            stack.enter_context(transaction.atomic(using=alias))
        yield


def stored(alias: str) -> list[tuple]:
    return list(
        OutboxEvent.objects.using(alias)
        .order_by("position")
        .values_list("id", "event_type", "payload", "aggregate_id")
    )


def test_publish_on_several_aliases__one_event_id_in_each_outbox(wakeups):
    with atomic(*ALIASES):
        rows = publish(Step(position=1), aggregate=CART, using=ALIASES)
        assert wakeups == []
    assert [row._state.db for row in rows] == ALIASES
    assert len({row.id for row in rows}) == 1
    expected = [(rows[0].id, "Step", {"position": 1}, "c")]
    assert {alias: stored(alias) for alias in ALIASES} == dict.fromkeys(
        ALIASES, expected
    )
    assert sorted(wakeups) == sorted(ALIASES)


def test_publish_on_several_aliases__refused_unless_atomic_on_each():
    with atomic(*ALIASES[:-1]), pytest.raises(OutboxRequiresActiveTransaction):
        publish(Step(position=1), using=ALIASES)
    for using in ([], ["default", "default"], ["default", None]):
        with atomic(*ALIASES), pytest.raises(InvalidEvent):
            publish(Step(position=1), using=using)
    assert all(stored(alias) == [] for alias in ALIASES)


def test_publish_on_several_aliases__is_not_atomic_across_them():
    """The aliases commit one after the other: a failure between the commits
    leaves the event where it committed; publishing it again under its id
    where it is missing repairs that."""
    with pytest.raises(RuntimeError), atomic("default"):
        with atomic(SHARD):
            [row, _] = publish(Step(position=1), using=["default", SHARD])
        raise RuntimeError("after the shard's commit, before default's")
    assert stored("default") == []
    assert [event_id for event_id, *_ in stored(SHARD)] == [row.id]
    with atomic("default"):
        publish(
            {"event_type": "Step", "payload": {"position": 1}, "id": row.id},
            using="default",
        )
    assert stored("default") == stored(SHARD)


def test_each_alias_relays_its_copy_in_order_per_aggregate(registered):
    """One relay per alias; a failure on one shard holds back that shard's
    aggregate only; the handler writes on the alias its context names."""
    seen: dict[str, list[int]] = {alias: [] for alias in ALIASES}

    @registered(Step, name="shards.ordered", ordered=True)
    def ordered(event, context):
        if context.using == SHARD and event.position == 1 and context.attempt == 1:
            raise ConnectionError("the shard's first try at 1 fails")
        seen[context.using].append(event.position)
        SideEffect.objects.using(context.using).create(
            handler="shards.ordered", event_id=context.event_id, position=event.position
        )

    for position in range(3):
        with atomic(*ALIASES):
            publish(Step(position=position), aggregate=CART, using=ALIASES)
    with atomic(SHARD):  # the shard's own event, after the others
        publish(Step(position=3), aggregate=CART, using=SHARD)

    # The first passes judge due times by a clock before the failure: its
    # retry (up to a second later, by the backoff's jitter) is not due,
    # however slow the passes are.
    before = timezone.now()
    for alias in ALIASES:
        for _ in range(4):
            relay_once(using=alias, now=before)
    for alias in ALIASES[:-1]:
        assert seen[alias] == [0, 1, 2]
    assert seen[SHARD] == [0]  # 1 is waiting for its retry; 2 and 3 behind it

    later = timezone.now() + datetime.timedelta(minutes=10)
    for _ in range(4):
        relay_once(using=SHARD, now=later)
    assert seen[SHARD] == [0, 1, 2, 3]
    ids = {
        alias: list(
            SideEffect.objects.using(alias)
            .order_by("position")
            .values_list("event_id", flat=True)
        )
        for alias in ALIASES
    }
    assert all(ids[alias] == ids[SHARD][:3] for alias in ALIASES[:-1])


def test_relay_command_serves_the_database_it_names(registered, capsys):
    delivered = []

    @registered(Step, name="shards.record")
    def record(event, context):
        delivered.append((context.using, event.position))

    with atomic(*ALIASES):
        publish(Step(position=7), using=ALIASES)
    call_command("relay", "--database", SHARD, "--once", verbosity=0)
    assert delivered == [(SHARD, 7)]
    assert "delivered 1," in capsys.readouterr().out


def test_celery_tasks_and_beat_serve_each_alias(registered):
    """The Celery relay tasks take the alias; one beat fragment per alias
    merges without a clash."""
    from outbox_app.tasks import beat_schedule, purge_outbox, run_handlers

    delivered = []

    @registered(Step, name="shards.celery")
    def record(event, context):
        delivered.append((context.using, event.position))

    schedule = {}
    for alias in ALIASES:
        schedule.update(beat_schedule(interval=1.0, using=alias))
    assert len(schedule) == 3 * len(ALIASES)
    assert {entry["kwargs"]["using"] for entry in schedule.values()} == set(ALIASES)
    assert schedule[f"outbox-purge-{SHARD}"]["kwargs"] == {"using": SHARD}

    with atomic(*ALIASES):
        publish(Step(position=5), using=ALIASES)
    assert run_handlers(using=SHARD, max_seconds=5)["succeeded"] == 1
    assert delivered == [(SHARD, 5)]
    assert purge_outbox(older_than_days=0, using=SHARD)["events"] == 1
    assert OutboxEvent.objects.using(SHARD).count() == 0
    assert OutboxEvent.objects.using("default").count() == 1
