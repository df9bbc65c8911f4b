"""The import graph of outbox_app goes one way (docs/architecture.md):
operators' doors -> relay and inbox -> running code, publishing, publishers
-> store -> events, with no cycle. Imports inside functions count too."""

from __future__ import annotations

import ast
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import outbox_app

PACKAGE = Path(outbox_app.__file__).resolve().parent

#: Each top-level module or package of outbox_app and its layer: a unit
#: imports only units of its layer or below. Layer 0 sits beside all.
LAYERS = {
    **dict.fromkeys(["exceptions", "conf", "subscribers", "health"], 0),
    "events": 1,
    **dict.fromkeys(["store", "models"], 2),
    **dict.fromkeys(["execution", "publishing", "publishers"], 3),
    **dict.fromkeys(["relay", "inbox", "middleware"], 4),
    **dict.fromkeys(
        [
            "ops",
            "admin",
            "management",
            "tasks",
            "apps",
            "templatetags",
            "testing",
            "__init__",
        ],
        5,
    ),
}


def unit(module: str) -> str:
    """``outbox_app.store.sql.base`` -> ``store``; the package itself ->
    ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> dict[str, set[str]]:
    """unit -> the other units it imports (migrations left out)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        if "migrations" in relative.parts:
            continue
        module = ".".join(relative.parts)
        is_package = path.name == "__init__.py"
        if is_package:
            module = module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom | ast.Import):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                targets = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                targets = [node.module or ""]
            for target in targets:
                inside = target == "outbox_app" or target.startswith("outbox_app.")
                if inside and unit(target) != unit(module):
                    graph[unit(module)].add(unit(target))
    return graph


def test_every_unit_has_a_layer():
    units = {
        path.stem if path.is_file() else path.name
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists())
        and path.name != "migrations"
    }
    assert units == set(LAYERS)


def test_imports_go_down_the_layers():
    upward = [
        f"{source} (layer {LAYERS[source]}) imports {target} (layer {LAYERS[target]})"
        for source, targets in imports().items()
        for target in targets
        if LAYERS[target] > LAYERS[source]
    ]
    assert upward == []


def test_no_cycle():
    try:
        tuple(TopologicalSorter(imports()).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
