from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from outbox_app.relay.registry import unregister


def _staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, is_staff=True)  # no password: fast
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="outbox_app", codename__in=codenames
        )
    )
    return user


@pytest.fixture
def admin_user(django_user_model) -> User:
    """pytest-django's superuser, without hashing a password (slow) each test."""
    return django_user_model.objects.create_superuser("admin", "admin@example.com")


@pytest.fixture
def viewer_client() -> Client:
    """A staff user who may look at the outbox but not requeue."""
    client = Client()
    client.force_login(_staff("viewer", "view_delivery", "view_outboxevent"))
    return client


@pytest.fixture
def operator_client() -> Client:
    """A staff user with the requeue permission (not a superuser)."""
    client = Client()
    client.force_login(
        _staff(
            "operator",
            "view_delivery",
            "view_outboxevent",
            "requeue_delivery",
        )
    )
    return client


@pytest.fixture
def replay_target():
    """A registered handler to replay events to."""
    from outbox_app import handler

    def fn(event, context):
        return None

    handler("OrderPlaced", name="late.handler")(fn)
    yield "late.handler"
    unregister("late.handler")
