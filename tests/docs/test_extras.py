"""The extras of setup.cfg: docs/installation.md lists them all, once, and the
other pages link there instead of listing some; and what the docs' code
imports, an extra installs (a reader who installs ``outbox_app[otel]`` can run
the traces example)."""

from __future__ import annotations

import ast
import configparser
import functools
import importlib.machinery
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from .blocks import PAGES, ROOT, all_blocks, section

#: Blocks whose code a reader runs in a project of their own.
RUN = ("python", "tour", "settings", "app", "app-run")


def _config() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


EXTRAS = dict(_config()["options.extras_require"])


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised: "psycopg[binary]>=3.1"
    -> "psycopg"."""
    return (
        re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]
        .lower()
        .replace("_", "-")
    )


def _requirements(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_installation_lists_every_extra_once():
    block = section(ROOT / "docs" / "installation.md", "Extras")[0]
    listed = re.findall(r'pip install "outbox_app\[(\w+)\]"', block.code)
    assert sorted(listed) == sorted(EXTRAS)  # each once


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p.name != "installation.md"], ids=lambda p: p.name
)
def test_other_pages_link_to_the_list_instead_of_listing_extras(page):
    """A paragraph or block naming three extras or more is a list of them: the
    other pages link to installation.md#extras instead (three lists once
    drifted apart, none of them whole)."""
    text = page.read_text()
    for paragraph in re.split(r"\n\s*\n", text):
        named = {
            extra
            for group in re.findall(r"\[([\w,]+)\]", paragraph)
            for extra in group.split(",")
            if extra in EXTRAS
        }
        assert len(named) < 3, f"{page.name} lists extras: {paragraph}"
    if page.name == "README.md":
        assert "docs/installation.md#extras" in text


@functools.cache
def _installable() -> set[str]:
    """The distributions outbox_app and its extras install, with what they
    require in turn (as installed here)."""
    config = _config()
    wanted = [
        _name(r) for r in _requirements(config["options"]["install_requires"])
    ] + [_name(r) for text in EXTRAS.values() for r in _requirements(text)]
    found: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        wanted += [_name(r) for r in requires if "extra ==" not in r]
    return found


@functools.cache
def _owners() -> dict[Path, str]:
    """Installed file -> the distribution that installed it."""
    owners = {}
    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            owners[Path(dist.locate_file(file)).resolve()] = _name(
                dist.metadata["Name"]
            )
    return owners


def _distribution(module: str) -> str | None:
    """The distribution that installed ``module``; None for the standard
    library, this repository's own code and modules a page defines."""
    if module.split(".")[0] in sys.stdlib_module_names:
        return None
    # Found on sys.path, as a fresh process would (not in sys.modules, where
    # a test may have left a stand-in).
    spec = None
    locations = None
    for part in module.split("."):
        name = f"{spec.name}.{part}" if spec else part
        spec = importlib.machinery.PathFinder.find_spec(name, locations)
        if spec is None:
            return None  # a page's own app (shop, billing)
        locations = spec.submodule_search_locations
    if spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    if ROOT in origin.parents and ".venv" not in origin.parts:
        return None  # outbox_app itself, the sample project, the tests
    return _owners().get(origin, f"? ({origin})")


def _imports(code: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_what_the_docs_import_an_extra_installs():
    """Every package a runnable block imports comes with outbox_app or one of
    its extras (the traces example imports OpenTelemetry's SDK: ``[otel]``
    installs it)."""
    missing = {
        f"{block.id}: {module} ({owner})"
        for block in all_blocks()
        if block.tag in RUN
        for module in _imports(block.code)
        if (owner := _distribution(module)) is not None and owner not in _installable()
    }
    assert not missing, sorted(missing)
