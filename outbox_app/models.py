"""The app's models, where Django looks for them: defined in
:mod:`outbox_app.store.models` (the store stage), importable from here."""

from .store.models import (
    ConsumerSubscription,
    Cursor,
    Delivery,
    InboxMessage,
    Notification,
    OutboxEvent,
    OutboxOverview,
    Sequencer,
    SubscriberPause,
    Subscription,
)

__all__ = [
    "ConsumerSubscription",
    "Cursor",
    "Delivery",
    "InboxMessage",
    "Notification",
    "OutboxEvent",
    "OutboxOverview",
    "Sequencer",
    "SubscriberPause",
    "Subscription",
]
