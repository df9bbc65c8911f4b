"""The states of a delivery and of an inbox message, and every transition
between them: one table each (:data:`DELIVERY`, :data:`INBOX`). The groups the
queries use (:data:`CLAIMABLE`, :data:`REQUEUEABLE`, ...) are read off the
tables, and docs/architecture.md shows them as :func:`table_markdown` renders
them (a test keeps the page equal to the tables).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import models
from django.utils.translation import gettext_lazy as _


class State(models.TextChoices):
    """A delivery's state (:class:`~outbox_app.store.models.Delivery`)."""

    PENDING = "PENDING", _("pending")
    RUNNING = "RUNNING", _("running")
    SUCCEEDED = "SUCCEEDED", _("succeeded")
    FAILED = "FAILED", _("failed")
    DEAD = "DEAD", _("dead")
    SKIPPED = "SKIPPED", _("skipped")


class InboxState(models.TextChoices):
    """A consumed message's state (:class:`~outbox_app.store.models.InboxMessage`)."""

    HANDLED = "HANDLED", _("handled")
    FAILED = "FAILED", _("failed")
    DEAD = "DEAD", _("dead")


@dataclass(frozen=True)
class Transition:
    """One way a row's state changes.

    Attributes:
        name: the transition's one name in code, admin, docs and metrics.
        sources: the states it applies to, in the order the queries list
            them; ``()``: it makes the row.
        targets: the states it may leave the row in; ``()``: it deletes the row.
        by: who makes it: ``"relay"``, ``"consume"``, ``"operator"`` (the admin,
            ``outbox_requeue``, ``DeliveryQuerySet.apply``,
            :mod:`~outbox_app.ops.subscriptions`), ``"retire"``
            (``outbox_subscribers --retire``) or ``"purge"``.
        when: the rule, in a sentence.
    """

    name: str
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    by: str
    when: str


P, R, S, F, D, K = (
    State.PENDING,
    State.RUNNING,
    State.SUCCEEDED,
    State.FAILED,
    State.DEAD,
    State.SKIPPED,
)

#: Every transition of a delivery.
DELIVERY: tuple[Transition, ...] = (
    Transition(
        "fan_out",
        (),
        (P, R),
        "relay",
        "one row per subscriber of the event's type; RUNNING when the "
        "fan-out claims it for its own batch",
    ),
    Transition(
        "divert",
        (),
        (P, R, F, D, K),
        "relay",
        "stream delivery passes an event it does not deliver now: its first "
        "attempt failed (FAILED; DEAD when it was the last or is never retried), "
        "it expired (SKIPPED), it is due later or waits behind an unfinished "
        "row of its aggregate (PENDING), or a handler's on_commit callbacks run "
        "after the commit (RUNNING)",
    ),
    Transition(
        "claim",
        (P, F, R),
        (R,),
        "relay",
        "due (next_retry_at passed; a RUNNING row's lease ran out): "
        "leased, one attempt counted",
    ),
    Transition(
        "succeed", (R,), (S,), "relay", "the handler returned, or the broker confirmed"
    ),
    Transition(
        "fail",
        (R,),
        (F,),
        "relay",
        "the attempt raised and attempts are left: due again after the backoff",
    ),
    Transition(
        "die",
        (R,),
        (D,),
        "relay",
        "the attempt raised and was the last, or raised an error that "
        "is never retried (give_up_on, UndeliverableMessage, LeaseLost)",
    ),
    Transition(
        "lapse",
        (R,),
        (K,),
        "relay",
        "the event's expires_at passed before delivery: no attempt, "
        "error type EventExpired",
    ),
    Transition(
        "release",
        (R,),
        (P, F),
        "relay",
        "the relay stops or the publisher pauses: the attempt is taken "
        "back, due again (FAILED when an earlier attempt failed)",
    ),
    Transition(
        "requeue",
        (F, D),
        (P,),
        "operator",
        "due now, attempts reset, the last error kept as history",
    ),
    Transition("retry_now", (F,), (F,), "operator", "due now, attempts kept"),
    Transition(
        "dead_letter",
        (P, F),
        (D,),
        "operator",
        "stop retrying (RUNNING rows are left to their worker)",
    ),
    Transition(
        "skip",
        (F, D),
        (K,),
        "operator",
        "give up delivering: finished, the error kept; an ordered "
        "subscriber's aggregate flows on",
    ),
    Transition(
        "replay",
        (P, S, F, D, K),
        (P,),
        "operator",
        "deliver again: due now, attempts reset (a scheduled row not "
        "due yet is left to its time)",
    ),
    Transition(
        "hand_over",
        (),
        (P, K),
        "retire",
        "a subscription is retired while its subscriber's cursor has not read "
        "all of its events: those become rows, PENDING with --waiting keep "
        "(relays that have the subscriber deliver them), SKIPPED with "
        "--waiting skip",
    ),
    Transition(
        "abandon",
        (P, F, D),
        (K,),
        "retire",
        "the subscription is retired with --waiting skip: no relay will deliver them",
    ),
    Transition("purge", (S, K), (), "purge", "finished and older than the retention"),
)

#: Every transition of an inbox message.
INBOX: tuple[Transition, ...] = (
    Transition(
        "receive",
        (),
        (InboxState.HANDLED, InboxState.FAILED, InboxState.DEAD),
        "consume",
        "the consumer ran and committed with its writes (HANDLED), "
        "raised (FAILED, or DEAD on its last attempt), or the message "
        "cannot be decoded (DEAD)",
    ),
    Transition(
        "retry",
        (InboxState.FAILED,),
        (InboxState.HANDLED, InboxState.FAILED, InboxState.DEAD),
        "consume",
        "due again (next_retry_at passed): run as on receipt",
    ),
    Transition(
        "requeue",
        (InboxState.FAILED, InboxState.DEAD),
        (InboxState.FAILED,),
        "operator",
        "due now, attempts reset",
    ),
    Transition(
        "dead_letter",
        (InboxState.FAILED,),
        (InboxState.DEAD,),
        "retire",
        "the consumer is retired with --waiting skip (the inbox's dead letter: "
        "an operator may requeue it)",
    ),
    Transition(
        "purge",
        (InboxState.HANDLED,),
        (),
        "purge",
        "handled and older than the retention",
    ),
)


def transition(name: str, table: tuple[Transition, ...] = DELIVERY) -> Transition:
    """The transition called ``name`` in ``table``.

    Raises:
        KeyError: ``table`` has no such transition.
    """
    for t in table:
        if t.name == name:
            return t
    raise KeyError(name)


#: A claim takes these once due: waiting, failed and due, or leased with the
#: lease run out (a RUNNING row's ``next_retry_at`` is its lease expiry).
CLAIMABLE = transition("claim").sources
#: An operator may requeue these (-> PENDING, attempts reset).
REQUEUEABLE = transition("requeue").sources
#: An operator may make these due now, attempts kept.
RETRYABLE = transition("retry_now").sources
#: An operator may stop retrying these (-> DEAD).
DEAD_LETTERABLE = transition("dead_letter").sources
#: An operator may give up delivering these (-> SKIPPED), which unblocks an
#: ordered subscriber's aggregate.
SKIPPABLE = transition("skip").sources
#: Retiring a subscription may give these up (-> SKIPPED).
ABANDONABLE = transition("abandon").sources
#: Done with: purge may delete these once old.
FINISHED = transition("purge").sources
#: Not finished: these hold back later rows of the same aggregate for an
#: ordered subscriber.
UNFINISHED = tuple(s for s in State if s not in FINISHED)
#: An operator may requeue these inbox messages (due now, attempts reset).
INBOX_REQUEUEABLE = transition("requeue", INBOX).sources


def table_markdown(table: tuple[Transition, ...] = DELIVERY) -> str:
    """``table`` as the Markdown table docs/architecture.md shows.

    Returns:
        The table's text, one row per transition, ending in a newline.
    """

    def states(values: tuple[str, ...], none: str) -> str:
        return ", ".join(values) if values else none

    lines = ["| transition | from | to | by | when |", "|---|---|---|---|---|"]
    for t in table:
        lines.append(
            f"| `{t.name}` | {states(t.sources, '(new row)')} | "
            f"{states(t.targets, '(deleted)')} | {t.by} | {t.when} |"
        )
    return "\n".join(lines) + "\n"
