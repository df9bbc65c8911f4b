"""The Django admin of the outbox: inspect events and deliveries, requeue them.

Outbox events and deliveries are read-only here: rows change state only
through the actions below, which call ``DeliveryQuerySet.apply`` (the
operator's transitions) and ``outbox_app.ops.subscriptions``, and rows are
deleted only by ``outbox_purge``. Every action needs the
``outbox_app.requeue_delivery`` permission, reports with ``message_user`` and
leaves a ``LogEntry`` in the admin log.

One module per page: ``base`` (the read-only base, the requeue permission,
the admin log, how values are shown), ``deliveries`` (the list, a
delivery's page with its transitions, the "requeue everything matching"
page), ``events``, ``subscriptions``, ``inbox`` (the consumers' received
messages, requeue), and ``overview`` (the overview page and
its JSON, served by their own admin).
"""

# Importing the modules registers their admins.
from . import deliveries, events, inbox, overview, subscriptions  # noqa: F401
