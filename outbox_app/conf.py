"""Every ``OUTBOX_*`` setting: one entry each (:data:`SETTINGS`) with its
default, its rule and the system check that reports a value breaking it, and
its meaning.

Settings are read when accessed (never at import time), so ``override_settings``
works in tests. ``docs/settings.md`` lists the same table (a test keeps it
so); ``ops/checks.py`` reports every value that breaks its rule
(``outbox.E0xx``) and every renamed setting still in use (``outbox.W010``).

Usage::

    from outbox_app.conf import outbox_settings
    outbox_settings.MAX_ATTEMPTS

Names: a duration ends in ``_SECONDS`` (or ``_DAYS``), a size in its unit
(``_BYTES``, ``_CHARS``); a limit starts with ``MAX_`` (``MAX_ATTEMPTS``),
but a backoff's largest wait keeps its backoff's name first, beside its
first one (``RETRY_BASE_SECONDS``, ``RETRY_MAX_SECONDS``;
``PAUSE_MAX_SECONDS``).
"""

from __future__ import annotations

import numbers
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .exceptions import OutboxDeprecationWarning


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


def boolean(value: Any) -> bool:
    return isinstance(value, bool)


@dataclass(frozen=True)
class Setting:
    """One ``OUTBOX_<name>`` setting.

    Attributes:
        name: its name without ``OUTBOX_``.
        default: its value when the project sets none.
        check: the system check id reporting a value that breaks ``valid``
            (``manage.py check``); reading such a value raises
            ImproperlyConfigured naming it.
        valid: the rule a value must follow.
        expected: what a valid value is, as messages say it.
        doc: what it means, in a sentence (docs/settings.md says more).
        renamed_from: its former names, still read for one release (with
            an :class:`~outbox_app.exceptions.OutboxDeprecationWarning` and
            ``outbox.W010``) when it is not set itself.
    """

    name: str
    default: Any
    check: str
    valid: Callable[[Any], bool]
    expected: str
    doc: str
    renamed_from: tuple[str, ...] = ()


SECONDS = {"valid": positive_number, "expected": "a positive number of seconds"}

#: Every setting, by name.
SETTINGS: dict[str, Setting] = {
    setting.name: setting
    for setting in (
        Setting(
            "NAMESPACE",
            "default",
            "outbox.E001",
            valid_namespace,
            "a non-empty string of at most 255 characters",
            "Service identifier stamped on every outbox event (CloudEvents `source`).",
        ),
        Setting(
            "MAX_PAYLOAD_BYTES",
            1024 * 1024,
            "outbox.E002",
            positive_int,
            "a positive integer (bytes)",
            "Largest encoded payload publish() accepts, in bytes.",
        ),
        Setting(
            "MAX_ATTEMPTS",
            10,
            "outbox.E003",
            positive_int,
            "a positive integer",
            "Attempts per delivery before it is DEAD.",
        ),
        Setting(
            "RETRY_BASE_SECONDS",
            1.0,
            "outbox.E004",
            **SECONDS,
            doc="First backoff ceiling in seconds; doubles with each attempt.",
        ),
        Setting(
            "RETRY_MAX_SECONDS",
            600.0,
            "outbox.E005",
            **SECONDS,
            doc="Largest backoff ceiling, in seconds.",
        ),
        Setting(
            "LEASE_SECONDS",
            60.0,
            "outbox.E006",
            **SECONDS,
            doc="How long a claimed delivery stays leased to one worker, in seconds.",
        ),
        Setting(
            "HANDLER_GROUP_SECONDS",
            0.1,
            "outbox.E025",
            non_negative_number,
            "a non-negative number of seconds",
            "Longest a group of in-process handlers shares one transaction and "
            "one mark, in seconds (a tenth of LEASE_SECONDS, if less); 0: each "
            "handler alone (chosen by measurement: docs/settings.md).",
        ),
        Setting(
            "BATCH_SIZE",
            500,
            "outbox.E007",
            positive_int,
            "a positive integer (rows)",
            "Rows claimed per batch by fan-out and delivery (chosen by "
            "measurement: docs/settings.md).",
        ),
        Setting(
            "BATCH_BYTES",
            8 * 1024 * 1024,
            "outbox.E024",
            positive_int,
            "a positive integer (bytes)",
            "Payload bytes (UTF-8 JSON) claimed per batch at most, besides "
            "BATCH_SIZE rows; a larger payload is claimed alone (chosen by "
            "measurement: docs/settings.md).",
        ),
        Setting(
            "PREPARED_STATEMENTS",
            False,
            "outbox.E028",
            boolean,
            "True or False",
            "PostgreSQL with psycopg 3: the relay prepares its statements on "
            "its connections (planned once, not at every run); off by default, "
            "as Django's own statements are, for connection poolers in "
            "transaction mode (docs/databases.md).",
        ),
        Setting(
            "ENGINE",
            None,
            "outbox.E029",
            lambda v: v in (None, "stream", "rows"),
            'None, "stream" or "rows"',
            'How relays deliver new events: "stream" (each subscriber reads '
            "the outbox through its cursors and writes a delivery row only for "
            'what needs attention), "rows" (a delivery row per event and '
            "subscriber), or None: stream.",
        ),
        Setting(
            "PARTITIONS",
            1,
            "outbox.E030",
            positive_int,
            "a positive integer",
            "Stream delivery: how many partitions each subscriber's events are "
            "split into by a hash of their aggregate, each read by one relay at "
            "a time (a subscriber's own `partitions` option wins); more than "
            "one lets several relays share a subscriber.",
        ),
        Setting(
            "POLL_INTERVAL_SECONDS",
            1.0,
            "outbox.E008",
            **SECONDS,
            doc="Longest idle wait of the relay loop between polls, in seconds.",
            renamed_from=("POLL_INTERVAL",),
        ),
        Setting(
            "PAUSE_MAX_SECONDS",
            30.0,
            "outbox.E016",
            **SECONDS,
            doc="Longest wait between probes of a publisher paused by an outage "
            "of its destination, in seconds.",
        ),
        Setting(
            "RETENTION_DAYS",
            30,
            "outbox.E009",
            positive_int,
            "a positive integer (days)",
            "Finished rows older than this many days may be purged.",
        ),
        Setting(
            "PUBLISHERS",
            {},
            "outbox.E010",
            valid_publishers,
            "a dict of name -> options",
            "Broker destinations: name -> options (see docs/brokers.md).",
        ),
        Setting(
            "CELERY_WAKE",
            False,
            "outbox.E011",
            boolean,
            "True or False",
            "Enqueue the Celery relay_events task when a transaction commits.",
        ),
        Setting(
            "CELERY_APP",
            None,
            "outbox.E017",
            lambda v: v is None or isinstance(v, str),
            'a dotted path ("yourproject.celery.app") or None',
            "Dotted path of the Celery app wake-ups are sent with "
            '("proj.celery.app"); None: an app configured from Django\'s '
            "CELERY_* settings.",
        ),
        Setting(
            "MAX_TRACEBACK_CHARS",
            8000,
            "outbox.E012",
            non_negative_int,
            "a non-negative integer",
            "Longest traceback kept on a failed delivery, in characters.",
            renamed_from=("TRACEBACK_MAX_CHARS",),
        ),
        Setting(
            "METRICS_TOKEN",
            None,
            "outbox.E018",
            lambda v: v is None or (isinstance(v, str) and len(v) >= 16),
            "None or a string of at least 16 characters",
            "Bearer token metrics_view wants (Authorization: Bearer <token>); "
            "None: the view checks none (protect its route yourself).",
        ),
        Setting(
            "INBOX_URL",
            None,
            "outbox.E019",
            lambda v: v is None or (isinstance(v, str) and "://" in v),
            'None or a kombu URL ("amqp://...", "redis://...")',
            "kombu URL of the broker `manage.py consume` reads from "
            '("amqp://guest:guest@127.0.0.1:5672//", "redis://..."); None: '
            "consume refuses to start.",
        ),
        Setting(
            "INBOX_EXCHANGE",
            "outbox",
            "outbox.E020",
            valid_namespace,
            "a non-empty string",
            "Exchange the consumers' queues are bound to: the producer's "
            "publisher EXCHANGE.",
        ),
        Setting(
            "INBOX_EXCHANGE_TYPE",
            "topic",
            "outbox.E021",
            lambda v: v in ("topic", "direct", "fanout", "headers"),
            "topic, direct, fanout or headers",
            "Its type, as the producer declares it (topic, direct, fanout).",
        ),
        Setting(
            "INBOX_PREFETCH",
            100,
            "outbox.E022",
            positive_int,
            "a positive integer (messages)",
            "Messages the broker sends `consume` ahead of its acks (chosen by "
            "measurement: docs/consumers.md).",
        ),
        Setting(
            "INBOX_RETENTION_DAYS",
            7,
            "outbox.E023",
            positive_int,
            "a positive integer (days)",
            "Handled inbox rows older than this many days are purged; a "
            "duplicate arriving later runs its consumer again.",
        ),
    )
}
#: A former name -> the setting that took its place.
RENAMED: dict[str, Setting] = {
    old: setting for setting in SETTINGS.values() for old in setting.renamed_from
}


def setting(name: str) -> Setting:
    """The setting called ``name`` (without ``OUTBOX_``); a former name warns
    (:class:`~outbox_app.exceptions.OutboxDeprecationWarning`) and gives the
    setting that took its place.

    Raises:
        AttributeError: not an outbox setting.
    """
    found = SETTINGS.get(name)
    if found is not None:
        return found
    found = RENAMED.get(name)
    if found is None:
        raise AttributeError(f"unknown outbox setting {name!r}")
    warnings.warn(
        f"outbox_settings.{name} is renamed {found.name}; the old name goes in "
        "the next release",
        OutboxDeprecationWarning,
        stacklevel=3,
    )
    return found


class OutboxSettings:
    """Attribute access to ``settings.OUTBOX_<NAME>`` with the defaults of
    :data:`SETTINGS`, validated where it is read.

    Raises:
        ImproperlyConfigured: the value breaks its rule; the message names
            the setting, what it must be and the check id (a shell or a web
            server never ran ``check``).
        AttributeError: not an outbox setting.
    """

    def raw(self, name: str) -> Any:
        """The value as configured, unvalidated (the system checks read it):
        the setting's, else a former name's (warning that it is renamed),
        else the default."""
        spec = setting(name)
        if hasattr(settings, f"OUTBOX_{spec.name}"):
            return getattr(settings, f"OUTBOX_{spec.name}")
        for old in spec.renamed_from:
            if hasattr(settings, f"OUTBOX_{old}"):
                warnings.warn(
                    f"OUTBOX_{old} is renamed OUTBOX_{spec.name}; the old name "
                    "is read until the next release",
                    OutboxDeprecationWarning,
                    stacklevel=3,
                )
                return getattr(settings, f"OUTBOX_{old}")
        return spec.default

    def __getattr__(self, name: str) -> Any:
        value = self.raw(name)
        spec = setting(name) if name in SETTINGS else RENAMED[name]
        if not spec.valid(value):
            raise ImproperlyConfigured(
                f"OUTBOX_{spec.name} is {mask_url(repr(value))}; it must be "
                f"{spec.expected} ({spec.check}; "
                "`python manage.py check` lists every malformed setting)."
            )
        return value


outbox_settings = OutboxSettings()


def __getattr__(name: str) -> Any:
    """``DEFAULTS`` and ``RULES``, the two tables :data:`SETTINGS` replaces,
    for one release (with a warning)."""
    if name not in ("DEFAULTS", "RULES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"outbox_app.conf.{name} is replaced by SETTINGS (one entry per "
        "setting); the old name goes in the next release",
        OutboxDeprecationWarning,
        stacklevel=2,
    )
    if name == "DEFAULTS":
        return SETTINGS
    return {n: (s.check, s.valid, s.expected) for n, s in SETTINGS.items()}


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
