"""The shop's integration events: published with publish() in the transaction of
the state change they describe."""

from dataclasses import dataclass
from decimal import Decimal

from outbox_app import Event


@dataclass(frozen=True)
class OrderPlaced(Event):
    order_id: int
    customer_email: str
    total: Decimal
    sku: str = ""
    quantity: int = 1


@dataclass(frozen=True)
class OrderPaid(Event):
    order_id: int
    payment_id: int
    amount: Decimal


@dataclass(frozen=True)
class OrderCancelled(Event):
    order_id: int


@dataclass(frozen=True)
class WalletDeposited(Event):
    owner: str
    amount: Decimal


@dataclass(frozen=True)
class WalletWithdrawn(Event):
    owner: str
    amount: Decimal
