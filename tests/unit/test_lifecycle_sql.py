"""Row delivery's statements (outbox_app/store/sql) held against the
lifecycle table: every state a statement's ``WHERE`` moves a row from and
every state its ``SET state = ...`` (or its INSERT) leaves it in is a
transition the table allows, the transition the gateway names for it.
The statements' text is built by each database's dialect, with no
database."""

from __future__ import annotations

import re

import pytest

from outbox_app.store.lifecycle import DELIVERY, State
from outbox_app.store.sql import DIALECTS
from outbox_app.store.tables import Tables

STATES = "|".join(State.values)
#: A condition on the row's own state (``c`` in a claim; not another row's,
#: as ``u.state`` of an ordered claim's hold).
SOURCE = re.compile(
    r"(?:^|[\s(])(?:c\.)?state (?:= '(" + STATES + r")'|IN \(([^)]*)\))"
)
#: What an UPDATE sets the state to: up to the next assignment or WHERE.
TARGET = re.compile(r"SET state = (.*?)(?:, \w+ = | WHERE )")
LITERAL = re.compile(r"'(" + STATES + r")'")

#: Gateway.fail's state parameter: FAILED while attempts are left, else DEAD.
FAIL_PARAMETER = {State.FAILED, State.DEAD}


def text(statement) -> str:
    """One statement, or the statements of one step (a tuple; list-length
    builders called for one id), as one text."""
    if isinstance(statement, str):
        return statement
    if callable(statement):
        return statement(1)
    return " ; ".join(text(s) for s in statement if s is not None)


def sources(sql: str) -> set[str]:
    found = set()
    conditions = sql.replace("SET state = ", "SET new_state = ")
    for single, listed in SOURCE.findall(conditions):
        found |= {single} if single else set(LITERAL.findall(listed))
    return found


def targets(sql: str) -> set[str]:
    found = set()
    for expression in TARGET.findall(sql):
        found |= (
            FAIL_PARAMETER if expression == "%s" else set(LITERAL.findall(expression))
        )
    return found


def row_statements(d) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each row delivery statement of dialect ``d``: its text and the
    transitions the gateway makes with it."""
    claims = {
        f"claim(ordered={ordered}, types={types})": (
            # Where the claim is several statements (lock, then mark by id),
            # the lock's conditions are the mark's.
            text(d.claim(1, ordered, types)) + " ; " + text(d.mark),
            ("claim",),
        )
        for ordered in (False, True)
        for types in (None, 2)
    }
    _, values = d._delivery_row(True)
    return {
        **claims,
        "fan_out": (values, ("fan_out",)),
        "renew": (d.renew(1, False), ()),
        "succeed": (d.succeed(1), ("succeed",)),
        "fail": (d.fail, ("fail", "die")),
        "release": (d.release(1), ("release",)),
        "lapse": (d.lapse(1), ("lapse",)),
    }


@pytest.mark.parametrize("vendor", sorted(DIALECTS))
def test_every_state_change_of_row_delivery_is_a_transition_of_the_table(vendor):
    d = DIALECTS[vendor]("default", Tables.of_models())
    table = {t.name: t for t in DELIVERY}
    for name, (sql, made) in row_statements(d).items():
        assert all(table[t].by == "relay" for t in made), name
        moved_from, moved_to = sources(sql), targets(sql)
        if not made:
            assert moved_to == set(), f"{name} changes a state it should keep"
            continue
        if not any(table[t].sources for t in made):  # a new row
            moved_to = set(LITERAL.findall(sql))
            assert moved_from == set(), name
            assert moved_to, f"{name}: no state found"
            assert all(state in table[t].targets for state in moved_to for t in made), (
                f"{name} makes rows in {moved_to}"
            )
            continue
        assert moved_from and moved_to, f"{name}: no state found in {sql}"
        for before in moved_from:
            for after in moved_to:
                assert any(
                    before in table[t].sources and after in table[t].targets
                    for t in made
                ), f"{name}: {before} -> {after} is none of {made} ({sql})"


def test_outcomes_are_fenced_to_rows_a_lease_holds():
    d = DIALECTS["sqlite"]("default", Tables.of_models())
    for sql in (d.renew(1, False), d.succeed(1), d.fail, d.release(1), d.lapse(1)):
        assert sources(sql) == {State.RUNNING}
        assert "lease_token = %s" in sql


def test_every_relay_transition_of_rows_has_its_statement():
    d = DIALECTS["sqlite"]("default", Tables.of_models())
    made = {t for _, names in row_statements(d).values() for t in names}
    relay = {t.name for t in DELIVERY if t.by == "relay"}
    # divert: stream delivery's, the state a parameter its caller picks.
    assert relay - made == {"divert"}
