"""``python manage.py consume_events``: consume the shop's events from the broker."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from sample_project.shop.consumer import EventConsumer


class Command(BaseCommand):
    help = (
        "Consume the shop's integration events from the broker (OUTBOX_BROKER_URL, "
        "queue SHOP_EVENTS_QUEUE bound to exchange SHOP_EVENTS_EXCHANGE), "
        "deduplicated by message_id: each message id is recorded once in "
        "shop_consumedmessage, a redelivery is acked and dropped. Runs until "
        "SIGINT/SIGTERM, or --idle-exit / --max-seconds."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--idle-exit",
            type=float,
            default=None,
            help="Exit after this many seconds without a message.",
        )
        parser.add_argument(
            "--max-seconds",
            type=float,
            default=None,
            help="Exit after this many seconds (default: run until stopped).",
        )

    def handle(self, *args, **options):
        if settings.SHOP_BROKER_URL.startswith("memory://"):
            raise CommandError(
                "OUTBOX_BROKER_URL is memory:// (in-process only); set it to a "
                "real broker, e.g. amqp://guest:guest@127.0.0.1:5672//"
            )
        consumer = EventConsumer()
        try:
            report = consumer.run(
                idle_seconds=options["idle_exit"], max_seconds=options["max_seconds"]
            )
        except KeyboardInterrupt:
            report = consumer.report
        except OSError as exc:
            raise CommandError(f"broker connection failed: {exc}") from exc
        self.stdout.write(
            f"consumed {report.consumed}, duplicates dropped {report.duplicates}"
        )
