"""Domain events of the tests' Account aggregate: plain dataclasses, internal
to the service (``outbox_app.publishing.aggregates``)."""

import decimal
from dataclasses import dataclass


@dataclass(frozen=True)
class Credited:
    amount: decimal.Decimal


@dataclass(frozen=True)
class BonusCredited(Credited):
    """A subclass: the translator registered for Credited claims it first."""


@dataclass(frozen=True)
class Split:
    parts: int


@dataclass(frozen=True)
class Noted:
    """No translator: never leaves the service."""

    text: str
