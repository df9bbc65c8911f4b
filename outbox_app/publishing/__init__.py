"""Publishing: where events come from, written in the caller's transaction.
``publish()``, actions and acting (:mod:`~outbox_app.publishing.outbox`),
change events of tracked models (:mod:`~outbox_app.publishing.tracking`),
domain events recorded on aggregates and their translators
(:mod:`~outbox_app.publishing.aggregates`)."""
