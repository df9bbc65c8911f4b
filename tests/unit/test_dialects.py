"""The database seam: one dialect class per database, chosen once per alias,
and the only code that asks which database it is on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
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
