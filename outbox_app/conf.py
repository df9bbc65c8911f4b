"""Every ``OUTBOX_*`` setting, its default, and its meaning.

Settings are read when accessed (never at import time), so ``override_settings``
works in tests. ``docs/settings.md`` lists the same table; ``checks.py``
validates each value with ``outbox.E001``-``outbox.E0xx``.

Usage::

    from outbox_app.conf import outbox_settings
    outbox_settings.MAX_ATTEMPTS
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class Setting:
    default: Any
    doc: str


DEFAULTS: dict[str, Setting] = {
    "NAMESPACE": Setting(
        "default",
        "Service identifier stamped on every outbox event (CloudEvents `source`).",
    ),
    "MAX_PAYLOAD_BYTES": Setting(
        1024 * 1024, "Largest encoded payload publish() accepts, in bytes."
    ),
    "MAX_ATTEMPTS": Setting(10, "Attempts per delivery before it is DEAD."),
    "RETRY_BASE_SECONDS": Setting(
        1.0, "First backoff ceiling in seconds; doubles with each attempt."
    ),
    "RETRY_MAX_SECONDS": Setting(600.0, "Largest backoff ceiling, in seconds."),
    "LEASE_SECONDS": Setting(
        60.0,
        "How long a claimed delivery stays leased to one worker, in seconds.",
    ),
    "HANDLER_GROUP_SECONDS": Setting(
        0.1,
        "Longest a group of in-process handlers shares one transaction and one "
        "mark, in seconds (a tenth of LEASE_SECONDS, if less); 0: each handler "
        "alone (chosen by measurement: docs/settings.md).",
    ),
    "BATCH_SIZE": Setting(
        500,
        "Rows claimed per batch by fan-out and delivery (chosen by measurement: "
        "docs/settings.md).",
    ),
    "BATCH_BYTES": Setting(
        8 * 1024 * 1024,
        "Payload bytes (UTF-8 JSON) claimed per batch at most, besides "
        "BATCH_SIZE rows; a larger payload is claimed alone (chosen by "
        "measurement: docs/settings.md).",
    ),
    "PREPARED_STATEMENTS": Setting(
        False,
        "PostgreSQL with psycopg 3: the relay prepares its statements on its "
        "connections (planned once, not at every run); off by default, as "
        "Django's own statements are, for connection poolers in transaction "
        "mode (docs/databases.md).",
    ),
    "ENGINE": Setting(
        "rows",
        'How relays deliver new events: "stream" (each subscriber reads the '
        "outbox through its cursors and writes a delivery row only for what "
        'needs attention), "rows" (a delivery row per event and subscriber), '
        "or None: stream where the database can (PostgreSQL, SQLite), rows "
        "elsewhere (MySQL/MariaDB).",
    ),
    "PARTITIONS": Setting(
        1,
        "Stream delivery: how many partitions each subscriber's events are "
        "split into by a hash of their aggregate, each read by one relay at a "
        "time (a subscriber's own `partitions` option wins); more than one "
        "lets several relays share a subscriber.",
    ),
    "POLL_INTERVAL": Setting(
        1.0, "Longest idle wait of the relay loop between polls, in seconds."
    ),
    "PAUSE_MAX_SECONDS": Setting(
        30.0,
        "Longest wait between probes of a publisher paused by an outage of its "
        "destination, in seconds.",
    ),
    "RETENTION_DAYS": Setting(
        30, "Finished rows older than this many days may be purged."
    ),
    "PUBLISHERS": Setting(
        {}, "Broker destinations: name -> options (see docs/brokers.md)."
    ),
    "CELERY_WAKE": Setting(
        False, "Enqueue the Celery relay_events task when a transaction commits."
    ),
    "CELERY_APP": Setting(
        None,
        'Dotted path of the Celery app wake-ups are sent with ("proj.celery.app"); '
        "None: an app configured from Django's CELERY_* settings.",
    ),
    "TRACEBACK_MAX_CHARS": Setting(
        8000, "Longest traceback kept on a failed delivery, in characters."
    ),
    "METRICS_TOKEN": Setting(
        None,
        "Bearer token metrics_view wants (Authorization: Bearer <token>); None: "
        "the view checks none (protect its route yourself).",
    ),
    "INBOX_URL": Setting(
        None,
        "kombu URL of the broker `manage.py consume` reads from "
        '("amqp://guest:guest@127.0.0.1:5672//", "redis://..."); None: consume '
        "refuses to start.",
    ),
    "INBOX_EXCHANGE": Setting(
        "outbox",
        "Exchange the consumers' queues are bound to: the producer's publisher "
        "EXCHANGE.",
    ),
    "INBOX_EXCHANGE_TYPE": Setting(
        "topic", "Its type, as the producer declares it (topic, direct, fanout)."
    ),
    "INBOX_PREFETCH": Setting(
        100,
        "Messages the broker sends `consume` ahead of its acks (chosen by "
        "measurement: bench/RESULTS.md).",
    ),
    "INBOX_RETENTION_DAYS": Setting(
        7,
        "Handled inbox rows older than this many days are purged; a duplicate "
        "arriving later runs its consumer again.",
    ),
}


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def positive_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


def non_negative_number(value: Any) -> bool:
    return (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0
    )


def valid_namespace(value: Any) -> bool:
    return isinstance(value, str) and len(value.strip()) > 0 and len(value) <= 255


def valid_publishers(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, dict) for k, v in value.items()
    )


#: setting -> (check id, predicate, what a valid value is): ``manage.py check``
#: reports every violation (checks.py); reading one raises it.
SECONDS = (positive_number, "a positive number of seconds")
RULES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "NAMESPACE": (
        "outbox.E001",
        valid_namespace,
        "a non-empty string of at most 255 characters",
    ),
    "MAX_PAYLOAD_BYTES": ("outbox.E002", positive_int, "a positive integer (bytes)"),
    "MAX_ATTEMPTS": ("outbox.E003", positive_int, "a positive integer"),
    "RETRY_BASE_SECONDS": ("outbox.E004", *SECONDS),
    "RETRY_MAX_SECONDS": ("outbox.E005", *SECONDS),
    "LEASE_SECONDS": ("outbox.E006", *SECONDS),
    "HANDLER_GROUP_SECONDS": (
        "outbox.E025",
        non_negative_number,
        "a non-negative number of seconds",
    ),
    "BATCH_SIZE": ("outbox.E007", positive_int, "a positive integer (rows)"),
    "BATCH_BYTES": ("outbox.E024", positive_int, "a positive integer (bytes)"),
    "POLL_INTERVAL": ("outbox.E008", *SECONDS),
    "ENGINE": (
        "outbox.E029",
        lambda v: v in (None, "stream", "rows"),
        'None, "stream" or "rows"',
    ),
    "PARTITIONS": ("outbox.E030", positive_int, "a positive integer"),
    "PREPARED_STATEMENTS": (
        "outbox.E028",
        lambda v: isinstance(v, bool),
        "True or False",
    ),
    "RETENTION_DAYS": ("outbox.E009", positive_int, "a positive integer (days)"),
    "PUBLISHERS": ("outbox.E010", valid_publishers, "a dict of name -> options"),
    "CELERY_WAKE": ("outbox.E011", lambda v: isinstance(v, bool), "True or False"),
    "TRACEBACK_MAX_CHARS": ("outbox.E012", non_negative_int, "a non-negative integer"),
    "PAUSE_MAX_SECONDS": ("outbox.E016", *SECONDS),
    "CELERY_APP": (
        "outbox.E017",
        lambda v: v is None or isinstance(v, str),
        'a dotted path ("yourproject.celery.app") or None',
    ),
    "INBOX_URL": (
        "outbox.E019",
        lambda v: v is None or (isinstance(v, str) and "://" in v),
        'None or a kombu URL ("amqp://...", "redis://...")',
    ),
    "INBOX_EXCHANGE": ("outbox.E020", valid_namespace, "a non-empty string"),
    "INBOX_EXCHANGE_TYPE": (
        "outbox.E021",
        lambda v: v in ("topic", "direct", "fanout", "headers"),
        "topic, direct, fanout or headers",
    ),
    "INBOX_PREFETCH": ("outbox.E022", positive_int, "a positive integer (messages)"),
    "INBOX_RETENTION_DAYS": (
        "outbox.E023",
        positive_int,
        "a positive integer (days)",
    ),
    "METRICS_TOKEN": (
        "outbox.E018",
        lambda v: v is None or (isinstance(v, str) and len(v) >= 16),
        "None or a string of at least 16 characters",
    ),
}


class OutboxSettings:
    """Attribute access to ``settings.OUTBOX_<NAME>`` with the defaults above,
    validated where it is read.

    Raises:
        ImproperlyConfigured: the value breaks its rule in :data:`RULES`; the
            message names the setting, what it must be and the check id (a
            shell or a web server never ran ``check``).
        AttributeError: not an outbox setting.
    """

    def raw(self, name: str) -> Any:
        """The value as configured, unvalidated (the system checks read it)."""
        try:
            spec = DEFAULTS[name]
        except KeyError:
            raise AttributeError(f"unknown outbox setting {name!r}") from None
        return getattr(settings, f"OUTBOX_{name}", spec.default)

    def __getattr__(self, name: str) -> Any:
        value = self.raw(name)
        rule = RULES.get(name)
        if rule is not None and not rule[1](value):
            check_id, _, expected = rule
            raise ImproperlyConfigured(
                f"OUTBOX_{name} is {mask_url(repr(value))}; it must be {expected} "
                f"({check_id}; "
                "`python manage.py check` lists every malformed setting)."
            )
        return value


outbox_settings = OutboxSettings()


#: A URL's userinfo anywhere in a text: ``scheme://``, a user, and a password
#: running to the last ``@`` before a blank (a password may hold ``/`` or
#: ``@``), or a token alone.
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s:@/]*)(?P<password>:\S*)?@"
)


def mask_url(text: str) -> str:
    """``text`` with the secret of every URL in it masked, for every message,
    log line and page that shows a URL: ``amqp://user:s3cret@host//`` becomes
    ``amqp://user:**@host//``, a token (``nats://t0ken@host``) ``nats://**@host``.

    By pattern, not by parsing: a URL no parser takes (a port that is not a
    number, an unclosed ``[``, a password holding ``/``) is masked too, and
    so is every URL inside a longer text (an exception's message, a
    setting's repr). A text that is one word without ``://`` but with an
    ``@`` is one URL without a scheme (kombu reads ``user:pass@host`` as a
    host name): its part before the last ``@`` is masked.
    """
    if "://" not in text:
        if "@" not in text or len(text.split()) != 1:
            return text
        userinfo, _, host = text.rpartition("@")
        return f"{_hidden(userinfo)}@{host}"
    return _USERINFO.sub(
        lambda m: f"{m['scheme']}{_hidden(m['user'] + (m['password'] or ''))}@", text
    )


def _hidden(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    return f"{user}:**" if colon else "**"
