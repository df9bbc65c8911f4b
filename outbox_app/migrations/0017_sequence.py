"""Stream delivery on MySQL/MariaDB: events numbered in commit order.

- ``OutboxEvent.sequence``: an event's number in commit order, given by a
  relay once the event committed (0 until then); a cursor there reads a
  tick's events by it. Existing events get 0 (they are delivered by rows, as
  before); the index ``outbox_event_sequence`` is composite on MySQL/MariaDB
  and a partial index holding nothing elsewhere, where nothing numbers
  events;
- ``Sequencer``: the last number given, one row whose lock the numbering
  relay holds.

The column is nullable with a constant default (0): every database adds it
in place, SQLite without rebuilding the table (its position trigger stays).
Numbering rewrites it at the same size, which costs MySQL/MariaDB less than
filling an empty column.
"""

from django.db import migrations, models

import outbox_app.store.db


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0016_stream_delivery"),
    ]

    operations = [
        migrations.CreateModel(
            name="Sequencer",
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
                (
                    "last",
                    models.BigIntegerField(
                        default=0, help_text="The last number given (0: none yet)."
                    ),
                ),
            ],
            options={
                "verbose_name": "sequencer",
                "verbose_name_plural": "sequencer",
            },
        ),
        migrations.AddField(
            model_name="outboxevent",
            name="sequence",
            field=models.BigIntegerField(
                db_default=models.Value(0),
                editable=False,
                help_text="MySQL/MariaDB, stream delivery: the event's number in commit order, given by a relay once the event committed (the one write after its INSERT); a tick is the last number given. 0 until then, and on other databases.",
                null=True,
            ),
        ),
        migrations.AddIndex(
            model_name="outboxevent",
            index=outbox_app.store.db.FilteredIndex(
                fallback_prefix=[],
                fields=["sequence", "fanned_out", "position"],
                name="outbox_event_sequence",
                when=models.Q(("sequence__gt", 0)),
            ),
        ),
    ]
