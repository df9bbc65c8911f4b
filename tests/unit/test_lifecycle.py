"""The lifecycle tables: the one declaration of every state change, the groups
the queries read off them, and the docs page that shows them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from outbox_app.admin.deliveries import TRANSITIONS as ADMIN_ACTIONS
from outbox_app.store import lifecycle
from outbox_app.store.lifecycle import DELIVERY, INBOX, InboxState, State
from outbox_app.store.models import Delivery
from outbox_app.store.querysets import DeliveryQuerySet

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@pytest.mark.parametrize(("name", "table"), [("delivery", DELIVERY), ("inbox", INBOX)])
def test_the_docs_show_the_table_as_declared(name, table):
    page = ARCHITECTURE.read_text()
    shown = re.search(
        rf"<!-- lifecycle: {name} -->\n(.*?)<!-- /lifecycle -->", page, re.S
    )
    assert shown, f"docs/architecture.md has no <!-- lifecycle: {name} --> block"
    assert shown.group(1) == lifecycle.table_markdown(table), (
        "docs/architecture.md differs from store/lifecycle.py; paste "
        f"lifecycle.table_markdown(lifecycle.{name.upper()}) between the markers"
    )


@pytest.mark.parametrize(("table", "states"), [(DELIVERY, State), (INBOX, InboxState)])
def test_every_state_is_reached_and_every_unfinished_one_left(table, states):
    reached = {s for t in table for s in t.targets}
    assert reached == set(states), "a state no transition leads to"
    for state in states:
        assert any(state in t.sources for t in table), f"{state} is never left"
    names = [t.name for t in table]
    assert len(names) == len(set(names)), "one name per transition"
    assert all(
        t.by in {"relay", "consume", "operator", "retire", "purge"} for t in table
    )


def test_rows_are_made_only_by_fan_out_divert_and_hand_over_and_deleted_by_purge():
    assert [t.name for t in DELIVERY if not t.sources] == [
        "fan_out",
        "divert",
        "hand_over",
    ]
    assert [t.name for t in DELIVERY if not t.targets] == ["purge"]
    assert [t.name for t in INBOX if not t.sources] == ["receive"]
    assert [t.name for t in INBOX if not t.targets] == ["purge"]


def test_the_groups_are_read_off_the_table():
    assert lifecycle.CLAIMABLE == (State.PENDING, State.FAILED, State.RUNNING)
    assert lifecycle.FINISHED == (State.SUCCEEDED, State.SKIPPED)
    assert lifecycle.UNFINISHED == (
        State.PENDING,
        State.RUNNING,
        State.FAILED,
        State.DEAD,
    )
    assert lifecycle.REQUEUEABLE == (State.FAILED, State.DEAD)
    assert lifecycle.INBOX_REQUEUEABLE == (InboxState.FAILED, InboxState.DEAD)
    # Only the dead letter and failures are requeued; nothing finished is.
    assert not set(lifecycle.REQUEUEABLE) & set(lifecycle.FINISHED)


def test_the_indexes_select_what_the_claims_and_the_ordering_read():
    conditions = {i.name: i.when for i in Delivery._meta.indexes if hasattr(i, "when")}
    assert conditions["outbox_delivery_due"].children == [
        ("state__in", lifecycle.CLAIMABLE)
    ]
    assert conditions["outbox_delivery_order"].children == [
        ("state__in", lifecycle.UNFINISHED)
    ]


def test_operators_offer_exactly_the_operators_transitions():
    by_operator = {t.name for t in DELIVERY if t.by == "operator"}
    assert set(ADMIN_ACTIONS) <= by_operator
    assert set(DeliveryQuerySet.OPERATOR_TRANSITIONS) == by_operator - {"replay"}


def test_an_unknown_transition_is_a_key_error():
    with pytest.raises(KeyError):
        lifecycle.transition("teleport")
