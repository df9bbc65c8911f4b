"""The Django admin of the outbox: inspect events and deliveries, requeue them.

Outbox events and deliveries are read-only here: rows change state only
through the actions below, which call ``DeliveryQuerySet.apply`` (the
operator's transitions) and ``outbox_app.ops.subscriptions``, and rows are
deleted only by ``outbox_purge``. Every action needs a permission (the
deliveries' and events' ``outbox_app.requeue_delivery``, the inbox's
``requeue_inboxmessage``, the subscriptions' ``pause_subscription`` and
``retire_subscription``), reports with ``message_user`` and leaves a
``LogEntry`` in the admin log.

One module per page: ``base`` (the read-only base, the requeue permission,
the admin log, how values are shown), ``deliveries`` (the list, a
delivery's page with its transitions, the "requeue everything matching"
page), ``events``, ``cursors`` (stream delivery's cursors, what each has
still to read), ``subscriptions`` (served, paused; pause, resume,
retire, reactivate), ``inbox`` (the consumers' received messages, requeue),
and ``overview`` (the overview page, its live part and its JSON, served by
their own admin).
"""

# Importing the modules registers their admins.
from . import (  # noqa: F401
    cursors,
    deliveries,
    events,
    inbox,
    overview,
    subscriptions,
)
