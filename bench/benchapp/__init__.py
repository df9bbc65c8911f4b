"""The tiny application of ``bench/settings.py``: one event class, handlers
switched on by environment variables, a publisher that records confirm times."""
