"""What importing outbox_app costs and needs."""

import subprocess
import sys

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
