"""What importing outbox_app costs and needs."""

import os
import subprocess
import sys

import pytest

import outbox_app
from outbox_app.relay import registry


def test_handlers_modules_are_autodiscovered():
    spec = registry.get("tests.testapp.handlers.record_audit")
    assert spec.event_types == frozenset({"AuditRecorded"})


def test_outbox_app_never_imports_celery():
    code = (
        "import sys, django, os;"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'tests.settings';"
        "django.setup();"
        "import outbox_app, outbox_app.relay, outbox_app.relay.worker;"
        "import outbox_app.admin;"
        "from outbox_app import publish, handler;"
        "assert 'celery' not in sys.modules, 'celery imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_public_names_are_what_an_application_imports():
    import outbox_app
    from outbox_app import exceptions

    assert len(outbox_app.__all__) <= 20
    for name in outbox_app.__all__:
        assert getattr(outbox_app, name) is not None
    # Every exception is in its module, and still importable from the package.
    for name, value in vars(exceptions).items():
        if isinstance(value, type) and issubclass(value, Exception):
            assert getattr(outbox_app, name) is value


#: The names of ``outbox_app`` that are model classes: they need the app
#: registry, as every Django model does.
MODELS = {"Delivery", "InboxMessage", "OutboxEvent"}


@pytest.mark.parametrize("name", sorted(set(outbox_app.__all__) - MODELS))
def test_every_public_name_but_the_models_imports_before_django_setup(name):
    """A settings file, a ``celery.py`` or an ``events.py`` imported early may
    import any of them, as Celery's ``shared_task`` may be: a fresh process,
    its settings named, ``django.setup()`` not called. What it imported is
    the thing itself, not a stand-in: the same object once the apps are
    ready."""
    code = (
        f"from outbox_app import {name};"
        "import django, outbox_app;"
        "from django.apps import apps;"
        "assert not apps.ready, 'the app registry was loaded';"
        "django.setup();"
        f"assert getattr(outbox_app, {name!r}) is {name}"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    ran = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr
