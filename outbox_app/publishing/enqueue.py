"""Celery tasks sent through the outbox: ``enqueue(signature)``.

``task.delay()`` inside a transaction is a dual write: the task may run before
the commit (and read rows that are not there yet), run for a transaction that
rolls back, or be lost when the process dies after the commit. ``enqueue()``
writes the task as one outbox event in the caller's transaction instead; the
relay's :class:`~outbox_app.publishers.celery.CeleryPublisher` sends it with
``app.send_task()`` once committed, at least once, with the task id set to
the event's id (a redelivery carries the same id), with the retries, pauses,
dead letter and requeue of every publisher.

This module loads before Django's app registry is ready (the Celery
publisher, which a project's ``celery.py`` imports through ``tasks.py``,
reads its constants). The event's payload is the task as Celery would send
it::

    {"task": "shop.tasks.send_receipt", "args": [42], "kwargs": {},
     "options": {"queue": "mail"}}

Its arguments are written as Celery's JSON serializer (kombu's) writes them:
a Decimal, UUID, datetime, date, time or bytes as kombu's ``{"__type__":
..., "__value__": ...}`` object, which the publisher reads back into that
type before ``send_task()``, so the task receives what ``delay()`` gives it.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any

from django.utils.dateparse import parse_datetime

from ..conf import outbox_settings
from ..exceptions import NoTaskPublisher, UnsupportedTask, UnsupportedTaskArgument

if TYPE_CHECKING:
    from ..store.models import OutboxEvent

#: The event type of an enqueued task: the type the Celery publisher takes.
TASK_EVENT_TYPE = "outbox_app.celery_task"
#: The backend a publisher of tasks has (``OUTBOX_PUBLISHERS[...]["BACKEND"]``).
TASK_BACKEND = "outbox_app.publishers.celery.CeleryPublisher"


def enqueue(signature: Any, *, using: str | None = None) -> OutboxEvent:
    """Send the Celery task ``signature`` once the current transaction commits,
    at least once; never for a transaction that rolls back.

    Args:
        signature: one task's ``celery.Signature`` (``send_receipt.s(order.pk)``,
            ``.set(queue="mail", countdown=5)``). Its options go to
            ``send_task()``, except: ``countdown`` (seconds) and ``eta`` (an
            aware datetime or ISO 8601 text) schedule the event
            (``deliver_at``: the relay sends it then, and Celery runs it at
            once); ``expires`` (seconds from now, or an aware datetime / ISO
            text) is the event's ``expires_at`` too (not sent by then:
            SKIPPED) and reaches Celery as that time. Seconds count from
            now by the database's clock, as ``publish()``'s timedeltas.
            Arguments are stored as Celery's JSON serializer writes them,
            and the task receives them as ``delay()`` with that serializer
            gives them (a Decimal, UUID, datetime, date, time or bytes as
            itself, a tuple as a list), whatever the app's serializer.
            Options must be JSON.
        using: database alias of the transaction; default: the router's.

    Returns:
        The :class:`~outbox_app.OutboxEvent` written; ``str(event.id)`` is the
        task's id (``AsyncResult(str(event.id))``).

    Raises:
        UnsupportedTask: a chain, group or chord (enqueue each task, or a task
            that runs the canvas), a ``task_id`` option, or not a signature.
        UnsupportedTaskArgument: an argument Celery's JSON serializer cannot
            write (a set, an object), or a NaN or infinite float.
        NoTaskPublisher: no ``OUTBOX_PUBLISHERS`` entry has the backend
            ``outbox_app.publishers.celery.CeleryPublisher``.
        OutboxRequiresActiveTransaction, InvalidPayload, InvalidSchedule:
            as :func:`~outbox_app.publish`. Nothing is written.
    """
    task, args, kwargs, options = _task(signature)
    args, kwargs = _celery_json(task, args, kwargs)
    if not any(
        entry.get("BACKEND") == TASK_BACKEND
        for entry in outbox_settings.PUBLISHERS.values()
    ):
        raise NoTaskPublisher(
            f"enqueue({task!r}): no OUTBOX_PUBLISHERS entry has the BACKEND "
            f"{TASK_BACKEND!r}, so no relay would send the task; nothing was "
            "written"
        )
    # "From now" by the database's clock, which the relays compare with.
    from ..store.clock import database_now  # the models: loads before them

    now = database_now(using, writer=True)
    deliver_at = _time(options.pop("eta", None), now, "eta")
    countdown = options.pop("countdown", None)
    if countdown is not None:  # as in Celery: countdown over eta
        deliver_at = _time(countdown, now, "countdown")
    expires_at = _time(options.get("expires"), now, "expires")
    if expires_at is not None:
        options["expires"] = expires_at.isoformat()
    payload = {"task": task, "args": args, "kwargs": kwargs, "options": options}
    from .outbox import publish  # the models: this module loads before them

    (event,) = publish(
        {"event_type": TASK_EVENT_TYPE, "payload": payload},
        using=using,
        deliver_at=deliver_at,
        expires_at=expires_at,
    )
    return event


def _task(signature: Any) -> tuple[str, list, dict, dict[str, Any]]:
    """``(name, args, kwargs, options)`` of one task's signature.

    Raises:
        UnsupportedTask: not one task's signature, or a ``task_id`` option.
    """
    from celery.canvas import Signature

    if not isinstance(signature, Signature):
        raise UnsupportedTask(
            "enqueue() takes a Celery signature (task.s(...), task.si(...), "
            f"signature(...)), got {type(signature).__name__}; nothing was written"
        )
    if signature.subtask_type is not None or not isinstance(signature.task, str):
        raise UnsupportedTask(
            f"enqueue() sends one task, not a {signature.subtask_type or 'canvas'}: "
            "enqueue each task, or enqueue a task that runs the canvas; nothing "
            "was written"
        )
    options = dict(signature.options)
    if "task_id" in options:
        raise UnsupportedTask(
            f"enqueue({signature.task!r}): the task's id is the outbox event's id, "
            "so a redelivery carries the same one; drop the task_id option. "
            "Nothing was written"
        )
    return signature.task, list(signature.args), dict(signature.kwargs), options


def _celery_json(task: str, args: list, kwargs: dict) -> tuple[list, dict]:
    """``args`` and ``kwargs`` as Celery's JSON serializer writes them
    (``kombu.utils.json``), as JSON types: kombu's ``{"__type__": ...,
    "__value__": ...}`` objects for a Decimal, UUID, datetime, date, time or
    bytes (and for a type registered with ``kombu.utils.json.register_type``).

    Raises:
        UnsupportedTaskArgument: a value kombu's JSON cannot write, or a NaN
            or infinite float (no database's JSON stores one).
    """
    from kombu.utils.json import dumps

    try:
        return tuple(json.loads(dumps([args, kwargs], allow_nan=False)))
    except (TypeError, ValueError):
        pass
    named = [(f"args[{i}]", value) for i, value in enumerate(args)]
    named += [(f"kwargs.{key}", value) for key, value in kwargs.items()]
    for field, value in named:
        try:
            dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise UnsupportedTaskArgument(
                f"enqueue({task!r}): {field} cannot be sent as Celery's JSON "
                f"serializer writes it, which the outbox stores: {exc}; nothing "
                "was written",
                field=field,
            ) from exc
    raise UnsupportedTaskArgument(  # a key of kwargs that is not a string
        f"enqueue({task!r}): the kwargs {sorted(map(repr, kwargs))} cannot be "
        "sent as Celery's JSON serializer writes them; nothing was written"
    )


def _time(value: Any, now: datetime.datetime, name: str):
    """``value`` (seconds from ``now``, an aware datetime or ISO 8601 text)
    as an aware datetime; None stays None.

    Raises:
        UnsupportedTask: any other value.
    """
    if value is None or isinstance(value, datetime.datetime):
        return value
    if isinstance(value, str):
        parsed = parse_datetime(value)
        if parsed is not None:
            return parsed
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return now + datetime.timedelta(seconds=value)
    raise UnsupportedTask(
        f"the {name} option must be seconds, a datetime or ISO 8601 text, got "
        f"{value!r}; nothing was written"
    )
