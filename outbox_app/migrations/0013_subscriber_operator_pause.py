"""An operator's pause of a subscriber (``Subscription.paused_at`` and
``paused_by``: no relay claims its deliveries until it is resumed), and the
permissions of the subscriptions' actions: pausing and resuming
(``pause_subscription``), retiring and reactivating
(``retire_subscription``; they needed ``requeue_delivery`` before).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0012_dead"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="subscription",
            options={
                "permissions": [
                    ("pause_subscription", "Can pause and resume subscribers"),
                    ("retire_subscription", "Can retire and reactivate subscriptions"),
                ],
                "verbose_name": "subscription",
                "verbose_name_plural": "subscriptions",
            },
        ),
        migrations.AddField(
            model_name="subscription",
            name="paused_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When an operator paused its subscriber: no relay claims the subscriber's deliveries until it is resumed. Empty: not paused.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="subscription",
            name="paused_by",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
    ]
