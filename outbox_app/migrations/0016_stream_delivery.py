"""Stream delivery: each subscriber reads the outbox through its cursors.

- ``Cursor``: one subscriber's place in the outbox, per partition, with the
  lease of the relay that reads it;
- ``OutboxEvent.txid``: the id of the transaction that wrote the event
  (PostgreSQL's ``xid8``, filled by the column's default
  ``pg_current_xact_id()``), indexed where it is filled: a tick's events are
  read by it. The column is added empty and the default set afterwards, so
  the table is not rewritten and existing rows stay empty (they are
  delivered by rows, as before). Elsewhere the column stays empty and no
  index is kept (MySQL/MariaDB) or the partial one holds nothing (SQLite);
- ``OutboxEvent.fanned_out`` may be NULL: an event written for stream
  delivery, which no relay of an earlier version fans out (it takes only
  FALSE ones).

On SQLite, making ``fanned_out`` nullable rebuilds the table, which drops its
triggers: the position numbering is set up again.
"""

import django.utils.timezone
from django.db import migrations, models

import outbox_app.store.db
import outbox_app.store.models
from outbox_app.store.db import number_positions
from outbox_app.store.sql import dialect_of


def number_again(apps, schema_editor):
    """SQLite rebuilt the table: its position trigger is created again
    (existing positions are kept)."""
    if dialect_of(schema_editor.connection).single_writer:
        number_positions(schema_editor, apps.get_model("outbox_app", "OutboxEvent"))


def add_transaction_id(apps, schema_editor):
    events = apps.get_model("outbox_app", "OutboxEvent")
    d = dialect_of(schema_editor.connection)
    table = schema_editor.quote_name(events._meta.db_table)
    schema_editor.execute(
        f"ALTER TABLE {table} ADD COLUMN txid {d.transaction_id_type or 'bigint'} NULL"
    )
    if d.transaction_id_type is not None:
        schema_editor.execute(
            f"ALTER TABLE {table} ALTER COLUMN txid SET DEFAULT "
            f"{d.current_transaction_id}"
        )


def drop_transaction_id(apps, schema_editor):
    events = apps.get_model("outbox_app", "OutboxEvent")
    table = schema_editor.quote_name(events._meta.db_table)
    schema_editor.execute(f"ALTER TABLE {table} DROP COLUMN txid")


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0015_inbox_body_digest"),
    ]

    operations = [
        migrations.AlterField(
            model_name="outboxevent",
            name="fanned_out",
            field=models.BooleanField(
                help_text="Row delivery: its deliveries exist (one per subscriber); whether each was delivered is the delivery's state. Written False on insert. Empty: stream delivery, where each subscriber's cursor reads the event and the row is never written again.",
                null=True,
                verbose_name="fanned out",
            ),
        ),
        migrations.RunPython(number_again, migrations.RunPython.noop),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="outboxevent",
                    name="txid",
                    field=outbox_app.store.models.TransactionIdField(
                        db_default=outbox_app.store.models.CurrentTransactionId(),
                        editable=False,
                        help_text="The id of the transaction that wrote the event (PostgreSQL's xid8): stream delivery reads the events whose transaction committed between two ticks. Empty on other databases.",
                        null=True,
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(add_transaction_id, drop_transaction_id),
            ],
        ),
        migrations.AddIndex(
            model_name="outboxevent",
            index=outbox_app.store.db.FilteredIndex(
                fallback_prefix=None,
                fields=["txid"],
                name="outbox_event_stream",
                when=models.Q(("txid__isnull", False)),
            ),
        ),
        migrations.CreateModel(
            name="Cursor",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True,
                        primary_key=True,
                        serialize=False,
                        verbose_name="ID",
                    ),
                ),
                ("subscriber", models.CharField(max_length=150)),
                (
                    "partition",
                    models.PositiveIntegerField(
                        default=0,
                        help_text="This cursor's slice of the subscriber's events.",
                    ),
                ),
                (
                    "partitions",
                    models.PositiveIntegerField(
                        default=1,
                        help_text="How many slices the subscriber's events are split into, by a hash of their aggregate.",
                    ),
                ),
                (
                    "tick",
                    models.TextField(
                        blank=True,
                        help_text="The last tick read to its end (PostgreSQL: a snapshot).",
                        null=True,
                    ),
                ),
                (
                    "next_tick",
                    models.TextField(
                        blank=True,
                        help_text="The tick being read, if one is (PostgreSQL: a snapshot).",
                        null=True,
                    ),
                ),
                (
                    "position",
                    models.BigIntegerField(
                        blank=True,
                        help_text="The last event position delivered (PostgreSQL: within the tick being read; empty: none yet).",
                        null=True,
                    ),
                ),
                (
                    "first_tick",
                    models.TextField(
                        blank=True,
                        help_text="Where it started (PostgreSQL: a snapshot): the events visible there were never its to deliver.",
                        null=True,
                    ),
                ),
                (
                    "first_position",
                    models.BigIntegerField(
                        blank=True,
                        help_text="Where it started (SQLite): the last position before it.",
                        null=True,
                    ),
                ),
                (
                    "own_position",
                    models.BigIntegerField(
                        blank=True,
                        help_text="PostgreSQL: the last position delivered of the events of a transaction that also ran the relay (a test's), written in that transaction.",
                        null=True,
                    ),
                ),
                (
                    "stop_tick",
                    models.TextField(
                        blank=True,
                        help_text="Where it stops (PostgreSQL: a snapshot): the subscriber's partitions are changing, and the cursors of the new count read on from here once every cursor of this count has read to it.",
                        null=True,
                    ),
                ),
                ("lease_token", models.UUIDField(blank=True, null=True)),
                (
                    "locked_by",
                    models.CharField(blank=True, default="", max_length=255),
                ),
                ("locked_until", models.DateTimeField(blank=True, null=True)),
                (
                    "wanted_by",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="A relay that asked for it to share the subscriber's partitions: its holder hands it over after its current batch.",
                        max_length=255,
                    ),
                ),
                (
                    "ticked_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="When it last read a tick to its end.",
                        null=True,
                    ),
                ),
                (
                    "created_at",
                    models.DateTimeField(default=django.utils.timezone.now),
                ),
                (
                    "updated_at",
                    models.DateTimeField(default=django.utils.timezone.now),
                ),
            ],
            options={
                "verbose_name": "cursor",
                "verbose_name_plural": "cursors",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("subscriber", "partitions", "partition"),
                        name="outbox_cursor_uniq",
                    )
                ],
            },
        ),
    ]
