"""The README's tour is real code: run it."""

import re
from pathlib import Path

import pytest

from outbox_app.registry import unregister

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.django_db(transaction=True)
def test_readme_tour_runs():
    text = README.read_text()
    tour = text.split("## Five-minute tour", 1)[1]
    [code] = re.findall(r"```python\n(.*?)```", tour, flags=re.S)[:1]
    try:
        exec(compile(code, str(README), "exec"), {"__name__": "readme_tour"})
    finally:
        unregister("readme_tour.record_payment")
