"""The inbox keys a message by (consumer, CloudEvents source, id), and
``consume`` processes record their consumers (ConsumerSubscription).

The source column has a database default (empty), so a ``consume`` process
of the previous version keeps inserting rows while this one is deployed;
rows without a source still stop a redelivery of their message id."""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0008_operation"),
    ]

    operations = [
        migrations.CreateModel(
            name="ConsumerSubscription",
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
                ("consumer", models.CharField(max_length=150)),
                ("queue", models.CharField(max_length=255)),
                (
                    "event_type",
                    models.CharField(
                        help_text="An event type, or * for every type.", max_length=255
                    ),
                ),
                ("ordered", models.BooleanField(default=False)),
                (
                    "first_seen_at",
                    models.DateTimeField(default=django.utils.timezone.now),
                ),
                (
                    "last_seen_at",
                    models.DateTimeField(
                        default=django.utils.timezone.now,
                        help_text="When a consume process that has it last ran.",
                    ),
                ),
                (
                    "last_seen_by",
                    models.CharField(blank=True, default="", max_length=255),
                ),
                (
                    "retired_at",
                    models.DateTimeField(
                        blank=True, help_text="Empty while active.", null=True
                    ),
                ),
                (
                    "retired_by",
                    models.CharField(blank=True, default="", max_length=255),
                ),
            ],
            options={
                "verbose_name": "consumer subscription",
                "verbose_name_plural": "consumer subscriptions",
            },
        ),
        migrations.AddField(
            model_name="inboxmessage",
            name="source",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text="The CloudEvents source: the producing service (its OUTBOX_NAMESPACE).",
                max_length=255,
            ),
        ),
        migrations.AddConstraint(
            model_name="inboxmessage",
            constraint=models.UniqueConstraint(
                fields=("consumer", "source", "message_id"), name="outbox_inbox_key"
            ),
        ),
        # Dropped once the new key is in place: no moment without one.
        migrations.RemoveConstraint(
            model_name="inboxmessage",
            name="outbox_inbox_uniq",
        ),
        migrations.AddConstraint(
            model_name="consumersubscription",
            constraint=models.UniqueConstraint(
                fields=("consumer", "queue", "event_type"),
                name="outbox_consumer_subscription_uniq",
            ),
        ),
    ]
