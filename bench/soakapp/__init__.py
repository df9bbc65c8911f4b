"""The application of ``bench/soak_settings.py`` (``bench/soak.py``): one event
class, the rows writers commit with it, the effects its handlers write."""
