"""The base of outbox_app's management commands: a reader of their output that
goes away (``outbox_status | head``) ends the command quietly, as it ends
``cat``, instead of with a ``BrokenPipeError`` traceback; and the date
arguments they share."""

from __future__ import annotations

import datetime
import os
import sys

from django.core.management.base import BaseCommand
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

#: The exit status of a command whose output's reader went away: a process
#: killed by SIGPIPE, as the shell reports it (128 + 13).
BROKEN_PIPE = 141


class OutboxCommand(BaseCommand):
    """A management command whose output may be piped into ``head``, ``less``
    or ``grep -q``: when the reader closes the pipe, the command stops writing
    and exits with status :data:`BROKEN_PIPE`, no traceback (Python's advice
    for SIGPIPE: stdout pointed at /dev/null, so the final flush finds nowhere
    to fail)."""

    def execute(self, *args, **options):
        try:
            output = super().execute(*args, **options)
            sys.stdout.flush()  # what is still buffered fails here, not at exit
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(BROKEN_PIPE)
        return output


def moment(text: str) -> datetime.datetime:
    """A ``--since``-style argument: an ISO date (midnight) or date-time;
    naive values are taken in the current time zone.

    Raises:
        ValueError: neither (argparse reports it as an invalid date).
    """
    parsed = parse_datetime(text)
    if parsed is None:
        day = parse_date(text)
        if day is None:
            raise ValueError(text)
        parsed = datetime.datetime.combine(day, datetime.time())
    if timezone.is_naive(parsed):
        parsed = timezone.make_aware(parsed)
    return parsed


moment.__name__ = "date"  # argparse: "invalid date value: 'x'"
