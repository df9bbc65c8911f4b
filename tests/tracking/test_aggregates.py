"""Domain events recorded on aggregates and translated into integration
events on save (``outbox_app.publishing.aggregates``), on every database."""

from __future__ import annotations

import decimal

import pytest
from django.db import transaction

from outbox_app import AggregateVersionConflict, DuplicateAggregateVersion, OutboxEvent
from tests.testapp.domain import BonusCredited, Noted, Split
from tests.testapp.models import Account

pytestmark = pytest.mark.django_db(transaction=True)

TEN = decimal.Decimal("10.00")


def published() -> list[tuple[str, int | None]]:
    return list(
        OutboxEvent.objects.order_by("aggregate_version").values_list(
            "event_type", "aggregate_version"
        )
    )


def test_save_translates_recorded_events_and_keeps_internal_ones_inside():
    account = Account.objects.create(owner="ana")
    account.credit(TEN)
    account.record(Noted("internal"))
    account.save()
    assert published() == [("AccountCredited", 1)]
    event = OutboxEvent.objects.get()
    assert event.payload == {"account_id": account.pk, "amount": "10.00"}
    assert (event.aggregate_type, event.aggregate_id) == (
        "testapp.Account",
        str(account.pk),
    )
    assert account.version == 1
    assert Account.objects.get().version == 1
    assert account.recorded_events == []  # committed: drained for good
    account.save()
    assert len(published()) == 1


def test_a_second_save_in_one_transaction_publishes_nothing_more():
    account = Account.objects.create(owner="ana")
    with transaction.atomic():
        account.credit(TEN)
        account.save()
        account.save()
        account.credit(TEN)
        account.save()
    assert published() == [("AccountCredited", 1), ("AccountCredited", 2)]


def test_a_rolled_back_save_keeps_the_events_for_the_retry():
    account = Account.objects.create(owner="ana")
    account.credit(TEN)
    with pytest.raises(RuntimeError), transaction.atomic():
        account.save()
        raise RuntimeError("rolled back")
    assert published() == []
    assert len(account.recorded_events) == 1
    assert account.version == 0  # put back with them
    account.save()  # the retry
    assert published() == [("AccountCredited", 1)]
    assert Account.objects.get().version == account.version == 1


def test_a_rolled_back_savepoint_keeps_them_too():
    account = Account.objects.create(owner="ana")
    with transaction.atomic():
        account.credit(TEN)
        with pytest.raises(RuntimeError), transaction.atomic():
            account.save()
            raise RuntimeError("the savepoint only")
        account.save()
    assert published() == [("AccountCredited", 1)]


def stored() -> tuple:
    account = Account.objects.get()
    return account.owner, account.balance, account.version


def test_a_stale_save_raises_a_version_conflict_and_writes_nothing():
    Account.objects.create(owner="ana")
    first, stale = Account.objects.get(), Account.objects.get()
    first.credit(TEN)
    first.save()
    stale.credit(decimal.Decimal("99"))
    with pytest.raises(AggregateVersionConflict) as raised:
        stale.save()
    # Code that reloads and retries on DuplicateAggregateVersion catches it too.
    assert isinstance(raised.value, DuplicateAggregateVersion)
    assert "version 0" in str(raised.value) and "reload" in str(raised.value)
    assert stored() == ("ana", TEN, 1)
    assert published() == [("AccountCredited", 1)]
    assert stale.version == 0 and len(stale.recorded_events) == 1  # as before


@pytest.mark.parametrize("update_fields", [None, ["owner"]])
def test_a_stale_plain_save_fails_and_leaves_the_stored_version(update_fields):
    """Two instances loaded at one version: the second save of the older one
    fails instead of writing its version over the newer one, which would make
    every later save raise DuplicateAggregateVersion."""
    Account.objects.create(owner="ana")
    first, stale = Account.objects.get(), Account.objects.get()
    first.credit(TEN)
    first.save()
    stale.owner = "bea"
    with pytest.raises(AggregateVersionConflict):
        stale.save(update_fields=update_fields)
    assert stored() == ("ana", TEN, 1)
    stale.refresh_from_db()  # the caller reloads and retries
    stale.owner = "bea"
    stale.save(update_fields=update_fields)
    fresh = Account.objects.get()
    fresh.credit(TEN)
    fresh.save()
    assert stored() == ("bea", 2 * TEN, 2)
    assert published() == [("AccountCredited", 1), ("AccountCredited", 2)]


def test_a_stale_save_caught_in_its_own_atomic_leaves_the_transaction_usable():
    """As any error of an ORM write, the conflict marks the transaction for
    rollback, unless the save has an ``atomic()`` of its own."""
    Account.objects.create(owner="ana")
    first, stale = Account.objects.get(), Account.objects.get()
    first.credit(TEN)
    first.save()
    with transaction.atomic():
        stale.owner = "bea"
        with pytest.raises(AggregateVersionConflict), transaction.atomic():
            stale.save()
        Account.objects.update(owner="cy")
    assert stored() == ("cy", TEN, 1)


def test_a_save_with_update_fields_writes_the_version_it_publishes():
    account = Account.objects.create(owner="ana")
    account.credit(TEN)
    account.save(update_fields=["balance"])
    assert stored() == ("ana", TEN, 1)
    account.credit(TEN)
    account.save(update_fields=["balance"])
    assert stored() == ("ana", 2 * TEN, 2)
    assert published() == [("AccountCredited", 1), ("AccountCredited", 2)]


def fail_on_commit():
    raise RuntimeError("an application's on_commit callback")


@pytest.mark.parametrize("versioned", [True, False])
def test_events_committed_before_a_raising_on_commit_callback_are_published_once(
    versioned,
):
    """Django drops the on-commit callbacks after one that raises, the
    aggregate's own among them: its next save must still know the events
    were committed."""
    account = Account.objects.create(owner="ana")
    if not versioned:
        account.outbox_version_field = None
    account.credit(TEN)
    with (
        pytest.raises(RuntimeError, match="on_commit callback"),
        transaction.atomic(),
    ):
        transaction.on_commit(fail_on_commit)
        account.save()
    assert len(published()) == 1
    assert account.recorded_events == []
    account.owner = "bea"
    account.save()
    account.credit(TEN)
    account.save()
    assert [t for t, _ in published()] == ["AccountCredited"] * 2
    if versioned:
        assert published() == [("AccountCredited", 1), ("AccountCredited", 2)]
        assert stored() == ("bea", 2 * TEN, 2)


def test_events_of_a_rolled_back_save_after_a_raising_callback_are_kept():
    """A transaction that commits with a raising callback, then a save that
    rolls back: the rolled-back events are published by the retry."""
    account = Account.objects.create(owner="ana")
    account.credit(TEN)
    with pytest.raises(RuntimeError), transaction.atomic():
        transaction.on_commit(fail_on_commit)
        account.save()
    account.credit(TEN)
    with pytest.raises(KeyError), transaction.atomic():
        account.save()
        raise KeyError("rolled back")
    assert published() == [("AccountCredited", 1)]
    account.save()
    assert published() == [("AccountCredited", 1), ("AccountCredited", 2)]


def test_several_integration_events_and_the_first_matching_translator():
    account = Account.objects.create(owner="ana")
    account.record(Split(parts=2))
    account.credit(TEN, BonusCredited)  # claimed by Credited's translator
    account.save()
    assert published() == [
        ("AccountCredited", 1),
        ("AccountCredited", 2),
        ("AccountCredited", 3),
    ]
    assert account.version == 3


def test_an_aggregate_with_nothing_recorded_saves_as_a_plain_model():
    account = Account.objects.create(owner="ana")
    account.owner = "bea"
    account.save()
    assert published() == [] and account.version == 0
