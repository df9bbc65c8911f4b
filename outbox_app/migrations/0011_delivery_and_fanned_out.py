"""Names: a delivery of one event to one subscriber is a ``Delivery`` (it was
``Notification``) and an event's fan-out flag is ``fanned_out`` (it was
``delivered``). Renames only: no row is rewritten or dropped.

- the table ``outbox_app_notification`` becomes ``outbox_app_delivery``, its
  indexes and unique constraint take the new name, and the permissions follow:
  ``requeue_notification`` becomes ``requeue_delivery`` (with the view, change,
  add and delete ones), so groups and users keep what they were granted;
- the column ``delivered`` becomes ``fanned_out`` (the partial indexes follow
  the column on every database) and its two indexes are renamed;
- a proxy model ``Notification`` keeps the former admin addresses answering
  (they redirect) and ``Notification.objects`` reading the deliveries.
"""

from django.db import migrations, models
from django.db.migrations.operations.base import Operation
from django.db.models import Q

import outbox_app.store.db
from outbox_app.store.sql import dialect_of


class RenameUniqueConstraint(Operation):
    """Rename a unique constraint without rebuilding its index where the
    database can rename it (PostgreSQL renames the constraint with its index;
    MySQL/MariaDB name it by its index); SQLite keeps the name only in the
    table's SQL, so its table is rebuilt (Django's way to alter a SQLite table)."""

    reversible = True

    def __init__(self, model_name, old_name, new_name):
        self.model_name, self.old_name, self.new_name = model_name, old_name, new_name

    def deconstruct(self):
        kwargs = {
            "model_name": self.model_name,
            "old_name": self.old_name,
            "new_name": self.new_name,
        }
        return self.__class__.__name__, [], kwargs

    def state_forwards(self, app_label, state):
        self._rename_in_state(app_label, state, self.old_name, self.new_name)

    def _rename_in_state(self, app_label, state, old, new):
        model_state = state.models[app_label, self.model_name]
        renamed = []
        for constraint in model_state.options["constraints"]:
            if constraint.name == old:
                constraint = constraint.clone()
                constraint.name = new
            renamed.append(constraint)
        model_state.options["constraints"] = renamed
        state.reload_model(app_label, self.model_name, delay=True)

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        self._rename(app_label, schema_editor, to_state, self.old_name, self.new_name)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        self._rename(app_label, schema_editor, to_state, self.new_name, self.old_name)

    def state_backwards(self, app_label, state):
        self._rename_in_state(app_label, state, self.new_name, self.old_name)

    def _rename(self, app_label, schema_editor, to_state, old, new):
        model = to_state.apps.get_model(app_label, self.model_name)
        renamed = dialect_of(schema_editor.connection).rename_index(
            model._meta.db_table, old, new
        )
        if renamed is not None:
            schema_editor.execute(renamed)
        else:
            (constraint,) = [c for c in model._meta.constraints if c.name == new]
            schema_editor.add_constraint(model, constraint)  # rebuilds the table

    def describe(self):
        return (
            f"Rename constraint {self.old_name} on {self.model_name} to {self.new_name}"
        )


PERMISSION_NAMES = {
    # codename: (former codename, name)
    "requeue_delivery": (
        "requeue_notification",
        "Can requeue, retry and expire deliveries",
    ),
    "add_delivery": ("add_notification", "Can add delivery"),
    "change_delivery": ("change_notification", "Can change delivery"),
    "delete_delivery": ("delete_notification", "Can delete delivery"),
    "view_delivery": ("view_notification", "Can view delivery"),
}


def rename_permissions(apps, schema_editor, backwards=False):
    """Give the model's permissions their new codenames in place (the content
    type itself is renamed by django.contrib.contenttypes), so every group and
    user keeps its grants."""
    try:
        Permission = apps.get_model("auth", "Permission")
    except LookupError:  # django.contrib.auth is not installed
        return
    db = schema_editor.connection.alias
    for new, (old, name) in PERMISSION_NAMES.items():
        if backwards:
            new, old, name = old, new, name.replace("deliveries", "notifications")
            name = name.replace("delivery", "notification")
        ours = Permission.objects.using(db).filter(content_type__app_label="outbox_app")
        if not ours.filter(codename=new).exists():
            ours.filter(codename=old).update(codename=new, name=name)


def rename_permissions_back(apps, schema_editor):
    rename_permissions(apps, schema_editor, backwards=True)


class Migration(migrations.Migration):
    dependencies = [
        ("outbox_app", "0010_event_position_and_size"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        # The overview's proxy names its base: taken off while the base is
        # renamed (a proxy has no table: nothing changes in the database).
        migrations.DeleteModel("OutboxOverview"),
        migrations.RenameModel("Notification", "Delivery"),
        migrations.CreateModel(
            name="OutboxOverview",
            fields=[],
            options={
                "verbose_name": "overview",
                "verbose_name_plural": "overview",
                "proxy": True,
                "default_permissions": (),
                "indexes": [],
                "constraints": [],
            },
            bases=("outbox_app.delivery",),
        ),
        migrations.AlterModelOptions(
            name="delivery",
            options={
                "ordering": ["-id"],
                "permissions": [
                    ("requeue_delivery", "Can requeue, retry and expire deliveries")
                ],
                "verbose_name": "delivery",
                "verbose_name_plural": "deliveries",
            },
        ),
        migrations.AlterField(
            model_name="delivery",
            name="event",
            field=models.ForeignKey(
                db_index=False,
                on_delete=models.deletion.CASCADE,
                related_name="deliveries",
                to="outbox_app.outboxevent",
            ),
        ),
        migrations.RenameIndex(
            model_name="delivery",
            new_name="outbox_delivery_due",
            old_name="outbox_notification_due",
        ),
        migrations.RenameIndex(
            model_name="delivery",
            new_name="outbox_delivery_order",
            old_name="outbox_notification_order",
        ),
        migrations.RenameIndex(
            model_name="delivery",
            new_name="outbox_delivery_state",
            old_name="outbox_notif_state",
        ),
        migrations.RenameIndex(
            model_name="delivery",
            new_name="outbox_delivery_completed",
            old_name="outbox_notif_completed",
        ),
        RenameUniqueConstraint(
            model_name="delivery",
            old_name="outbox_notification_uniq",
            new_name="outbox_delivery_uniq",
        ),
        migrations.RunPython(rename_permissions, rename_permissions_back),
        # The event's fan-out flag: indexes renamed while their condition still
        # names the old column, then the column (the databases carry the
        # indexes over), then the indexes' definitions in the state.
        migrations.RenameIndex(
            model_name="outboxevent",
            new_name="outbox_event_fanout",
            old_name="outbox_event_undelivered",
        ),
        migrations.RenameIndex(
            model_name="outboxevent",
            new_name="outbox_event_fanout_agg",
            old_name="outbox_event_undelivered_agg",
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RenameField("outboxevent", "delivered", "fanned_out"),
            ],
            state_operations=[
                migrations.RemoveIndex("outboxevent", "outbox_event_fanout"),
                migrations.RemoveIndex("outboxevent", "outbox_event_fanout_agg"),
                migrations.RenameField("outboxevent", "delivered", "fanned_out"),
                migrations.AddIndex(
                    model_name="outboxevent",
                    index=outbox_app.store.db.FilteredIndex(
                        fields=["id", "event_type"],
                        name="outbox_event_fanout",
                        when=Q(fanned_out=False),
                        fallback_prefix=["fanned_out"],
                    ),
                ),
                migrations.AddIndex(
                    model_name="outboxevent",
                    index=outbox_app.store.db.FilteredIndex(
                        fields=["aggregate_type", "aggregate_id", "position"],
                        name="outbox_event_fanout_agg",
                        when=Q(fanned_out=False),
                        fallback_prefix=["fanned_out"],
                    ),
                ),
            ],
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="fanned_out",
            field=models.BooleanField(
                help_text="Its deliveries exist (one per subscriber); whether each "
                "was delivered is the delivery's state. Written False on insert.",
                verbose_name="fanned out",
            ),
        ),
        migrations.CreateModel(
            name="Notification",
            fields=[],
            options={
                "verbose_name": "delivery (former name)",
                "proxy": True,
                "default_permissions": (),
                "indexes": [],
                "constraints": [],
            },
            bases=("outbox_app.delivery",),
        ),
    ]
