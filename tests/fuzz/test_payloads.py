"""publish(), the stored JSON and the CloudEvents body against hostile input
(hypothesis): every input is stored and delivered unchanged (as its JSON form)
or refused before the INSERT with a named ``outbox_app.exceptions`` error, and
nothing is half-written."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import json
import math

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox_app import OutboxEvent, outbox_action, publish
from outbox_app.events.codec import decode, loads
from outbox_app.exceptions import InvalidEvent, OutboxError
from outbox_app.publishers.cloudevents import body
from outbox_app.subscribers import DeliveryContext
from tests.kit import tried
from tests.testapp.events import Address, OrderShipped

pytestmark = pytest.mark.django_db(transaction=True)

#: Every code point, lone surrogates and NUL included.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=20)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too
    | st.floats()  # NaN and infinities too
    | ANY_TEXT
)
JSON_ISH = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(ANY_TEXT | st.integers() | st.none(), inner, max_size=4)
    ),
    max_leaves=12,
)
EXAMPLES = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

TRIED = tried("fuzzed publish()", {"stored": 0, "refused": 0})


def json_form(value):
    """What JSON makes of ``value`` (keys become strings)."""
    return json.loads(json.dumps(value))


def same(a, b) -> bool:
    """Equal as JSON: numbers by value (PostgreSQL's jsonb stores numbers as
    numeric, so 1e16 comes back as the integer 10000000000000000), booleans,
    nulls, strings, arrays and objects exactly."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        # The number the JSON text wrote (jsonb keeps 3.425942732237037e+16
        # as the integer it spells, which the float only approximates).
        return decimal.Decimal(str(a)) == decimal.Decimal(str(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@EXAMPLES
@given(
    event_type=ANY_TEXT,
    payload=st.dictionaries(ANY_TEXT, JSON_ISH, max_size=4),
    headers=JSON_ISH,
)
def test_publish_stores_unchanged_or_refuses_before_the_insert(
    event_type, payload, headers
):
    before = OutboxEvent.objects.count()
    try:
        with transaction.atomic():
            [row] = publish(
                {"event_type": event_type, "payload": payload}, headers=headers
            )
    except OutboxError as exc:
        assert isinstance(exc, InvalidEvent), exc  # refused as bad input
        assert OutboxEvent.objects.count() == before  # nothing written
        TRIED["refused"] += 1
        return
    TRIED["stored"] += 1
    assert headers is None or isinstance(headers, dict), "headers must be a mapping"
    stored = OutboxEvent.objects.get(id=row.id)
    assert stored.event_type == event_type
    assert same(stored.payload, json_form(payload))
    assert same(stored.headers, json_form(headers or {}))
    # What a publisher sends: the same payload, valid UTF-8 JSON.
    context = DeliveryContext(
        event_id=stored.id,
        namespace=stored.namespace,
        event_type=stored.event_type,
        revision=stored.revision,
        payload=stored.payload,
        aggregate_type=None,
        aggregate_id=None,
        aggregate_version=None,
        headers=stored.headers,
        tenant_id=None,
        action_id=None,
        occurred_at=stored.occurred_at,
        attempt=1,
        subscriber="fuzz",
        delivery_id=1,
    )
    assert same(json.loads(body(context).decode())["data"], json_form(payload))


def storable(text: str) -> bool:
    """Text every database stores unchanged: no NUL, no lone surrogate."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


#: Text of any length around the columns' limits (150 and 255 characters).
LONG_TEXT = st.text(st.characters(codec="utf-8"), min_size=140, max_size=270)


@EXAMPLES
@given(
    aggregate_type=ANY_TEXT | LONG_TEXT,
    aggregate_id=ANY_TEXT | LONG_TEXT,
    tenant_id=st.none() | ANY_TEXT | LONG_TEXT,
    operation=st.none() | ANY_TEXT,
    action=st.none()
    | st.tuples(ANY_TEXT, st.dictionaries(ANY_TEXT, JSON_ISH, max_size=3)),
)
def test_every_stored_text_is_stored_unchanged_or_refused_before_the_insert(
    aggregate_type, aggregate_id, tenant_id, operation, action
):
    """The row's other texts (aggregate type and id, tenant, operation, the
    action's name and params): stored as given, or refused with an
    ``InvalidEvent`` before the INSERT, alike on every database (a NUL, a
    lone surrogate, over the column's length)."""
    unstorable = any(
        text is not None and (not storable(text) or len(text) > limit)
        for text, limit in (
            (aggregate_type, 150),
            (aggregate_id, 255),
            (tenant_id, 255),
            (operation, 32),
        )
    )
    before = OutboxEvent.objects.count()
    try:
        with transaction.atomic():
            acting = outbox_action(*action) if action else contextlib.nullcontext()
            with acting:
                [row] = publish(
                    {"event_type": "Fuzzed", "payload": {}},
                    aggregate=(aggregate_type, aggregate_id),
                    tenant_id=tenant_id,
                    operation=operation,
                )
    except OutboxError as exc:
        assert isinstance(exc, InvalidEvent), exc
        assert OutboxEvent.objects.count() == before
        TRIED["refused"] += 1
        return
    TRIED["stored"] += 1
    assert not unstorable, "stored text some database cannot hold"
    stored = OutboxEvent.objects.get(id=row.id)
    assert (
        stored.aggregate_type,
        stored.aggregate_id,
        stored.tenant_id,
        stored.operation,
    ) == (aggregate_type, aggregate_id, tenant_id, operation)
    if action:
        assert stored.action_name == action[0]
        assert same(stored.action_params, json_form(action[1]))


@EXAMPLES
@given(value=JSON_ISH)
def test_stored_json_text_reads_back_as_the_standard_library_reads_it(value):
    try:
        text = json.dumps({"v": value})
    except ValueError:
        return
    assert same(loads(text), json.loads(text)) or any(
        isinstance(x, float) and math.isnan(x) for x in _leaves(value)
    )


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = {"n": value}
    return value


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        ({"n": 2**70 + 1}, None),  # beyond 64 bits: kept exactly
        ({"n": -(2**64)}, None),
        ({"n": float("nan")}, "InvalidPayload"),
        ({"n": float("inf")}, "InvalidPayload"),
        ({"s": "a\x00b"}, "InvalidPayload"),  # no JSON column stores NUL
        ({"s": "\ud800"}, "InvalidPayload"),  # a lone surrogate
        ({"\udfff": 1}, "InvalidPayload"),
        ({"s": "😀 grüße"}, None),  # astral and non-ASCII text
        ({1: "int key", None: "null key"}, None),  # JSON makes them strings
        ({(1, 2): "tuple key"}, "InvalidPayload"),
        (nested(31), None),  # 31 levels: the deepest MariaDB's JSON columns take
        (nested(32), "InvalidPayload"),  # refused on every database alike
        (nested(100_000), "InvalidPayload"),  # deeper than any encoder goes
    ],
    ids=[
        "int-beyond-64-bits",
        "negative-2**64",
        "nan",
        "infinity",
        "nul",
        "lone-surrogate",
        "lone-surrogate-key",
        "astral-text",
        "non-string-keys",
        "tuple-key",
        "nested-31-levels",
        "nested-32-levels",
        "nested-100000",
    ],
)
def test_hostile_payloads(payload, refused):
    try:
        with transaction.atomic():
            [row] = publish({"event_type": "Hostile", "payload": payload})
    except OutboxError as exc:
        assert type(exc).__name__ == refused, exc
        assert not OutboxEvent.objects.exists()
        return
    assert refused is None, f"stored, expected {refused}"
    assert same(OutboxEvent.objects.get(id=row.id).payload, json_form(payload))


@pytest.mark.parametrize("event_type", ["a\x00b", "\ud800", " ", "x" * 256])
def test_unusable_event_types_are_refused_before_the_insert(event_type):
    with pytest.raises(InvalidEvent), transaction.atomic():
        publish({"event_type": event_type, "payload": {}})
    assert not OutboxEvent.objects.exists()


def test_a_payload_at_the_size_limit_is_stored_one_byte_more_is_refused(settings):
    settings.OUTBOX_MAX_PAYLOAD_BYTES = 1000
    text = "é" * ((1000 - len('{"s": ""}')) // 2)  # UTF-8: 2 bytes each
    with transaction.atomic():
        publish({"event_type": "Big", "payload": {"s": text}})
    with (
        pytest.raises(OutboxError, match="OUTBOX_MAX_PAYLOAD_BYTES"),
        transaction.atomic(),
    ):
        publish({"event_type": "Big", "payload": {"s": text + "x" * 2}})
    assert OutboxEvent.objects.count() == 1


# Unicode text (no NUL, no lone surrogates: publish() refuses those, see above).
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
SHIPMENTS = st.builds(
    OrderShipped,
    order_id=st.integers(),
    shipped_at=st.datetimes(
        timezones=st.sampled_from(
            [datetime.UTC, datetime.timezone(datetime.timedelta(hours=-5, minutes=-30))]
        )
    ),
    delivery_date=st.dates(),
    tracking=st.uuids(),
    address=st.builds(Address, city=TEXT, postcode=st.none() | TEXT),
    parcels=st.lists(st.decimals(allow_nan=False, allow_infinity=False), max_size=3),
    note=st.none() | TEXT,
)


@EXAMPLES
@given(event=SHIPMENTS)
def test_an_event_is_decoded_as_it_was_published(event):
    """What a handler receives is the event that was published: Decimal,
    datetime (with its offset), date, UUID, nested dataclasses, lists and
    optionals of them."""
    with transaction.atomic():
        [row] = publish(event)
    stored = OutboxEvent.objects.get(id=row.id)
    assert decode(stored.event_type, stored.revision, stored.payload) == event
