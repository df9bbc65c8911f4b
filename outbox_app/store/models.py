"""The outbox table and the deliveries table.

``OutboxEvent`` is one published event with its envelope. ``Delivery`` is one
delivery of one event to one subscriber and carries its state; the states and
every transition between them are the table in
:mod:`outbox_app.store.lifecycle`.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from ..events import ids
from ..events.codec import OutboxJSONEncoder
from .db import FilteredIndex
from .lifecycle import CLAIMABLE, UNFINISHED, InboxState, State
from .querysets import (
    ConsumerSubscriptionQuerySet,
    CursorQuerySet,
    DeliveryQuerySet,
    InboxMessageQuerySet,
    OutboxEventQuerySet,
    SubscriberPauseQuerySet,
    SubscriptionQuerySet,
    served_since,
)
from .sql import dialect_of

#: The unique constraint on (aggregate_type, aggregate_id, aggregate_version):
#: publish() reports its violation as DuplicateAggregateVersion.
AGGREGATE_VERSION_UNIQUE = "outbox_event_aggregate_version_uniq"


class TransactionIdField(models.BigIntegerField):
    """The id of the transaction that wrote a row: ``xid8`` on PostgreSQL,
    filled by the column's default (:class:`CurrentTransactionId`); a bigint
    left empty elsewhere. Never read into Python by the relay: its SQL
    compares it with snapshots."""

    def db_type(self, connection):
        return dialect_of(connection).transaction_id_type or super().db_type(connection)

    def get_placeholder(self, value, compiler, connection) -> str:
        """A value written back (a row copied with ``save()``) reaches an
        ``xid8`` column as text: PostgreSQL casts no integer to it."""
        kind = dialect_of(connection).transaction_id_type
        return f"%s::text::{kind}" if kind else "%s"


class CurrentTransactionId(models.Func):
    """The writing transaction's id as a column default: PostgreSQL's
    ``pg_current_xact_id()``; NULL elsewhere."""

    output_field = models.BigIntegerField()

    def as_sql(self, compiler, connection, **extra_context):
        return dialect_of(connection).current_transaction_id, []


def new_event_id() -> uuid.UUID:
    """A UUIDv7 (see :mod:`outbox_app.events.ids`): time-ordered, so the primary key
    index stays append-mostly and ids sort in the order they were made."""
    return ids.new_event_id()


class OutboxEvent(models.Model):
    """One event in the outbox, written in the publisher's transaction.

    A row whose ``event_type`` is NULL is an action's sentinel: the action ran and
    published nothing. Sentinels are never fanned out nor published.
    """

    id = models.UUIDField(primary_key=True, default=new_event_id, editable=False)
    namespace = models.CharField(max_length=255)
    event_type = models.CharField(max_length=255, null=True, blank=True)
    revision = models.PositiveIntegerField(default=1)
    aggregate_type = models.CharField(max_length=150, null=True, blank=True)
    aggregate_id = models.CharField(max_length=255, null=True, blank=True)
    aggregate_version = models.BigIntegerField(null=True, blank=True)
    payload = models.JSONField(null=True, blank=True, encoder=OutboxJSONEncoder)
    headers = models.JSONField(default=dict, blank=True, encoder=OutboxJSONEncoder)
    tenant_id = models.CharField(max_length=255, null=True, blank=True)
    action_id = models.UUIDField(null=True, blank=True)
    action_name = models.CharField(max_length=255, null=True, blank=True)
    action_params = models.JSONField(null=True, blank=True, encoder=OutboxJSONEncoder)
    occurred_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)
    operation = models.CharField(
        max_length=32,
        null=True,
        blank=True,
        help_text=_(
            "What happened to the aggregate (create, update, delete, soft_delete "
            "for tracked models), if given."
        ),
    )
    deliver_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=_("Scheduled: no delivery before this time. Empty: at once."),
    )
    expires_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=_(
            "Not delivered after this time: a delivery still waiting then is "
            "skipped (EventExpired). Empty: never expires."
        ),
    )
    position = models.BigIntegerField(
        null=True,
        unique=True,
        editable=False,
        help_text=_(
            "Publish order, numbered by the database when the row is inserted "
            "(a row inserted without one gets the next number): ordered "
            "subscribers receive an aggregate's events in this order."
        ),
    )
    payload_bytes = models.PositiveIntegerField(
        db_default=0,
        editable=False,
        help_text=_("Length of the payload's JSON text, in bytes (UTF-8)."),
    )
    fanned_out = models.BooleanField(
        _("fanned out"),
        null=True,
        help_text=_(
            "Row delivery: its deliveries exist (one per subscriber); whether "
            "each was delivered is the delivery's state. Written False on "
            "insert. Empty: stream delivery, where each subscriber's cursor "
            "reads the event and the row is never written again."
        ),
    )
    txid = TransactionIdField(
        null=True,
        editable=False,
        db_default=CurrentTransactionId(),
        help_text=_(
            "The id of the transaction that wrote the event (PostgreSQL's "
            "xid8): stream delivery reads the events whose transaction "
            "committed between two ticks. Empty on other databases."
        ),
    )
    sequence = models.BigIntegerField(
        null=True,
        editable=False,
        # A Value, not the bare 0: Django's SQLite schema editor then adds
        # the column in place instead of rebuilding the table.
        db_default=models.Value(0),
        help_text=_(
            "MySQL/MariaDB, stream delivery: the event's number in commit "
            "order, given by a relay once the event committed (the one write "
            "after its INSERT); a tick is the last number given. 0 until "
            "then, and on other databases."
        ),
    )

    objects = OutboxEventQuerySet.as_manager()

    class Meta:
        verbose_name = _("outbox event")
        verbose_name_plural = _("outbox events")
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["aggregate_type", "aggregate_id", "aggregate_version"],
                name=AGGREGATE_VERSION_UNIQUE,
            ),
        ]
        indexes = [
            # Fan-out scans events awaiting fan-out of subscribed types, oldest
            # first: in id order, so a batch (which starts after the previous
            # one's last id, fanout.py) reads only the entries it takes.
            FilteredIndex(
                fields=["id", "event_type"],
                name="outbox_event_fanout",
                when=Q(fanned_out=False),
                fallback_prefix=["fanned_out"],
            ),
            # Ordered claims: does an aggregate have an earlier event still
            # waiting for fan-out (gateway.py)? Only waiting rows are indexed.
            FilteredIndex(
                fields=["aggregate_type", "aggregate_id", "position"],
                name="outbox_event_fanout_agg",
                when=Q(fanned_out=False),
                fallback_prefix=["fanned_out"],
            ),
            # Only the events that have an action or a tenant are indexed:
            # most have neither, and an entry per event would cost every
            # publish() and every fan-out (which writes the row anew) an
            # index insert for nothing. A query for one action or tenant
            # implies NOT NULL, so it uses them.
            FilteredIndex(
                fields=["action_id"],
                name="outbox_event_action_set",
                when=Q(action_id__isnull=False),
                fallback_prefix=[],
            ),
            FilteredIndex(
                fields=["tenant_id", "id"],
                name="outbox_event_tenant_set",
                when=Q(tenant_id__isnull=False),
                fallback_prefix=[],
            ),
            models.Index(fields=["created_at"], name="outbox_event_created"),
            # Stream delivery reads a tick's events by their transaction id
            # (PostgreSQL); nothing fills it elsewhere, where no index is
            # kept (fallback_prefix None).
            FilteredIndex(
                fields=["txid"],
                name="outbox_event_stream",
                when=Q(txid__isnull=False),
                fallback_prefix=None,
            ),
            # Stream delivery on MySQL/MariaDB: a tick's events by their
            # number, and the events a relay numbers next (0, written for
            # stream delivery) in position order. Numbered nowhere else,
            # where the partial index holds nothing.
            FilteredIndex(
                fields=["sequence", "fanned_out", "position"],
                name="outbox_event_sequence",
                when=Q(sequence__gt=0),
                fallback_prefix=[],
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event_type or '(sentinel)'} {self.id}"

    @property
    def is_sentinel(self) -> bool:
        return self.event_type is None


class Delivery(models.Model):
    """One delivery of one outbox event to one subscriber.

    ``next_retry_at`` is when the row is next claimable: now for a new row (its
    event's ``deliver_at`` if scheduled later), the backoff time for a FAILED
    one, and the lease expiry (``locked_until``) for a RUNNING one, so one
    index serves every claim. The event's type, aggregate, position and
    payload size are copied here at fan-out so claims, per-aggregate ordering
    and the batch's byte budget read this table alone; the payload is read
    through the ``event`` join.
    """

    id = models.BigAutoField(primary_key=True)
    event = models.ForeignKey(
        OutboxEvent,
        on_delete=models.CASCADE,
        related_name="deliveries",
        db_index=False,  # the (event, subscriber) unique constraint leads with it
    )
    subscriber = models.CharField(max_length=150)
    event_type = models.CharField(max_length=255)
    aggregate_type = models.CharField(max_length=150, null=True, blank=True)
    aggregate_id = models.CharField(max_length=255, null=True, blank=True)
    aggregate_version = models.BigIntegerField(null=True, blank=True)
    tenant_id = models.CharField(max_length=255, null=True, blank=True)
    deliver_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=_("The event's scheduled time, copied at fan-out."),
    )
    position = models.BigIntegerField(
        null=True,
        blank=True,
        editable=False,
        help_text=_("The event's publish order, copied at fan-out."),
    )
    payload_bytes = models.PositiveIntegerField(
        db_default=0,
        editable=False,
        help_text=_("The event's payload size in bytes, copied at fan-out."),
    )
    state = models.CharField(max_length=16, choices=State, default=State.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_retry_at = models.DateTimeField()
    locked_until = models.DateTimeField(null=True, blank=True)
    locked_by = models.CharField(max_length=255, blank=True, default="")
    lease_token = models.UUIDField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    last_error_type = models.CharField(max_length=255, blank=True, default="")
    last_traceback = models.TextField(blank=True, default="")
    first_failed_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = DeliveryQuerySet.as_manager()

    class Meta:
        verbose_name = _("delivery")
        verbose_name_plural = _("deliveries")
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["event", "subscriber"], name="outbox_delivery_uniq"
            ),
        ]
        indexes = [
            # Claims: due rows of some subscribers, in claim order
            # (next_retry_at, id), so a claim reads only the rows it takes,
            # whatever the backlog and however stale the table's statistics.
            FilteredIndex(
                fields=["subscriber", "next_retry_at", "id"],
                name="outbox_delivery_due",
                when=Q(state__in=CLAIMABLE),
                fallback_prefix=["state"],
            ),
            # Ordered subscribers: unfinished rows of one aggregate, in
            # publish order.
            FilteredIndex(
                fields=["subscriber", "aggregate_type", "aggregate_id", "position"],
                name="outbox_delivery_order",
                when=Q(state__in=UNFINISHED),
                fallback_prefix=[],
            ),
            models.Index(fields=["state", "subscriber"], name="outbox_delivery_state"),
            # Finished rows only (purge and the status's rates read them by
            # completion time): a delivery is born unfinished, so fan-out
            # writes no entry here.
            FilteredIndex(
                fields=["completed_at"],
                name="outbox_delivery_completed_set",
                when=Q(completed_at__isnull=False),
                fallback_prefix=[],
            ),
        ]
        permissions = [
            ("requeue_delivery", _("Can requeue, retry and dead-letter deliveries")),
        ]

    def __str__(self) -> str:
        return f"{self.event_type} -> {self.subscriber} [{self.state}]"


class SubscriberPause(models.Model):
    """A publisher a relay paused because its destination was unreachable
    (``delivery/publishers.py``): written when it pauses, after each failed
    probe and when it resumes, so operators see outages in ``outbox_status``
    and the admin overview. No attempt is counted while it is paused.
    """

    subscriber = models.CharField(max_length=150, unique=True)
    paused_at = models.DateTimeField(help_text=_("When the outage began."))
    resume_at = models.DateTimeField(help_text=_("When the next probe may run."))
    resumed_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=_("When a probe succeeded; empty while paused."),
    )
    probes = models.PositiveIntegerField(default=0, help_text=_("Failed probes."))
    reason = models.TextField(blank=True, default="")
    worker = models.CharField(max_length=255, blank=True, default="")
    updated_at = models.DateTimeField(default=timezone.now)

    objects = SubscriberPauseQuerySet.as_manager()

    class Meta:
        verbose_name = _("subscriber pause")
        verbose_name_plural = _("subscriber pauses")

    def __str__(self) -> str:
        return f"{self.subscriber} paused at {self.paused_at}"


class Subscription(models.Model):
    """One subscriber's subscription to one event type, as relays recorded it
    (``delivery/fanout.py``): fan-out creates a delivery for every active
    subscription of an event's type, whichever relay runs it, so a subscriber
    one relay has reaches every relay during a rolling deploy. A relay
    delivers only to the subscribers it has. NServiceBus's subscription
    storage (message type, subscriber endpoint) is the model.

    Rows are inserted by relays (and ``manage.py outbox_subscribers
    --record``), refreshed while a relay has them (``last_seen_at``), and
    retired only by an operator (``outbox_subscribers --retire``, the admin
    action) or by a rename (a subscriber's ``aliases``); a retired row gets
    no new deliveries until it is reactivated. An operator may also pause a
    subscriber (``paused_at`` on its rows, ``outbox_subscribers --pause``, the
    admin action): fan-out still creates its deliveries, no relay claims them
    until it is resumed.
    """

    subscriber = models.CharField(max_length=150)
    event_type = models.CharField(
        max_length=255, help_text=_("An event type, or * for every type.")
    )
    kind = models.CharField(max_length=20)
    ordered = models.BooleanField(default=False)
    first_seen_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(
        default=timezone.now, help_text=_("When a relay that has it last ran.")
    )
    last_seen_by = models.CharField(max_length=255, blank=True, default="")
    retired_at = models.DateTimeField(
        null=True, blank=True, help_text=_("Empty while active.")
    )
    retired_by = models.CharField(max_length=255, blank=True, default="")
    paused_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=_(
            "When an operator paused its subscriber: no relay claims the "
            "subscriber's deliveries until it is resumed. Empty: not paused."
        ),
    )
    paused_by = models.CharField(max_length=255, blank=True, default="")

    objects = SubscriptionQuerySet.as_manager()

    class Meta:
        verbose_name = _("subscription")
        verbose_name_plural = _("subscriptions")
        constraints = [
            models.UniqueConstraint(
                fields=["subscriber", "event_type"],
                name="outbox_subscription_uniq",
            ),
        ]
        permissions = [
            ("pause_subscription", _("Can pause and resume subscribers")),
            ("retire_subscription", _("Can retire and reactivate subscriptions")),
        ]

    def __str__(self) -> str:
        return f"{self.subscriber} <- {self.event_type}"

    def is_served(self, now=None) -> bool:
        """Active, and a relay refreshed it within ``SERVED_SECONDS``."""
        return self.retired_at is None and self.last_seen_at >= served_since(
            now, self._state.db
        )


class Cursor(models.Model):
    """One subscriber's position in the outbox, for stream delivery: one row
    per subscriber and partition, held by one relay at a time through a
    fenced lease (``lease_token``, ``locked_until`` on the database's clock).

    On PostgreSQL a cursor reads the events by snapshot visibility: a batch
    is the events whose transaction is visible in the tick being read
    (``next_tick``, a ``pg_current_snapshot()``) and was not in the last
    finished one (``tick``), in position order, after ``position``. On
    SQLite, whose writers are serialised so that positions are numbered in
    commit order, a cursor is the last position delivered (``position``).
    A subscriber that is up to date has written nothing per event: a
    cursor moves once a batch, and only what needs attention (a failed
    attempt, an event due later, an event waiting behind an unfinished
    delivery of its aggregate) becomes a :class:`Delivery` row.
    """

    subscriber = models.CharField(max_length=150)
    partition = models.PositiveIntegerField(
        default=0, help_text=_("This cursor's slice of the subscriber's events.")
    )
    partitions = models.PositiveIntegerField(
        default=1,
        help_text=_(
            "How many slices the subscriber's events are split into, by a hash "
            "of their aggregate."
        ),
    )
    tick = models.TextField(
        null=True,
        blank=True,
        help_text=_("The last tick read to its end (PostgreSQL: a snapshot)."),
    )
    next_tick = models.TextField(
        null=True,
        blank=True,
        help_text=_("The tick being read, if one is (PostgreSQL: a snapshot)."),
    )
    position = models.BigIntegerField(
        null=True,
        blank=True,
        help_text=_(
            "The last event position delivered (PostgreSQL: within the tick "
            "being read; empty: none yet)."
        ),
    )
    first_tick = models.TextField(
        null=True,
        blank=True,
        help_text=_(
            "Where it started (PostgreSQL: a snapshot): the events visible "
            "there were never its to deliver."
        ),
    )
    first_position = models.BigIntegerField(
        null=True,
        blank=True,
        help_text=_("Where it started (SQLite): the last position before it."),
    )
    own_position = models.BigIntegerField(
        null=True,
        blank=True,
        help_text=_(
            "PostgreSQL: the last position delivered of the events of a "
            "transaction that also ran the relay (a test's), written in that "
            "transaction."
        ),
    )
    stop_tick = models.TextField(
        null=True,
        blank=True,
        help_text=_(
            "Where it stops (PostgreSQL: a snapshot): the subscriber's "
            "partitions are changing, and the cursors of the new count read "
            "on from here once every cursor of this count has read to it."
        ),
    )
    lease_token = models.UUIDField(null=True, blank=True)
    locked_by = models.CharField(max_length=255, blank=True, default="")
    locked_until = models.DateTimeField(null=True, blank=True)
    wanted_by = models.CharField(
        max_length=255,
        blank=True,
        default="",
        help_text=_(
            "A relay that asked for it to share the subscriber's partitions: "
            "its holder hands it over after its current batch."
        ),
    )
    ticked_at = models.DateTimeField(
        null=True, blank=True, help_text=_("When it last read a tick to its end.")
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = CursorQuerySet.as_manager()

    class Meta:
        verbose_name = _("cursor")
        verbose_name_plural = _("cursors")
        constraints = [
            models.UniqueConstraint(
                fields=["subscriber", "partitions", "partition"],
                name="outbox_cursor_uniq",
            ),
        ]

    def __str__(self) -> str:
        if self.partitions == 1:
            return self.subscriber
        return f"{self.subscriber} [{self.partition + 1}/{self.partitions}]"


class Sequencer(models.Model):
    """MySQL/MariaDB, stream delivery: the last number given to an event in
    commit order (:attr:`OutboxEvent.sequence`). One row, created by the
    first relay that numbers events; a relay numbers a batch of committed
    events while it holds the row's lock (``FOR UPDATE SKIP LOCKED``: one
    relay at a time, the others read on), and the numbers commit with the
    row, so they become visible in order and a cursor that has read to a
    number has seen every smaller one. Unused on other databases.
    """

    last = models.BigIntegerField(
        default=0, help_text=_("The last number given (0: none yet).")
    )

    class Meta:
        verbose_name = _("sequencer")
        verbose_name_plural = _("sequencer")

    def __str__(self) -> str:
        return f"sequencer at {self.last}"


class InboxMessage(models.Model):
    """A message a consumer received (``manage.py consume``): the transactional
    inbox.

    The row of a handled message is inserted in the transaction that holds the
    consumer's own writes, so both commit or neither does; a redelivered
    message finds its row, keyed by (consumer, CloudEvents ``source``, message
    id), and is acknowledged without running the consumer again (MassTransit's
    InboxState, Eventuate's ``received_messages``). The message is
    acknowledged to the broker only after that commit. A message whose
    consumer failed is kept here with its body and retried from the database
    (FAILED, then DEAD: the dead letter), never blocking the queue; so is a
    message kept for a consumer this process lacks (:class:`ConsumerSubscription`).
    HANDLED rows older than ``OUTBOX_INBOX_RETENTION_DAYS`` are purged. Rows
    recorded before the source was (an empty ``source``) still stop a
    redelivery of their message id, whatever its source.
    """

    id = models.BigAutoField(primary_key=True)
    consumer = models.CharField(max_length=150)
    source = models.CharField(
        max_length=255,
        blank=True,
        default="",
        db_default="",
        help_text=_(
            "The CloudEvents source: the producing service (its OUTBOX_NAMESPACE)."
        ),
    )
    message_id = models.CharField(
        max_length=255, help_text=_("The CloudEvents id: the outbox event id.")
    )
    queue = models.CharField(max_length=255, blank=True, default="")
    event_type = models.CharField(max_length=255, blank=True, default="")
    aggregate_type = models.CharField(max_length=150, blank=True, default="")
    aggregate_id = models.CharField(max_length=255, blank=True, default="")
    state = models.CharField(max_length=16, choices=InboxState)
    attempts = models.PositiveIntegerField(default=0)
    next_retry_at = models.DateTimeField(null=True, blank=True)
    body = models.TextField(
        blank=True,
        default="",
        help_text=_("The message as received; kept until it is handled."),
    )
    body_digest = models.CharField(
        max_length=64,
        blank=True,
        default="",
        db_default="",
        help_text=_(
            "SHA-256 of the CloudEvent first received under this key (its JSON "
            "with sorted keys): another body under this id is a differing "
            "duplicate, logged and counted."
        ),
    )
    last_error = models.TextField(blank=True, default="")
    last_error_type = models.CharField(max_length=255, blank=True, default="")
    last_traceback = models.TextField(blank=True, default="")
    received_at = models.DateTimeField(default=timezone.now)
    handled_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = InboxMessageQuerySet.as_manager()

    class Meta:
        verbose_name = _("inbox message")
        verbose_name_plural = _("inbox messages")
        ordering = ["-id"]
        constraints = [
            # CloudEvents ids are unique per source.
            models.UniqueConstraint(
                fields=["consumer", "source", "message_id"], name="outbox_inbox_key"
            ),
        ]
        indexes = [
            # The retry loop: FAILED rows due, in due order.
            models.Index(fields=["state", "next_retry_at"], name="outbox_inbox_due"),
            # Ordered consumers: unfinished rows of one aggregate.
            models.Index(
                fields=["consumer", "aggregate_type", "aggregate_id", "state"],
                name="outbox_inbox_order",
            ),
            # Retention: handled rows by age.
            models.Index(fields=["handled_at"], name="outbox_inbox_handled"),
        ]
        permissions = [
            ("requeue_inboxmessage", _("Can requeue dead inbox messages")),
        ]

    def __str__(self) -> str:
        return f"{self.event_type or self.message_id} -> {self.consumer} [{self.state}]"


class ConsumerSubscription(models.Model):
    """One ``@consumer``'s subscription to one event type on one queue, as
    ``manage.py consume`` processes recorded it (at start, then every
    ``HEARTBEAT_SECONDS``): the inbox's counterpart of :class:`Subscription`.

    A ``consume`` process never acknowledges as ignored a message that an
    active consumer recorded here receives and the process lacks (a rolling
    deploy: the consumer is in the new code only); it keeps the message as
    that consumer's inbox row (FAILED, due now, no attempt counted) and a
    process that has the consumer runs it from the database. Rows are retired
    only by an operator (``manage.py outbox_subscribers --retire``); a retired
    consumer's messages are no longer kept by processes that lack it.
    """

    consumer = models.CharField(max_length=150)
    queue = models.CharField(max_length=255)
    event_type = models.CharField(
        max_length=255, help_text=_("An event type, or * for every type.")
    )
    ordered = models.BooleanField(default=False)
    first_seen_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(
        default=timezone.now,
        help_text=_("When a consume process that has it last ran."),
    )
    last_seen_by = models.CharField(max_length=255, blank=True, default="")
    retired_at = models.DateTimeField(
        null=True, blank=True, help_text=_("Empty while active.")
    )
    retired_by = models.CharField(max_length=255, blank=True, default="")

    objects = ConsumerSubscriptionQuerySet.as_manager()

    class Meta:
        verbose_name = _("consumer subscription")
        verbose_name_plural = _("consumer subscriptions")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "queue", "event_type"],
                name="outbox_consumer_subscription_uniq",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.consumer} <- {self.event_type} on {self.queue}"

    def is_served(self, now=None) -> bool:
        """Active, and a consume process refreshed it within ``SERVED_SECONDS``."""
        return self.retired_at is None and self.last_seen_at >= served_since(now)


class OutboxOverview(Delivery):
    """Puts the outbox overview on the admin index (``admin.OverviewAdmin``):
    a reusable app reaches the index only through a registered model."""

    class Meta:
        proxy = True
        verbose_name = _("overview")
        verbose_name_plural = _("overview")
        default_permissions = ()


class Notification(Delivery):
    """The former name of :class:`Delivery`, kept as a proxy so that admin
    addresses under ``/admin/outbox_app/notification/`` (bookmarks, links in
    alerts) redirect to the same page under ``delivery/``
    (``admin.LegacyNotificationAdmin``), and ``Notification.objects`` still
    reads the deliveries table. It has no permissions and no admin page."""

    class Meta:
        proxy = True
        verbose_name = _("delivery (former name)")
        default_permissions = ()
