"""Three indexes hold only the rows they are read for (PostgreSQL, SQLite):
events with an action (``action_id``) or a tenant (``tenant_id``), and
finished deliveries (``completed_at``). Most events have neither an action nor
a tenant and a delivery is born unfinished, so ``publish()`` and fan-out
(which writes the event's row anew) no longer insert an index entry per row
for nothing. A query for one action, one tenant or a completion time implies
NOT NULL and uses them. MySQL/MariaDB have no partial indexes and get the
same plain indexes under the new names.

The new indexes are built before the old ones are dropped, so no query is
without one meanwhile; building them reads the tables once (see "Upgrading"
in docs/operations.md).
"""

from django.db import migrations, models

import outbox_app.store.db


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0013_subscriber_operator_pause"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="delivery",
            index=outbox_app.store.db.FilteredIndex(
                fallback_prefix=[],
                fields=["completed_at"],
                name="outbox_delivery_completed_set",
                when=models.Q(("completed_at__isnull", False)),
            ),
        ),
        migrations.AddIndex(
            model_name="outboxevent",
            index=outbox_app.store.db.FilteredIndex(
                fallback_prefix=[],
                fields=["action_id"],
                name="outbox_event_action_set",
                when=models.Q(("action_id__isnull", False)),
            ),
        ),
        migrations.AddIndex(
            model_name="outboxevent",
            index=outbox_app.store.db.FilteredIndex(
                fallback_prefix=[],
                fields=["tenant_id", "id"],
                name="outbox_event_tenant_set",
                when=models.Q(("tenant_id__isnull", False)),
            ),
        ),
        migrations.RemoveIndex(model_name="delivery", name="outbox_delivery_completed"),
        migrations.RemoveIndex(model_name="outboxevent", name="outbox_event_action"),
        migrations.RemoveIndex(model_name="outboxevent", name="outbox_event_tenant"),
    ]
