"""Running user code: the retry policy (:mod:`~outbox_app.execution.retry`),
time limits (:mod:`~outbox_app.execution.limits`), what a handler or a
consumer receives and how its failure is recorded
(:mod:`~outbox_app.execution.run`), and the traces and metrics of it
(:mod:`~outbox_app.execution.tracing`, :mod:`~outbox_app.execution.metrics`).
The relay's handlers and the inbox's consumers both run through here."""
