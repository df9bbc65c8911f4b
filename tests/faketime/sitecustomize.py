"""Loaded only into the processes the tests run under libfaketime (this
directory goes first on their ``PYTHONPATH``; see
:func:`tests.processes.spawn`).

They run with ``FAKETIME_DONT_FAKE_MONOTONIC=1``, since a faked monotonic
clock makes timed lock waits hang; but then libfaketime makes
``time.sleep()`` fail with EINVAL. A sleep through ``select()`` with no file
descriptors waits the same time and is not intercepted.
"""

import select
import time


def _sleep(seconds: float) -> None:
    select.select([], [], [], max(0.0, seconds))


time.sleep = _sleep
