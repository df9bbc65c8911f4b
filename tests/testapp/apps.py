import os

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Relay processes started by the tests (manage.py relay, Celery workers)
        # register handler sets named in the environment.
        sets = os.environ.get("OUTBOX_TEST_HANDLER_SETS")
        if sets:
            from . import scenarios

            for name in sets.split(","):
                scenarios.register(name)
