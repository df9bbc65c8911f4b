"""The relay: from committed outbox events to their subscribers.

One module per step of the way:

* :mod:`~outbox_app.relay.fanout`: events not fanned out yet -> one
  delivery per active subscription;
* :mod:`~outbox_app.relay.batch`: a claimed batch, its lease (claim, keep,
  renew, release) and claiming ahead;
* :mod:`~outbox_app.relay.handlers` and :mod:`~outbox_app.relay.sending`:
  running a batch through in-process handlers, or through a broker publisher
  with a confirm window and outage pauses;
* :mod:`~outbox_app.relay.outcomes`: the one place outcomes are written,
  counted (:class:`RelayReport`) and logged;
* :mod:`~outbox_app.relay.loop`: :func:`relay_once` and :func:`deliver`,
  which the ``relay`` command, the Celery tasks and tests call;
* :mod:`~outbox_app.relay.worker`: the long-running process around them, and
  :mod:`~outbox_app.relay.wake`: its wake-ups;
* :mod:`~outbox_app.relay.registry`: which subscribers this process has.

The statements the relay sends are :mod:`outbox_app.store.gateway`'s; the
retry policy is :mod:`outbox_app.execution.retry`'s.

The names below are loaded on first access, so importing a module of this
package (the registry, from ``tasks.py`` or a settings file) loads no model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fanout import fan_out
    from .loop import deliver, relay_once, worker_name
    from .outcomes import RelayReport

__all__ = ["RelayReport", "deliver", "fan_out", "relay_once", "worker_name"]

_LAZY = {
    "fan_out": "fanout",
    "deliver": "loop",
    "relay_once": "loop",
    "worker_name": "loop",
    "RelayReport": "outcomes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
