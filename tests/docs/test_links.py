"""Relative links of README.md and docs/*.md point at files and headings that
exist."""

import ast
import re

import pytest

from .blocks import PAGES, ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        if not path.exists() or (anchor and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def _docstrings(path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [tree, *ast.walk(tree)]
    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    return [ast.get_docstring(n) or "" for n in nodes if isinstance(n, kinds)]


def test_shipped_docstrings_point_to_docs_pages_that_exist():
    """A wheel ships outbox_app/ without bench/: where a docstring says a
    figure was measured, it names the docs/ page that has it (which links
    to the benchmark), and the page exists."""
    benches, missing = [], []
    for path in sorted((ROOT / "outbox_app").rglob("*.py")):
        for doc in _docstrings(path):
            if "bench/" in doc:
                benches.append(str(path.relative_to(ROOT)))
            for page in re.findall(r"\bdocs/([\w-]+\.md)", doc):
                if not (ROOT / "docs" / page).exists():
                    missing.append(f"{path.relative_to(ROOT)}: docs/{page}")
    assert benches == [] and missing == []
