"""The base of outbox_app's management commands: a reader of their output that
goes away (``outbox_status | head``) ends the command quietly, as it ends
``cat``, instead of with a ``BrokenPipeError`` traceback."""

from __future__ import annotations

import os
import sys

from django.core.management.base import BaseCommand

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
