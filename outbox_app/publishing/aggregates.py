"""Domain events recorded on aggregates, and the translators that turn them
into integration events.

An aggregate (a model with :class:`RecordsEvents`) records *domain* events as
its state changes; they are internal to the service. When it is saved, each
recorded event goes through the first translator registered for its class and
becomes zero, one or several *integration* events, published to the outbox in
the save's transaction. A domain event no translator claims never leaves the
service::

    class Order(RecordsEvents, models.Model):
        version = models.PositiveIntegerField(default=0)
        outbox_version_field = "version"

        def ship(self):
            self.status = "shipped"
            self.record(OrderShippedInternally(order_id=self.pk))

    # shop/translators.py (found at start-up, as handlers.py is)
    @translator(OrderShippedInternally)
    def to_public(event, order):
        return OrderShipped(order_id=event.order_id)

What a Django user expects of the recorded events, and what happens:

- **Drained once.** ``save()`` publishes what was recorded since the last
  committed save; a second ``save()`` in the same transaction publishes
  nothing more; once the transaction commits, the events are gone from the
  instance.
- **Never lost to a rollback.** If the save's transaction (or a savepoint
  around it) rolls back, the rows are gone, and the instance still holds its
  recorded events: the retried save publishes them. (Django has no rollback
  hook: the instance notices at its next ``save()`` or ``recorded_events``,
  and puts its version field back then too.) A second drain in one
  transaction is a no-op, not a ``DuplicateOutboxEvent``; a drain after a
  rollback is the retry.
- **Published once.** A transaction that commits while an ``on_commit``
  callback registered before the save raises (Django then drops the
  callbacks after it, the instance's own among them) is not taken for a
  rollback: the next ``save()`` finds the published rows.
- **Optimistic concurrency.** With ``outbox_version_field``, each save that
  publishes advances that field by the number of integration events and
  stamps them ``aggregate_version`` ``stored + 1, + 2, ...``; every save,
  with or without recorded events, updates the row only at the version the
  instance holds: a stale one raises ``AggregateVersionConflict`` and writes
  nothing.

In-process handlers do not receive domain events: handlers are subscribers
of the outbox, which holds integration events only. A domain event meant for
this service's own handlers gets a translator like any other.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import router, transaction

from ..events.types import Event
from ..exceptions import AggregateVersionConflict
from .outbox import publish

_translators: list[tuple[type, Callable[[Any, Any], Any]]] = []
_lock = threading.Lock()


def translator(*domain_events: type) -> Callable[[Callable], Callable]:
    """Register ``fn(domain_event, aggregate)`` as the translator of these
    domain event classes (and their subclasses): it returns an integration
    :class:`~outbox_app.Event` (or a ``publish()`` mapping), several, or None
    to keep the domain event internal. The first translator registered for a
    class wins. Put translators in an app's ``translators.py``: outbox_app
    imports every app's at start-up.

    Raises:
        ImproperlyConfigured: no class given, or something that is not a class.
    """
    if not domain_events or not all(isinstance(c, type) for c in domain_events):
        raise ImproperlyConfigured(
            f"@translator needs domain event classes, got {domain_events!r}"
        )

    def register(fn: Callable) -> Callable:
        with _lock:
            for cls in domain_events:
                if not any(known is cls and f is fn for known, f in _translators):
                    _translators.append((cls, fn))
        return fn

    return register


def unregister_translator(fn: Callable) -> None:
    """Remove ``fn`` from every class it translates (tests)."""
    with _lock:
        _translators[:] = [(c, f) for c, f in _translators if f is not fn]


def translate(domain_event: Any, aggregate: Any) -> list[Event | dict]:
    """The integration events of ``domain_event``: the first matching
    translator's result as a list (empty: internal, or no translator)."""
    with _lock:
        found = next(
            (fn for cls, fn in _translators if isinstance(domain_event, cls)), None
        )
    if found is None:
        return []
    result = found(domain_event, aggregate)
    if result is None:
        return []
    if isinstance(result, Event | dict):
        return [result]
    return list(result)


class RecordsEvents:
    """A model mixin (before ``models.Model`` in the bases) that records
    domain events and publishes their translations when saved.

    Attributes:
        outbox_version_field: name of an integer field holding the aggregate's
            version (optimistic concurrency), or None.
    """

    outbox_version_field: str | None = None

    def record(self, event: Any) -> None:
        """Record a domain event; the next ``save()`` translates and publishes
        it."""
        self.__dict__.setdefault("_recorded", []).append(event)

    @property
    def recorded_events(self) -> list[Any]:
        """What the next ``save()`` drains (a copy), those of a save rolled
        back since included."""
        self._requeue_rolled_back(router.db_for_write(type(self), instance=self))
        return list(self.__dict__.get("_recorded", []))

    def save(self, *args, **kwargs):
        """Django's ``save()``; with recorded events, in one transaction with
        the publish of their translations.

        Raises:
            AggregateVersionConflict: a versioned aggregate's row was saved
                at another version since this instance was loaded; nothing
                was written, the instance is as it was.
            DuplicateAggregateVersion, InvalidEvent: as ``publish()``.
        """
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        self._requeue_rolled_back(using)
        recorded = self.__dict__.get("_recorded", [])
        before = self._version()
        if not recorded:
            with self._saving_from(before):
                return super().save(*args, **kwargs)
        with transaction.atomic(using=using):
            try:
                integration = [e for d in recorded for e in translate(d, self)]
                version = self._advance_version(len(integration))
                with self._saving_from(before):
                    result = super().save(*args, **self._with_version(kwargs))
                rows = (
                    publish(
                        *integration,
                        aggregate=self,
                        aggregate_version=version,
                        using=using,
                    )
                    if integration
                    else []
                )
            except BaseException:
                if self.outbox_version_field is not None:
                    setattr(self, self.outbox_version_field, before)
                raise
            self._drained(recorded, using, before, rows[0].id if rows else None)
        return result

    def _version(self) -> int | None:
        name = self.outbox_version_field
        return None if name is None else getattr(self, name)

    def _advance_version(self, count: int) -> int | None:
        """The first new event's aggregate_version; the field advanced to the
        last one."""
        name = self.outbox_version_field
        if name is None or not count:
            return None
        current = getattr(self, name) or 0
        setattr(self, name, current + count)
        return current + 1

    def _with_version(self, kwargs: dict) -> dict:
        """``save()``'s arguments, the version field added to ``update_fields``
        (a save that publishes writes the version it advanced to)."""
        name = self.outbox_version_field
        fields = kwargs.get("update_fields")
        if name is None or fields is None or name in fields:
            return kwargs
        return {**kwargs, "update_fields": [*fields, name]}

    @contextlib.contextmanager
    def _saving_from(self, version: int | None) -> Iterator[None]:
        """While the block saves, the UPDATE of a versioned aggregate matches
        its row only at ``version``, the one this instance was loaded (or
        last saved) at (:meth:`_do_update`)."""
        if self.outbox_version_field is None or self._state.adding:
            yield
            return
        self.__dict__["_saving_from"] = version
        try:
            yield
        finally:
            del self.__dict__["_saving_from"]

    def _do_update(self, base_qs, using, pk_val, values, *args, **kwargs):
        """Django's UPDATE of a save, optimistically locked on a versioned
        aggregate: it writes only a row still at the version this instance
        holds.

        Raises:
            AggregateVersionConflict: the row exists at another version (a
                stale instance); nothing was written.
        """
        expected = self.__dict__.get("_saving_from", _NOT_SAVING)
        name = self.outbox_version_field
        if expected is _NOT_SAVING or not any(
            f.attname == name for f in base_qs.model._meta.local_concrete_fields
        ):
            return super()._do_update(base_qs, using, pk_val, values, *args, **kwargs)
        locked = base_qs.filter(**{name: expected})
        updated = super()._do_update(locked, using, pk_val, values, *args, **kwargs)
        if not updated and base_qs.filter(pk=pk_val).exists():
            raise AggregateVersionConflict(
                f"{self._meta.label} {pk_val} was saved at another version since "
                f"this instance was loaded at version {expected}: nothing was "
                "written; reload it, apply the change again and save"
            )
        return updated

    def _drained(
        self, events: list, using: str, version: int | None, row: uuid.UUID | None
    ) -> None:
        """Move ``events`` out of the recorded list until the transaction
        commits (then they are gone) or rolls back (then the next save puts
        them back, and the version field as it was: :meth:`_requeue_rolled_back`).
        ``row``: the id of the first event published for them, if any."""
        del self.__dict__["_recorded"]
        pending = self.__dict__.setdefault("_draining", [])
        marker = functools.partial(self._committed, events)
        pending.append((using, marker, events, version, row))
        transaction.on_commit(marker, using=using)

    def _committed(self, events: list) -> None:
        pending = self.__dict__.get("_draining", [])
        pending[:] = [p for p in pending if p[2] is not events]

    def _requeue_rolled_back(self, using: str) -> None:
        """Drained events whose transaction rolled back (their on-commit
        marker is no longer pending, and their rows do not exist) go back to
        the front of the record.

        A marker that did not run is usually a rollback, but Django also
        drops every on-commit callback after one that raises: then the
        transaction committed and the published rows exist (one query, in
        these two cases only). Events that published nothing cannot be told
        apart: they go back, and translating them again publishes nothing
        again.
        """
        pending = self.__dict__.get("_draining")
        if not pending:
            return
        connection = transaction.get_connection(using)
        waiting = {id(fn) for _, fn, _ in connection.run_on_commit}
        lost = [p for p in pending if p[0] == using and id(p[1]) not in waiting]
        if not lost:
            return
        pending[:] = [p for p in pending if p not in lost]
        rows = [p[4] for p in lost if p[4] is not None]
        from ..store.models import OutboxEvent

        committed = set(
            OutboxEvent.objects.using(using)
            .filter(id__in=rows)
            .values_list("id", flat=True)
            if rows
            else ()
        )
        lost = [p for p in lost if p[4] not in committed]
        if not lost:
            return
        back = [e for _, _, events, _, _ in lost for e in events]
        self.__dict__["_recorded"] = back + self.__dict__.get("_recorded", [])
        if self.outbox_version_field is not None:
            setattr(self, self.outbox_version_field, lost[0][3])


_NOT_SAVING: Any = object()
