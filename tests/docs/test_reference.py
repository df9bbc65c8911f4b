"""The reference pages list what the code defines: every setting with its
default, every system check id."""

import ast
import re

from outbox_app.conf import SETTINGS as DECLARED
from outbox_app.ops import checks

from .blocks import ROOT

PAGE = (ROOT / "docs" / "settings.md").read_text()
TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()


def test_every_setting_is_listed_with_its_default():
    rows = dict(re.findall(r"^\| `OUTBOX_(\w+)` \| `([^`]+)`", PAGE, flags=re.M))
    assert set(rows) == set(DECLARED)
    for name, setting in DECLARED.items():
        assert ast.literal_eval(rows[name]) == setting.default, name
        assert setting.check.removeprefix("outbox.") in PAGE, name


def test_every_check_id_is_explained():
    source = "".join(
        (ROOT / "outbox_app" / name).read_text()
        for name in ("ops/checks.py", "conf.py")
    )
    ids = set(re.findall(r"outbox\.[EW]\d{3}", source))
    assert ids == {f"outbox.E{n:03}" for n in range(1, 31)} | {
        "outbox.W001",
        "outbox.W002",
        "outbox.W003",
        "outbox.W004",
        "outbox.W005",
        "outbox.W006",
        "outbox.W007",
        "outbox.W008",
        "outbox.W009",
        "outbox.W010",
    }
    for check_id in ids:
        short = check_id.removeprefix("outbox.")
        assert short in PAGE or check_id in TROUBLESHOOTING, check_id
    assert checks  # the module registers the checks the pages describe
