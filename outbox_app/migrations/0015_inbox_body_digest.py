"""The inbox keeps the SHA-256 of each message it records, so a later message
of the same id with another body is told apart from a redelivery.

The column has a database default (empty: unknown), so a ``consume`` process
of the previous version keeps inserting rows while this one is deployed."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0014_partial_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="inboxmessage",
            name="body_digest",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text=(
                    "SHA-256 of the CloudEvent first received under this key (its "
                    "JSON with sorted keys): another body under this id is a "
                    "differing duplicate, logged and counted."
                ),
                max_length=64,
            ),
        ),
    ]
