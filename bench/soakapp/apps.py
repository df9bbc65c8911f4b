from django.apps import AppConfig


class SoakAppConfig(AppConfig):
    name = "bench.soakapp"
    label = "soakapp"
    default_auto_field = "django.db.models.BigAutoField"
