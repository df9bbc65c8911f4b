"""One name for the dead letter: a delivery out of attempts (was EXPIRED) and
an inbox message out of attempts or undecodable (was PARKED) are both DEAD.

Stored states are converted in place (one UPDATE per table, reversible); the
index of unfinished deliveries, whose condition lists the states, is rebuilt
around the conversion. SKIPPED keeps its meaning: an event whose
``expires_at`` passed.
"""

from django.db import migrations, models
from django.db.models import Q

import outbox_app.store.db

STATES = (
    # (model, former state, state)
    ("Delivery", "EXPIRED", "DEAD"),
    ("InboxMessage", "PARKED", "DEAD"),
)
PERMISSION_NAMES = {
    # codename: (former name, name)
    "requeue_delivery": (
        "Can requeue, retry and expire deliveries",
        "Can requeue, retry and dead-letter deliveries",
    ),
    "requeue_inboxmessage": (
        "Can requeue parked inbox messages",
        "Can requeue dead inbox messages",
    ),
}


def convert(apps, schema_editor, backwards=False):
    db = schema_editor.connection.alias
    for model, former, state in STATES:
        old, new = (state, former) if backwards else (former, state)
        apps.get_model("outbox_app", model).objects.using(db).filter(state=old).update(
            state=new
        )
    try:
        Permission = apps.get_model("auth", "Permission")
    except LookupError:  # django.contrib.auth is not installed
        return
    for codename, (former, name) in PERMISSION_NAMES.items():
        Permission.objects.using(db).filter(
            content_type__app_label="outbox_app", codename=codename
        ).update(name=former if backwards else name)


def convert_back(apps, schema_editor):
    convert(apps, schema_editor, backwards=True)


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0011_delivery_and_fanned_out"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="delivery", name="outbox_delivery_order"),
        migrations.AlterField(
            model_name="delivery",
            name="state",
            field=models.CharField(
                choices=[
                    ("PENDING", "pending"),
                    ("RUNNING", "running"),
                    ("SUCCEEDED", "succeeded"),
                    ("FAILED", "failed"),
                    ("DEAD", "dead"),
                    ("SKIPPED", "skipped"),
                ],
                default="PENDING",
                max_length=16,
            ),
        ),
        migrations.AlterField(
            model_name="inboxmessage",
            name="state",
            field=models.CharField(
                choices=[
                    ("HANDLED", "handled"),
                    ("FAILED", "failed"),
                    ("DEAD", "dead"),
                ],
                max_length=16,
            ),
        ),
        migrations.RunPython(convert, convert_back),
        migrations.AddIndex(
            model_name="delivery",
            index=outbox_app.store.db.FilteredIndex(
                fields=["subscriber", "aggregate_type", "aggregate_id", "position"],
                name="outbox_delivery_order",
                when=Q(state__in=("PENDING", "RUNNING", "FAILED", "DEAD")),
                fallback_prefix=[],
            ),
        ),
        migrations.AlterModelOptions(
            name="delivery",
            options={
                "ordering": ["-id"],
                "permissions": [
                    (
                        "requeue_delivery",
                        "Can requeue, retry and dead-letter deliveries",
                    )
                ],
                "verbose_name": "delivery",
                "verbose_name_plural": "deliveries",
            },
        ),
        migrations.AlterModelOptions(
            name="inboxmessage",
            options={
                "ordering": ["-id"],
                "permissions": [
                    ("requeue_inboxmessage", "Can requeue dead inbox messages")
                ],
                "verbose_name": "inbox message",
                "verbose_name_plural": "inbox messages",
            },
        ),
    ]
