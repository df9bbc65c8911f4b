"""What a block of code published: the events a capture recorded, read back
from their databases, and the assertions on them (:class:`Recording`, which
:class:`~outbox_app.testing.CapturedEvents` extends with ``deliver_now()``).

A capture records each row ``publish()`` writes (the ``events_written``
signal, sent right after the INSERT, in every thread of the process) while it
is on. Which of them stay is asked of the database whenever the capture is
read: a row still there is committed, or in a transaction still open that
would commit it (a ``TestCase``'s, which never ends in a commit); a row gone
was rolled back (its savepoint or its transaction). The rows are read back
from their database, so a captured event is what the relay would read: its
payload as stored, the event rebuilt from it as a handler receives it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..events.types import Event, validate_event_type
from ..exceptions import PublishedMismatch
from ..subscribers import DeliveryContext

if TYPE_CHECKING:
    from ..store.models import OutboxEvent

#: Ids read back per query (SQLite allows 999 parameters at least).
_CHUNK = 500
#: A payload is shown in an assertion's message up to this many characters.
_SHOWN = 200


@dataclass(frozen=True)
class CapturedEvent:
    """One event ``publish()`` wrote while a capture was on.

    Attributes:
        row: the :class:`~outbox_app.OutboxEvent` as the relay reads it from
            its database; for a rolled-back event, the row as it was written.
        rolled_back: True when the row is no longer in its database: the
            savepoint or the transaction that wrote it rolled back, and the
            relay will never see it.
    """

    row: OutboxEvent
    rolled_back: bool

    @property
    def id(self):
        """The event id (a UUID)."""
        return self.row.id

    @property
    def event_type(self) -> str:
        return self.row.event_type

    @property
    def payload(self) -> dict[str, Any]:
        """The stored payload: plain JSON values (a Decimal is a string)."""
        return self.row.payload

    @property
    def using(self) -> str:
        """The alias of the database whose outbox holds the event."""
        return self.row._state.db

    @cached_property
    def context(self) -> DeliveryContext:
        """The envelope a handler receives beside the event, as the relay
        builds it: the first attempt (``attempt`` 1), no subscriber yet
        (``subscriber`` ""), and ``delivery_id`` 0: a capture has no delivery
        rows (``deliver_now()`` fills in the attempt and the handler's
        name)."""
        row = self.row
        return DeliveryContext(
            event_id=row.id,
            namespace=row.namespace,
            event_type=row.event_type,
            revision=row.revision,
            payload=row.payload,
            aggregate_type=row.aggregate_type,
            aggregate_id=row.aggregate_id,
            aggregate_version=row.aggregate_version,
            headers=row.headers,
            tenant_id=row.tenant_id,
            action_id=row.action_id,
            occurred_at=row.occurred_at,
            attempt=1,
            subscriber="",
            delivery_id=0,
            deliver_at=row.deliver_at,
            expires_at=row.expires_at,
            operation=row.operation,
            payload_bytes=row.payload_bytes,
            using=self.using,
        )

    @cached_property
    def event(self) -> Any:
        """The event a handler receives: the :class:`~outbox_app.Event`
        rebuilt from the stored payload (upcast to its class's revision), or
        the payload dict for a type no class defines.

        Raises:
            EventDecodeError: the payload no longer fits its class, as the
                relay would find when delivering it.
        """
        from ..execution.run import event_for

        return event_for(self.context)

    def describe(self) -> str:
        """One line for messages: type, stored payload (keys sorted, cut at
        200 characters), aggregate, database when not ``default``, and whether it
        rolled back."""
        text = json.dumps(
            self.payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        if len(text) > _SHOWN:
            text = text[: _SHOWN - 3] + "..."
        line = f"{self.event_type} {text}"
        if self.row.aggregate_type is not None:
            line += f", aggregate {self.row.aggregate_type} {self.row.aggregate_id}"
        if self.using != "default":
            line += f", on {self.using!r}"
        if self.row.deliver_at is not None:
            line += f", deliver_at {self.row.deliver_at.isoformat()}"
        if self.rolled_back:
            line += " (rolled back)"
        return line


class Recording:
    """The events published while a capture was on, in publish order, and
    assertions on them: everything of
    :class:`~outbox_app.testing.CapturedEvents` but delivering them."""

    def __init__(self) -> None:
        self._rows: list[OutboxEvent] = []
        self._lock = threading.Lock()
        self._on = 0
        #: deliver_now()'s finished deliveries: (alias, event id, handler
        #: name) -> their state (outbox_app.testing.delivery).
        self._finished: dict[tuple[str, Any, str], str] = {}

    # --- capturing ------------------------------------------------------------

    def _written(self, sender: Any, rows: Sequence[OutboxEvent], **kwargs) -> None:
        with self._lock:
            self._rows.extend(rows)

    @contextmanager
    def listening(self) -> Iterator[Recording]:
        """A context manager: capture within it (blocks nest; the capture is
        on while any is open)."""
        from ..publishing.outbox import events_written

        with self._lock:
            self._on += 1
            if self._on == 1:
                events_written.connect(self._written, weak=False)
        try:
            yield self
        finally:
            with self._lock:
                self._on -= 1
                if self._on == 0:
                    events_written.disconnect(self._written)

    def clear(self) -> None:
        """Forget what was captured so far (what a test's set-up published,
        say) and what ``deliver_now()`` delivered."""
        with self._lock:
            self._rows.clear()
            self._finished.clear()

    def written(self) -> int:
        """How many rows were captured so far, rolled back or not."""
        with self._lock:
            return len(self._rows)

    # --- reading --------------------------------------------------------------

    def resolve(self, start: int = 0, end: int | None = None) -> list[CapturedEvent]:
        """The rows captured at positions ``start`` to ``end`` (default: all),
        read back from their databases: every one, rolled back or not, in
        publish order."""
        from ..store.models import OutboxEvent

        with self._lock:
            written = self._rows[start:end]
        wanted: dict[str, set] = {}
        for row in written:
            wanted.setdefault(row._state.db, set()).add(row.pk)
        stored: dict[tuple[str, Any], OutboxEvent] = {}
        for alias, ids in wanted.items():
            ordered = sorted(ids, key=str)
            for first in range(0, len(ordered), _CHUNK):
                chunk = ordered[first : first + _CHUNK]
                for row in OutboxEvent.objects.using(alias).filter(pk__in=chunk):
                    stored[alias, row.pk] = row
        # One id is stored once per database: when it was written twice (an
        # aggregate's events published again after a rollback), the last
        # write is the one that stays, the earlier ones rolled back.
        last = {(row._state.db, row.pk): index for index, row in enumerate(written)}
        captured = []
        for index, row in enumerate(written):
            key = (row._state.db, row.pk)
            kept = stored.get(key) if last[key] == index else None
            captured.append(
                CapturedEvent(row, True) if kept is None else CapturedEvent(kept, False)
            )
        return captured

    @property
    def published(self) -> list[CapturedEvent]:
        """Every event captured, in publish order, the rolled-back ones
        included (:attr:`CapturedEvent.rolled_back`)."""
        return self.resolve()

    @property
    def events(self) -> list[CapturedEvent]:
        """The events that stay, in publish order: committed, or in a
        transaction still open that would commit them (a ``TestCase``'s).
        What the relay delivers once they commit."""
        return [c for c in self.resolve() if not c.rolled_back]

    @property
    def rolled_back(self) -> list[CapturedEvent]:
        """The events published and then rolled back (their savepoint or
        their transaction): never delivered."""
        return [c for c in self.resolve() if c.rolled_back]

    # --- assertions -----------------------------------------------------------

    def assert_published(self, event: Any, /, **fields: Any) -> list[CapturedEvent]:
        """Assert that at least one event that stays (:attr:`events`) matches.

        Args:
            event: an :class:`~outbox_app.Event` class, an event type name
                (for types no class defines), or an Event instance (equal to
                the rebuilt event).
            **fields: values the rebuilt event's fields must equal (the
                payload's keys, for a type no class defines).

        Returns:
            The matching captured events, in publish order
            (``[placed] = outbox.assert_published(...)`` asserts there is one
            more loosely; :meth:`assert_published_once` says it).

        Raises:
            PublishedMismatch: none matches, or a field the event does not
                have; the message lists what was published.
            InvalidEventType: ``event`` is none of the three.
            EventDecodeError: a stored payload of that type no longer fits
                its class.
        """
        published = self.resolve()
        found = self._matching(published, event, fields)
        if not found:
            raise PublishedMismatch(
                f"expected {_wanted(event, fields)} to be published; "
                + _listing(published)
            )
        return found

    def assert_published_once(self, event: Any, /, **fields: Any) -> CapturedEvent:
        """Assert that exactly one event that stays matches; return it.
        Arguments and errors as :meth:`assert_published`."""
        published = self.resolve()
        found = self._matching(published, event, fields)
        if len(found) != 1:
            raise PublishedMismatch(
                f"expected one {_wanted(event, fields)} to be published, found "
                f"{len(found)}; " + _listing(published)
            )
        return found[0]

    def assert_not_published(self, event: Any = None, /, **fields: Any) -> None:
        """Assert that no event that stays matches; with no argument, that
        nothing stays at all (rolled-back events do not count). Arguments and
        errors as :meth:`assert_published`."""
        published = self.resolve()
        if event is None:
            if fields:
                raise PublishedMismatch(
                    "assert_not_published() takes fields only with an event type"
                )
            found = [c for c in published if not c.rolled_back]
            wanted = "nothing"
        else:
            found = self._matching(published, event, fields)
            wanted = f"no {_wanted(event, fields)}"
        if found:
            raise PublishedMismatch(
                f"expected {wanted} to be published, found {len(found)}; "
                + _listing(published)
            )

    def _matching(
        self, published: list[CapturedEvent], event: Any, fields: dict[str, Any]
    ) -> list[CapturedEvent]:
        if isinstance(event, Event):
            name = type(event).event_type
        elif isinstance(event, type) and issubclass(event, Event):
            name = event.event_type
        else:
            name = validate_event_type(event)
        found = []
        for captured in published:
            if captured.rolled_back or captured.event_type != name:
                continue
            rebuilt = captured.event
            if isinstance(event, Event) and rebuilt != event:
                continue
            if all(_field(rebuilt, k, name) == v for k, v in fields.items()):
                found.append(captured)
        return found


def _field(rebuilt: Any, key: str, name: str) -> Any:
    """Field ``key`` of a rebuilt event (an Event, or a payload dict).

    Raises:
        PublishedMismatch: the event has no such field (a typo in an
            assertion): the message lists its fields.
    """
    if isinstance(rebuilt, dict):
        if key in rebuilt:
            return rebuilt[key]
        known = sorted(rebuilt)
    else:
        known = sorted(f.name for f in dataclasses.fields(rebuilt))
        if key in known:
            return getattr(rebuilt, key)
    raise PublishedMismatch(
        f"{name} has no field {key!r}; its fields: {', '.join(known) or 'none'}"
    )


def _wanted(event: Any, fields: dict[str, Any]) -> str:
    """``OrderPlaced with order_id=1`` (or the instance's repr)."""
    if isinstance(event, Event):
        text = repr(event)
    else:
        text = event.event_type if isinstance(event, type) else str(event)
    if fields:
        text += " with " + ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return text


def _listing(published: list[CapturedEvent]) -> str:
    if not published:
        return "nothing was published"
    lines = [f"published ({len(published)}):"]
    lines += [f"  {n}. {c.describe()}" for n, c in enumerate(published, 1)]
    return "\n".join(lines)
