"""Events get a position (publish order, numbered by the database on
insert) and their payload's size; deliveries copy both. Ordered subscribers
follow positions; claims bound their batches by payload bytes.

Existing events are numbered in id order (the order ordered subscribers
followed for events without a version), sizes are measured from the stored
JSON, and both are copied onto existing deliveries.
"""

from django.db import migrations, models

import outbox_app.store.db
from outbox_app.store.db import copy_to_deliveries, number_positions
from outbox_app.store.sql import dialect_of


def fill(apps, schema_editor):
    events = apps.get_model("outbox_app", "OutboxEvent")
    deliveries = apps.get_model("outbox_app", "Notification")
    number_positions(schema_editor, events)
    table = schema_editor.quote_name(events._meta.db_table)
    size = dialect_of(schema_editor.connection).json_bytes("payload")
    schema_editor.execute(f"UPDATE {table} SET payload_bytes = {size}", params=None)
    copy_to_deliveries(schema_editor, events, deliveries, ["position", "payload_bytes"])


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0009_inbox_source_and_consumers"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="notification",
            name="outbox_notification_order",
        ),
        migrations.RemoveIndex(
            model_name="outboxevent",
            name="outbox_event_undelivered_agg",
        ),
        migrations.AddField(
            model_name="notification",
            name="payload_bytes",
            field=models.PositiveIntegerField(
                db_default=0,
                editable=False,
                help_text="The event's payload size in bytes, copied at fan-out.",
            ),
        ),
        migrations.AddField(
            model_name="notification",
            name="position",
            field=models.BigIntegerField(
                blank=True,
                editable=False,
                help_text="The event's publish order, copied at fan-out.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="outboxevent",
            name="payload_bytes",
            field=models.PositiveIntegerField(
                db_default=0,
                editable=False,
                help_text="Length of the payload's JSON text, in bytes (UTF-8).",
            ),
        ),
        migrations.AddField(
            model_name="outboxevent",
            name="position",
            field=models.BigIntegerField(
                editable=False,
                help_text="Publish order, numbered by the database when the row is inserted (a row inserted without one gets the next number): ordered subscribers receive an aggregate's events in this order.",
                null=True,
                unique=True,
            ),
        ),
        migrations.RunPython(
            fill, migrations.RunPython.noop, atomic=False, elidable=False
        ),
        migrations.AddIndex(
            model_name="notification",
            index=outbox_app.store.db.FilteredIndex(
                fallback_prefix=[],
                fields=["subscriber", "aggregate_type", "aggregate_id", "position"],
                name="outbox_notification_order",
                when=models.Q(
                    ("state__in", ("PENDING", "RUNNING", "FAILED", "EXPIRED"))
                ),
            ),
        ),
        migrations.AddIndex(
            model_name="outboxevent",
            index=outbox_app.store.db.FilteredIndex(
                fallback_prefix=["delivered"],
                fields=["aggregate_type", "aggregate_id", "position"],
                name="outbox_event_undelivered_agg",
                when=models.Q(("delivered", False)),
            ),
        ),
    ]
