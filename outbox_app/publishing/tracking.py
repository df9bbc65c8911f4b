"""Model change events: every create, update and delete of a tracked model
publishes an event in the same transaction.

``@outbox_app.track`` on a model class::

    @track(exclude=["search_vector"], soft_delete="deleted_at")
    class Product(models.Model): ...

publishes, with the instance as the aggregate and ``operation`` in the
envelope (routing key ``"{aggregate_type}.{operation}"``):

=================  ===========  ==================================================
event type         operation    payload
=================  ===========  ==================================================
``ProductCreated``  create      ``{"pk": ..., "values": {every tracked field}}``
``ProductUpdated``  update      ``{"pk": ..., "changed": {...}, "previous": {...}}``
``ProductSoftDeleted`` soft_delete ``{"pk": ..., "values": {...}}``
``ProductDeleted``  delete      ``{"pk": ..., "values": {the last values}}``
=================  ===========  ==================================================

Why a class decorator (``pghistory.track()``, ``auditlog.register()``): the
model stays a plain model, tracking is visible where the model is defined, and
nothing else in the project changes. Values are keyed by attribute name
(``category_id`` for a foreign key: its id) and encoded as payloads are
(Decimal, dates, UUID as text); a file field is its name; a NaN or infinite
float as the text ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.

How each write is covered, so no write escapes silently:

- ``save()`` runs in ``transaction.atomic`` (its own when there is none, so
  the outbox rule holds: no change without its event, no event without its
  change). An update reads the stored row with ``SELECT ... FOR UPDATE`` first:
  ``previous`` is what the database held, and concurrent saves of the row are
  serialised. A save that changes no tracked field publishes nothing, nor
  one that changes only ``auto_now`` fields. Values are compared and
  published as the database stores them: one not yet in its stored form
  (text for a number or a date, a Decimal of another scale, an ``F()``
  expression) is read back after the save. A new instance whose primary key
  has no default may name a stored row: it is read first, and Django's
  ``UPDATE`` of it publishes an Updated event, not a Created one.
- ``delete()``, ``QuerySet.delete()`` and deletes by cascade publish through
  Django's ``post_delete`` signal, inside the deletion's transaction; one
  INSERT for all the events of one ``delete()`` call.
- The model's querysets are :class:`TrackedQuerySet` (``@track`` gives its
  managers, its base manager and so its related managers a queryset class
  that mixes it in): only tracked models' bulk writes go through tracking.
- ``QuerySet.bulk_create()`` publishes a Created event per object, one INSERT.
- ``QuerySet.update()`` and ``bulk_update()`` publish an Updated (or
  SoftDeleted) event per row they change, in their transaction: the rows are
  read and locked first (``SELECT ... FOR UPDATE``), written (``update()`` by
  primary key, :data:`UPDATE_BATCH` at a time), read again, and the changes
  published with one INSERT per operation. A row the statement leaves as it
  was publishes nothing; ``F()`` expressions show as the values they wrote.
  Two reads besides Django's own statements: under :func:`untracked`, they
  are Django's alone again.
- ``bulk_create(ignore_conflicts=True / update_conflicts=True)`` raises
  :class:`~outbox_app.exceptions.UntrackedWrite`: it cannot tell which rows
  it wrote.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import decimal
import functools
import math
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models, router, transaction
from django.db.models.fields.files import FieldFile
from django.db.models.signals import post_delete, pre_delete
from django.db.models.sql.constants import LOUTER
from django.utils import timezone

from ..conf import outbox_settings
from ..events.codec import to_json
from ..events.types import validate_event_type
from ..exceptions import PayloadTooLarge, UntrackedWrite
from ..store.db import lock_waiting
from .outbox import publish_each

#: The operations of a tracked model and their event types' default suffix.
SUFFIXES = {
    "create": "Created",
    "update": "Updated",
    "soft_delete": "SoftDeleted",
    "delete": "Deleted",
}
#: model class -> its tracking
_tracked: dict[type[models.Model], Tracking] = {}
#: While set, tracked writes publish nothing (:func:`untracked`).
_off: contextvars.ContextVar[bool] = contextvars.ContextVar("outbox_off", default=False)
#: Deleted-event buffers of the delete() calls in progress (innermost last).
_deleting: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "outbox_deleting", default=None
)


@dataclass(frozen=True)
class Tracking:
    """How one model is tracked (what :func:`track` recorded)."""

    model: type[models.Model]
    name: str
    fields: tuple[models.Field, ...]
    soft_delete: models.Field | None
    #: The events' aggregate type (default: the model's label).
    aggregate_type: str
    #: operation -> event type suffix (:data:`SUFFIXES` with ``names`` over it).
    suffixes: dict[str, str]
    #: Keys of ``names`` that are no operation (``manage.py check`` names them).
    unknown_names: tuple[str, ...] = ()

    def event_type(self, operation: str) -> str:
        return f"{self.name}{self.suffixes[operation]}"

    def aggregate(self, pk: Any) -> tuple[str, Any]:
        """The ``(aggregate_type, aggregate_id)`` of the row ``pk``."""
        return self.aggregate_type, pk

    def values(self, instance: models.Model, using: str) -> dict[str, Any]:
        """The tracked values of a saved ``instance`` as the database holds
        them: read back (one SELECT of those fields) when one is not yet in
        its stored form (text for a number or a date, a Decimal of another
        scale, an ``F()`` expression)."""
        values = {f.attname: f.value_from_object(instance) for f in self.fields}
        unsure = [f.attname for f in self.fields if not _stored(f, values[f.attname])]
        if unsure:
            rows = self.model._base_manager.using(using).filter(pk=instance.pk)
            values.update(rows.values(*unsure).get())
        return {f.attname: _plain(f, values[f.attname]) for f in self.fields}

    def last_values(self, instance: models.Model) -> dict[str, Any]:
        """The tracked values ``instance`` holds (one just read from the
        database, or deleted: its last values)."""
        return {
            f.attname: _plain(f, f.value_from_object(instance)) for f in self.fields
        }

    @functools.cached_property
    def auto_now(self) -> frozenset[str]:
        """The tracked fields ``save()`` sets itself (``auto_now``): their
        change alone is no change of the row."""
        return frozenset(
            f.attname for f in self.fields if getattr(f, "auto_now", False)
        )

    def stored(self, rows: models.QuerySet) -> dict[Any, dict[str, Any]]:
        """The tracked values of ``rows`` as the database holds them, by
        primary key, locked until the transaction ends."""
        names = [f.attname for f in self.fields]
        return {
            row["pk"]: {f.attname: _plain(f, row[f.attname]) for f in self.fields}
            for row in lock_waiting(rows.values("pk", *names))
        }


def track(
    model: type[models.Model] | None = None,
    *,
    fields: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    soft_delete: str | None = None,
    name: str | None = None,
    aggregate_type: str | None = None,
    names: dict[str, str] | None = None,
):
    """Class decorator: publish a change event for every write of the model.

    Args:
        model: the model class (``@track`` without arguments).
        fields: field names to track (default: every concrete field but the
            primary key, which every payload carries as ``pk``).
        exclude: field names not to track.
        soft_delete: a nullable field whose change from empty to a value is a
            soft delete (``{Name}SoftDeleted``, operation ``soft_delete``).
        name: the event types' prefix (default: the model's class name).
        aggregate_type: the events' aggregate type, 1 to 150 characters
            (default: the model's label, ``shop.Product``); a short code
            (``"PRD"``) or a name (``"Product"``) as subscribers know it.
        names: the event type suffix of each operation (``create``,
            ``update``, ``soft_delete``, ``delete``) over the defaults
            :data:`SUFFIXES`: ``{"soft_delete": "Deleted", "delete":
            "ForceDeleted"}`` publishes ``ProductDeleted`` for a soft delete
            and ``ProductForceDeleted`` for a row deleted for good. Another
            key is reported by ``manage.py check`` (``outbox.E026``).

    Returns:
        The model class, its ``save`` wrapped.

    Raises:
        ImproperlyConfigured: an unknown field name.
        InvalidEventType: a ``name`` that makes a malformed event type.
    """

    def register(cls: type[models.Model]) -> type[models.Model]:
        from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured

        opts = cls._meta
        try:
            wanted = (
                [opts.get_field(n) for n in fields]
                if fields is not None
                else [f for f in opts.concrete_fields if not f.primary_key]
            )
            skipped = {opts.get_field(n).name for n in exclude}
            soft = opts.get_field(soft_delete) if soft_delete else None
        except FieldDoesNotExist as exc:
            raise ImproperlyConfigured(f"@track on {opts.label}: {exc}") from exc
        prefix = name or cls.__name__
        given = dict(names or {})
        suffixes = {op: given.get(op, suffix) for op, suffix in SUFFIXES.items()}
        for suffix in suffixes.values():
            validate_event_type(f"{prefix}{suffix}")
        kind = aggregate_type if aggregate_type is not None else opts.label
        if not isinstance(kind, str) or not 0 < len(kind) <= 150:
            raise ImproperlyConfigured(
                f"@track on {opts.label}: aggregate_type must be a string of 1 "
                f"to 150 characters, got {kind!r}"
            )
        spec = Tracking(
            cls,
            prefix,
            tuple(f for f in wanted if f.name not in skipped and f.concrete),
            soft,
            kind,
            suffixes,
            tuple(sorted(set(given) - set(SUFFIXES))),
        )
        _tracked[cls] = spec
        cls.save = _saving(cls.save, spec)
        cls.delete = _instance_delete(cls.delete)
        post_delete.connect(_deleted, sender=cls, weak=False)
        _track_managers(cls)
        return cls

    return register(model) if model is not None else register


def _spec_for(model: type[models.Model]) -> Tracking | None:
    """How writes through ``model`` are tracked: its own ``@track``, its
    concrete model's (a proxy), or its nearest tracked parent's (a
    multi-table child, whose rows hold the parent's); None: untracked."""
    spec = _tracked.get(model) or _tracked.get(model._meta.concrete_model)
    if spec is None:
        for parent in model._meta.get_parent_list():
            spec = _tracked.get(parent)
            if spec is not None:
                break
    return spec


def primary_key_name(aggregate_type: str | None) -> str:
    """The primary key's attribute name of the tracked model whose events
    have ``aggregate_type`` (``"id"`` mostly); ``"pk"`` when no tracked model
    of this process has it."""
    for spec in _tracked.values():
        if spec.aggregate_type == aggregate_type:
            return spec.model._meta.pk.attname
    return "pk"


def connect_signals() -> None:
    """Once every model is loaded (the app's ``ready()``): give tracked
    models' proxies and multi-table children tracked querysets, receive the
    deletes of the proxies, and the deletes of rows that tracked
    models reference with ``on_delete=SET_DEFAULT`` or ``SET(...)``, whose
    updates Django writes without ``QuerySet.update()``. Receivers are
    connected per sender, so other models keep Django's fast deletes."""
    from django.apps import apps

    for model in apps.get_models():
        if model not in _tracked and _spec_for(model) is not None:
            _track_managers(model)  # a proxy's, a multi-table child's
        if model._meta.proxy and model._meta.concrete_model in _tracked:
            post_delete.connect(_deleted, sender=model, weak=False)
    for spec in _tracked.values():
        for field in spec.fields:
            on_delete = getattr(field.remote_field, "on_delete", None)
            if on_delete is None or getattr(on_delete, "lazy_sub_objs", False):
                continue  # not a relation, or updated through QuerySet.update()
            if on_delete is models.SET_DEFAULT or hasattr(on_delete, "deconstruct"):
                target = field.remote_field.model
                _references.setdefault(target, []).append((spec, field))
                pre_delete.connect(_referenced_deleting, sender=target, weak=False)
                post_delete.connect(_referenced_deleted, sender=target, weak=False)


#: referenced model -> (tracking, field) of each tracked foreign key to it
#: whose on_delete Django applies to fetched rows (SET_DEFAULT, a callable SET).
_references: dict[type[models.Model], list[tuple[Tracking, models.Field]]] = {}
#: The tracked rows a delete in progress will update: (referenced model,
#: its row's pk, alias) -> [(tracking, their stored values by pk)].
_referencing = threading.local()


def _referenced_deleting(sender, instance, using, **kwargs) -> None:
    """``pre_delete`` of a row tracked rows reference: read and lock them."""
    if _off.get():
        return
    found = []
    for spec, field in _references[sender]:
        key = getattr(instance, field.target_field.attname)
        rows = spec.model._base_manager.using(using).filter(**{field.attname: key})
        stored = spec.stored(rows)
        if stored:
            found.append((spec, stored))
    if found:
        pending = _referencing.__dict__.setdefault("pending", {})
        pending[sender, instance.pk, using] = found


def _referenced_deleted(sender, instance, using, **kwargs) -> None:
    """``post_delete`` of that row: Django has updated the tracked rows;
    publish their changes, in the deletion's transaction."""
    pending = _referencing.__dict__.get("pending", {})
    for spec, before in pending.pop((sender, instance.pk, using), ()):
        _publish_rewritten(spec, before, using)


def tracked_models() -> list[Tracking]:
    """How each model ``@track`` registered is tracked."""
    return list(_tracked.values())


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Tracked writes in the block publish nothing, and ``QuerySet.update()``
    / ``bulk_update()`` on tracked models are Django's single statements
    again: for data migrations, backfills and writes that publish their own
    event."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def _saving(save, spec: Tracking):
    @functools.wraps(save)
    def tracked_save(self, *args, **kwargs):
        if _off.get():
            return save(self, *args, **kwargs)
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using):
            before = None
            if self.pk is not None and (
                not self._state.adding or not self._meta.pk.has_default()
            ):  # a row that may be stored: Django updates it if it is
                rows = spec.model._base_manager.using(using).filter(pk=self.pk)
                before = next(iter(spec.stored(rows).values()), None)
            result = save(self, *args, **kwargs)
            _publish_save(spec, self, before, kwargs.get("update_fields"), using)
        return result

    return tracked_save


def _publish_save(spec, instance, before, update_fields, using) -> None:
    after = spec.values(instance, using)
    if before is None:
        event, operation = _event(spec, "create", instance.pk, values=after), "create"
    else:
        names = {f.attname for f in spec.fields}
        if update_fields is not None:
            chosen = {spec.model._meta.get_field(n).attname for n in update_fields}
            names &= chosen
        change = _change(spec, instance.pk, before, after, names)
        if change is None:
            return
        event, operation = change
    _publish([(event, spec.aggregate(instance.pk))], operation, using)


def _change(
    spec: Tracking, pk: Any, before: dict, after: dict, names: Iterable[str]
) -> tuple[dict[str, Any], str] | None:
    """The event of a row going from ``before`` to ``after`` (tracked values
    by attname), comparing ``names``, and its operation; None when none of
    them changed."""
    changed = sorted(n for n in names if before[n] != after[n])
    if not set(changed) - spec.auto_now:
        return None
    soft = spec.soft_delete
    if soft is not None and before[soft.attname] is None and after[soft.attname]:
        return _event(spec, "soft_delete", pk, values=after), "soft_delete"
    event = _event(
        spec,
        "update",
        pk,
        changed={n: after[n] for n in changed},
        previous={n: before[n] for n in changed},
    )
    return event, "update"


def _deleted(sender, instance, using, **kwargs) -> None:
    """``post_delete`` of a tracked model: inside the deletion's transaction."""
    spec = _tracked.get(sender._meta.concrete_model)  # a proxy's deletes too
    if spec is None or _off.get():
        return
    pk = instance.pk
    item = (
        _event(spec, "delete", pk, values=spec.last_values(instance)),
        spec.aggregate(pk),
    )
    buffer = _deleting.get()
    if buffer is not None:
        buffer.append((using, item))
    else:
        _publish([item], "delete", using)


def _publish(items: list, operation: str, using: str) -> None:
    """``publish_each`` of change events; one over ``OUTBOX_MAX_PAYLOAD_BYTES``
    is published :func:`_fitted`, never refused: the row is saved and its
    event names what it left out. (publish_each checks every payload before
    its INSERT, so a refusal wrote nothing and the call is made again.)"""
    try:
        publish_each(items, operation=operation, using=using)
    except PayloadTooLarge:
        fitted_items = [(_fitted(event), aggregate) for event, aggregate in items]
        publish_each(fitted_items, operation=operation, using=using)


def _fitted(event: dict[str, Any]) -> dict[str, Any]:
    """A change event within ``OUTBOX_MAX_PAYLOAD_BYTES``: its largest tracked
    values left out (from ``values``, or from ``changed`` and ``previous``
    alike), largest first, until it fits, and named in ``"omitted"`` (sorted)
    so a subscriber knows to read them from the source. An event that fits
    is returned as it is; one that cannot fit even so is left for
    ``publish()`` to refuse (PayloadTooLarge)."""
    limit = outbox_settings.MAX_PAYLOAD_BYTES
    label = event["event_type"]

    def size(data: dict[str, Any]) -> int:
        return len(to_json(data, label, sys.maxsize)[1].encode())

    payload = event["payload"]
    if size(payload) <= limit:
        return event
    parts = [part for part in ("values", "changed", "previous") if part in payload]
    payload = {**payload, **{part: dict(payload[part]) for part in parts}}
    names = {name for part in parts for name in payload[part]}

    def weight(name: str) -> int:
        return sum(
            size({name: payload[part][name]}) for part in parts if name in payload[part]
        )

    omitted: list[str] = []
    for name in sorted(names, key=weight, reverse=True):
        for part in parts:
            payload[part].pop(name, None)
        omitted.append(name)
        payload["omitted"] = sorted(omitted)
        if size(payload) <= limit:
            break
    return {**event, "payload": payload}


def _event(spec: Tracking, operation: str, pk: Any, **payload: Any) -> dict[str, Any]:
    return {
        "event_type": spec.event_type(operation),
        "payload": {"pk": pk, **payload},
    }


def _stored(field: models.Field, value: Any) -> bool:
    """Whether ``value`` is already what reading ``field`` back would give:
    its Python type (``to_python``), a Decimal at the field's scale, an aware
    datetime under ``USE_TZ``; not an expression."""
    if value is None or isinstance(field, models.FileField):
        return True
    if hasattr(value, "resolve_expression"):
        return False
    try:
        python = field.to_python(value)
    except ValidationError:
        return False
    if type(python) is not type(value) or python != value:
        return False
    if isinstance(field, models.DecimalField) and python.is_finite():
        return python.as_tuple().exponent == -field.decimal_places
    if isinstance(python, datetime.datetime) and settings.USE_TZ:
        return timezone.is_aware(python)
    return True


def _plain(field: models.Field, value: Any) -> Any:
    """A value as payloads carry it: a file field as its name (None when
    empty, stored or not); a float JSON has no number for as its text
    (:func:`_spelled`)."""
    if isinstance(field, models.FileField):
        return (value.name if isinstance(value, FieldFile) else value) or None
    return _spelled(value)


def _spelled(value: Any) -> Any:
    """``value`` with each NaN, Infinity and -Infinity float, in lists and
    objects too (an array column), as the text ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``: the words a Decimal's text and JSON codecs that carry
    them (protobuf's JSON mapping) use. JSON has no number for them, yet the
    database holds them (PostgreSQL's ``double precision``; Infinity in
    SQLite's ``REAL``): the row's writes publish them as text, never refused.
    Text compares equal where NaN never does, so an unchanged NaN is no
    change."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(decimal.Decimal(value))
    if isinstance(value, list):
        return [_spelled(item) for item in value]
    if isinstance(value, dict):
        return {key: _spelled(item) for key, item in value.items()}
    return value


# --- the querysets' bulk writes ------------------------------------------------------


def _track_managers(model: type[models.Model]) -> None:
    """Give ``model``'s managers (its base manager included, which Django's
    deletes use for related rows) querysets of :class:`TrackedQuerySet`. A
    manager's class is swapped for a subclass whose ``_queryset_class`` mixes
    it in, so the related managers Django derives from it track too; the
    subclass keeps the original's name and module, so migrations see the
    manager they saw."""
    for manager in [*model._meta.managers, model._meta.base_manager]:
        kind = type(manager)
        if issubclass(kind._queryset_class, TrackedQuerySet):
            continue
        manager.__class__ = type(
            kind.__name__,
            (kind,),
            {
                "_queryset_class": _tracked_queryset_class(kind._queryset_class),
                "__module__": kind.__module__,
                "__qualname__": kind.__qualname__,
            },
        )


def _tracked_queryset_class(queryset: type[models.QuerySet]) -> type:
    """``queryset`` with :class:`TrackedQuerySet` mixed in after it, made once
    and kept in this module under a name of its own, so its querysets pickle
    (a cached queryset) and unpickle as tracked."""
    if queryset is models.QuerySet:
        return TrackedQuerySet
    name = "Tracked_" + re.sub(
        r"\W", "_", f"{queryset.__module__}.{queryset.__qualname__}"
    )
    tracked = globals().get(name)
    if tracked is None:
        tracked = type(
            name,
            (queryset, TrackedQuerySet),
            {"__module__": __name__, "__qualname__": name},
        )
        globals()[name] = tracked
    return tracked


def _queryset_delete(delete):
    @functools.wraps(delete)
    def tracked_delete(self, *args, **kwargs):
        if _spec_for(self.model) is None or _off.get():
            return delete(self, *args, **kwargs)
        return _buffered(delete, self, self.db, args, kwargs)

    return tracked_delete


def _instance_delete(delete):
    @functools.wraps(delete)
    def tracked_delete(self, using=None, keep_parents=False):
        if _off.get():
            return delete(self, using=using, keep_parents=keep_parents)
        alias = using or router.db_for_write(type(self), instance=self)
        return _buffered(
            delete, self, alias, (), {"using": using, "keep_parents": keep_parents}
        )

    return tracked_delete


def _buffered(delete, target, alias: str, args, kwargs):
    """Run ``delete`` in a transaction; its Deleted events, cascades
    included, are published with one INSERT at its end, inside it."""
    with transaction.atomic(using=alias), _buffer() as flush:
        result = delete(target, *args, **kwargs)
        flush()
    return result


@contextlib.contextmanager
def _buffer():
    """Collect the Deleted events of one delete() call; ``flush()`` publishes
    them with one INSERT per database."""
    buffer: list = []
    token = _deleting.set(buffer)

    def flush() -> None:
        by_alias: dict[str, list] = {}
        for using, item in buffer:
            by_alias.setdefault(using, []).append(item)
        buffer.clear()
        for using, items in by_alias.items():
            _publish(items, "delete", using)

    try:
        yield flush
    finally:
        _deleting.reset(token)


def _tracked_bulk_create(bulk_create):
    @functools.wraps(bulk_create)
    def tracked_bulk_create(self, objs, *args, **kwargs):
        spec = _spec_for(self.model)
        if spec is None or _off.get():
            return bulk_create(self, objs, *args, **kwargs)
        if kwargs.get("ignore_conflicts") or kwargs.get("update_conflicts"):
            raise UntrackedWrite(
                f"bulk_create(ignore_conflicts/update_conflicts) on the tracked "
                f"{spec.model._meta.label} cannot tell which rows it wrote: save() "
                "each object, or run it in outbox_app.untracked() and "
                "publish your own events"
            )
        with transaction.atomic(using=self.db):
            created = bulk_create(self, objs, *args, **kwargs)
            _publish_created(spec, created, self.db)
        return created

    return tracked_bulk_create


def _publish_created(spec: Tracking, objs: Sequence[models.Model], using: str):
    if any(obj.pk is None for obj in objs):
        raise UntrackedWrite(
            f"bulk_create on the tracked {spec.model._meta.label}: this database "
            "does not return the new primary keys, so no Created event could name "
            "its row; nothing was written. save() each object instead"
        )
    _publish(
        [
            (
                _event(spec, "create", obj.pk, values=spec.values(obj, using)),
                spec.aggregate(obj.pk),
            )
            for obj in objs
        ],
        "create",
        using,
    )


#: Rows one UPDATE of a tracked ``QuerySet.update()`` writes, by primary key
#: (a parameter each: SQLite allows 32,766 per statement).
UPDATE_BATCH = 1000


def _tracked_update(update):
    @functools.wraps(update)
    def tracked_update(self, **kwargs):
        spec = _spec_for(self.model)
        if spec is None or _off.get() or self.query.is_sliced:
            return update(self, **kwargs)  # Django refuses a sliced one
        rows = self.model._base_manager.using(self.db)  # a child's: its fields

        def write(pks: list) -> int:
            return sum(
                update(rows.filter(pk__in=pks[i : i + UPDATE_BATCH]), **kwargs)
                for i in range(0, len(pks), UPDATE_BATCH)
            )

        return _publish_changes(spec, _lockable(self, rows), write, self.db)

    return tracked_update


def _lockable(chosen: models.QuerySet, rows: models.QuerySet) -> models.QuerySet:
    """The rows of ``chosen`` as a queryset ``SELECT ... FOR UPDATE`` can
    lock, in primary key order: ``chosen`` itself, or, when it has DISTINCT,
    annotations or an outer join (PostgreSQL locks none of them), the rows of
    ``rows`` (the model's plain queryset) whose keys it selects."""
    query = chosen.query
    outer = any(
        getattr(join, "join_type", None) == LOUTER for join in query.alias_map.values()
    )
    if query.distinct or query.annotations or query.group_by is not None or outer:
        chosen = rows.filter(pk__in=chosen.order_by().values("pk"))
    return chosen.order_by("pk")


def _tracked_bulk_update(bulk_update):
    @functools.wraps(bulk_update)
    def tracked_bulk_update(self, objs, fields, *args, **kwargs):
        spec = _spec_for(self.model)
        if spec is None or _off.get():
            return bulk_update(self, objs, fields, *args, **kwargs)
        objs = list(objs)
        chosen = self.filter(pk__in=[obj.pk for obj in objs]).order_by("pk")

        def write(pks: list) -> int:
            with untracked():  # its own update() calls: published here
                return bulk_update(self, objs, fields, *args, **kwargs)

        return _publish_changes(spec, chosen, write, self.db)

    return tracked_bulk_update


class TrackedQuerySet(models.QuerySet):
    """The querysets of tracked models (mixed in by ``@track`` after any
    custom queryset class, so a custom ``update()`` runs first): their
    ``delete()``, ``bulk_create()``, ``update()`` and ``bulk_update()``
    publish change events. Other models' querysets are Django's own."""

    delete = _queryset_delete(models.QuerySet.delete)
    bulk_create = _tracked_bulk_create(models.QuerySet.bulk_create)
    update = _tracked_update(models.QuerySet.update)
    bulk_update = _tracked_bulk_update(models.QuerySet.bulk_update)


def _publish_changes(spec: Tracking, chosen, write, using: str) -> int:
    """Lock and read the rows of ``chosen`` (a queryset), ``write(pks)`` them,
    read them again and publish a change event per changed row, one INSERT
    per operation, all in one transaction. Returns what ``write`` returned."""
    with transaction.atomic(using=using):
        before = spec.stored(chosen)
        written = write(list(before))
        _publish_rewritten(spec, before, using)
    return written


def _publish_rewritten(spec: Tracking, before: dict, using: str) -> None:
    """Read again the rows whose tracked values were ``before`` (by primary
    key) and publish a change event per changed row, one INSERT per
    operation."""
    names = [f.attname for f in spec.fields]
    after = spec.model._base_manager.using(using).in_bulk(list(before))
    by_operation: dict[str, list] = {}
    for pk, was in before.items():
        if pk not in after:
            continue
        change = _change(spec, pk, was, spec.last_values(after[pk]), names)
        if change is not None:
            event, operation = change
            by_operation.setdefault(operation, []).append((event, spec.aggregate(pk)))
    for operation, items in by_operation.items():
        _publish(items, operation, using)
