"""The transactional inbox: the consuming end of the pipe.

* :mod:`~outbox_app.inbox.registry`: ``@consumer`` functions, found in each
  installed app's ``consumers.py``, and the ``ConsumeContext`` they receive;
* :mod:`~outbox_app.inbox.context`: one received message as the inbox reads
  it (its CloudEvent, the consumer's context, the inbox row's columns);
* :mod:`~outbox_app.inbox.receive`: one message through the inbox, once per
  consumer (the inbox row and the consumer's writes in one transaction), and
  a batch of them in one transaction;
* :mod:`~outbox_app.inbox.outcomes`: what the inbox writes and counts for
  each outcome (handled, failed, dead, kept, duplicate), and the
  ``on_commit`` callbacks after the commit;
* :mod:`~outbox_app.inbox.retry`: the retries of failed messages from the
  database;
* :mod:`~outbox_app.inbox.recorded`: the consumers ``consume`` processes
  recorded, whose messages a process without them keeps;
* :mod:`~outbox_app.inbox.worker`: ``manage.py consume``'s loop on the broker
  (kombu, manual acks after the commit).

The names below are loaded on first access, so importing a module of this
package (the registry, from a ``consumers.py`` or a settings file) loads no
model. ``receive`` is the function, as it was when this package imported
its names at once, not the submodule of the same name.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .outcomes import Tally
    from .receive import receive, receive_batch
    from .registry import ConsumeContext, Consumer, consumer, consumers
    from .retry import retry_due

__all__ = [
    "ConsumeContext",
    "Consumer",
    "Tally",
    "consumer",
    "consumers",
    "receive",
    "receive_batch",
    "retry_due",
]

_LAZY = {
    "ConsumeContext": "registry",
    "Consumer": "registry",
    "consumer": "registry",
    "consumers": "registry",
    "Tally": "outcomes",
    "receive": "receive",
    "receive_batch": "receive",
    "retry_due": "retry",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """This package: loading its submodule ``receive`` binds the module here
    (the import system's ``setattr``), which would hide the function of that
    name; the function stays."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "receive" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
