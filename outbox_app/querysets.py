"""Predicates and state transitions of the outbox tables.

Every write to a notification's state happens here, once: the relay, the admin,
the management commands and the Celery tasks call these methods and never
update a row themselves. Transitions of a claimed row are compare-and-set on its
lease token, so a worker that lost its lease writes nothing.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterable

from django.db import transaction
from django.db.models import Case, Exists, F, OuterRef, Q, QuerySet, Value, When
from django.db.models.functions import Coalesce
from django.utils import timezone

from .db import insert_select, lock_skipping_locked
from .states import (
    CLAIMABLE,
    EXPIRABLE,
    REQUEUEABLE,
    RETRYABLE,
    SKIPPABLE,
    UNFINISHED,
    State,
)


class OutboxEventQuerySet(QuerySet):
    def for_tenant(self, tenant_id: str | None) -> OutboxEventQuerySet:
        """Events of one tenant only (seed 003: every query is tenant-scoped)."""
        return self.filter(tenant_id=tenant_id)

    def sentinels(self) -> OutboxEventQuerySet:
        """Rows recording an action that published nothing."""
        return self.filter(event_type__isnull=True)

    def undelivered(self) -> OutboxEventQuerySet:
        """Events not fanned out yet (sentinels excluded)."""
        return self.filter(delivered=False, event_type__isnull=False)


class NotificationQuerySet(QuerySet):
    # --- predicates -------------------------------------------------------------

    def for_subscribers(self, names: Iterable[str]) -> NotificationQuerySet:
        return self.filter(subscriber__in=list(names))

    def due(self, now: datetime.datetime | None = None) -> NotificationQuerySet:
        """Rows a claim may take at ``now``: PENDING or FAILED whose retry time has
        come, and RUNNING rows whose lease ran out."""
        return self.filter(
            state__in=CLAIMABLE, next_retry_at__lte=now or timezone.now()
        )

    def heads(self) -> NotificationQuerySet:
        """Only the first unfinished row of each (subscriber, aggregate).

        "First" is by ``aggregate_version`` when the event has one, else by event
        id (UUIDv7, publish order). A row with no aggregate is its own head.
        """
        unfinished = self.model._default_manager.filter(
            subscriber=OuterRef("subscriber"),
            aggregate_type=OuterRef("aggregate_type"),
            aggregate_id=OuterRef("aggregate_id"),
            state__in=UNFINISHED,
        )
        earlier_by_id = Q(event_id__lt=OuterRef("event_id"))
        earlier_by_version = Q(aggregate_version__lt=OuterRef("aggregate_version")) | Q(
            aggregate_version__isnull=True, event_id__lt=OuterRef("event_id")
        )
        return self.filter(
            Q(~Exists(unfinished.filter(earlier_by_id)), aggregate_version__isnull=True)
            | Q(
                ~Exists(unfinished.filter(earlier_by_version)),
                aggregate_version__isnull=False,
            )
        )

    def blocked_aggregates(self) -> int:
        """How many (subscriber, aggregate) pairs an EXPIRED row holds back.

        Meaningful on ordered subscribers' rows: call it on
        ``for_subscribers(ordered_names)``.
        """
        return (
            self.filter(state=State.EXPIRED)
            .values("subscriber", "aggregate_type", "aggregate_id")
            .distinct()
            .count()
        )

    # --- fan-out ---------------------------------------------------------------------

    def create_for(
        self, events: QuerySet, subscriber: str, now: datetime.datetime
    ) -> int:
        """Create a PENDING notification to ``subscriber``, due at ``now``, for
        each event of ``events`` that has none yet: one ``INSERT ... SELECT``.

        The event's ``OutboxEvent.DELIVERY_FIELDS`` are copied (``id`` into
        ``event_id``); every other column takes the model's default. Returns
        rows created.
        """
        model = self.model
        template = model(
            subscriber=subscriber, next_retry_at=now, created_at=now, updated_at=now
        )
        copied = {
            ("event_id" if name == "id" else name): name
            for name in events.model.DELIVERY_FIELDS
        }
        columns = {
            field.column: F(copied[field.attname])
            if field.attname in copied
            else Value(getattr(template, field.attname), output_field=field)
            for field in model._meta.concrete_fields
            if not field.primary_key  # numbered by the database
        }
        return insert_select(model, columns, events.using(self.db).order_by("id"))

    # --- the relay's transitions --------------------------------------------------

    def claim(
        self,
        *,
        limit: int,
        lease_seconds: float,
        worker: str,
        ordered: bool = False,
        now: datetime.datetime | None = None,
    ) -> tuple[uuid.UUID, list[int]]:
        """Lease up to ``limit`` due rows of this queryset in one short transaction.

        The rows become RUNNING with ``attempts + 1``, a fresh lease token and
        ``locked_until = next_retry_at = now + lease_seconds``. Rows another
        worker holds are skipped (``FOR UPDATE SKIP LOCKED``); no lock outlives
        the transaction.

        Args:
            limit: most rows to claim.
            lease_seconds: lease length, in seconds.
            worker: who holds the lease (``host:pid``), for operators.
            ordered: claim only each aggregate's head (see :meth:`heads`).
            now: the clock (tests pass a fixed one).

        Returns:
            ``(lease_token, claimed ids)``; the ids are empty when nothing is due.
        """
        now = now or timezone.now()
        token = uuid.uuid4()
        candidates = self.due(now)
        if ordered:
            candidates = candidates.heads()
        candidates = lock_skipping_locked(candidates.order_by("next_retry_at", "id"))
        expiry = now + datetime.timedelta(seconds=lease_seconds)
        with transaction.atomic(using=self.db):
            ids = list(candidates.values_list("id", flat=True)[:limit])
            if ids:
                self.model._default_manager.using(self.db).filter(id__in=ids).update(
                    state=State.RUNNING,
                    attempts=F("attempts") + 1,
                    lease_token=token,
                    locked_by=worker[:255],
                    locked_until=expiry,
                    next_retry_at=expiry,
                    updated_at=now,
                )
        return token, ids

    def leased(self, token: uuid.UUID) -> NotificationQuerySet:
        """Rows still held under ``token``: the fence every outcome passes."""
        return self.filter(lease_token=token, state=State.RUNNING)

    def renew(
        self, token: uuid.UUID, lease_seconds: float, now: datetime.datetime
    ) -> int:
        """Extend the lease of the rows still held under ``token`` to
        ``now + lease_seconds``. Returns rows renewed."""
        expiry = now + datetime.timedelta(seconds=lease_seconds)
        return self.leased(token).update(
            locked_until=expiry, next_retry_at=expiry, updated_at=now
        )

    def succeed(self, token: uuid.UUID, now: datetime.datetime | None = None) -> int:
        """Mark the rows held under ``token`` SUCCEEDED. Returns rows written."""
        now = now or timezone.now()
        return self.leased(token).update(
            state=State.SUCCEEDED,
            completed_at=now,
            locked_until=None,
            lease_token=None,
            updated_at=now,
        )

    def fail(
        self,
        token: uuid.UUID,
        *,
        error: str,
        error_type: str,
        traceback: str,
        retry_at: datetime.datetime | None,
        now: datetime.datetime | None = None,
    ) -> int:
        """Record a failed attempt on the rows held under ``token``.

        ``retry_at=None`` expires them (the dead letter); otherwise they become
        FAILED and due again at ``retry_at``. The error is kept either way.
        Returns rows written (0: the lease was lost).
        """
        now = now or timezone.now()
        fields = {
            "last_error": error,
            "last_error_type": error_type[:255],
            "last_traceback": traceback,
            "first_failed_at": Coalesce(F("first_failed_at"), Value(now)),
            "locked_until": None,
            "lease_token": None,
            "updated_at": now,
        }
        if retry_at is None:
            fields.update(state=State.EXPIRED, completed_at=now)
        else:
            fields.update(state=State.FAILED, next_retry_at=retry_at)
        return self.leased(token).update(**fields)

    def release(self, token: uuid.UUID, now: datetime.datetime | None = None) -> int:
        """Hand back rows claimed under ``token`` but never attempted (a relay
        shutting down): due now, the claim's attempt taken back."""
        now = now or timezone.now()
        return self.leased(token).update(
            # A row with a failed attempt before this one goes back to FAILED.
            state=Case(
                When(attempts__gt=1, then=Value(State.FAILED)),
                default=Value(State.PENDING),
            ),
            attempts=F("attempts") - 1,
            next_retry_at=now,
            locked_until=None,
            lease_token=None,
            locked_by="",
            updated_at=now,
        )

    # --- operators' transitions ---------------------------------------------------

    def requeue(self, batch_size: int = 1000) -> int:
        """FAILED/EXPIRED -> PENDING, due now, attempts reset to 0.

        The last error, its type and traceback and ``first_failed_at`` are kept,
        as history, until the next attempt overwrites or succeeds. Works in
        batches of ``batch_size`` rows, so requeueing 100,000 rows never loads
        them into memory nor holds one long lock. Returns rows requeued.
        """
        now = timezone.now()
        return self._in_batches(
            self.filter(state__in=REQUEUEABLE),
            batch_size,
            state=State.PENDING,
            attempts=0,
            next_retry_at=now,
            completed_at=None,
            updated_at=now,
        )

    def retry_now(self, batch_size: int = 1000) -> int:
        """Make FAILED rows due now, keeping their attempt count."""
        now = timezone.now()
        return self._in_batches(
            self.filter(state__in=RETRYABLE),
            batch_size,
            next_retry_at=now,
            updated_at=now,
        )

    def expire(self, batch_size: int = 1000) -> int:
        """Stop retrying: PENDING/FAILED -> EXPIRED (RUNNING rows are left to
        their worker)."""
        now = timezone.now()
        return self._in_batches(
            self.filter(state__in=EXPIRABLE),
            batch_size,
            state=State.EXPIRED,
            completed_at=now,
            updated_at=now,
        )

    def skip(self, batch_size: int = 1000) -> int:
        """Give up delivering: FAILED/EXPIRED -> SKIPPED, finished, the error
        kept. An ordered subscriber's aggregate held back by the row flows on."""
        now = timezone.now()
        return self._in_batches(
            self.filter(state__in=SKIPPABLE),
            batch_size,
            state=State.SKIPPED,
            completed_at=now,
            updated_at=now,
        )

    def replay(self, now: datetime.datetime | None = None) -> int:
        """Deliver again: every row but RUNNING ones -> PENDING, due now,
        attempts reset (the last error kept as history). Returns rows reset."""
        now = now or timezone.now()
        return self.exclude(state=State.RUNNING).update(
            state=State.PENDING,
            attempts=0,
            next_retry_at=now,
            completed_at=None,
            locked_until=None,
            lease_token=None,
            locked_by="",
            updated_at=now,
        )

    def _in_batches(self, queryset: QuerySet, batch_size: int, **fields) -> int:
        total = 0
        last_id = 0
        base = queryset.order_by("id")
        while True:
            ids = list(
                base.filter(id__gt=last_id).values_list("id", flat=True)[:batch_size]
            )
            if not ids:
                return total
            # Re-filtered, so a row that changed state meanwhile is left alone.
            total += base.filter(id__in=ids).update(**fields)
            last_id = ids[-1]
