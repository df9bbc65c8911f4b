"""``python manage.py simulate``: drive the shop through its views, let the relay
and the broker consumer catch up, and reconcile both ends of the outbox.

The broker reconciliation (published vs consumed) covers the publisher named
``"broker"``, the one ``manage.py consume`` reads back; a NATS JetStream
publisher (``SHOP_NATS_URL``) is reconciled on the outbox side: every committed
event it receives has a SUCCEEDED delivery (the stream stored it).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connections
from django.db.models import Count
from django.test import Client

from outbox_app import Delivery, OutboxEvent
from outbox_app.inbox import consumers
from outbox_app.inbox.worker import ConsumeWorker
from outbox_app.management.base import OutboxCommand
from outbox_app.ops import streams
from outbox_app.relay import relay_once
from outbox_app.relay.registry import subscribers
from outbox_app.store.lifecycle import State
from sample_project.shop.handlers import REVIEW_THRESHOLD, PaymentFlagged
from sample_project.shop.models import ConsumedMessage, Product

try:
    from outbox_app.publishers.nats import JetStreamPublisher
except ImportError:  # nats-py is not installed: no NATS publisher to reconcile
    JetStreamPublisher = None

SKUS = ["mug", "tee", "cap", "sock", "pen"]
UNFINISHED = (State.PENDING, State.RUNNING, State.FAILED)
#: The publisher whose messages ``manage.py consume`` reads back (settings.py).
BROKER = "broker"


class Command(OutboxCommand):
    help = (
        "Simulate shop traffic through the shop's JSON views (Django's test Client "
        "in --concurrency threads: real views, real transactions): orders placed, "
        "paid from wallets, cancelled, deposits, withdrawals failing on "
        "insufficient funds (their transactions roll back with their events). "
        "By default the relay and the broker consumer run in this process until "
        "everything is delivered; with --no-relay, external relays (manage.py relay "
        "or Celery worker+beat) and an external `manage.py consume` must do "
        "it within --timeout. Then prints a reconciliation of committed events vs "
        "deliveries per subscriber vs messages consumed from the broker (the "
        "'broker' publisher) and, with SHOP_NATS_URL, the events the NATS "
        "publisher stored in its JetStream stream, and exits with an error if "
        "anything committed was not delivered, anything delivered was never "
        "committed, or a message was consumed twice."
    )

    def add_arguments(self, parser):
        parser.add_argument("--orders", type=int, default=300, help="Orders to place.")
        parser.add_argument(
            "--concurrency", type=int, default=4, help="Client threads (default 4)."
        )
        parser.add_argument(
            "--failure-rate",
            type=float,
            default=0.05,
            help="Share of orders (0-1) whose payment the shop.fraud_check handler "
            "rejects (an expected dead letter). Default 0.05.",
        )
        parser.add_argument(
            "--no-relay",
            action="store_true",
            help="Do not run the relay and consumer in-process; wait for external "
            "ones.",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=300.0,
            help="Seconds to wait for delivery after the traffic (default 300).",
        )
        parser.add_argument("--seed", type=int, default=1, help="Random seed.")

    def handle(self, *args, **options):
        orders, concurrency = options["orders"], options["concurrency"]
        rate = options["failure_rate"]
        if orders < 1 or concurrency < 1:
            raise CommandError("--orders and --concurrency must be positive")
        if not 0 <= rate <= 1:
            raise CommandError("--failure-rate must be between 0 and 1")
        if options["no_relay"] and settings.SHOP_BROKER_URL.startswith("memory://"):
            raise CommandError(
                "--no-relay needs a real broker (OUTBOX_BROKER_URL): memory:// "
                "cannot reach another process's consumer"
            )
        # 409s and expected dead letters are part of the traffic (the table
        # counts them): keep stderr for the progress bar and the errors.
        logging.getLogger("django.request").setLevel(logging.ERROR)
        _ErrorsBesideTheBar.install(logging.getLogger("outbox_app"))
        for sku in SKUS:
            Product.objects.get_or_create(sku=sku, defaults={"stock": 10**6})
        background = [] if options["no_relay"] else _InProcess().start()
        started = time.monotonic()
        traffic = _Traffic(orders, rate, options["seed"], self._progress)
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(traffic.run, range(concurrency), [concurrency] * concurrency))
        driven = time.monotonic() - started
        _ErrorsBesideTheBar.end_bar()
        delivered = self._wait(options["timeout"])
        for stop in background:
            stop()
        elapsed = time.monotonic() - started
        self.stdout.write(
            f"traffic: {sum(traffic.calls.values())} requests in {driven:.1f}s "
            f"({sum(traffic.calls.values()) / driven:.0f}/s); all delivered after "
            f"{elapsed:.1f}s" + ("" if delivered else " (TIMED OUT)")
        )
        for (kind, status), count in sorted(traffic.calls.items()):
            self.stdout.write(f"  {kind:<10} HTTP {status}: {count}")
        problems = _Reconciliation(traffic.rolled_back).report(self.stdout.write)
        if problems:
            raise CommandError("reconciliation failed: " + "; ".join(problems))
        self.stdout.write(self.style.SUCCESS("reconciliation: OK"))

    def _progress(self, done: int, total: int) -> None:
        width = 30
        filled = int(done / total * width)
        _ErrorsBesideTheBar.bar(
            f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} orders"
        )

    def _wait(self, timeout: float) -> bool:
        """Wait until nothing is left to deliver or consume; True when done."""
        deadline = time.monotonic() + timeout
        while True:
            left = _outstanding()
            _ErrorsBesideTheBar.bar(f"waiting for delivery: {left} outstanding    ")
            if left == 0 or time.monotonic() >= deadline:
                _ErrorsBesideTheBar.end_bar()
                return left == 0
            time.sleep(2.0)


class _ErrorsBesideTheBar(logging.Handler):
    """outbox_app's log while simulate runs, in place of the project's
    handlers (one line per record, whatever the project's LOGGING): ERROR and
    above, each on a line of its own below the progress bar, which then goes
    on. The expected dead letters, payments shop.fraud_check rejects on
    purpose (``PaymentFlagged``), are not logged: the table counts them
    (``dead(exp)``)."""

    _lock = threading.Lock()
    _bar_shown = False  # the progress bar's line is open on stderr

    @classmethod
    def install(cls, logger: logging.Logger) -> None:
        logger.handlers = [cls(logging.ERROR)]
        logger.propagate = False
        logger.setLevel(logging.ERROR)

    @classmethod
    def bar(cls, text: str) -> None:
        with cls._lock:
            sys.stderr.write(f"\r{text}")
            sys.stderr.flush()
            cls._bar_shown = True

    @classmethod
    def end_bar(cls) -> None:
        with cls._lock:
            if cls._bar_shown:
                sys.stderr.write("\n")
                cls._bar_shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(arg, PaymentFlagged) for arg in args)

    def emit(self, record: logging.LogRecord) -> None:
        cls = type(self)
        with cls._lock:
            if cls._bar_shown:
                sys.stderr.write("\n")
                cls._bar_shown = False
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()


def _outstanding() -> int:
    """Events not fanned out or still to be read by a cursor + deliveries not
    finished + broker deliveries not consumed yet, counted in the order
    events move (what waits, then what was delivered, then what was
    consumed): counted the other way round, an event delivered between two
    counts is in neither, and the wait ends early."""
    waiting = (
        OutboxEvent.objects.awaiting_fanout().count()
        + streams.awaited()
        + Delivery.objects.filter(state__in=UNFINISHED).count()
    )
    done = streams.delivered()
    broker = sum(len(done.get(name, ())) for name in _broker_names())
    return waiting + max(broker - ConsumedMessage.objects.count(), 0)


def _broker_names() -> tuple[str, ...]:
    """The names the "broker" publisher's deliveries are stored under (its
    own and its aliases); empty when there is none."""
    for publisher in subscribers("publisher"):
        if publisher.name == BROKER:
            return publisher.stored_names
    return ()


def _nats_publishers() -> list:
    """The NATS JetStream publishers (SHOP_NATS_URL's "nats")."""
    if JetStreamPublisher is None:
        return []
    return [p for p in subscribers("publisher") if isinstance(p, JetStreamPublisher)]


class _Traffic:
    """The shop's customers: each thread takes every ``step``-th order."""

    def __init__(self, orders: int, failure_rate: float, seed: int, progress):
        self.orders, self.failure_rate, self.seed = orders, failure_rate, seed
        self.progress = progress
        self.calls: Counter = Counter()
        self.rolled_back: set[str] = set()
        self.done = 0
        self.every = max(orders // 40, 25)
        self.lock = threading.Lock()

    def run(self, first: int, step: int) -> None:
        client = Client(HTTP_HOST="localhost")
        try:
            for i in range(first, self.orders, step):
                self._customer(client, i)
                with self.lock:
                    self.done += 1
                    if self.done % self.every == 0 or self.done == self.orders:
                        self.progress(self.done, self.orders)
        finally:
            connections.close_all()

    def _customer(self, client: Client, i: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + i)
        email = f"customer{i % 400}@example.com"
        flagged = rng.random() < self.failure_rate
        total = (
            REVIEW_THRESHOLD + 50 if flagged else Decimal(rng.randint(500, 20000)) / 100
        )
        if flagged or rng.random() < 0.5:
            self._post(
                client,
                "deposit",
                f"/api/wallets/{email}/deposit",
                amount=str(total * 2 if flagged else rng.randint(50, 300)),
            )
        order = self._post(
            client,
            "place",
            "/api/orders",
            email=email,
            total=str(total),
            sku=rng.choice(SKUS),
            quantity=rng.randint(1, 3),
        )["order"]
        roll = rng.random()
        if flagged or roll < 0.6:
            self._post(client, "pay", f"/api/orders/{order}/pay")
        elif roll < 0.75:
            self._post(client, "cancel", f"/api/orders/{order}/cancel")
        elif roll < 0.9:
            self._post(
                client,
                "withdraw",
                f"/api/wallets/{email}/withdraw",
                amount=str(rng.randint(10, 400)),
            )

    def _post(self, client: Client, kind: str, path: str, **data) -> dict:
        response = client.post(path, json.dumps(data), content_type="application/json")
        body = response.json()
        with self.lock:
            self.calls[kind, response.status_code] += 1
            self.rolled_back.update(body.get("rolled_back_events", ()))
        if response.status_code >= 500 or response.status_code == 400:
            raise CommandError(f"{kind} {path}: HTTP {response.status_code} {body}")
        return body


class _InProcess:
    """The relay and the broker consumer as threads of this process."""

    def __init__(self):
        self.stopping = threading.Event()

    def start(self) -> list:
        threads = [
            threading.Thread(target=self._relay, name="simulate-relay", daemon=True),
            threading.Thread(
                target=self._consume, name="simulate-consumer", daemon=True
            ),
        ]
        for thread in threads:
            thread.start()

        def stop():
            self.stopping.set()
            for thread in threads:
                thread.join()

        return [stop]

    def _relay(self) -> None:
        try:
            while not self.stopping.is_set():
                report = relay_once(stop=self.stopping, max_seconds=5)
                if not report.as_dict() or not any(report.as_dict().values()):
                    self.stopping.wait(0.1)
        finally:
            connections.close_all()

    def _consume(self) -> None:
        try:
            ConsumeWorker(
                consumers([settings.SHOP_EVENTS_QUEUE]), stop=self.stopping
            ).run()
        finally:
            connections.close_all()


class _Reconciliation:
    """Committed events vs deliveries per subscriber vs broker consumption."""

    def __init__(self, rolled_back: set[str]):
        self.rolled_back = rolled_back

    def report(self, write) -> list[str]:
        """Write the table; return the problems found (empty: all reconciled)."""
        problems = []
        committed = dict(
            OutboxEvent.objects.exclude(event_type=None)
            .values_list("event_type")
            .annotate(n=Count("id"))
            .values_list("event_type", "n")
        )
        write(
            f"committed events: {sum(committed.values())} "
            + ", ".join(f"{t} {n}" for t, n in sorted(committed.items()))
        )
        not_fanned = OutboxEvent.objects.awaiting_fanout().count()
        if not_fanned:
            problems.append(f"{not_fanned} events not fanned out")
        header = (
            f"{'subscriber':<24}{'expected':>9}{'delivered':>10}"
            f"{'dead(exp)':>10}{'dead(unexp)':>12}{'unfinished':>11}"
        )
        done = streams.delivered()
        write(header)
        write("-" * len(header))
        for sub in sorted(subscribers(), key=lambda s: s.name):
            expected = sum(n for t, n in committed.items() if sub.receives(t))
            rows = Delivery.objects.filter(subscriber__in=sub.stored_names)
            states = Counter(
                dict(
                    rows.values_list("state")
                    .annotate(n=Count("id"))
                    .values_list("state", "n")
                )
            )
            dead = rows.filter(state=State.DEAD)
            dead_expected = dead.filter(
                last_error_type__endswith=PaymentFlagged.__name__
            ).count()
            dead_unexpected = states[State.DEAD] - dead_expected
            unfinished = sum(states[s] for s in UNFINISHED)
            delivered = sum(len(done.get(name, ())) for name in sub.stored_names)
            write(
                f"{sub.name:<24}{expected:>9}{delivered:>10}"
                f"{dead_expected:>10}{dead_unexpected:>12}{unfinished:>11}"
            )
            if delivered + dead_expected != expected:
                problems.append(
                    f"{sub.name}: {expected} expected, {delivered} "
                    f"delivered + {dead_expected} expected dead letters"
                )
            if dead_unexpected or unfinished:
                problems.append(
                    f"{sub.name}: {dead_unexpected} unexpected dead "
                    f"letters, {unfinished} unfinished"
                )
        problems += self._broker(write)
        for publisher in _nats_publishers():
            problems += self._nats(publisher, write)
        return problems

    def _broker(self, write) -> list[str]:
        problems = []
        done = streams.delivered()
        sent = {str(i) for name in _broker_names() for i in done.get(name, ())}
        consumed = {
            m.replace("-", "")
            for m in ConsumedMessage.objects.values_list("message_id", flat=True)
        }
        sent_keys = {s.replace("-", "") for s in sent}
        committed = {
            str(i).replace("-", "")
            for i in OutboxEvent.objects.values_list("id", flat=True)
        }
        twice = (
            ConsumedMessage.objects.values("message_id")
            .annotate(n=Count("id"))
            .filter(n__gt=1)
            .count()
        )
        rolled = {r.replace("-", "") for r in self.rolled_back}
        leaked = rolled & (committed | consumed)
        write(
            f"broker: published {len(sent)}, consumed {len(consumed)} "
            f"(not consumed {len(sent_keys - consumed)}, consumed but never "
            f"committed {len(consumed - committed)}, consumed twice {twice})"
        )
        write(
            f"rolled-back transactions: {len(rolled)} events published then "
            f"rolled back, {len(leaked)} of them seen committed or consumed"
        )
        if sent_keys - consumed:
            problems.append(f"{len(sent_keys - consumed)} published, not consumed")
        if consumed - committed:
            problems.append(f"{len(consumed - committed)} consumed, never committed")
        if twice:
            problems.append(f"{twice} messages consumed twice")
        if leaked:
            problems.append(f"{len(leaked)} rolled-back events delivered")
        return problems

    def _nats(self, publisher, write) -> list[str]:
        """Every committed event the NATS publisher receives has a SUCCEEDED
        delivery: its PubAck came back, so the stream holds it (once: its
        Nats-Msg-Id names the event)."""
        committed = {
            i
            for i, event_type in OutboxEvent.objects.exclude(
                event_type=None
            ).values_list("id", "event_type")
            if publisher.receives(event_type)
        }
        done = streams.delivered()
        delivered = {i for name in publisher.stored_names for i in done.get(name, ())}
        missing = committed - delivered
        write(
            f"{publisher.name}: delivered {len(delivered)} of "
            f"{len(committed)} committed events to JetStream stream "
            f"{publisher.stream!r} (not delivered {len(missing)})"
        )
        if missing:
            return [f"{publisher.name}: {len(missing)} committed events not in stream"]
        return []
