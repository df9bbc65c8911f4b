"""Operating the outbox: what operators see and do. Status
(:mod:`~outbox_app.ops.status`), purge (:mod:`~outbox_app.ops.purge`),
Prometheus metrics read from the database (:mod:`~outbox_app.ops.metrics`),
system checks (:mod:`~outbox_app.ops.checks`) and operations on a
subscriber (:mod:`~outbox_app.ops.subscriptions`). The admin
(``outbox_app/admin``) and the management commands
(``outbox_app/management/commands``) are thin callers of these, where Django
looks for them."""
