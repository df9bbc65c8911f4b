"""The publisher of Celery tasks written by :func:`outbox_app.enqueue`.

One ``OUTBOX_PUBLISHERS`` entry makes a relay send them, with the Celery app
of :func:`celery_app` (``OUTBOX_CELERY_APP``)::

    OUTBOX_CELERY_APP = "shop.celery.app"
    OUTBOX_PUBLISHERS = {
        "tasks": {"BACKEND": "outbox_app.publishers.celery.CeleryPublisher"},
    }

It takes the enqueued tasks' event type (``outbox_app.celery_task``) and no
other; ``ORDERED``, ``MAX_ATTEMPTS`` and ``ALIASES`` mean what they mean for
every publisher.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from celery.result import denied_join_result
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string
from kombu.utils.json import object_hook

from ..conf import mask_url, outbox_settings
from ..exceptions import PublisherUnavailable
from ..publishing.enqueue import TASK_EVENT_TYPE
from ..subscribers import DeliveryContext
from .base import COMMON_OPTIONS, Publisher, config_error, failure


def celery_app() -> Celery:
    """The Celery app outbox_app sends with: the enqueued tasks
    (:class:`CeleryPublisher`) and the on-commit wake-ups (``tasks.py``).

    ``OUTBOX_CELERY_APP`` names it (``"yourproject.celery.app"``); unset, it is
    an app configured from Django's ``CELERY_*`` settings, as the ``celery.py``
    of Celery's Django guide configures the project's own
    (``config_from_object("django.conf:settings", namespace="CELERY")``). Not
    Celery's "current app": in a web process that is Celery's fallback app
    (localhost broker, queue ``celery``) unless the project's ``__init__``
    imported its app, and only in the importing thread.

    Raises:
        ImproperlyConfigured: ``OUTBOX_CELERY_APP`` cannot be imported or is
            not a Celery app.
    """
    path = outbox_settings.CELERY_APP
    cached = _apps.get(path)
    if cached is not None:
        return cached
    if path:
        try:
            app = import_string(path)
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"OUTBOX_CELERY_APP = {path!r} cannot be imported: {exc} "
                "(check outbox.E017)."
            ) from exc
        if not isinstance(app, Celery):
            raise ImproperlyConfigured(
                f"OUTBOX_CELERY_APP = {path!r} is a {type(app).__name__}, not a "
                "Celery app (check outbox.E017)."
            )
    else:
        app = Celery("outbox_app", set_as_current=False, fixups=[])
        app.config_from_object("django.conf:settings", namespace="CELERY")
    _apps[path] = app
    return app


_apps: dict[str | None, Celery] = {}


@receiver(setting_changed)
def _forget_apps(setting: str, **kwargs: Any) -> None:
    if setting == "OUTBOX_CELERY_APP" or setting.startswith("CELERY_"):
        _apps.clear()


class CeleryPublisher(Publisher):
    """Sends each enqueued task with the Celery app's ``send_task()``.

    Options: ``ORDERED``, ``MAX_ATTEMPTS`` and ``ALIASES``; the app is
    :func:`celery_app`'s (its broker, serializer and routes are used).

    Behaviour: a task is sent as ``app.send_task(task, args, kwargs,
    task_id=<event id>, **options)`` without kombu's own retries, so a
    redelivery carries the same task id, its arguments read back as Celery's
    JSON serializer reads them (``enqueue()`` wrote them so: a Decimal, UUID,
    datetime, date, time or bytes is itself again, whatever the app's
    serializer). It is reported delivered once ``send_task`` returns, which
    with RabbitMQ means the broker confirmed it only when the app publishes
    with confirms (``broker_transport_options = {"confirm_publish": True}``;
    docs/celery.md).

    Sending depends on the broker alone: the relay never reads a task's
    result, so the app's result backend is left alone (Celery's Redis and RPC
    backends would subscribe the sender to each result, and one that is down
    would fail the send). A batch's sends end within half of
    ``OUTBOX_LEASE_SECONDS`` (each AMQP publish and its confirm get the time
    left), so none outlives the lease. A broker that cannot be reached, a
    connection lost or a batch out of time fails the rest of the batch with
    :class:`~outbox_app.exceptions.PublisherUnavailable` (the relay pauses the
    publisher, counts no attempt, and resumes once :meth:`probe` connects);
    any other error fails that task alone (an attempt, retried with backoff).

    Raises:
        ImproperlyConfigured: ``EVENT_TYPES`` given (it is fixed), or an
            unknown option.
    """

    def __init__(self, name: str, options: Mapping[str, Any]):
        unknown = set(options) - COMMON_OPTIONS
        if unknown:
            raise config_error(name, f"unknown option(s) {sorted(unknown)}")
        if "EVENT_TYPES" in options:
            raise config_error(
                name,
                f"'EVENT_TYPES' is fixed to [{TASK_EVENT_TYPE!r}] for a "
                "CeleryPublisher: drop it",
            )
        super().__init__(name, {**options, "EVENT_TYPES": [TASK_EVENT_TYPE]})

    @property
    def app(self) -> Celery:
        """:func:`celery_app` (raises ImproperlyConfigured as it does)."""
        return celery_app()

    def send_batch(
        self, messages: Sequence[DeliveryContext]
    ) -> list[BaseException | None]:
        """Send each message's task; one outcome per message, in order."""
        app = self.app
        outcomes: list[BaseException | None] = []
        lost = (OSError, *self._connection_errors())
        budget = outbox_settings.LEASE_SECONDS / 2
        deadline = time.monotonic() + budget
        try:
            # Nothing here joins a result: Celery's result backends then
            # subscribe to none (denied_join_result, as Celery's own worker).
            with denied_join_result(), app.producer_or_acquire() as producer:
                try:
                    self._send_each(producer, messages, deadline, lost, outcomes)
                except lost:
                    # Dropped without the closing handshake: a broker that
                    # stopped answering would hold the close as it held the
                    # send.
                    producer.connection.collect()
                    raise
        except lost as exc:
            self._forget_connections()
            where = mask_url(app.conf.broker_url or "the Celery broker")
            text = f"send_task to {where} failed: {exc}"
            if time.monotonic() >= deadline:
                text += (
                    f" (past the {budget:g} s a batch's sends get: half of "
                    "OUTBOX_LEASE_SECONDS)"
                )
            error = failure(PublisherUnavailable, text, exc)
            outcomes += [error] * (len(messages) - len(outcomes))
        return outcomes

    def _send_each(
        self,
        producer: Any,
        messages: Sequence[DeliveryContext],
        deadline: float,
        lost: tuple[type[BaseException], ...],
        outcomes: list[BaseException | None],
    ) -> None:
        """Send each message's task with ``producer``, appending its outcome
        to ``outcomes``; each publish and its confirm get the time left until
        ``deadline`` (``time.monotonic()``, seconds).

        Raises:
            What ``lost`` holds: the connection failed, or time is up
                (``TimeoutError``).
        """
        app = self.app
        for message in messages:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("out of time")
            task = message.payload
            try:
                app.send_task(
                    task["task"],
                    args=_read(task["args"]),
                    kwargs=_read(task["kwargs"]),
                    task_id=str(message.event_id),
                    producer=producer,
                    retry=False,
                    **{**task["options"], "timeout": left, "confirm_timeout": left},
                )
            except lost:
                raise
            except Exception as exc:  # this task alone
                outcomes.append(exc)
            else:
                outcomes.append(None)

    def probe(self) -> None:
        """Connect to the app's broker once; raises while it is down."""
        with self.app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)

    def close(self) -> None:
        if outbox_settings.CELERY_APP in _apps:  # built: connections to drop
            self._forget_connections()

    def _connection_errors(self) -> tuple[type[BaseException], ...]:
        from kombu.exceptions import OperationalError

        with self.app.connection_for_write() as connection:
            return (OperationalError, *connection.connection_errors)

    def _forget_connections(self) -> None:
        """Drop the app's pooled connections and producers: after an outage
        they are dead, and the next batch connects anew."""
        self.app.amqp.producer_pool.force_close_all(close_pool=False)
        self.app.pool.force_close_all(close_pool=False)


def _read(value: Any) -> Any:
    """``value`` (stored JSON) with kombu's ``{"__type__": ...,
    "__value__": ...}`` objects turned back into their types, innermost
    first, as Celery's JSON serializer reads a message
    (``kombu.utils.json.loads``). One of a type this process has not
    registered (``kombu.utils.json.register_type``) is sent as it is: the
    worker's JSON serializer reads it."""
    if isinstance(value, list):
        return [_read(item) for item in value]
    if not isinstance(value, dict):
        return value
    value = {key: _read(item) for key, item in value.items()}
    try:
        return object_hook(value)
    except ValueError:  # "Unsupported type": the worker's to read
        return value
