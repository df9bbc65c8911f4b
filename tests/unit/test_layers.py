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


def modules() -> dict[str, Path]:
    """Every module of outbox_app (migrations left out) -> its file; a
    package is named by its ``__init__.py``'s package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        if "migrations" in relative.parts:
            continue
        parts = relative.parts[:-1] if path.name == "__init__.py" else relative.parts
        found[".".join(parts)] = path
    return found


def module_imports() -> dict[str, set[str]]:
    """module -> the modules of outbox_app it imports, at module level, in
    functions and under ``TYPE_CHECKING`` alike.

    ``from a import b`` imports the module ``a.b`` where there is one (``from
    . import registry``: the sibling, not the package), the package ``a``
    otherwise (a name its ``__init__.py`` gives). Importing a module first
    runs the packages above it, so those count too, but for the ones
    enclosing the importer, which runs inside them already (unless it
    imports a name one gives)."""
    known = modules()

    def module_of(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {module: set() for module in known}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = module.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    source = ".".join([*base, *([source] if source else [])])
                targets = [f"{source}.{alias.name}" for alias in node.names]
                targets = [t if t in known else source for t in targets]
            else:
                continue
            for target in targets:
                if not (target == "outbox_app" or target.startswith("outbox_app.")):
                    continue
                target = module_of(target)
                parts = target.split(".")
                above = {".".join(parts[:end]) for end in range(1, len(parts))}
                graph[module] |= {
                    reached
                    for reached in {target, *above}
                    if reached != module
                    and (reached == target or not module.startswith(reached + "."))
                }
    return graph


def imports() -> dict[str, set[str]]:
    """unit -> the other units it imports (migrations left out)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in module_imports().items():
        for target in targets:
            if unit(target) != unit(module):
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


def test_the_module_graph_sees_every_kind_of_import():
    graph = module_imports()
    # at module level, a sibling by "from . import"
    assert "outbox_app.ops.streams" in graph["outbox_app.ops.status"]
    assert "outbox_app.ops" not in graph["outbox_app.ops.status"]
    # inside a function
    assert "outbox_app.store.gateway" in graph["outbox_app.store.querysets"]
    # under TYPE_CHECKING
    assert "outbox_app.testing.publisher" in graph["outbox_app.testing"]
    # a name a package gives, and the packages run on the way to a module
    assert "outbox_app.relay" in graph["outbox_app.relay.worker"]
    assert {"outbox_app.store", "outbox_app.store.sql"} <= graph[
        "outbox_app.relay.wake"
    ]


def test_no_cycle_between_modules():
    """No module imports, through any others, one that imports it: a loop
    inside a package too, which the units' graph cannot see."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in module_imports().items():
        graph[module] |= targets - {module}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
