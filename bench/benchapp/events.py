import decimal
from dataclasses import dataclass

from outbox_app import Event


@dataclass(frozen=True)
class OrderPlaced(Event):
    order_id: int
    total: decimal.Decimal
