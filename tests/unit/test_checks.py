"""System checks on OUTBOX_* settings."""

from __future__ import annotations

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from outbox_app.conf import mask_url, outbox_settings
from outbox_app.ops.checks import check_settings, check_subscribers
from tests.kit import needs

#: The cases of a NATS publisher: nats-py is an extra (outbox_app[nats]).
NATS = needs("nats", "nats")


def test_defaults_pass(settings):
    assert check_settings() == []


@pytest.mark.parametrize(
    ("name", "value", "check_id"),
    [
        ("OUTBOX_NAMESPACE", "", "outbox.E001"),
        ("OUTBOX_NAMESPACE", 5, "outbox.E001"),
        ("OUTBOX_MAX_PAYLOAD_BYTES", 0, "outbox.E002"),
        ("OUTBOX_MAX_ATTEMPTS", "3", "outbox.E003"),
        ("OUTBOX_MAX_ATTEMPTS", True, "outbox.E003"),
        ("OUTBOX_RETRY_BASE_SECONDS", -1, "outbox.E004"),
        ("OUTBOX_RETRY_MAX_SECONDS", None, "outbox.E005"),
        ("OUTBOX_LEASE_SECONDS", 0, "outbox.E006"),
        ("OUTBOX_HANDLER_GROUP_SECONDS", -0.1, "outbox.E025"),
        ("OUTBOX_BATCH_SIZE", 2.5, "outbox.E007"),
        ("OUTBOX_POLL_INTERVAL_SECONDS", "1s", "outbox.E008"),
        ("OUTBOX_RETENTION_DAYS", 0, "outbox.E009"),
        ("OUTBOX_PUBLISHERS", ["rabbitmq"], "outbox.E010"),
        ("OUTBOX_CELERY_WAKE", "yes", "outbox.E011"),
        ("OUTBOX_MAX_TRACEBACK_CHARS", -1, "outbox.E012"),
        ("OUTBOX_PAUSE_MAX_SECONDS", 0, "outbox.E016"),
        ("OUTBOX_CELERY_APP", 42, "outbox.E017"),
        ("OUTBOX_RETRY_BASE_SECONDS", 120, "outbox.E013"),
    ],
)
def test_malformed_setting_is_reported(settings, name, value, check_id):
    setattr(settings, name, value)
    messages = check_settings()
    assert [m.id for m in messages] == [check_id]
    assert messages[0].level == checks.ERROR
    assert name in messages[0].msg
    assert messages[0].hint
    if check_id != "outbox.E013":  # a pair of settings: checked by `check`
        with pytest.raises(ImproperlyConfigured, match=f"{name} is .*{check_id}"):
            getattr(outbox_settings, name.removeprefix("OUTBOX_"))


@pytest.mark.django_db
def test_a_malformed_setting_read_outside_check_names_itself(settings):
    """In a shell or a web process ``check`` never ran: the code reading the
    setting says which one is wrong (it was a bare TypeError)."""
    from django.db import transaction

    from outbox_app import publish
    from tests.testapp.events import OrderPlaced

    settings.OUTBOX_MAX_PAYLOAD_BYTES = "1mb"
    message = (
        r"OUTBOX_MAX_PAYLOAD_BYTES is '1mb'; it must be a positive integer "
        r"\(bytes\) \(outbox.E002; `python manage.py check` lists"
    )
    with pytest.raises(ImproperlyConfigured, match=message), transaction.atomic():
        publish(OrderPlaced(order_id=1, total=1))


def test_unknown_outbox_setting_warns(settings):
    settings.OUTBOX_MAX_ATTEMTPS = 3
    [message] = check_settings()
    assert (message.id, message.level) == ("outbox.W001", checks.WARNING)
    assert "OUTBOX_MAX_ATTEMTPS" in message.msg
    assert message.hint == "Did you mean OUTBOX_MAX_ATTEMPTS?"
    settings.OUTBOX_SOMETHING_ELSE = 1
    hints = {m.hint for m in check_settings()}
    assert any(h.startswith("Check the spelling: outbox_app's settings") for h in hints)


def test_checks_run_through_manage_py_check(settings):
    settings.OUTBOX_BATCH_SIZE = 0
    errors = checks.run_checks(tags=["outbox"])
    assert "outbox.E007" in [e.id for e in errors]


def test_publisher_that_cannot_be_built_is_reported(settings):
    settings.OUTBOX_PUBLISHERS = {"broken": {"BACKEND": "no.such.Backend"}}
    from outbox_app.ops.checks import check_subscribers

    [message] = check_subscribers()
    assert message.id == "outbox.E015"
    assert "cannot import BACKEND 'no.such.Backend'" in message.msg


def test_publisher_backend_must_be_a_publisher(settings):
    settings.OUTBOX_PUBLISHERS = {"odd": {"BACKEND": "collections.OrderedDict"}}
    from outbox_app.ops.checks import check_subscribers

    [message] = check_subscribers()
    assert "is not a Publisher subclass" in message.msg


def test_handler_for_an_undefined_event_type_warns(handlers):
    from outbox_app import handler
    from outbox_app.ops.checks import check_subscribers
    from outbox_app.relay.registry import unregister

    handler("OrderPlacd", name="typo")(lambda event, context: None)
    try:
        [message] = check_subscribers()
    finally:
        unregister("typo")
    assert (message.id, message.level) == ("outbox.W002", checks.WARNING)
    assert "'OrderPlacd'" in message.msg


def test_sqlite_with_celery_relays_warns(settings):
    from django.db import connections

    from outbox_app.ops.checks import check_sqlite_relays

    settings.OUTBOX_CELERY_WAKE = True
    ids = [m.id for m in check_sqlite_relays()]
    # One per SQLite database (the shard tests add aliases: tests/settings.py).
    sqlite = [alias for alias in connections if connections[alias].vendor == "sqlite"]
    assert ids == ["outbox.W003"] * len(sqlite)
    settings.OUTBOX_CELERY_WAKE = False
    assert check_sqlite_relays() == []


# --- passwords in URLs ------------------------------------------------------------

SECRET = "s3cret"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("amqp://user:s3cret@host:5672//", "amqp://user:**@host:5672//"),
        ("amqp://user:s3cret@host:notaport//", "amqp://user:**@host:notaport//"),
        ("redis://:s3cret@host:xx/0", "redis://:**@host:xx/0"),
        ("amqp://user:pa/s3cret@x@host//", "amqp://user:**@host//"),
        ("amqp://user:s3cret@[::1//", "amqp://user:**@[::1//"),
        ("nats://s3cret@host:4222", "nats://**@host:4222"),
        ("user:s3cret@host", "user:**@host"),
        ("amqp://host//", "amqp://host//"),
        ("memory://", "memory://"),
        ("someone@example.com wrote", "someone@example.com wrote"),
        (
            "'URL' 'amqp://u:s3cret@h:x//' is not a kombu URL: Port could not be",
            "'URL' 'amqp://u:**@h:x//' is not a kombu URL: Port could not be",
        ),
        (
            "['nats://a:s3cret@n1:4222', 'tls://b:s3cret@n2']",
            "['nats://a:**@n1:4222', 'tls://b:**@n2']",
        ),
    ],
)
def test_mask_url_hides_the_secret_of_any_url_by_pattern(text, shown):
    assert mask_url(text) == shown


MALFORMED = "amqp://user:s3cret@host:notaport//"


@pytest.mark.parametrize(
    ("publishers", "check_id"),
    [
        pytest.param({"rabbitmq": {"URL": MALFORMED}}, "outbox.E015", id="kombu"),
        pytest.param(
            {
                "nats": {
                    "BACKEND": "outbox_app.publishers.nats.JetStreamPublisher",
                    "URL": ["nats://user:s3cret@n1:bad", ""],
                    "STREAM": "S",
                }
            },
            "outbox.E015",
            id="nats-list",
            marks=NATS,
        ),
    ],
)
def test_a_malformed_publisher_url_is_masked_in_check_and_errors(
    settings, publishers, check_id
):
    settings.OUTBOX_PUBLISHERS = publishers
    [message] = check_subscribers()
    assert message.id == check_id
    assert SECRET not in message.msg and "user:**@" in message.msg, message.msg
    from outbox_app.relay.registry import publishers as built

    with pytest.raises(ImproperlyConfigured) as raised:
        built()
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    ("name", "value", "check_id"),
    [
        ("OUTBOX_INBOX_URL", "user:s3cret@host", "outbox.E019"),
        ("OUTBOX_PUBLISHERS", [{"URL": MALFORMED}], "outbox.E010"),
    ],
)
def test_a_malformed_url_setting_is_masked(settings, name, value, check_id):
    setattr(settings, name, value)
    [message] = check_settings()
    assert message.id == check_id
    assert SECRET not in message.msg and "user:**@" in message.msg, message.msg
    with pytest.raises(ImproperlyConfigured) as raised:
        getattr(outbox_settings, name.removeprefix("OUTBOX_"))
    assert SECRET not in str(raised.value) and "user:**@" in str(raised.value)


def test_a_url_without_a_scheme_is_masked_where_publishers_show_it():
    pytest.importorskip("nats")  # an extra: outbox_app[nats]
    from outbox_app.publishers.kombu import KombuPublisher
    from outbox_app.publishers.nats import JetStreamPublisher

    kombu = KombuPublisher("p", {"URL": "user:s3cret@host"})
    nats = JetStreamPublisher("n", {"URL": "user:s3cret@host:4222", "STREAM": "S"})
    assert kombu.where == "user:**@host"
    assert nats.where == "user:**@host:4222"
    # A port no parser takes: built (it fails to connect), shown masked.
    odd = JetStreamPublisher("n", {"URL": ["nats://user:s3cret@n1:bad"], "STREAM": "S"})
    assert odd.where == "nats://user:**@n1:bad"


def test_consume_refuses_a_malformed_inbox_url_masked(settings):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    settings.OUTBOX_INBOX_URL = MALFORMED
    with pytest.raises(CommandError) as raised:
        call_command("consume", "--max-seconds", "1")
    assert SECRET not in str(raised.value)
    assert "OUTBOX_INBOX_URL 'amqp://user:**@host:notaport//'" in str(raised.value)


@pytest.mark.django_db
def test_a_pause_logs_and_records_its_reason_masked(caplog):
    import logging

    from django.utils import timezone

    from outbox_app.models import SubscriberPause
    from outbox_app.publishers.base import Publisher
    from outbox_app.relay.sending import pauses

    caplog.set_level(logging.ERROR, logger="outbox_app.relay")
    error = ConnectionError(f"cannot reach redis://:{SECRET}@cache:6379/0")
    try:
        pauses.pause(Publisher("down", {}), error, timezone.now(), "default")
    finally:
        pauses.clear()
    [record] = caplog.records
    assert SECRET not in record.getMessage()
    assert "redis://:**@cache:6379/0" in record.getMessage()
    assert SECRET not in SubscriberPause.objects.get(subscriber="down").reason


@pytest.mark.django_db(transaction=True)
def test_the_relay_refuses_a_malformed_url_masked(settings, caplog):
    from django.core.management import call_command

    settings.OUTBOX_PUBLISHERS = {"rabbitmq": {"URL": MALFORMED}}
    with pytest.raises(ImproperlyConfigured) as raised:
        call_command("relay", "--once", "--verbosity", "0")
    assert SECRET not in str(raised.value)
    assert "amqp://user:**@host:notaport//" in str(raised.value)
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


def test_a_publisher_for_a_misspelt_event_type_is_warned_of(settings):
    settings.OUTBOX_PUBLISHERS = {
        "bus": {"URL": "memory://", "EVENT_TYPES": ["OrderPlaced", "OrderPlacd"]},
        "gadgets": {"URL": "memory://", "EVENT_TYPES": ["GadgetForceDeleted"]},
    }
    warned = [m for m in check_subscribers() if m.id == "outbox.W002"]
    assert [m.msg.split(",")[0] for m in warned] == [
        "publisher 'bus' is registered for event type 'OrderPlacd'"
    ]


def test_records_events_after_models_model_is_an_error():
    from django.db import models
    from django.test.utils import isolate_apps

    from outbox_app import RecordsEvents
    from outbox_app.ops.checks import check_recording_models

    with isolate_apps("tests.testapp") as apps:

        class Inert(models.Model, RecordsEvents):
            class Meta:
                app_label = "testapp"

        class Fine(RecordsEvents, models.Model):
            class Meta:
                app_label = "testapp"

        [error] = check_recording_models([apps.get_app_config("testapp")])
    assert error.id == "outbox.E027" and error.obj is Inert


def test_a_consumer_for_a_near_miss_of_a_known_type_is_warned_of():
    from outbox_app import consumer
    from outbox_app.inbox.registry import unregister_consumer

    @consumer("OrderPlacd", queue="q", name="tests.misspelt")
    def misspelt(event, context):
        pass

    @consumer("InvoiceSent", queue="q", name="tests.foreign")  # another service's
    def foreign(event, context):
        pass

    try:
        warned = [m.msg for m in check_subscribers() if m.id == "outbox.W002"]
    finally:
        unregister_consumer("tests.misspelt")
        unregister_consumer("tests.foreign")
    assert [m for m in warned if "consumer" in m] == [
        "consumer 'tests.misspelt' is registered for event type 'OrderPlacd', "
        "which nothing here defines; did you mean 'OrderPlaced'?"
    ]


@pytest.mark.parametrize(
    ("setting", "value", "check_id", "hint"),
    [
        ("OUTBOX_MAX_ATTEMPTS", "3", "outbox.E003", "(default: 10)"),
        ("OUTBOX_MAX_ATTEMTPS", 3, "outbox.W001", "Did you mean OUTBOX_MAX_ATTEMPTS?"),
        ("OUTBOX_NOTHING_LIKE_IT", 3, "outbox.W001", "OUTBOX_MAX_ATTEMPTS, "),
        (
            "OUTBOX_PUBLISHERS",
            {"bus": {"URL": "amqp://h//", "EXCHNAGE": "x"}},
            "outbox.E015",
            "python -m pydoc outbox_app.publishers.kombu.KombuPublisher",
        ),
        pytest.param(
            "OUTBOX_PUBLISHERS",
            {
                "bus": {
                    "BACKEND": "outbox_app.publishers.nats.JetStreamPublisher",
                    "URL": "nats://h:4222",
                    "STREAM": "S",
                    "DECLARE": True,
                    "DUPLICATE_WINDOW": 1,
                }
            },
            "outbox.W005",
            "python -m pydoc outbox_app.publishers.nats.JetStreamPublisher",
            marks=NATS,
        ),
    ],
)
def test_hints_say_it_there_not_in_pages_a_wheel_lacks(
    settings, setting, value, check_id, hint
):
    """A check's hint is read where the app is installed, often from a wheel,
    which has no docs/ pages: it says what to do itself (the setting's default,
    the close match, every setting's name, the publisher class whose pydoc
    lists the options)."""
    setattr(settings, setting, value)
    found = [m for m in [*check_settings(), *check_subscribers()] if m.id == check_id]
    assert found, check_id
    for message in found:
        assert "docs/" not in message.msg and "docs/" not in (message.hint or "")
    assert any(hint in (m.hint or "") for m in found), [m.hint for m in found]
