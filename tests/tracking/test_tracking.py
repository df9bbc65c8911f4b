"""Model change events (``@outbox_app.track``) on every database: each write
of a tracked model publishes its event in the same transaction, or is
refused before anything is written."""

from __future__ import annotations

import decimal
import math

import pytest
from django.core.files.base import ContentFile
from django.db import DatabaseError, connection, models, transaction
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext, isolate_apps
from django.utils import timezone

from outbox_app import OutboxEvent, UntrackedWrite, acting, untracked
from outbox_app.middleware import ActingMiddleware
from tests.testapp.models import Category, Product

pytestmark = pytest.mark.django_db(transaction=True)


def events() -> list[OutboxEvent]:
    return list(OutboxEvent.objects.order_by("id"))


def one() -> OutboxEvent:
    [event] = events()
    OutboxEvent.objects.all().delete()
    return event


def outbox_inserts(queries) -> int:
    table = OutboxEvent._meta.db_table
    return sum(
        1 for q in queries if q["sql"].startswith("INSERT") and table in q["sql"]
    )


@pytest.fixture
def category():
    return Category.objects.create(title="tea")


def test_create_publishes_every_tracked_field(category):
    product = Product.objects.create(
        name="Sencha", price=decimal.Decimal("4.50"), category=category, notes="x"
    )
    event = one()
    assert (event.event_type, event.operation) == ("ProductCreated", "create")
    assert (event.aggregate_type, event.aggregate_id) == (
        "testapp.Product",
        str(product.pk),
    )
    assert event.payload == {
        "pk": product.pk,
        "values": {
            "name": "Sencha",
            "price": "4.50",
            "category_id": category.pk,  # a foreign key as its id
            "leaflet": None,
            "deleted_at": None,  # "notes" is excluded
        },
    }


def test_update_publishes_the_changed_fields_and_their_previous_values():
    product = Product.objects.create(name="Sencha", price=decimal.Decimal("4.50"))
    one()
    product.price = decimal.Decimal("5.00")
    product.notes = "untracked"
    product.save()
    event = one()
    assert (event.event_type, event.operation) == ("ProductUpdated", "update")
    assert event.payload == {
        "pk": product.pk,
        "changed": {"price": "5.00"},
        "previous": {"price": "4.50"},
    }
    product.save()  # nothing changed: nothing published
    product.notes = "still untracked"
    product.save()
    assert events() == []


def test_previous_values_are_the_stored_ones_not_the_instance_s():
    product = Product.objects.create(name="Sencha", price=decimal.Decimal("4.50"))
    stale = Product.objects.get(pk=product.pk)
    product.price = decimal.Decimal("6.00")
    product.save()
    OutboxEvent.objects.all().delete()
    stale.name = "Gyokuro"  # saves every field: price goes back to 4.50
    stale.save()
    assert one().payload["previous"] == {"name": "Sencha", "price": "6.00"}


def test_update_fields_limit_what_is_compared():
    product = Product.objects.create(name="Sencha", price=decimal.Decimal("4.50"))
    one()
    product.name, product.price = "Gyokuro", decimal.Decimal("9.00")
    product.save(update_fields=["name"])
    assert one().payload["changed"] == {"name": "Gyokuro"}


def test_a_file_field_is_its_name(tmp_path, settings):
    settings.MEDIA_ROOT = str(tmp_path)
    product = Product(name="Matcha", price=decimal.Decimal("12"))
    product.leaflet.save("leaflet.txt", ContentFile(b"green"), save=False)
    product.save()
    assert one().payload["values"]["leaflet"] == "leaflet.txt"


def test_soft_delete_and_delete():
    product = Product.objects.create(name="Sencha", price=decimal.Decimal("4.50"))
    one()
    product.deleted_at = timezone.now()
    product.save()
    event = one()
    assert (event.event_type, event.operation) == ("ProductSoftDeleted", "soft_delete")
    assert event.payload["values"]["name"] == "Sencha"
    pk = product.pk
    product.delete()
    event = one()
    assert (event.event_type, event.operation) == ("ProductDeleted", "delete")
    assert event.aggregate_id == str(pk)
    assert event.payload["pk"] == pk and event.payload["values"]["price"] == "4.50"


def test_a_save_outside_a_transaction_wraps_itself_and_a_rollback_leaves_neither():
    assert not connection.in_atomic_block
    Product.objects.create(name="Sencha", price=decimal.Decimal("4.50"))
    assert len(events()) == 1  # publish() refuses outside atomic: save made one
    with pytest.raises(RuntimeError), transaction.atomic():
        Product.objects.create(name="Gone", price=decimal.Decimal("1"))
        raise RuntimeError("rolled back")
    assert not Product.objects.filter(name="Gone").exists()
    assert len(events()) == 1


def test_queryset_delete_and_cascades_publish_with_one_insert(category):
    for name in ("a", "b", "c"):
        Product.objects.create(name=name, price=1, category=category)
    Product.objects.create(name="d", price=1)
    OutboxEvent.objects.all().delete()
    with CaptureQueriesContext(connection) as queries:
        Product.objects.filter(name__in=["a", "b"]).delete()
    assert outbox_inserts(queries) == 1
    assert [e.event_type for e in events()] == ["ProductDeleted"] * 2
    OutboxEvent.objects.all().delete()
    with CaptureQueriesContext(connection) as queries:
        category.delete()  # cascades to "c"
    assert outbox_inserts(queries) == 1
    [event] = events()
    assert event.payload["values"]["name"] == "c"


def test_bulk_create_publishes_each_object_with_one_insert():
    with CaptureQueriesContext(connection) as queries:
        made = Product.objects.bulk_create(
            [Product(name=n, price=2) for n in ("x", "y", "z")]
        )
    assert outbox_inserts(queries) == 1
    published = events()
    assert [e.aggregate_id for e in published] == [str(p.pk) for p in made]
    assert {e.operation for e in published} == {"create"}


def test_update_publishes_an_event_per_changed_row_with_one_insert():
    tea, mug, pot = (
        Product.objects.create(name=n, price=decimal.Decimal(p))
        for n, p in (("tea", "4.50"), ("mug", "9.00"), ("pot", "4.50"))
    )
    OutboxEvent.objects.all().delete()
    with CaptureQueriesContext(connection) as queries:
        # F() and a value one row already has: the events say what was written.
        count = Product.objects.filter(price__lt=5).update(
            price=models.F("price") * 2, notes="sale"
        )
    assert count == 2
    assert outbox_inserts(queries) == 1
    published = events()
    assert [(e.event_type, e.operation) for e in published] == [
        ("ProductUpdated", "update"),
        ("ProductUpdated", "update"),
    ]
    assert [e.aggregate_id for e in published] == [str(tea.pk), str(pot.pk)]
    assert published[0].payload == {
        "pk": tea.pk,
        "changed": {"price": "9.00"},
        "previous": {"price": "4.50"},  # notes is not tracked
    }
    OutboxEvent.objects.all().delete()
    # A row the statement leaves as it was publishes nothing.
    assert Product.objects.filter(pk=mug.pk).update(price=decimal.Decimal("9")) == 1
    assert events() == []


def test_update_of_the_soft_delete_field_is_a_soft_delete():
    product = Product.objects.create(name="Sencha", price=1)
    OutboxEvent.objects.all().delete()
    Product.objects.filter(pk=product.pk).update(deleted_at=timezone.now())
    event = one()
    assert (event.event_type, event.operation) == ("ProductSoftDeleted", "soft_delete")


def test_bulk_update_publishes_the_changed_objects():
    made = [Product.objects.create(name=n, price=1) for n in ("x", "y", "z")]
    OutboxEvent.objects.all().delete()
    made[0].price, made[2].price = 3, 1  # z keeps its price
    made[2].name = "zz"
    assert Product.objects.bulk_update(made, ["price", "name"]) == 3
    published = events()
    assert [e.aggregate_id for e in published] == [str(made[0].pk), str(made[2].pk)]
    assert published[1].payload["changed"] == {"name": "zz"}


def test_a_rolled_back_update_leaves_neither_the_change_nor_its_event():
    product = Product.objects.create(name="Sencha", price=1)
    OutboxEvent.objects.all().delete()
    with pytest.raises(RuntimeError), transaction.atomic():
        Product.objects.filter(pk=product.pk).update(price=2)
        raise RuntimeError("rolled back")
    product.refresh_from_db()
    assert product.price == 1
    assert events() == []


def test_bulk_create_with_conflicts_is_refused_and_untracked_lets_writes_through():
    product = Product.objects.create(name="Sencha", price=decimal.Decimal("4.50"))
    one()
    with pytest.raises(UntrackedWrite, match="ignore_conflicts"):
        Product.objects.bulk_create([Product(name="q", price=1)], ignore_conflicts=True)
    assert Product.objects.count() == 1
    # Other models are untouched; untracked() publishes nothing.
    Category.objects.update(title="any")
    with untracked():
        Product.objects.filter(pk=product.pk).update(price=9)
        product.refresh_from_db()
        product.name = "quiet"
        product.save()
    assert events() == []


def test_acting_puts_the_actor_and_metadata_in_every_event_s_headers():
    with acting("import-job", source="erp.csv"), acting(run=7):
        Product.objects.create(name="Sencha", price=1)
    assert one().headers == {
        "actor": "import-job",
        "metadata": {"source": "erp.csv", "run": 7},
    }


def test_the_middleware_acts_for_the_request_s_user(django_user_model):
    user = django_user_model.objects.create(username="ana")

    def view(request):
        Product.objects.create(name="Sencha", price=1)
        return None

    request = RequestFactory().post("/products/", HTTP_X_REQUEST_ID="req-9")
    request.user = user
    ActingMiddleware(view)(request)
    assert one().headers == {
        "actor": str(user.pk),
        "metadata": {"method": "POST", "path": "/products/", "request_id": "req-9"},
    }


def test_a_routing_key_may_use_the_operation(settings):
    from django.core.management import call_command

    from outbox_app.relay import relay_once
    from outbox_app.relay.registry import close_publishers

    settings.OUTBOX_PUBLISHERS = {
        "bus": {
            "URL": "memory://",
            "EXCHANGE": "tracked",
            "ROUTING_KEY": "{aggregate_type}.{operation}",
        }
    }
    call_command("check")  # no outbox.E015
    from kombu import Connection, Exchange, Queue

    with Connection("memory://") as conn:
        queue = Queue("tracked-q", Exchange("tracked", "topic"), routing_key="#")
        queue(conn.default_channel).declare()
        try:
            Product.objects.create(name="Sencha", price=1)
            assert relay_once(kind="publisher").succeeded == 1
            message = queue(conn.default_channel).get(no_ack=True)
        finally:
            close_publishers()
    assert message.delivery_info["routing_key"] == "testapp.Product.create"


@pytest.mark.parametrize("operation", ["", "x" * 33, 7])
def test_a_malformed_operation_is_refused_before_the_insert(operation):
    from outbox_app import InvalidEvent, publish

    with pytest.raises(InvalidEvent, match="operation"), transaction.atomic():
        publish({"event_type": "Noted", "payload": {}}, operation=operation)
    assert events() == []


def test_the_aggregate_type_and_event_names_are_the_subscribers(settings):
    from django.core.management import call_command

    from outbox_app.relay import relay_once
    from outbox_app.relay.registry import close_publishers
    from tests.testapp.models import Gadget

    settings.OUTBOX_PUBLISHERS = {
        "bus": {
            "URL": "memory://",
            "EXCHANGE": "gadgets",
            "ROUTING_KEY": "{dimension}.{operation}",
        }
    }
    gadget = Gadget.objects.create(name="Lamp", price=5)
    gadget.price = 6
    gadget.save()
    gadget.removed_at = timezone.now()
    gadget.save()
    Gadget.objects.create(name="Fan").delete()
    published = [(e.event_type, e.aggregate_type, e.operation) for e in events()]
    assert published == [
        ("GadgetCreated", "Gadget", "create"),
        ("GadgetUpdated", "Gadget", "update"),
        ("GadgetDeleted", "Gadget", "soft_delete"),
        ("GadgetCreated", "Gadget", "create"),
        ("GadgetForceDeleted", "Gadget", "delete"),
    ]
    call_command("check")
    from kombu import Connection, Exchange, Queue

    with Connection("memory://") as conn:
        queue = Queue("gadgets-q", Exchange("gadgets", "topic"), routing_key="#")
        queue(conn.default_channel).declare()
        try:
            assert relay_once(kind="publisher").succeeded == 5
            keys = [
                queue(conn.default_channel)
                .get(no_ack=True)
                .delivery_info["routing_key"]
                for _ in range(5)
            ]
        finally:
            close_publishers()
    assert sorted(keys) == sorted(
        [
            "gadget.create",
            "gadget.update",
            "gadget.soft_delete",
            "gadget.create",
            "gadget.delete",
        ]
    )


@isolate_apps("tests.testapp")
def test_an_unknown_name_key_is_refused_by_a_check():
    from outbox_app import track
    from outbox_app.ops.checks import check_tracked_models
    from outbox_app.publishing import tracking

    class Probe(models.Model):
        class Meta:
            app_label = "testapp"

    try:
        track(names={"softdelete": "Gone"})(Probe)
        [error] = check_tracked_models()
        assert error.id == "outbox.E026" and "['softdelete']" in error.msg
    finally:
        del tracking._tracked[Probe]
    assert check_tracked_models() == []


@isolate_apps("tests.testapp")
def test_a_malformed_aggregate_type_is_refused_at_import():
    from django.core.exceptions import ImproperlyConfigured

    from outbox_app import track

    class Probe(models.Model):
        class Meta:
            app_label = "testapp"

    with pytest.raises(ImproperlyConfigured, match="aggregate_type"):
        track(aggregate_type="")(Probe)


# --- never invent a change, never miss one ------------------------------------------


def gadget_events() -> list[tuple[str, dict]]:
    found = [(e.event_type, e.payload) for e in events()]
    OutboxEvent.objects.all().delete()
    return found


def test_values_are_compared_and_published_as_the_database_stores_them():
    import datetime

    from tests.testapp.models import Gadget

    gadget = Gadget.objects.create(name="Lamp", price=5, launched="2024-05-01")
    [(_, created)] = gadget_events()
    stored = Gadget.objects.get()
    assert created["values"]["price"] == str(stored.price) == "5.00"
    assert created["values"]["launched"] == "2024-05-01"
    # Text that the database stores as it holds already, and a save that only
    # moves the auto_now field, are no change.
    gadget.price, gadget.launched = "5.00", "2024-05-01"
    gadget.save()
    gadget.launched = datetime.date(2024, 5, 1)
    gadget.save()
    assert gadget_events() == []
    # A Decimal the database rounds is published as it rounded it.
    gadget.price = decimal.Decimal("7.123")
    gadget.save()
    [(event_type, updated)] = gadget_events()
    assert event_type == "GadgetUpdated"
    assert updated["changed"]["price"] == str(Gadget.objects.get().price)
    # The auto_now field moved with it: part of the change, never one alone.
    assert set(updated["changed"]) == {"price", "touched"}
    assert updated["previous"]["price"] == "5.00"
    gadget.price = decimal.Decimal("7.12")
    gadget.save()
    assert gadget_events() == []


def test_a_new_instance_with_a_stored_primary_key_publishes_an_update():
    from tests.testapp.models import Gadget

    gadget = Gadget.objects.create(name="Lamp", price=5)
    gadget_events()
    Gadget(pk=gadget.pk, name="Lamp", price=6).save()
    [(event_type, payload)] = gadget_events()
    assert event_type == "GadgetUpdated"
    assert payload["changed"]["price"] == "6.00"
    assert payload["previous"]["price"] == "5.00"
    Gadget(pk=gadget.pk + 100, name="New", price=1).save()  # not stored: created
    assert [t for t, _ in gadget_events()] == ["GadgetCreated"]


def test_an_f_expression_in_save_publishes_the_value_it_wrote():
    from django.db.models import F

    from tests.testapp.models import Gadget

    gadget = Gadget.objects.create(name="Lamp", price=5)
    gadget_events()
    gadget.price = F("price") + 1
    gadget.save()
    [(event_type, payload)] = gadget_events()
    assert event_type == "GadgetUpdated"
    assert payload["changed"]["price"] == "6.00"
    assert payload["previous"]["price"] == "5.00"


def test_update_of_a_distinct_annotated_or_outer_joined_queryset_publishes():
    from django.db.models import Count, Q

    tea = Category.objects.create(title="tea")
    for name in ("Sencha", "Matcha"):
        Product.objects.create(name=name, price=1, category=tea)
    Product.objects.create(name="Cup", price=1)
    OutboxEvent.objects.all().delete()
    querysets = [  # PostgreSQL refuses FOR UPDATE with each of these
        (Product.objects.filter(category__title="tea").distinct(), 2),
        (Product.objects.annotate(n=Count("id")).filter(n__gte=1), 3),
        (Product.objects.filter(Q(category__title="tea") | Q(name="Cup")), 3),
    ]
    for price, (queryset, rows) in enumerate(querysets, start=2):
        assert queryset.update(price=price) == rows
        changed = [e.payload["changed"] for e in events()]
        OutboxEvent.objects.all().delete()
        assert changed == [{"price": f"{price}.00"}] * rows


def test_a_proxy_publishes_as_its_concrete_model():
    from tests.testapp.models import GadgetProxy

    GadgetProxy.objects.bulk_create([GadgetProxy(name="A"), GadgetProxy(name="B")])
    GadgetProxy.objects.filter(name="A").update(price=3)
    proxy = GadgetProxy.objects.get(name="B")
    proxy.price = 4
    proxy.save()
    GadgetProxy.objects.filter(name="A").delete()
    proxy.delete()
    published = [(e.event_type, e.aggregate_type) for e in events()]
    assert published == [
        ("GadgetCreated", "Gadget"),
        ("GadgetCreated", "Gadget"),
        ("GadgetUpdated", "Gadget"),
        ("GadgetUpdated", "Gadget"),
        ("GadgetForceDeleted", "Gadget"),
        ("GadgetForceDeleted", "Gadget"),
    ]


def test_a_multi_table_child_publishes_its_tracked_parent_s_changes():
    from tests.testapp.models import SmartGadget

    child = SmartGadget.objects.create(name="Hub", price=10)
    SmartGadget.objects.filter(pk=child.pk).update(price=11, firmware="2.0")
    SmartGadget.objects.filter(pk=child.pk).update(firmware="3.0")  # untracked field
    child.refresh_from_db()
    child.price = 12
    child.save()
    key = str(child.pk)
    child.delete()
    published = [(e.event_type, e.aggregate_type, e.aggregate_id) for e in events()]
    assert published == [
        ("GadgetCreated", "Gadget", key),
        ("GadgetUpdated", "Gadget", key),
        ("GadgetUpdated", "Gadget", key),
        ("GadgetForceDeleted", "Gadget", key),
    ]
    first = OutboxEvent.objects.filter(event_type="GadgetUpdated").order_by("id")[0]
    assert first.payload["changed"] == {"price": "11.00"}


def test_deleting_a_referenced_row_publishes_the_updates_on_delete_makes():
    from tests.testapp.models import Gadget

    old, other = (
        Category.objects.create(title="old"),
        Category.objects.create(title="o"),
    )
    Gadget.objects.create(name="A", category=old, shelf=other, backup=other)
    Gadget.objects.create(name="B", shelf=old)
    Gadget.objects.create(name="C", backup=old)
    gadget_events()
    old.delete()
    fallback = Category.objects.get(title="fallback")
    changed = sorted(
        (payload["pk"], tuple(sorted(payload["changed"].items())))
        for event_type, payload in gadget_events()
        if event_type == "GadgetUpdated"
    )
    a, b, c = Gadget.objects.order_by("name").values_list("pk", flat=True)
    assert changed == [
        (a, (("category_id", None),)),
        (b, (("shelf_id", None),)),
        (c, (("backup_id", fallback.pk),)),
    ]


def test_a_row_over_the_payload_cap_is_saved_with_its_largest_values_omitted(
    settings,
):
    settings.OUTBOX_MAX_PAYLOAD_BYTES = 180  # the row's values take about 220
    product = Product.objects.create(name="x" * 45, price=1, leaflet="l" * 90)
    [created] = events()
    assert created.payload["omitted"] == ["leaflet"]
    assert "leaflet" not in created.payload["values"]
    assert created.payload["values"]["name"] == "x" * 45
    OutboxEvent.objects.all().delete()
    product.leaflet = "m" * 90
    product.price = 2
    product.save()
    [updated] = events()
    assert updated.payload["omitted"] == ["leaflet"]
    assert updated.payload["changed"] == {"price": "2.00"}
    assert updated.payload["previous"] == {"price": "1.00"}
    assert Product.objects.get().leaflet.name == "m" * 90  # the row is whole
    OutboxEvent.objects.all().delete()
    Product.objects.filter(pk=product.pk).update(leaflet="n" * 90)
    assert [e.payload["omitted"] for e in events()] == [["leaflet"]]


#: Floats JSON has no number for, as change events spell them (as a Decimal's
#: text spells them: the same words).
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
#: What a database's float column refuses itself: its own error, nothing
#: written (SQLite stores NaN as NULL; MariaDB's DOUBLE has neither).
REFUSED_BY_THE_DATABASE = {
    "sqlite": {"NaN"},
    "mysql": {"NaN", "Infinity", "-Infinity"},
}


@pytest.fixture
def reading_model():
    """A tracked model with a float column, its table made for the test."""
    from outbox_app import track
    from outbox_app.publishing import tracking

    fields = {
        "__module__": __name__,
        "label": models.CharField(max_length=20),
        "value": models.FloatField(),
        "Meta": type("Meta", (), {"app_label": "testapp"}),
    }
    if connection.vendor == "postgresql":  # an array column: NaN in a list
        from django.contrib.postgres.fields import ArrayField

        fields["series"] = ArrayField(models.FloatField(), default=list)
    with isolate_apps("tests.testapp"):
        Reading = track(type("Reading", (models.Model,), fields))
        with connection.schema_editor() as editor:
            editor.create_model(Reading)
        try:
            yield Reading
        finally:
            with connection.schema_editor() as editor:
                editor.delete_model(Reading)
            del tracking._tracked[Reading]


@pytest.mark.parametrize("spelling", NON_FINITE)
def test_a_row_holding_nan_or_infinity_is_written_and_deleted_as_any_other(
    reading_model, spelling
):
    Reading, value = reading_model, NON_FINITE[spelling]
    if spelling in REFUSED_BY_THE_DATABASE.get(connection.vendor, ()):
        with pytest.raises(DatabaseError):
            Reading.objects.create(label="probe", value=value)
        assert not Reading.objects.exists() and events() == []
        return
    reading = Reading.objects.create(label="probe", value=value)
    pk = reading.pk
    [(created, payload)] = gadget_events()
    assert created == "ReadingCreated" and payload["pk"] == pk
    assert (payload["values"]["label"], payload["values"]["value"]) == (
        "probe",
        spelling,
    )
    reading.label = "renamed"
    reading.save()
    reading.save()  # nothing changed, NaN included: nothing published
    assert gadget_events() == [
        (
            "ReadingUpdated",
            {"pk": pk, "changed": {"label": "renamed"}, "previous": {"label": "probe"}},
        )
    ]
    Reading.objects.filter(pk=pk).update(value=1.5)
    Reading.objects.filter(pk=pk).update(value=value)
    assert [payload for _, payload in gadget_events()] == [
        {"pk": pk, "changed": {"value": 1.5}, "previous": {"value": spelling}},
        {"pk": pk, "changed": {"value": spelling}, "previous": {"value": 1.5}},
    ]
    Reading.objects.get(pk=pk).delete()
    Reading.objects.bulk_create([Reading(label="a", value=value)])
    Reading.objects.create(label="b", value=value)
    Reading.objects.all().delete()
    assert [(t, p["values"]["value"]) for t, p in gadget_events()] == [
        ("ReadingDeleted", spelling),
        ("ReadingCreated", spelling),
        ("ReadingCreated", spelling),
        ("ReadingDeleted", spelling),
        ("ReadingDeleted", spelling),
    ]
    assert not Reading.objects.exists()


@pytest.mark.only_database("postgresql")
def test_nan_and_infinity_in_an_array_column_are_spelled_alike(reading_model):
    reading = reading_model.objects.create(
        label="probe", value=0.5, series=[math.nan, 1.5, -math.inf]
    )
    reading.delete()
    assert [p["values"]["series"] for _, p in gadget_events()] == [
        ["NaN", 1.5, "-Infinity"],
        ["NaN", 1.5, "-Infinity"],
    ]


def test_tracking_is_opt_in_per_model_not_a_patch_of_every_queryset():
    from outbox_app.publishing.tracking import TrackedQuerySet
    from tests.testapp.models import Gadget, GadgetProxy, SmartGadget

    # Django's QuerySet is Django's: an untracked model pays nothing.
    assert models.QuerySet.update.__module__ == "django.db.models.query"
    assert not isinstance(Category.objects.all(), TrackedQuerySet)
    for model in (Product, Gadget, GadgetProxy, SmartGadget):
        assert isinstance(model.objects.all(), TrackedQuerySet), model
        assert isinstance(model._base_manager.all(), TrackedQuerySet), model
    tea = Category.objects.create(title="tea")
    Product.objects.create(name="Sencha", price=1, category=tea)
    OutboxEvent.objects.all().delete()
    assert isinstance(tea.product_set.all(), TrackedQuerySet)
    tea.product_set.update(price=2)  # a related manager's update publishes
    assert [e.event_type for e in events()] == ["ProductUpdated"]


@isolate_apps("tests.testapp")
def test_a_manager_that_bypasses_tracking_is_named_by_a_check():
    from outbox_app import track
    from outbox_app.ops.checks import check_tracked_models
    from outbox_app.publishing import tracking

    class Raw(models.Manager):
        def get_queryset(self):
            return models.QuerySet(self.model, using=self._db)

    class Probe(models.Model):
        objects = models.Manager()
        raw = Raw()

        class Meta:
            app_label = "testapp"

    try:
        track(Probe)
        [warning] = check_tracked_models()
        assert warning.id == "outbox.W009" and "'raw'" in warning.msg
    finally:
        del tracking._tracked[Probe]


def test_a_custom_queryset_keeps_its_methods_and_pickles():
    import pickle

    from outbox_app.publishing.tracking import TrackedQuerySet
    from tests.testapp.models import Gadget, GadgetQuerySet

    Gadget.objects.create(name="Lamp", price=3)
    OutboxEvent.objects.all().delete()
    queryset = Gadget.objects.cheap()
    assert isinstance(queryset, GadgetQuerySet)
    assert isinstance(queryset, TrackedQuerySet)
    assert queryset.update(price=4) == 1
    assert [e.event_type for e in events()] == ["GadgetUpdated"]
    copy = pickle.loads(pickle.dumps(queryset))
    assert type(copy) is type(queryset) and len(copy) == 1
