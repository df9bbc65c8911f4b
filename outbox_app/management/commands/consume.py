"""``python manage.py consume``: run the ``@consumer`` functions on the
messages of their queues, through the transactional inbox."""

from __future__ import annotations

import signal
import threading

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from kombu import Connection

from outbox_app.conf import mask_url, outbox_settings
from outbox_app.execution.metrics import consume_metrics
from outbox_app.inbox import consumers
from outbox_app.inbox.worker import ConsumeWorker
from outbox_app.management.base import OutboxCommand

from .relay import add_health_file_argument, configure_logging, health_file


class Command(OutboxCommand):
    help = (
        "Consume the messages of the @consumer functions' queues (from "
        "OUTBOX_INBOX_URL, bound to OUTBOX_INBOX_EXCHANGE) through the "
        "transactional inbox: per message and consumer, one transaction holds "
        "the consumer's writes and the inbox row of the message id, and the "
        "message is acknowledged after the commit, so a redelivered message "
        "has no second effect. A consumer that raises is retried from the "
        "database with backoff, then dead-lettered (the admin requeues it). Runs until "
        "SIGTERM/SIGINT (finishing the message in hand, exit 0), or "
        "--idle-exit / --max-seconds."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="QUEUE",
            help="Read only this queue (repeatable). Default: every consumer's.",
        )
        parser.add_argument(
            "--prefetch",
            type=int,
            default=None,
            help="Messages in flight before acks (default: OUTBOX_INBOX_PREFETCH).",
        )
        parser.add_argument(
            "--idle-exit",
            type=float,
            default=None,
            metavar="SECONDS",
            help="Exit 0 after this many seconds without a message or a retry.",
        )
        parser.add_argument(
            "--max-seconds",
            type=float,
            default=None,
            help="Exit 0 after this many seconds (default: run until stopped).",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            metavar="PORT",
            help="Serve this process's Prometheus metrics (messages received "
            "per queue, by outcome and by error class per consumer, consumer "
            "call durations, publish-to-handled latency) on this port, at "
            "/metrics (needs outbox_app[prometheus]). The inbox's own numbers "
            "come from outbox_app.ops.metrics.metrics_view.",
        )
        parser.add_argument(
            "--metrics-host",
            default="127.0.0.1",
            metavar="ADDRESS",
            help="The address --metrics-port binds (default: %(default)s, this "
            "machine only; the server checks no credentials). 0.0.0.0 or :: "
            "for every interface, e.g. for a Prometheus in another container.",
        )

        add_health_file_argument(
            parser,
            "the broker is connected and the database answered on the last turn",
        )

    def handle(self, *args, **options):
        configure_logging(options["verbosity"])
        health = health_file(options["health_file"])
        if options["prefetch"] is not None and options["prefetch"] < 1:
            raise CommandError("--prefetch must be a positive number of messages")
        if not outbox_settings.INBOX_URL:
            raise CommandError(
                "OUTBOX_INBOX_URL is not set: set it to the broker the producer "
                'publishes to, e.g. "amqp://guest:guest@127.0.0.1:5672//"'
            )
        try:
            _ = Connection(outbox_settings.INBOX_URL).transport  # raises if malformed
        except Exception as exc:
            raise CommandError(
                f"OUTBOX_INBOX_URL {mask_url(outbox_settings.INBOX_URL)!r} is not a "
                f"kombu URL: {mask_url(str(exc))}"
            ) from exc
        if outbox_settings.INBOX_URL.startswith("memory://"):
            raise CommandError(
                "OUTBOX_INBOX_URL is memory:// (in-process only): another "
                "process's messages never arrive; set it to the broker, e.g. "
                '"amqp://guest:guest@127.0.0.1:5672//"'
            )
        chosen = consumers(options["queues"])
        if not chosen:
            known = sorted({c.queue for c in consumers()})
            raise CommandError(
                "no @consumer reads "
                + (", ".join(options["queues"]) if options["queues"] else "any queue")
                + f" (queues with consumers: {', '.join(known) or 'none'}; "
                "consumers live in an installed app's consumers.py)"
            )
        if options["metrics_port"] is not None:
            try:
                consume_metrics.enable(
                    options["metrics_port"], addr=options["metrics_host"]
                )
            except (ImproperlyConfigured, OSError) as exc:
                raise CommandError(f"--metrics-port: {exc}") from exc
        stop = threading.Event()
        worker = ConsumeWorker(
            chosen,
            prefetch=options["prefetch"],
            idle_exit=options["idle_exit"],
            max_seconds=options["max_seconds"],
            stop=stop,
            health=health,
        )
        previous = {
            sig: signal.signal(sig, lambda *_: stop.set())
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            tally = worker.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write(str(tally))
