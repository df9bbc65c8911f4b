"""The store: the outbox's tables and every statement sent to them.
The models (:mod:`~outbox_app.store.models`; migrations stay in
``outbox_app/migrations``, where Django looks for them), the lifecycle of a
delivery and of an inbox message (:mod:`~outbox_app.store.lifecycle`), the
operators' transitions (:mod:`~outbox_app.store.querysets`), the relay's
statements run (:mod:`~outbox_app.store.gateway`), how the databases differ
(:mod:`~outbox_app.store.sql`: one dialect per database, the statements'
text among it), the tables and columns by name that the dialects are given
(:mod:`~outbox_app.store.tables`), database work beyond the ORM's
(:mod:`~outbox_app.store.db`) and the database's clock
(:mod:`~outbox_app.store.clock`)."""
