"""Collect the fenced code blocks of README.md and docs/*.md with their tags.

A block is tagged by an HTML comment on the line before its fence, invisible on
GitHub: ``<!-- test: python -->``. The tag says how the block is checked; see
TAGS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

TAGS = {
    "python": "executed in a fresh namespace with the test settings, in a database",
    "settings": "executed; its UPPERCASE names set in settings; no system check error",
    "compile": "a fragment (names from the surrounding prose): compiled, not run",
    "shell": "run by bash against the sample project on a temporary SQLite database",
    "commands": "every `manage.py <command> --flag` in it exists (checked with --help)",
    "output": "shown output or message: its phrases are in outbox_app's or shop code",
    "json": "parsed as JSON",
    "pip": "`pip install`: each extra is in setup.cfg, each package in requirements",
    "ci": "run by .ci/docs with every service up (tests/docs/ci.py): options"
    " `fresh` (in a fresh copy of the repository, no environment) and `running`"
    " (a server: still running after 20 s counts as success)",
    "suite": "runs the test suite itself, as .ci/run does",
    "diagram": "a drawing; every path in it exists in the repository; option"
    " `imports`: its arrows (`relay/ ──> store/ events/`) are the imports"
    " between outbox_app's packages, no more, no less",
    "app": "a module of an example app (its first line names it, '# shop/models.py'):"
    " the page's app blocks make a fresh project of their own (migrate --run-syncdb,"
    " check), in which its app-run blocks run",
    "app-run": "executed, in order, in the project the page's app blocks make",
    "kubernetes": "a Kubernetes manifest: parsed (PyYAML) and whole (apiVersion,"
    " kind, name; a Deployment's selector matches its pods' labels; each"
    " container has an image); its manage.py commands exist",
    "tour": "a step of the README's five-minute tour that needs RabbitMQ: run with"
    " the tour's other blocks, in order, in one new project"
    " (tests/docs/test_fresh_project.py)",
    "app-test": "a test module of that project (its first line names it:"
    " '# shop/tests.py', '# conftest.py'), run there by Django's test runner"
    " (`manage.py test`) and by pytest with pytest-django (`test_*.py`); both pass",
}


def section(page: Path, heading: str) -> list[Block]:
    """The blocks of ``page`` under the heading ``heading`` (its text, without
    the ``#``), up to the next heading of the same or a higher level."""
    lines = page.read_text().splitlines()
    level = start = None
    end = len(lines) + 1
    fenced = False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):  # an opening or a closing fence
            fenced = not fenced
        match = None if fenced else re.match(r"(#+) (.*)", line)
        if not match:
            continue
        if start is None and match.group(2).strip() == heading:
            level, start = len(match.group(1)), number
        elif start is not None and len(match.group(1)) <= level:
            end = number
            break
    assert start is not None, f"{page.name} has no heading {heading!r}"
    return [block for block in blocks(page) if start < block.line < end]


FENCE = re.compile(r"^```(\S*)\s*$")
TAG = re.compile(r"^<!--\s*test:\s*(\S+)((?:\s+[\w-]+)*)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    tag: str | None
    code: str
    options: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        tag = TAG.match(lines[start - 1]) if start else None
        found.append(
            Block(
                page=page,
                line=start + 1,
                lang=match.group(1),
                tag=tag.group(1) if tag else None,
                code="\n".join(lines[start + 1 : end]) + "\n",
                options=tuple(tag.group(2).split()) if tag else (),
            )
        )
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def tagged(tag: str) -> list[Block]:
    return [block for block in all_blocks() if block.tag == tag]


MANAGE = re.compile(r"manage\.py\s+([a-z_]+)((?:\s+[^\s|;&>#]+)*)")


def ids(blocks):
    return [block.id for block in blocks]


def manage_commands(code: str) -> list[tuple[str, list[str]]]:
    """(command, --flags) of every ``manage.py`` invocation in a block."""
    text = re.sub(r"[\"\[\],]", " ", code.replace("\\\n", " "))
    return [
        (match.group(1), re.findall(r"(?<!\S)(--?[a-z][a-z-]*)", match.group(2)))
        for match in MANAGE.finditer(text)
    ]
