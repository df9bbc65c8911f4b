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
        constraints = connection.introspection.get_constraints(
            cursor, "outbox_app_notification"
        )
    due = constraints["outbox_notification_due"]
    if connection.features.supports_partial_indexes:
        # In claim order, so a claim reads only the rows it takes.
        assert due["columns"] == ["subscriber", "next_retry_at", "id"]
    else:
        # Django drops conditions on MySQL/MariaDB: a composite index instead.
        assert due["columns"] == ["state", "subscriber", "next_retry_at", "id"]
