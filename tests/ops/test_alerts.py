"""The Prometheus alerting rules shipped in docs/alerts: promtool checks them
and runs their unit tests, and every series they and their tests name is one
this project exposes, with its type (no rate or increase of a gauge) and its
labels."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from outbox_app.execution.metrics import ConsumeMetrics, RelayMetrics
from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events, subscribed

ALERTS = Path(__file__).resolve().parents[2] / "docs" / "alerts"
RULES = ALERTS / "outbox.rules.yml"
UNIT_TESTS = ALERTS / "outbox.tests.yml"
TOKEN = "s3cret-token-for-tests"
#: PromQL functions that want a counter (a range of a value that only rises).
COUNTER_FUNCTIONS = {"rate", "irate", "increase", "resets"}
#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}


def expressions(text: str) -> list[str]:
    """The ``expr:`` of each rule (the rules file keeps each on one line)."""
    return re.findall(r"^\s*expr:\s*(.+?)\s*$", text, flags=re.MULTILINE)


def series(text: str) -> list[tuple[str, set[str]]]:
    """The input series of a promtool test file: (name, label names)."""
    found = []
    for spec in re.findall(r"series:\s*'([^']*)'", text):
        name, _, labels = spec.partition("{")
        found.append((name, set(re.findall(r"(\w+)=", labels))))
    return found


def problems(expr: str, kinds: dict[str, str]) -> list[str]:
    """What is wrong with one expression: a metric that is not exposed, a
    counter function applied to a gauge."""
    wrong = [
        f"{name}: not exposed"
        for name in re.findall(r"\b(outbox_\w+)", expr)
        if name not in kinds
    ]
    for function, name in re.findall(r"\b(\w+)\s*\(\s*(outbox_\w+)", expr):
        if function in COUNTER_FUNCTIONS and kinds.get(name) == "gauge":
            wrong.append(f"{function}({name}): {name} is a gauge")
    return wrong


def exposed(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """The series names of an exposition, each ``"gauge"`` or ``"counter"``
    (a counter's ``_total``, a histogram's ``_bucket``, ``_count`` and
    ``_sum``), and the label names of those that have samples."""
    kinds: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge":
            kinds[family.name] = "gauge"
        elif family.type == "counter":
            kinds[f"{family.name}_total"] = "counter"
        elif family.type == "histogram":
            for suffix in ("_bucket", "_count", "_sum"):
                kinds[family.name + suffix] = "counter"
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return kinds, labels


@pytest.fixture
def scraped(client, settings):
    """Every series this project exposes: the metrics view (an outbox with a
    pending, a dead and a failed delivery and an event awaiting fan-out), and
    the relay's and ``consume``'s own metrics."""
    settings.OUTBOX_METRICS_TOKEN = TOKEN
    first, second, third = events(3)
    delivery(first, "ops.record", State.PENDING)
    delivery(second, "ops.record", State.DEAD)
    delivery(third, "ops.record", State.FAILED)
    events(1)
    with subscribed("OrderPlaced"):
        response = client.get("/outbox/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    texts = [response.content.decode()]
    for metrics in (
        RelayMetrics(),
        ConsumeMetrics(),
    ):
        registry = CollectorRegistry()
        metrics.enable(None, registry=registry)
        texts.append(generate_latest(registry).decode())
    return exposed("\n".join(texts))


@pytest.mark.django_db
def test_every_rule_reads_exposed_series_by_their_type(scraped):
    kinds, _ = scraped
    exprs = expressions(RULES.read_text())
    assert len(exprs) == RULES.read_text().count("- alert:")
    assert [p for e in exprs for p in problems(e, kinds)] == []
    assert {kinds[name] for e in exprs for name in re.findall(r"outbox_\w+", e)} == {
        "gauge"
    }


@pytest.mark.django_db
def test_the_rule_tests_feed_series_the_view_exposes(scraped):
    kinds, labels = scraped
    fed = series(UNIT_TESTS.read_text())
    assert fed
    for name, names in fed:
        assert name in kinds, name
        if name in labels:  # a family without samples has no label names to see
            assert names - TARGET_LABELS == labels[name], name
    assert {"outbox_deliveries", "outbox_lag_seconds"} <= labels.keys()


def test_the_check_finds_a_counter_function_on_a_gauge():
    kinds = {"outbox_deliveries": "gauge", "outbox_relay_outcomes_total": "counter"}
    assert problems('increase(outbox_deliveries{state="dead"}[15m]) > 0', kinds) == [
        "increase(outbox_deliveries): outbox_deliveries is a gauge"
    ]
    assert problems("rate(outbox_relay_outcomes_total[5m]) > 1", kinds) == []
    assert problems("outbox_notifications > 0", kinds) == [
        "outbox_notifications: not exposed"
    ]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["promtool", *args],
        cwd=ALERTS,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.services("promtool")
def test_promtool_checks_the_rules():
    done = promtool("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


@pytest.mark.services("promtool")
def test_promtool_runs_the_rules_unit_tests():
    """Each alert fires after its ``for``, once for two web instances, keeps
    firing while the level stays (where increase() went silent) and resolves."""
    done = promtool("test", "rules", UNIT_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
