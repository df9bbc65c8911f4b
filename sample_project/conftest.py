# The fixtures of outbox_app.testing (outbox, outbox_publishers) for the shop's
# pytest tests: `python -m pytest sample_project` from the repository's root.
pytest_plugins = ["outbox_app.testing.pytest"]
