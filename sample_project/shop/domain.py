"""The shop's domain events: internal to the shop, recorded by its aggregates
(``outbox_app.publishing.aggregates``); ``translators.py`` decides what leaves."""

from dataclasses import dataclass


@dataclass(frozen=True)
class OrderWithdrawn:
    """The customer withdrew a placed order (published as OrderCancelled)."""

    order_id: int
