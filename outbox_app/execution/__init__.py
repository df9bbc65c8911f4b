"""Running user code: the one wrapper around a handler's or a consumer's call
and how its failure is recorded (:mod:`~outbox_app.execution.run`), the retry
policy (:mod:`~outbox_app.execution.retry`), time limits
(:mod:`~outbox_app.execution.limits`), and the traces and metrics of it
(:mod:`~outbox_app.execution.tracing`, :mod:`~outbox_app.execution.metrics`).
The relay's handlers and the inbox's consumers both run through here."""
