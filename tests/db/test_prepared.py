"""OUTBOX_PREPARED_STATEMENTS: the relay's statements prepared on PostgreSQL
(planned once per connection), the rest of the connection left as Django
set it."""

from __future__ import annotations

import pytest
from django.db import connection

from outbox_app.relay import relay_once
from outbox_app.store.lifecycle import State
from tests import kit
from tests.delivery.test_delivery import place

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.only_database("postgresql"),
]


def prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.parametrize("on", [False, True])
def test_the_relay_prepares_its_statements_only_when_asked(handlers, settings, on):
    settings.OUTBOX_PREPARED_STATEMENTS = on
    connection.close()  # a new connection: nothing prepared yet
    handlers("record")
    place(3)
    assert relay_once().succeeded == 6
    place(2)
    assert relay_once().succeeded == 4  # the prepared statements again
    assert kit.states() == {State.SUCCEEDED: 10}
    statements = prepared()
    if not on:
        assert statements == []
        return
    # The relay's reads and writes (a claim and a mark, or a tick, a read and
    # a move).
    assert len(statements) >= 2, statements
    assert all(
        "outbox_app_" in text or "pg_current_snapshot()" in text for text in statements
    )
    # Django's own queries on the connection are not prepared.
    assert not [s for s in statements if "pg_prepared_statements" in s]
