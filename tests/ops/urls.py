"""A URLconf that does not route the metrics view (the deploy check's test)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
