"""The database's clock: leases, due times and expiry are compared with it,
never with the host's (a relay whose clock is wrong neither takes over
leases early nor delivers scheduled events early)."""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

from django.apps import apps
from django.conf import settings
from django.db import DatabaseError, connections, router
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from .sql import dialect

logger = logging.getLogger("outbox_app.relay")

#: How often the offset of a database server's clock is measured again, in
#: seconds.
CLOCK_REFRESH_SECONDS = 60.0


#: Added to half a measurement's round trip: how far the host's clock may be
#: from the estimate and still be taken as the database's (the two clocks'
#: rates differ by a few parts per million over a refresh period).
CLOCK_SLACK_SECONDS = 0.002


@dataclass(frozen=True)
class _Reading:
    at: datetime.datetime  # the server's clock (aware, UTC) ...
    monotonic: float  # ... at this time.monotonic(): the round trip's middle
    error: float  # half the round trip, in seconds


_readings: dict[str, _Reading] = {}


def database_now(
    alias: str | None = None, *, writer: bool = False
) -> datetime.datetime:
    """The time by the clock of database ``alias``'s server (default: the
    outbox's, ``router.db_for_write(OutboxEvent)``), to compare with and to
    compute the times stored there: leases, due times, expiry, completions,
    and the times ``publish()`` stamps and counts from.

    The server's clock is read (:attr:`Dialect.clock_sql`, one query) on the
    first call of a process and every :data:`CLOCK_REFRESH_SECONDS`, never
    inside a transaction once read unless ``writer`` (``publish()``, whose
    calls all run in its caller's transaction: a web process would otherwise
    run on its first reading for good, and a monotonic clock stops while
    its virtual machine is suspended); in between it runs on
    ``time.monotonic()`` from the reading (taken as the middle of the round
    trip), so a host clock that is wrong, or steps, changes nothing. When
    the host's clock agrees with the estimate within the reading's
    uncertainty (half its round trip, plus :data:`CLOCK_SLACK_SECONDS`), the
    host's own time is returned. SQLite is embedded: its clock is the
    process's, ``timezone.now()``, with no query.

    Returns:
        An aware datetime, or a naive one in the current time zone when
        ``USE_TZ`` is False, as ``timezone.now()`` gives.

    Raises:
        django.db.DatabaseError: the first reading failed (later ones that
            fail keep the previous reading, and are tried again at the next
            call).
    """
    if alias is None:
        # By the registry, not an import: the models' querysets read this clock.
        alias = router.db_for_write(apps.get_model("outbox_app", "OutboxEvent"))
    host = timezone.now()
    sql = dialect(alias).clock_sql
    if sql is None:
        return host
    reading = _reading(alias, sql, writer)
    estimate = reading.at + datetime.timedelta(
        seconds=time.monotonic() - reading.monotonic
    )
    if not settings.USE_TZ:
        estimate = timezone.make_naive(estimate)
    if abs((estimate - host).total_seconds()) <= reading.error + CLOCK_SLACK_SECONDS:
        return host
    return estimate


def _reading(alias: str, sql: str, writer: bool) -> _Reading:
    reading = _readings.get(alias)
    connection = connections[alias]
    if reading is not None and (
        time.monotonic() - reading.monotonic < CLOCK_REFRESH_SECONDS
        or (connection.in_atomic_block and not writer)
    ):
        return reading
    try:
        with connection.cursor() as cursor:
            began = time.monotonic()
            cursor.execute(sql)
            ended = time.monotonic()
            (value,) = cursor.fetchone()
    except DatabaseError:
        if reading is None:
            raise
        logger.warning("could not read the clock of database %s", alias, exc_info=True)
        return reading
    if isinstance(value, str):
        value = parse_datetime(value)
    if timezone.is_naive(value):  # UTC_TIMESTAMP()
        value = value.replace(tzinfo=datetime.UTC)
    first = reading is None
    reading = _Reading(value, (began + ended) / 2, (ended - began) / 2)
    _readings[alias] = reading
    offset = (value - datetime.datetime.now(datetime.UTC)).total_seconds()
    if first and abs(offset) > 1:
        logger.warning(
            "the clock of database %s is %+.1f s from this host's; outbox_app "
            "compares and stores times by the database's",
            alias,
            offset,
        )
    return reading
