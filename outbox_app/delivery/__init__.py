"""Delivery: from committed outbox events to their subscribers.

One module per stage of the flow:

* :mod:`~outbox_app.delivery.gateway`: every statement of the hot path, named,
  built once, sent through the DB-API cursor (the only sender of the relay's
  SQL);
* :mod:`~outbox_app.delivery.fanout`: undelivered events -> notifications;
* :mod:`~outbox_app.delivery.batch`: a claimed batch, its lease (claim, keep,
  renew, release) and claiming ahead;
* :mod:`~outbox_app.delivery.handlers` and
  :mod:`~outbox_app.delivery.publishers`: running a batch through in-process
  handlers, or through a broker publisher with a confirm window and outage
  pauses;
* :mod:`~outbox_app.delivery.retry`: the retry policy (retry at, or the dead
  letter);
* :mod:`~outbox_app.delivery.outcomes`: the one place outcomes are written,
  counted (:class:`RelayReport`) and logged;
* :mod:`~outbox_app.delivery.loop`: :func:`relay_once` and :func:`deliver`,
  which the ``relay`` command, the Celery tasks and tests call.
"""

from __future__ import annotations

from .fanout import fan_out
from .loop import deliver, relay_once, worker_name
from .outcomes import RelayReport

__all__ = ["RelayReport", "deliver", "fan_out", "relay_once", "worker_name"]
