"""The delivery state machine's states and the groups the queries use.

::

    PENDING --claim--> RUNNING --> SUCCEEDED
                          |------> FAILED (due again at next_retry_at) --claim--> ...
                          '------> DEAD (the dead letter) --requeue--> PENDING
    FAILED / DEAD --skip (an operator gives up on it)--> SKIPPED
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class State(models.TextChoices):
    PENDING = "PENDING", _("pending")
    RUNNING = "RUNNING", _("running")
    SUCCEEDED = "SUCCEEDED", _("succeeded")
    FAILED = "FAILED", _("failed")
    DEAD = "DEAD", _("dead")
    SKIPPED = "SKIPPED", _("skipped")


#: A claim takes these once due: waiting, failed and due, or leased with the lease
#: run out (a RUNNING row's ``next_retry_at`` is its lease expiry).
CLAIMABLE = (State.PENDING, State.FAILED, State.RUNNING)
#: These hold back later rows of the same aggregate for an ordered subscriber.
UNFINISHED = (State.PENDING, State.RUNNING, State.FAILED, State.DEAD)
#: An operator may requeue these (-> PENDING, attempts reset).
REQUEUEABLE = (State.FAILED, State.DEAD)
#: An operator may make these due now, attempts kept.
RETRYABLE = (State.FAILED,)
#: An operator may stop retrying these (-> DEAD).
DEAD_LETTERABLE = (State.PENDING, State.FAILED)
#: An operator may give up delivering these (-> SKIPPED), which unblocks an
#: ordered subscriber's aggregate.
SKIPPABLE = (State.FAILED, State.DEAD)
#: Retiring a subscription may give these up (-> SKIPPED): no relay will
#: deliver them (RUNNING rows are left to the relay that leased them).
ABANDONABLE = (State.PENDING, State.FAILED, State.DEAD)
#: Done with: purge may delete these once old.
FINISHED = (State.SUCCEEDED, State.SKIPPED)


class InboxState(models.TextChoices):
    """A consumed message's state in the inbox (:class:`~outbox_app.store.models.
    InboxMessage`)::

        (received) --consumer ran, committed with its writes--> HANDLED
        (received) --consumer raised--> FAILED (retried at next_retry_at) --> ...
        FAILED --last attempt--> DEAD (the dead letter) --requeue--> FAILED
    """

    HANDLED = "HANDLED", _("handled")
    FAILED = "FAILED", _("failed")
    DEAD = "DEAD", _("dead")


#: An operator may requeue these (due now, attempts reset).
INBOX_REQUEUEABLE = (InboxState.FAILED, InboxState.DEAD)
