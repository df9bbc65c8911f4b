from dataclasses import dataclass
from decimal import Decimal

from outbox_app import Event


@dataclass(frozen=True)
class OrderPlaced(Event):
    order_id: int
    customer_email: str
    total: Decimal
