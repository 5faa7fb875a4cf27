"""What every real-component tier shares: whether it runs, its one-line skip, each component it started, and
the log tails a failing test shows.

Each conftest (tests/e2e, tests/runtime, tests/runtime_install) makes one ``Tier`` and hands pytest's hooks to
it; the fixtures start their components through ``Tier.started``, so a component that fails to start shows its
log and is stopped, and every started component's log tail is attached to a failing test's report, in the
order they started. Components live in one registry per process: a tier that reuses another's fixtures (the
runtime tier takes the control plane of tests/e2e) shows those too.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# name -> what was started (an object with tail(lines), or logs(lines) for the control plane), in start order.
RUNNING: dict[str, object] = {}


def tail_of(owner: object, lines: int) -> str:
    show = getattr(owner, "logs", None) or owner.tail
    return show(lines)


class Tier:
    """One tier of real components: its folder of tests, and why it cannot run here ('' when it can)."""

    def __init__(self, name: str, folder: Path, why: str, markers: tuple[str, ...] = ("e2e",),
                 last: Callable[[pytest.Item], bool] | None = None):
        self.name, self.folder, self.why, self.markers = name, folder, why, markers
        # Tests that change the install for good (the DRA backend) go last.
        self.last = last
        self.deselected = 0
        # Where a failing test also looks, beyond the component logs (the cluster's pods, say).
        self.extra: list[Callable[[], str]] = []

    def ours(self, items: list[pytest.Item]) -> list[pytest.Item]:
        return [item for item in items if self.folder in Path(str(item.fspath)).parents]

    def collect(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """One line for the whole tier when it cannot run (the header and the summary), not one skip per test."""
        ours = self.ours(items)
        if self.why:
            if ours:
                config.hook.pytest_deselected(items=ours)
                dropped = set(ours)
                items[:] = [item for item in items if item not in dropped]
                self.deselected = len(ours)
            return
        if self.last is not None:
            items.sort(key=lambda item: item in set(ours) and self.last(item))
        for item in ours:
            for marker in self.markers:
                item.add_marker(getattr(pytest.mark, marker))

    def summary(self, terminalreporter) -> None:
        if self.deselected:
            terminalreporter.write_line(f"{self.name}: {self.deselected} tests not run: {self.why}")

    def header(self, describe: Callable[[], str]) -> str:
        return f"{self.name}: skipped: {self.why}" if self.why else f"{self.name}: {describe()}"

    def report(self, item: pytest.Item, report: pytest.TestReport, lines: int = 25) -> None:
        """A failing test of this tier shows the log tails that explain it, not only its assertion."""
        if self.why or report.when != "call" or not report.failed or item not in self.ours([item]):
            return
        sections = [tail_of(owner, lines) for owner in RUNNING.values()]
        for show in self.extra:
            try:
                sections.append(show())
            except Exception as exc:  # the cluster may be what failed
                sections.append(f"--- {show.__name__}: {exc}")
        if sections:
            report.sections.append(("component logs", "\n".join(sections)))

    @staticmethod
    def started(name: str, owner, start: Callable[[], object] | None = None, lines: int = 60):
        """``owner`` started (``start()``, else ``owner.start()``) and registered; on failure its log, then stopped."""
        RUNNING[name] = owner
        try:
            (start or owner.start)()
        except BaseException:
            print(tail_of(owner, lines), file=sys.stderr)
            owner.stop()
            raise
        return owner

    @staticmethod
    def stopped(name: str) -> None:
        owner = RUNNING.pop(name, None)
        if owner is not None:
            owner.stop()


def work_folder(prefix: str) -> Iterator[Path]:
    """A fresh folder for a run's state and logs, removed afterwards unless GPUSHARD_E2E_KEEP is set."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    yield folder
    if os.environ.get("GPUSHARD_E2E_KEEP"):
        print(f"gpushard e2e: logs and state kept in {folder}", file=sys.stderr)
    else:
        shutil.rmtree(folder, ignore_errors=True)
