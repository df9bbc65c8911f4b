"""Benchmarks: each measures outbox_app against a baseline in the same run."""

from __future__ import annotations

import collections
import contextlib
import cProfile
import glob
import inspect
import os
import resource
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def clear() -> None:
    """Empty the outbox: deliveries, events, and the subscriptions and cursors
    relays recorded (a benchmark's subscribers are its own; another run's
    would get deliveries too)."""
    from outbox_app.models import Cursor, Delivery, OutboxEvent, Subscription

    for model in (Delivery, OutboxEvent, Subscription, Cursor):
        model.objects.all().delete()


def record(*subscribers: Any) -> None:
    """Record ``subscribers`` (:class:`~outbox_app.subscribers.Subscriber`
    values) as ``manage.py outbox_subscribers --record`` does: with stream
    delivery their cursors start now, so they receive the events published
    from now on (record before publishing a backlog: events published before
    a subscriber exists are not its); with row delivery, the subscriptions
    fan-out reads."""
    from outbox_app.models import Subscription
    from outbox_app.relay import worker_name

    Subscription.objects.record(subscribers, f"bench {worker_name()}", started=True)


def engine() -> str:
    """The delivery engine of events published now on the default database:
    ``"stream"`` or ``"rows"`` (``OUTBOX_ENGINE`` and the database decide)."""
    from outbox_app.store.gateway import streaming

    return "stream" if streaming() else "rows"


def delivered() -> int:
    """Deliveries done, whichever engine delivered them: SUCCEEDED rows and
    events delivered by stream, one per subscriber
    (:func:`outbox_app.ops.streams.delivered`; reads every event kept)."""
    from outbox_app.ops.streams import delivered as done

    return sum(len(ids) for ids in done().values())


def publish_orders(count: int, aggregate_type: str, **schedule: Any) -> None:
    """``count`` committed ``OrderPlaced`` events (``bench.benchapp``), 1,000 per
    transaction, each transaction's on one aggregate; not fanned out.
    ``schedule``: ``deliver_at`` / ``expires_at`` for ``publish()``."""
    import decimal

    from django.db import transaction

    from bench.benchapp.events import OrderPlaced
    from outbox_app import publish

    for start in range(0, count, 1000):
        with transaction.atomic():
            publish(
                *[
                    OrderPlaced(order_id=i, total=decimal.Decimal(i) / 100)
                    for i in range(start, min(count, start + 1000))
                ],
                aggregate=(aggregate_type, start),
                **schedule,
            )


def context_for(event: Any, delivery: Any = None, subscriber: str = "") -> Any:
    """The ``DeliveryContext`` the relay builds for an ``OutboxEvent`` row and
    its ``Delivery`` row (without one: a first attempt for ``subscriber``):
    what a publisher encodes and a handler receives, for the baselines that
    deliver rows without the relay."""
    from outbox_app.subscribers import DeliveryContext

    return DeliveryContext(
        event_id=event.id,
        namespace=event.namespace,
        event_type=event.event_type,
        revision=event.revision,
        payload=event.payload,
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        aggregate_version=event.aggregate_version,
        headers=event.headers,
        tenant_id=event.tenant_id,
        action_id=event.action_id,
        occurred_at=event.occurred_at,
        attempt=1 if delivery is None else delivery.attempts,
        subscriber=subscriber if delivery is None else delivery.subscriber,
        delivery_id=0 if delivery is None else delivery.id,
    )


def percentile(sorted_values: list[float], p: float) -> float:
    """The ``p`` quantile (0..1) of an ascending list, nearest rank below."""
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p))]


class Stopwatch:
    """Wall time and calls per label of the functions :meth:`watch` chose, read
    from Python's own profiler (``cProfile``, wall clock) running in this
    thread and in every thread started while :meth:`running` is open: nothing
    is replaced. Time spent in another thread than the main one (the relay's
    claim-ahead, its SUCCEEDED marks) is labelled apart; nested stages are
    counted in both. The profiler slows Python code (2-3x on the relay's
    encoding), not the waits on the database or a broker."""

    def __init__(self) -> None:
        self.labels: dict[tuple[str, int, str], str] = {}
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(
            float
        )
        self.calls: collections.Counter[str] = collections.Counter()
        self._profiles: list[tuple[str, cProfile.Profile]] = []

    def watch(self, function: Any, label: str) -> None:
        """Time ``function`` (a function, method or classmethod, decorated or
        not) under ``label``."""
        code = inspect.unwrap(getattr(function, "__func__", function)).__code__
        self.labels[(code.co_filename, code.co_firstlineno, code.co_name)] = label

    def _profile(self) -> None:
        thread = threading.current_thread()
        name = "" if thread is threading.main_thread() else thread.name
        profile = cProfile.Profile(builtins=False)
        self._profiles.append((name.split("_")[0], profile))
        profile.enable()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Profile the block, and the threads it starts, into ``seconds`` and
        ``calls``."""
        self._profiles.clear()
        # A new thread's first profiling event hands the thread to a profile
        # of its own (cProfile follows one thread).
        threading.setprofile(lambda *event: self._profile())
        self._profile()
        try:
            yield
        finally:
            self._profiles[0][1].disable()
            threading.setprofile(None)
            for thread, profile in self._profiles:
                profile.create_stats()
                for key, (_, calls, _, seconds, _) in profile.stats.items():
                    label = self.labels.get(key)
                    if label is not None:
                        if thread:
                            label += f" ({thread})"
                        self.seconds[label] += seconds
                        self.calls[label] += calls

    def report(self, wall: float, items: int, unit: str = "event") -> None:
        """Print each label's calls, seconds, share of ``wall`` and time per
        item, in the order the functions were chosen."""
        for label in self.labels.values():
            for key in sorted(self.seconds, key=len):
                if key != label and not key.startswith(label + " ("):
                    continue
                seconds = self.seconds[key]
                print(
                    f"{key:52} {self.calls[key]:6} x {seconds:6.2f} s "
                    f"{seconds / wall:6.1%} {seconds / items * 1e6:6.0f} us/{unit}"
                )


def lock_skipping_locked(queryset):
    """``select_for_update(skip_locked=True)`` where the database has it,
    locking only the queryset's own table (the baselines' one-row claims); a
    no-op on SQLite, whose writers are serialised."""
    from django.db import connections

    features = connections[queryset.db].features
    if not features.has_select_for_update:
        return queryset
    of = ("self",) if features.has_select_for_update_of else ()
    return queryset.select_for_update(skip_locked=True, of=of)


def vacuum() -> None:
    """On PostgreSQL, VACUUM ANALYZE the outbox tables: each round deletes and
    re-creates 100,000 rows, faster than autovacuum catches up, and the dead
    rows would slow every later round (1.1 million were seen)."""
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            for table in ("outbox_app_outboxevent", "outbox_app_delivery"):
                cursor.execute(f"VACUUM ANALYZE {table}")


def summarize(
    medians: dict[str, float],
    base: float,
    *,
    column: str,
    unit: str,
    title: str,
    plot: str | None,
) -> None:
    """Print each variant's median and its ratio to ``base``; with ``plot``,
    save the medians as ``bench/<plot>.png``."""
    width = max(len(column), *map(len, medians)) + 2
    print(f"{column:<{width}}{unit + ' (median)':>24}{'ratio':>10}")
    for name, rate in medians.items():
        print(f"{name:<{width}}{rate:>24,.0f}{rate / base:>9.2f}x")
    if plot:
        from bench.plot import bars

        path = bars(
            plot,
            title,
            f"{unit} (median)",
            list(medians),
            {unit: list(medians.values())},
        )
        print(f"plot: {path}")


class CpuMeter:
    """CPU seconds spent by each party of a benchmark between :meth:`start`
    and :meth:`stop` (Linux ``/proc``): this process (``self``: a raw client's
    work), its children that exited (``relay``: ``RUSAGE_CHILDREN``), the
    database server (processes named ``postgres``, ``mariadbd``, ``mysqld``),
    RabbitMQ (``beam.smp``) and Kafka (``tansu``). A server's exited workers
    count through their parent's ``cutime``/``cstime`` (a PostgreSQL backend
    whose relay disconnected), so nothing is counted twice or lost."""

    SERVERS = {
        "postgres": "database",
        "mariadbd": "database",
        "mysqld": "database",
        "beam.smp": "rabbitmq",
        "tansu": "kafka",
    }

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.began: dict[str, float] = {}
        self.spent: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        totals = collections.Counter(
            {"self": _own("RUSAGE_SELF"), "relay": _own("RUSAGE_CHILDREN")}
        )
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                text = Path(stat).read_text()
            except OSError:
                continue  # exited meanwhile
            name = text[text.index("(") + 1 : text.rindex(")")]
            party = self.SERVERS.get(name)
            if party:
                fields = text[text.rindex(")") + 2 :].split()
                totals[party] += sum(map(int, fields[11:15])) / self.tick
        return dict(totals)

    def start(self) -> None:
        self.began = self._read()

    def stop(self) -> dict[str, float]:
        """Seconds of CPU per party since :meth:`start`."""
        now = self._read()
        self.spent = {k: now.get(k, 0.0) - self.began.get(k, 0.0) for k in now}
        return self.spent


def _own(who: str) -> float:
    usage = resource.getrusage(getattr(resource, who))
    return usage.ru_utime + usage.ru_stime


def print_cpu(
    cpu: dict[str, list[dict[str, float]]],
    events: int,
    rates: dict[str, float],
    parties: tuple[str, ...],
) -> None:
    """CPU per event of each party (medians over the rounds of
    :meth:`CpuMeter.stop`'s figures), and the cores the run kept busy at its
    median rate: where the machine's cores went."""
    print(
        f"{'CPU per event (us, median)':<28}"
        + "".join(f"{p:>10}" for p in parties)
        + f"{'total':>10}{'cores busy':>12}"
    )
    for name, runs in cpu.items():
        per = {p: statistics.median(r.get(p, 0.0) for r in runs) for p in parties}
        total = sum(per.values())
        print(
            f"{name:<28}"
            + "".join(f"{per[p] / events * 1e6:>10.1f}" for p in parties)
            + f"{total / events * 1e6:>10.1f}{total / events * rates[name]:>12.2f}"
        )
