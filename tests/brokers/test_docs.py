"""docs/brokers.md's webhook publisher is real code: run it against a local
HTTP server."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from outbox_app.exceptions import DeliveryError, PublisherUnavailable
from outbox_app.publishers.base import Publisher

from .conftest import across_aggregates

DOC = Path(__file__).resolve().parents[2] / "docs" / "brokers.md"


@pytest.fixture
def webhook_class() -> type[Publisher]:
    section = DOC.read_text().split("## Writing another publisher", 1)[1]
    [code] = [
        block
        for block in re.findall(r"```python\n(.*?)```", section, flags=re.S)
        if "class WebhookPublisher" in block
    ]
    namespace: dict = {"__name__": "docs_brokers"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace["WebhookPublisher"]


@pytest.fixture
def server():
    received: list[tuple[str, dict, dict]] = []
    heads: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, dict(self.headers), json.loads(body)))
            self.send_response(500 if self.path == "/broken" else 204)
            self.end_headers()

        def do_HEAD(self):
            heads.append(self.path)
            # A gateway whose endpoint is down, or an endpoint that takes POST
            # alone.
            self.send_response(503 if self.path == "/down" else 405)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    httpd.received = received
    httpd.heads = heads
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_the_webhook_example_delivers_cloudevents(webhook_class, server):
    url = f"http://127.0.0.1:{server.server_port}/hooks/outbox"
    sent = across_aggregates(3)

    outcomes = webhook_class("hook", {"URL": url}).send_batch(sent)

    assert outcomes == [None] * 3
    assert [event["id"] for _, _, event in server.received] == [
        str(c.event_id) for c in sent
    ]
    _, headers, event = server.received[0]
    assert headers["Content-Type"] == "application/cloudevents+json"
    assert headers["Idempotency-Key"] == event["id"]
    assert event["specversion"] == "1.0"


def test_the_webhook_example_reports_http_errors(webhook_class, server):
    url = f"http://127.0.0.1:{server.server_port}/broken"
    [outcome] = webhook_class("hook", {"URL": url}).send_batch(across_aggregates(1))
    assert isinstance(outcome, DeliveryError)
    assert "500" in str(outcome)


def test_the_webhook_example_reports_an_unreachable_endpoint_as_an_outage(
    webhook_class, server
):
    port = server.server_port
    server.shutdown()
    server.server_close()  # nothing listens on the port any more
    outcomes = webhook_class("hook", {"URL": f"http://127.0.0.1:{port}/x"}).send_batch(
        across_aggregates(3)
    )
    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    assert "refused" in str(outcomes[0]).lower()


def test_the_webhook_example_probes_without_posting(webhook_class, server):
    base = f"http://127.0.0.1:{server.server_port}"
    webhook_class("hook", {"URL": f"{base}/hooks/outbox"}).probe()  # it answers
    with pytest.raises(OSError, match="503"):  # a gateway says it is down
        webhook_class("hook", {"URL": f"{base}/down"}).probe()
    assert server.heads == ["/hooks/outbox", "/down"]
    assert server.received == []  # no event was sent to learn it
    server.shutdown()
    server.server_close()
    with pytest.raises(OSError, match="refused"):
        webhook_class("hook", {"URL": f"{base}/hooks/outbox"}).probe()
