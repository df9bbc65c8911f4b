"""Poison input at the inbox, on every database: text no column can hold in
what a consumer raised, CloudEvents attributes the inbox cannot store, and
the deduplication key (consumer, source, message id)."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
from django.utils import timezone

from outbox_app import InboxMessage
from outbox_app.inbox import Tally, receive, receive_batch, retry_due
from outbox_app.store.lifecycle import InboxState
from tests.inbox.conftest import LATER, QUEUE, batch_of, message, mine
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)

UNDECODABLE = "outbox_app.exceptions.UndecodableMessage"


@pytest.fixture
def everything(consumer):
    """``everything``: a consumer of every type, writing one SideEffect each
    (under an id of its own: one message id may come from two sources)."""

    @consumer("*", name="everything")
    def everything(event, context):
        SideEffect.objects.create(
            handler="everything",
            event_id=uuid.uuid4(),
            position=context.payload["order_id"],
        )

    return everything


def effects(name: str = "everything") -> list[int]:
    return sorted(
        SideEffect.objects.filter(handler=name).values_list("position", flat=True)
    )


def altered(n: int, **attributes) -> bytes:
    """Message ``n`` with ``attributes`` replaced (Python's JSON encoder: it
    writes what orjson would refuse, as a foreign producer might)."""
    envelope = json.loads(message(n))
    envelope.update(attributes)
    return json.dumps(envelope).encode()


def test_a_consumer_raising_text_no_column_can_hold_is_recorded_readably(consumer):
    """A lone surrogate and a NUL character in the error (and so in the
    traceback): stored with backslash escapes, the batch goes on."""

    @consumer(OrderPlaced, name="garbled", max_attempts=2)
    def garbled(event, context):
        if event.order_id == 2:
            raise ValueError("bad \udcff and \x00 here")
        SideEffect.objects.create(
            handler="garbled", event_id=context.event_id, position=event.order_id
        )

    tally = receive_batch(batch_of(*(message(n) for n in (1, 2, 3))), {QUEUE: mine()})
    assert (tally.handled, tally.failed) == (2, 1)
    row = InboxMessage.objects.get(state=InboxState.FAILED)
    assert row.last_error == "bad \\udcff and \\x00 here"
    assert "ValueError: bad \\udcff and \\x00 here" in row.last_traceback
    assert retry_due(mine(), now=timezone.now() + LATER).dead == 1  # an UPDATE
    row.refresh_from_db()
    assert (row.state, row.last_error) == (
        InboxState.DEAD,
        "bad \\udcff and \\x00 here",
    )
    assert effects("garbled") == [1, 3]


#: attribute -> (a bad value, what the parked row's error says)
POISON = [
    ("id", "a\x00b", "id holds a NUL character"),
    ("id", 42, "no id (a string each)"),
    ("id", "i" * 256, "id is 256 characters long (the limit is 255)"),
    ("source", "sh\x00op", "source holds a NUL character"),
    ("source", ["shop"], "no source (a string each)"),
    ("source", "s" * 256, "source is 256 characters long (the limit is 255)"),
    ("type", "Order\x00Placed", "type holds a NUL character"),
    ("type", "T" * 256, "type is 256 characters long (the limit is 255)"),
    ("subject", "4\x002", "subject holds a NUL character"),
    ("subject", 42, "subject is not a string (int)"),
    ("subject", "s" * 256, "subject is 256 characters long (the limit is 255)"),
    ("aggregatetype", "shop.\x00Order", "aggregatetype holds a NUL character"),
    ("aggregatetype", {"a": 1}, "aggregatetype is not a string (dict)"),
    ("aggregatetype", "a" * 151, "aggregatetype is 151 characters long"),
    ("specversion", "0.3", "specversion is '0.3'; the inbox reads CloudEvents 1.0"),
    ("specversion", "2.0", "specversion is '2.0'; the inbox reads CloudEvents 1.0"),
]


@pytest.mark.parametrize(
    ("attribute", "value", "reason"), POISON, ids=[f"{a}-{r}" for a, _, r in POISON]
)
def test_a_cloudevent_the_inbox_cannot_store_is_parked_and_the_batch_goes_on(
    everything, attribute, value, reason
):
    poison = altered(2, **{attribute: value})
    tally = receive_batch(batch_of(message(1), poison, message(3)), {QUEUE: mine()})
    assert (tally.handled, tally.dead) == (2, 1)
    assert effects() == [1, 3]
    parked = InboxMessage.objects.get(state=InboxState.DEAD)
    assert parked.last_error_type == UNDECODABLE
    assert reason in parked.last_error
    # Keyed by the body's digest when (source, id) is no usable key, or the
    # body is not read as a CloudEvent at all (another specversion's).
    envelope = json.loads(poison)
    if attribute in ("id", "source", "specversion"):
        assert (parked.source, parked.message_id) == (
            "",
            hashlib.sha256(poison).hexdigest(),
        )
    else:
        assert (parked.source, parked.message_id) == ("shop", envelope["id"])
    assert "\x00" not in parked.body and '"order_id": 2' in parked.body
    # Redelivered: a duplicate, message by message too.
    again = receive(poison, QUEUE, mine())
    assert (again.dead, again.duplicates) == (0, 1)
    assert InboxMessage.objects.filter(state=InboxState.DEAD).count() == 1


def test_a_broker_message_id_the_inbox_cannot_store_is_not_the_key(everything):
    body = b"\xff not json"
    tally = receive_batch([(body, QUEUE, "m\x00" + "x" * 300)], {QUEUE: mine()})
    assert tally.dead == 1
    assert InboxMessage.objects.get().message_id == hashlib.sha256(body).hexdigest()


def test_one_id_from_two_sources_is_two_messages(everything):
    """CloudEvents ids are unique per source: the key is (consumer, source,
    id)."""
    same = uuid.uuid4()
    shop, billing = message(1, event_id=same), message(2, event_id=same, source="bill")
    assert receive_batch(batch_of(shop, billing), {QUEUE: mine()}).handled == 2
    assert receive(billing, QUEUE, mine()).duplicates == 1
    assert receive_batch(batch_of(shop), {QUEUE: mine()}).duplicates == 1
    assert sorted(InboxMessage.objects.values_list("source", "message_id")) == [
        ("bill", str(same)),
        ("shop", str(same)),
    ]
    assert effects() == [1, 2]


def test_a_row_recorded_without_its_source_still_counts_as_the_message(everything):
    """Rows written before the inbox kept the source (an empty one) still
    stop a redelivery of their message, whatever its source."""
    old = uuid.uuid4()
    InboxMessage.objects.create(
        consumer="everything",
        message_id=str(old),
        state=InboxState.HANDLED,
        attempts=1,
    )
    tally = receive_batch(
        batch_of(message(1, event_id=old), message(2)), {QUEUE: mine()}
    )
    assert (tally.handled, tally.duplicates) == (1, 1)
    assert receive(message(1, event_id=old), QUEUE, mine()).duplicates == 1
    assert effects() == [2]


def test_the_context_and_the_admin_show_the_source(consumer, admin_client):
    seen = []

    @consumer(OrderPlaced, name="tells")
    def tells(event, context):
        seen.append(context.source)

    receive(message(1, source="billing-service"), QUEUE, mine())
    assert seen == ["billing-service"]
    row = InboxMessage.objects.get()
    assert (row.state, row.body) == (InboxState.HANDLED, "")  # no body to show it
    page = admin_client.get(f"/admin/outbox_app/inboxmessage/{row.id}/change/")
    assert b"billing-service" in page.content
    # What a differing duplicate's WARNING compares with.
    assert len(row.body_digest) == 64 and row.body_digest.encode() in page.content
    listing = admin_client.get("/admin/outbox_app/inboxmessage/")
    assert listing.status_code == 200
    assert "billing-service" in listing.content.decode()  # the source filter


def test_an_id_received_again_with_another_body_is_logged_and_counted(
    consumer, metrics, caplog
):
    """The first message of an id is the one that ran; another body under
    that id (a producer reusing ids, a tampered message) is acknowledged as
    a duplicate, with a WARNING and a count, in a batch and alone. The same
    event spaced or ordered otherwise is the same body."""

    @consumer(OrderPlaced, name="once", max_attempts=3)
    def once(event, context):
        if event.order_id == 13:
            raise ValueError("unlucky")
        SideEffect.objects.create(
            handler="once", event_id=uuid.uuid4(), position=event.order_id
        )

    def differing() -> float:
        value = metrics.get_sample_value(
            "outbox_consume_differing_duplicates_total", {"consumer": "once"}
        )
        return value or 0.0

    def warned() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        caplog.clear()
        return [line for line in lines if "another body" in line]

    same = uuid.uuid4()
    first, other = message(1, event_id=same), message(2, event_id=same)
    assert receive(first, QUEUE, mine()).handled == 1
    assert receive(other, QUEUE, mine()).duplicates == 1
    [line] = warned()
    assert f"once: message {same} from shop arrived again" in line
    assert "the inbox keeps the first one" in line
    assert differing() == 1
    assert receive_batch(batch_of(other), {QUEUE: mine()}).duplicates == 1
    assert len(warned()) == 1 and differing() == 2
    # The same event again, and as another producer's JSON would write it.
    reordered = json.dumps(dict(reversed(json.loads(first).items())), indent=2)
    assert receive_batch(batch_of(first, reordered.encode()), {QUEUE: mine()}) == (
        Tally(duplicates=2)
    )
    assert receive(reordered, QUEUE, mine()).duplicates == 1
    assert warned() == [] and differing() == 2
    # Both bodies new in one batch: the first runs. A failing consumer sends
    # the batch message by message: still one line and one count.
    again = uuid.uuid4()
    bodies = message(3, event_id=again), message(13), message(4, event_id=again)
    tally = receive_batch(batch_of(*bodies), {QUEUE: mine()})
    assert (tally.handled, tally.failed, tally.duplicates) == (1, 1, 1)
    assert len(warned()) == 1 and differing() == 3
    assert effects("once") == [1, 3]
