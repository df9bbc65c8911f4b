"""Events: what the outbox carries.

* :mod:`~outbox_app.events.types`: the ``Event`` base class, the registry of
  event types and of upcasters;
* :mod:`~outbox_app.events.codec`: payloads encoded to JSON before the INSERT
  and decoded back into their events;
* :mod:`~outbox_app.events.text`: which text every database stores unchanged,
  and outside text made storable;
* :mod:`~outbox_app.events.ids`: event ids (UUIDv7) and worker names.
"""

from .types import Event, upcaster

__all__ = ["Event", "upcaster"]
