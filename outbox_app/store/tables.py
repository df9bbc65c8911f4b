"""The outbox's tables by name, for the SQL outbox_app writes itself: the
event columns its statements read and copy (beside the models, whose fields
they name), and :class:`Tables`, the tables' and columns' names a database's
:class:`~outbox_app.store.sql.base.Dialect` is given, as Django's database
backends are given names, never models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.apps import apps

#: The event columns a delivery reads (``DeliveryContext``), in its order:
#: the relay's statements select them in this order
#: (:class:`~outbox_app.store.gateway.Gateway` reads them back so).
EVENT_COLUMNS = (
    "id",
    "namespace",
    "event_type",
    "revision",
    "payload",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "headers",
    "tenant_id",
    "action_id",
    "occurred_at",
    "deliver_at",
    "expires_at",
    "operation",
    "payload_bytes",
)

#: The event columns fan-out copies onto each delivery, in the dialect's
#: statements and in ``DeliveryQuerySet.create_for`` (``id`` becomes
#: ``event_id``; every other column keeps its name); a batch of events
#: awaiting fan-out is read with these, unless it is claimed at once.
COPIED_COLUMNS = (
    "id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "tenant_id",
    "deliver_at",
    "position",
    "payload_bytes",
)


@dataclass(frozen=True)
class Tables:
    """The names a :class:`~outbox_app.store.sql.base.Dialect`'s statements
    use, unquoted.

    Attributes:
        event: the outbox's table (``OutboxEvent``).
        delivery: the deliveries' table (``Delivery``).
        subscription: the relay's subscriptions' table (``Subscription``).
        cursor: stream delivery's cursors' table (``Cursor``).
        sequencer: the table of the last number given to an event in commit
            order (``Sequencer``; MySQL/MariaDB).
        delivery_defaults: column -> its model field's default, for every
            column of the deliveries' table but the primary key, in the
            model's field order: what a statement inserting a delivery
            writes where it sets no value of its own (a callable default,
            such as a time, is taken once here; the statements set those
            columns themselves).
        event_columns: :data:`EVENT_COLUMNS`.
        copied_columns: :data:`COPIED_COLUMNS`.
    """

    event: str
    delivery: str
    subscription: str
    cursor: str
    sequencer: str
    delivery_defaults: dict[str, Any]
    event_columns: tuple[str, ...] = EVENT_COLUMNS
    copied_columns: tuple[str, ...] = COPIED_COLUMNS

    @classmethod
    def of_models(cls) -> Tables:
        """The names of outbox_app's models, read through the app registry
        (the models import the store's modules, so none of those imports
        them). Raises ``AppRegistryNotReady`` before ``django.setup()``."""

        def model(name: str):
            return apps.get_model("outbox_app", name)

        delivery = model("Delivery")
        return cls(
            event=model("OutboxEvent")._meta.db_table,
            delivery=delivery._meta.db_table,
            subscription=model("Subscription")._meta.db_table,
            cursor=model("Cursor")._meta.db_table,
            sequencer=model("Sequencer")._meta.db_table,
            delivery_defaults={
                field.column: field.get_default()
                for field in delivery._meta.concrete_fields
                if not field.primary_key
            },
        )
