"""``ActingMiddleware``: the request's user and where it came from, in the
headers of every event the request publishes (``outbox_app.acting``)."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from .publishing.outbox import acting


class ActingMiddleware:
    """Put it after ``AuthenticationMiddleware``::

        MIDDLEWARE = [..., "outbox_app.middleware.ActingMiddleware"]

    Each event published while the request is handled gets
    ``{"actor": "<user pk>", "metadata": {"method": ..., "path": ...,
    "request_id": ...}}`` in its headers: ``actor`` only for an authenticated
    user, ``request_id`` only when the request has an ``X-Request-ID`` header.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = getattr(request, "user", None)
        actor = str(user.pk) if user is not None and user.is_authenticated else None
        metadata = {"method": request.method, "path": request.path}
        request_id = request.headers.get("X-Request-ID")
        if request_id:
            metadata["request_id"] = request_id
        with acting(actor, **metadata):
            return self.get_response(request)
