"""Run the blocks of README.md and docs/*.md tagged ``ci``: the ones that need
every service up or a fresh machine. ``.ci/docs`` calls this with the services
running; a block fails on a non-zero exit status, or when the page shows its
output (an ``output`` block right after it) and a shown line matches no printed
line once numbers are left out.

    python -m tests.docs.ci            # every ci block
    python -m tests.docs.ci README     # the ci blocks of pages whose path has README
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .blocks import ROOT, Block, all_blocks, tagged

DATABASE = "outbox_docs"
RUNNING_SECONDS = 20
TIMEOUT = 1800
STOP_SECONDS = 30  # from SIGTERM to SIGKILL


def _environment(home: Path) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(
            ("OUTBOX_", "CELERY_", "DATABASE_", "DJANGO_", "VIRTUAL_ENV")
        )
    }
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env['PATH']}"
    env["DATABASE_URL"] = f"sqlite:///{home}/db.sqlite3"
    return env


def _fresh_copy(home: Path) -> Path:
    """The committed files of the repository, as a fresh clone has them."""
    copy = home / "repo"
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file():
            target = copy / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return copy


def _recreate_databases() -> None:
    import psycopg

    with psycopg.connect(
        "postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True
    ) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {DATABASE}")


#: Names of their own on the shared RabbitMQ, so other runs' messages never mix in.
ISOLATION = {
    "SHOP_EVENTS_EXCHANGE": "shop.events.docs",
    "CELERY_TASK_DEFAULT_QUEUE": "shop.celery.docs",
}


def _reset_queues(url: str) -> None:
    from kombu import Connection

    with Connection(url) as connection:
        channel = connection.channel()
        for queue in (
            f"{ISOLATION['SHOP_EVENTS_EXCHANGE']}.all",
            ISOLATION["CELERY_TASK_DEFAULT_QUEUE"],
        ):
            channel.queue_delete(queue)


def _wait_for_group(pgid: int, seconds: float = 60) -> None:
    """Until every process of the block's group has exited (then SIGKILL)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _shown_output(block: Block) -> Block | None:
    """The output block that follows ``block`` on its page, if any."""
    page = [b for b in all_blocks() if b.page == block.page]
    after = page[page.index(block) + 1 :]
    return after[0] if after and after[0].tag == "output" else None


def _shape(line: str) -> tuple[str, ...]:
    """A line's words without its numbers: what every run prints the same."""
    return tuple(re.findall(r"[A-Za-z][A-Za-z_.()-]*", line))


def _missing_lines(shown: str, printed: str) -> list[str]:
    """Lines of a page's shown output that no printed line matches in shape."""
    shapes = {_shape(line) for line in re.split(r"[\r\n]+", printed)}
    return [
        line
        for line in shown.splitlines()
        if line.strip() and _shape(line) not in shapes
    ]


def run(block: Block) -> bool:
    home = Path(f"/tmp/docs-ci-{block.page.stem}-{block.line}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = _environment(home)
    cwd = ROOT
    code = block.code.replace("yourproject", "sample_project")
    if "fresh" in block.options:
        cwd = _fresh_copy(home)
        env.pop("DATABASE_URL")
        env["PATH"] = env["PATH"].split(":", 1)[1]  # no virtualenv either
    if DATABASE in code:
        _recreate_databases()
    if "amqp://" in code:
        env.update(ISOLATION)
        _reset_queues("amqp://guest:guest@127.0.0.1:5672//")
    before = set(cwd.glob("celerybeat-schedule*"))
    print(f"\n== {block.id} {' '.join(block.options)}\n{code}", flush=True)
    started = time.monotonic()
    log = home / "output.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    limit = RUNNING_SECONDS if "running" in block.options else TIMEOUT
    try:
        status = process.wait(timeout=limit)
        ok = status == 0
        verdict = f"exit status {status}"
    except subprocess.TimeoutExpired:
        ok = "running" in block.options
        verdict = f"still running after {limit} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)  # its background jobs too
        try:
            process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            # Seen once: `celery worker --beat` hung in its warm shutdown
            # after "beat: Shutting down...", and CI with it.
            print(f"(not stopped {STOP_SECONDS} s after SIGTERM: SIGKILL)")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        _wait_for_group(process.pid)
        for path in set(cwd.glob("celerybeat-schedule*")) - before:
            path.unlink()  # beat's schedule, written where it runs
    printed = log.read_text(errors="replace")
    print(printed, flush=True)
    shown = _shown_output(block)
    if ok and shown is not None:
        missing = _missing_lines(shown.code, printed)
        if missing:
            ok = False
            verdict += f"; {shown.id} shows lines it did not print: {missing}"
    print(
        f"== {block.id}: {verdict} in {time.monotonic() - started:.0f} s, "
        f"{'ok' if ok else 'FAILED'}",
        flush=True,
    )
    return ok


def main(argv: list[str]) -> int:
    blocks = [b for b in tagged("ci") if not argv or any(a in b.id for a in argv)]
    failed = [block.id for block in blocks if not run(block)]
    print(f"\n{len(blocks) - len(failed)}/{len(blocks)} ci blocks passed", flush=True)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    # SIGTERM (.ci/run stopping early) unwinds like an error: the running
    # block's processes are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main(sys.argv[1:]))
