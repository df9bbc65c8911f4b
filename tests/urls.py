from django.contrib import admin
from django.urls import path

from outbox_app.ops.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("outbox/metrics", metrics_view),
]
