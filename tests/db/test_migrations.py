"""The migration set matches the models, on every database."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection


@pytest.mark.django_db
def test_makemigrations_check__no_changes():
    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)


@pytest.mark.django_db
def test_indexes_fit_the_database():
    with connection.cursor() as cursor:
        due = connection.introspection.get_constraints(
            cursor, "outbox_app_notification"
        )["outbox_notification_due"]
        undelivered = connection.introspection.get_constraints(
            cursor, "outbox_app_outboxevent"
        )["outbox_event_undelivered"]
    # In the order claims and fan-out read them, so a batch reads only the
    # index entries it takes (migration 0002).
    if connection.features.supports_partial_indexes:
        assert due["columns"] == ["subscriber", "next_retry_at", "id"]
        assert undelivered["columns"] == ["id", "event_type"]
    else:
        # Django drops conditions on MySQL/MariaDB: a composite index instead.
        assert due["columns"] == ["state", "subscriber", "next_retry_at", "id"]
        assert undelivered["columns"] == ["delivered", "id", "event_type"]
