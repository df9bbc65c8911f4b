"""The publisher's ``basic.publish`` frames are py-amqp's, byte for byte."""

from types import SimpleNamespace

import amqp
import pytest
from amqp import spec
from amqp.method_framing import frame_writer
from amqp.serialization import dumps

from outbox_app.publishers.amqp_frames import PublishFrames

FRAME_MAX = 4096
CONTENT_TYPE = "application/cloudevents+json"


def pyamqp(channel, exchange, key, body, message_id, type, expiration=None):
    """What py-amqp's ``Channel.basic_publish`` writes (mandatory)."""
    written = bytearray()
    connection = SimpleNamespace(frame_max=FRAME_MAX, bytes_sent=0)
    write = frame_writer(connection, SimpleNamespace(write=written.extend))
    properties = dict(
        content_type=CONTENT_TYPE,
        content_encoding="utf-8",
        delivery_mode=2,
        message_id=message_id,
        type=type,
    )
    if expiration is not None:
        properties["expiration"] = expiration
    message = amqp.Message(body, **properties)
    args = dumps("Bssbb", (0, exchange, key, True, False))
    write(1, channel, spec.Basic.Publish, args, message)
    return bytes(written)


@pytest.mark.parametrize(
    "key, body, expiration",
    [
        ("shop.Order.OrderPlaced", b'{"data":{"id":1}}', None),
        ("shop.Order.OrderPlaced", b'{"data":{"id":1}}', "1500"),
        ("", b"", None),  # no body: no body frame
        ("clé.é", "données".encode() * 10, "0"),
        ("big", b"x" * (3 * FRAME_MAX + 17), None),  # split into 4 body frames
        ("exact", b"y" * (FRAME_MAX - 8), None),
    ],
)
def test_a_batch_is_py_amqp_s_frames_one_after_the_other(key, body, expiration):
    frames = PublishFrames(7, FRAME_MAX, "shop.events", CONTENT_TYPE, "utf-8")
    out = bytearray()
    for message_id in ("0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10", "m2"):
        frames.add(out, key, body, message_id, "OrderPlaced", expiration)
    assert bytes(out) == b"".join(
        pyamqp(7, "shop.events", key, body, m, "OrderPlaced", expiration)
        for m in ("0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10", "m2")
    )


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("type", "é" * 200, "'type' is 400 bytes"),
        ("message_id", "m" * 256, "'message_id' is 256 bytes"),
        ("key", "k" * 300, "'routing_key' is 300 bytes"),
        ("type", "\ud800", "surrogates not allowed"),
    ],
)
def test_a_value_that_is_no_short_string_is_refused_and_nothing_written(
    field, value, error
):
    frames = PublishFrames(1, FRAME_MAX, "x", CONTENT_TYPE, "utf-8")
    out = bytearray(b"before")
    values = {"key": "k", "message_id": "m", "type": "t", field: value}
    with pytest.raises(ValueError, match=error):
        frames.add(out, values["key"], b"{}", values["message_id"], values["type"])
    assert out == b"before"


def test_an_exchange_name_that_is_no_short_string_is_refused():
    with pytest.raises(ValueError, match="'exchange' is 256 bytes"):
        PublishFrames(1, FRAME_MAX, "e" * 256, CONTENT_TYPE, "utf-8")
