"""Long functions read as named steps: the inbox's modules (split along the
relay's seams: context, outcomes, retry, receive) and the operators'
overview have no function longer than a screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import outbox_app

PACKAGE = Path(outbox_app.__file__).resolve().parent
#: Lines of a function's body, its docstring left out.
LIMIT = 60
MODULES = [*sorted(PACKAGE.glob("inbox/*.py")), PACKAGE / "ops" / "status.py"]


def long_functions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0]
        documented = isinstance(first, ast.Expr) and isinstance(
            first.value, ast.Constant
        )
        start = first.end_lineno + 1 if documented else first.lineno
        if node.end_lineno - start + 1 > LIMIT:
            found.append(f"{node.name} ({node.end_lineno - start + 1} lines)")
    return found


def test_the_inbox_has_the_relays_seams():
    names = {path.stem for path in PACKAGE.glob("inbox/*.py")}
    assert {"context", "outcomes", "retry", "receive"} <= names
    relay = {path.stem for path in PACKAGE.glob("relay/*.py")}
    assert {"outcomes", "registry", "worker"} <= relay & names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_is_longer_than_a_screen(path):
    assert long_functions(path) == []
