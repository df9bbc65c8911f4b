"""The database seam: one dialect class per database, chosen once per alias,
and the only code that asks which database it is on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.apps import apps
from django.db import connection

from outbox_app.exceptions import UnsupportedDatabase
from outbox_app.store import sql

PACKAGE = Path(sql.__file__).resolve().parents[2]


@pytest.mark.django_db
def test_each_alias_gets_its_databases_dialect_once():
    d = sql.dialect("default")
    assert type(d) is sql.DIALECTS[connection.vendor]
    assert sql.dialect("default") is d
    assert d.skip_locked == connection.features.has_select_for_update_skip_locked
    assert d.native_uuid == connection.features.has_native_uuid_field


def test_a_database_without_a_dialect_is_refused():
    with pytest.raises(UnsupportedDatabase, match="'default' is oracle"):
        sql._dialect("default", "oracle")


def test_only_the_seam_asks_which_database_it_is_on():
    asked = re.compile(r"vendor ==|vendor !=|\.vendor in\b")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if "store/sql" not in path.as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if asked.search(line)
    ]
    assert found == []


def test_fan_out_inserts_every_delivery_column_with_the_models_defaults():
    delivery = apps.get_model("outbox_app", "Delivery")
    for claiming in (False, True):
        columns, values = sql.dialect("default")._delivery_row(claiming)
        names = columns.split(", ")
        assert sorted(names) == sorted(
            f.column for f in delivery._meta.concrete_fields if not f.primary_key
        )
        assert names[-5:] == [
            "last_error",
            "last_error_type",
            "last_traceback",
            "first_failed_at",
            "completed_at",
        ]  # the columns the model's defaults fill, last
        assert values.endswith("'', '', '', NULL, NULL")
        assert values.startswith("b.id, ") and names[0] == "event_id"
        # The parameters, in the order Gateway.fan_out passes them.
        assert values.count("%s") == (7 if claiming else 3)


def test_a_default_sql_cannot_spell_is_refused():
    assert sql.base._literal("it's") == "'it''s'"
    assert sql.base._literal(0) == "0" and sql.base._literal(None) == "NULL"
    with pytest.raises(TypeError, match="float"):
        sql.base._literal(1.5)
