"""One word per concept. What was renamed keeps working for one release: the
old name reads the new thing and warns (OutboxDeprecationWarning), and
``manage.py check`` names a renamed setting still in use."""

from __future__ import annotations

import importlib

import pytest
from django.core import checks

from outbox_app.conf import SETTINGS, outbox_settings
from outbox_app.exceptions import OutboxDeprecationWarning
from outbox_app.ops.checks import check_settings
from outbox_app.store.lifecycle import DELIVERY, INBOX, InboxState, State


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("outbox_app.exceptions", "HandlerTimeout", "CallTimeout"),
        ("outbox_app.ops.subscriptions", "WAITING", "RETIRE_WAITING"),
        ("outbox_app.ops.status", "WAITING", "LAG_STATES"),
        ("outbox_app.inbox.receive", "WAITING", "HELD_BACK"),
    ],
)
def test_a_renamed_name_reads_the_new_one_and_warns(module, old, new):
    found = importlib.import_module(module)
    with pytest.warns(OutboxDeprecationWarning, match=f"{old} is renamed {new}"):
        value = getattr(found, old)
    assert value is getattr(found, new)
    assert not hasattr(found, "NOT_A_NAME")


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("POLL_INTERVAL", "POLL_INTERVAL_SECONDS", 2.5),
        ("TRACEBACK_MAX_CHARS", "MAX_TRACEBACK_CHARS", 100),
    ],
)
def test_a_renamed_setting_is_read_with_a_warning_and_checked(
    settings, old, new, value
):
    delattr(settings, f"OUTBOX_{new}") if hasattr(settings, f"OUTBOX_{new}") else None
    setattr(settings, f"OUTBOX_{old}", value)
    with pytest.warns(OutboxDeprecationWarning, match=f"OUTBOX_{old} is renamed"):
        assert getattr(outbox_settings, new) == value
    with pytest.warns(OutboxDeprecationWarning):
        assert getattr(outbox_settings, old) == value  # the attribute too
    [message] = check_settings()
    assert (message.id, message.level) == ("outbox.W010", checks.WARNING)
    assert f"OUTBOX_{old}" in message.msg and f"OUTBOX_{new}" in message.hint
    setattr(settings, f"OUTBOX_{new}", value)  # both: the new one wins
    assert getattr(outbox_settings, new) == value
    [message] = check_settings()
    assert "is ignored" in message.msg


def test_each_setting_is_one_entry_with_its_default_rule_check_and_doc():
    for name, setting in SETTINGS.items():
        assert setting.name == name
        assert setting.doc and setting.check.startswith("outbox.E"), name
        assert setting.valid(setting.default), name
    durations = [n for n in SETTINGS if "INTERVAL" in n or "GROUP" in n]
    assert all(n.endswith("_SECONDS") for n in durations), durations
    limits = [n for n in SETTINGS if "MAX" in n]
    backoff_caps = {"RETRY_MAX_SECONDS", "PAUSE_MAX_SECONDS"}
    assert all(n.startswith("MAX_") for n in set(limits) - backoff_caps), limits


def test_abandon_means_skipped_and_dead_letter_means_dead_in_every_table():
    for table in (DELIVERY, INBOX):
        for t in table:
            if t.name == "abandon":
                assert t.targets == (State.SKIPPED,), t
            if t.targets == (State.DEAD,) and t.by != "relay":
                assert t.name == "dead_letter", t
    assert [t.name for t in INBOX if t.by == "retire"] == ["dead_letter"]
    assert InboxState.DEAD == State.DEAD


def test_an_undecodable_message_is_an_event_that_cannot_be_decoded():
    from outbox_app.exceptions import EventDecodeError, UndecodableMessage

    assert issubclass(UndecodableMessage, EventDecodeError)


def test_a_consumers_policy_method_warns_and_gives_the_one_policy():
    from outbox_app.execution.retry import RetryPolicy
    from outbox_app.inbox.registry import Consumer

    consumer = Consumer(name="c", event_types=None, queue="q", max_attempts=2)
    with pytest.warns(OutboxDeprecationWarning, match="RetryPolicy.of"):
        policy = consumer.policy()
    assert policy == RetryPolicy.of(consumer)
