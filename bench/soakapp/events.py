from dataclasses import dataclass

from outbox_app import Event


@dataclass(frozen=True)
class Deposited(Event):
    """What the soak's writers publish: the ``version``-th deposit on
    ``account`` (also its ``aggregate_version``), by writer ``writer``."""

    account: str
    version: int
    writer: int
    amount: int
