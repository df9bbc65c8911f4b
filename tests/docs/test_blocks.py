"""Every fenced block of README.md and docs/*.md is checked according to its tag
(tests/docs/blocks.py lists the tags). Blocks tagged ``ci`` run in .ci/docs."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from django.core import checks
from django.test import override_settings

from outbox_app.events import types as events
from outbox_app.relay import registry

from .blocks import ROOT, TAGS, all_blocks, ids, manage_commands, tagged

SOURCE = "\n".join(
    path.read_text()
    for package in ("outbox_app", "sample_project")
    for path in sorted((ROOT / package).rglob("*.py"))
)


def test_every_block_has_a_known_tag():
    untagged = [
        f"{block.id} ({block.tag or 'no tag'})"
        for block in all_blocks()
        if block.tag not in TAGS
    ]
    assert not untagged, "blocks without a known <!-- test: ... --> tag: " + ", ".join(
        untagged
    )


@pytest.fixture
def clean_registry():
    handlers = dict(registry._handlers)
    types = dict(events._registry)
    events._registry.clear()  # the pages reuse tests.testapp's type names
    yield
    registry._handlers.clear()
    registry._handlers.update(handlers)
    events._registry.clear()
    events._registry.update(types)
    registry.close_publishers()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("block", tagged("python"), ids=ids(tagged("python")))
def test_python_block_runs(block, clean_registry):
    module = types.ModuleType(f"docs_{block.page.stem}_{block.line}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(block.code, block.id, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize("block", tagged("compile"), ids=ids(tagged("compile")))
def test_fragment_compiles(block):
    compile(block.code, block.id, "exec")


@pytest.mark.parametrize("block", tagged("settings"), ids=ids(tagged("settings")))
def test_settings_block_passes_the_system_checks(block, settings, clean_registry):
    from django.conf import settings as live

    # What a fresh project's settings.py (startproject) defines before the
    # block is pasted at its end: DATABASES, nothing else the block could use.
    namespace = {
        "DATABASES": {
            alias: {**config, "OPTIONS": dict(config.get("OPTIONS", {}))}
            for alias, config in live.DATABASES.items()
        },
    }
    exec(compile(block.code, block.id, "exec"), namespace)
    values = {name: value for name, value in namespace.items() if name.isupper()}
    values.pop("DATABASES", None)  # read by the connection at start: shape only
    with override_settings(**values):
        registry.close_publishers()
        problems = [
            message
            for message in checks.run_checks(include_deployment_checks=False)
            if message.is_serious()
        ]
    assert not problems, problems


def _help(command: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", command, "--help"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "sample_project.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"manage.py {command}: {result.stderr}"
    return result.stdout


@pytest.mark.parametrize("block", tagged("commands"), ids=ids(tagged("commands")))
def test_command_lines_exist(block):
    found = manage_commands(block.code)
    assert found, f"{block.id}: no manage.py command in a block tagged commands"
    helps: dict[str, str] = {}
    for command, flags in found:
        text = helps.setdefault(command, _help(command))
        missing = [flag for flag in flags if not re.search(rf"{flag}\b", text)]
        assert not missing, f"manage.py {command} has no {missing}"


#: What a workload's pod template sits under, by kind.
POD_TEMPLATE = {
    "Deployment": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@pytest.mark.parametrize("block", tagged("kubernetes"), ids=ids(tagged("kubernetes")))
def test_kubernetes_manifest_is_whole(block):
    """What ``kubectl apply -f`` takes as it is: every document names its API
    and kind and has a name; a workload's pods have containers with images; a
    Deployment selects its own pods; the manage.py commands it runs exist."""
    import yaml

    documents = [doc for doc in yaml.safe_load_all(block.code) if doc]
    assert documents, block.id
    for doc in documents:
        assert isinstance(doc.get("apiVersion"), str), block.id
        assert DNS_LABEL.fullmatch(doc["metadata"]["name"]), doc["metadata"]
        kind = doc["kind"]
        assert kind in POD_TEMPLATE, f"{block.id}: a {kind}?"
        template = doc
        for key in POD_TEMPLATE[kind]:
            template = template[key]
        containers = template["spec"]["containers"]
        assert containers and all(c["name"] and c["image"] for c in containers)
        if kind == "Deployment":
            assert doc["apiVersion"] == "apps/v1"
            selected = doc["spec"]["selector"]["matchLabels"]
            labels = template["metadata"]["labels"]
            assert selected.items() <= labels.items(), (selected, labels)
        else:
            assert template["spec"]["restartPolicy"] in ("Never", "OnFailure")
    test_command_lines_exist(block)


def _phrases(text: str) -> list[str]:
    """Runs of two or more words in a shown output, without numbers and names."""
    out = []
    for chunk in re.split(r"[^A-Za-z ]+", text):
        words = chunk.split()
        if len(words) >= 2:
            out.append(" ".join(words))
    return out


def _printed(phrase: str, haystack: str) -> bool:
    """The phrase is in the source, allowing for values interpolated at its ends
    (one word each) and at one place inside."""
    words = phrase.split()
    for start in (0, 1):
        for end in (len(words), len(words) - 1):
            kept = words[start:end]
            if len(kept) < 2:
                return True  # nothing left that is not a value
            if any(
                " ".join(kept[:cut]) in haystack and " ".join(kept[cut:]) in haystack
                for cut in range(len(kept))
            ):
                return True
    return False


@pytest.mark.parametrize("block", tagged("output"), ids=ids(tagged("output")))
def test_output_phrases_come_from_the_code(block):
    joined = re.sub(r"[\"']\s*\n\s*[fr]?[\"']", "", SOURCE)  # implicit concatenation
    haystack = re.sub(r"\s+", " ", joined)
    missing = [p for p in _phrases(block.code) if not _printed(p, haystack)]
    assert not missing, f"{block.id}: phrases not printed by outbox_app: {missing}"


@pytest.mark.parametrize("block", tagged("pip"), ids=ids(tagged("pip")))
def test_pip_extras_exist(block):
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    extras = set(parser["options.extras_require"])
    for name, wanted in re.findall(
        r"pip install \"?([\w-]+)(?:\[([\w,]+)\])?", block.code
    ):
        if name == "outbox_app":
            assert set(filter(None, wanted.split(","))) <= extras, block.code
        else:
            assert name in (ROOT / "requirements.txt").read_text(), name


@pytest.mark.parametrize("block", tagged("json"), ids=ids(tagged("json")))
def test_json_block_parses(block):
    json.loads(block.code)


@pytest.mark.parametrize("block", tagged("shell"), ids=ids(tagged("shell")))
def test_shell_block_runs(block, tmp_path_factory):
    directory = Path("/tmp") / f"docs-{os.getpid()}-{block.line}"
    directory.mkdir(exist_ok=True)
    venv = ROOT / ".venv" / "bin"
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OUTBOX_", "CELERY_"))
        },
        "DJANGO_SETTINGS_MODULE": "sample_project.settings",
        "DATABASE_URL": f"sqlite:///{directory}/db.sqlite3",
        "PATH": f"{venv}:{os.environ['PATH']}",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=120,
    )
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{block.id}:\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("block", tagged("diagram"), ids=ids(tagged("diagram")))
def test_diagram_names_what_exists(block):
    package = ROOT / "outbox_app"
    named = set(re.findall(r"\b(\w+/|\w+\.py)", block.code))
    missing = [n for n in sorted(named) if not any(package.rglob(n.rstrip("/")))]
    assert not missing, f"{block.id}: not in outbox_app/: {missing}"


#: A drawn package or module: ``relay/``, ``tasks.py``.
NODE = re.compile(r"(?<![\w/.])(\w+/|\w+\.py)(?![\w/])")


def drawn_arrows(code: str) -> list[tuple[set[str], set[str]]]:
    """The arrows of a drawing: ``(sources, targets)`` per ``──>`` line, its
    sources the nodes that open the lines above it (up to the previous
    arrow), by unit name (``relay``, ``tasks``)."""
    arrows, sources = [], set()
    for line in code.splitlines():
        if line.lstrip().startswith("──>"):
            targets = {
                n.removesuffix("/").removesuffix(".py") for n in NODE.findall(line)
            }
            arrows.append((sources, targets))
            sources = set()
        elif line.startswith(" ") and not line.startswith("  "):
            for word in line.split():
                if not NODE.fullmatch(word):
                    break
                sources.add(word.removesuffix("/").removesuffix(".py"))
    return arrows


@pytest.mark.parametrize(
    "block",
    [b for b in tagged("diagram") if "imports" in b.options],
    ids=lambda b: b.id,
)
def test_the_diagram_draws_the_imports(block):
    """Each arrow ``A/ ──> B/ C/`` says what the packages opening the lines
    above it import among the drawn ones (those beside all, layer 0, are
    left out): no arrow more, none less."""
    from tests.unit.test_layers import LAYERS, imports

    graph = imports()
    arrows = drawn_arrows(block.code)
    drawn = {unit for sources, targets in arrows for unit in sources | targets}
    assert drawn == {u for u, layer in LAYERS.items() if layer > 0}, block.id
    sourced = {unit for sources, _ in arrows for unit in sources}
    for unit in drawn - sourced:
        assert not graph.get(unit, set()) & drawn, f"{block.id}: {unit} has no arrow"
    for sources, targets in arrows:
        real = set().union(*(graph.get(unit, set()) for unit in sources))
        real = {unit for unit in real if unit in drawn} - sources
        assert targets == real, (
            f"{block.id}: {sorted(sources)} draw {sorted(targets)}, "
            f"import {sorted(real)}"
        )


#: The settings of the project a page's app blocks make: outbox_app, Django's
#: auth, and the apps the blocks write (none of the suite's test apps, whose
#: event types the pages reuse).
APP_SETTINGS = """
import environ
SECRET_KEY = "docs"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "outbox_app"]
INSTALLED_APPS += {apps!r}
DATABASES = {{"default": environ.Env().db_url_config({database!r})}}
"""

#: Runs in that project: migrate, the system checks (errors fail), then each
#: app-run block in a namespace of its own.
APP_RUNNER = """
import django, json, sys
django.setup()
from django.core.management import call_command
call_command("migrate", run_syncdb=True, verbosity=0)
call_command("check", fail_level="ERROR", stdout=sys.stderr)
for name, code in json.load(sys.stdin):
    exec(compile(code, name, "exec"), {"__name__": "__main__"})
    print("ran", name)
"""


def _app_pages() -> list[Path]:
    return sorted({block.page for block in tagged("app")})


def _modules(page: Path, tag: str) -> dict[str, str]:
    """The modules the page's blocks tagged ``tag`` write: path -> code (a
    module's blocks in page order)."""
    files: dict[str, str] = {}
    for block in tagged(tag):
        if block.page != page:
            continue
        first = block.code.splitlines()[0]
        match = re.fullmatch(r"# ([\w/]+\.py)\b.*", first)
        assert match, f"{block.id}: the first line must name the module"
        path = match.group(1)
        files[path] = files.get(path, "") + block.code + "\n"
    return files


@pytest.mark.parametrize("page", _app_pages(), ids=lambda page: page.name)
def test_app_blocks_make_a_project_that_runs(page, tmp_path):
    files = _modules(page, "app")
    apps = sorted({path.split("/")[0] for path in files})
    tests = _modules(page, "app-test")
    for path, code in {**files, **tests}.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.parent != tmp_path:
            (target.parent / "__init__.py").touch()
        target.write_text(code)
    database = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    (tmp_path / "docs_settings.py").write_text(
        APP_SETTINGS.format(apps=apps, database=database)
    )
    runs = [[block.id, block.code] for block in tagged("app-run") if block.page == page]
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}:{ROOT}",
        "DJANGO_SETTINGS_MODULE": "docs_settings",
    }
    done = subprocess.run(
        [sys.executable, "-c", APP_RUNNER],
        input=json.dumps(runs),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == [word for run in runs for word in ("ran", run[0])]
    if tests:
        _run_tests(tmp_path, env)


def _run_tests(project: Path, env: dict[str, str]) -> None:
    """The project's tests, by Django's runner (it finds ``test*.py``: the
    ``TestCase`` modules) and by pytest with pytest-django (``test_*.py``,
    the project's root ``conftest.py``); each must run some and pass."""

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", *args],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        return output

    django = run("django", "test", "--noinput")
    assert re.search(r"^Ran [1-9]\d* tests?", django, flags=re.M), django
    pytest_run = run("pytest", "-p", "no:cacheprovider", ".")
    assert re.search(r"\b[1-9]\d* passed", pytest_run), pytest_run
