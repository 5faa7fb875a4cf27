"""Fixtures of the kueue tier: the e2e tier's control plane, kubelet and agent (two cards of 100 shares), gpushard's
webhook, and real Kueue with a ClusterQueue whose quota is in gpushard's shares.

Every test here is marked ``e2e``. It needs what tests/e2e needs, and ``GPUSHARD_E2E_KUEUE`` (e2e/build.py build
--kueue: a folder with the ``kueue`` command, Kueue's CRDs in bases/ and its webhook configurations); without them
the tier is skipped with one line saying what to set. ``make e2e`` builds them and runs it (e2e/run.py, tier
``kueue``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e import components, tiers

# The e2e tier's fixtures, taken by name (as tests/autoscaling does).
from tests.e2e.conftest import NODE, agent, cri, install, installed, kubectl, kubelet, plane, work  # noqa: F401
from tests.kueue import kueue as kueue_mod

ASSETS, WHY_NOT = components.which_assets(os.environ)
FOLDER = Path(os.environ.get("GPUSHARD_E2E_KUEUE", "/nonexistent"))
if ASSETS is not None and not (FOLDER / "kueue").exists():
    WHY_NOT = "set GPUSHARD_E2E_KUEUE to the folder e2e/build.py build --kueue makes, to run the kueue tier"
elif ASSETS is not None and not NODE:
    WHY_NOT = "the kueue tier needs the e2e tier's node (GPUSHARD_E2E_KUBELET, and a CRI runtime)"
TIER = tiers.Tier("gpushard kueue", Path(__file__).parent, WHY_NOT if ASSETS is None or WHY_NOT else "")
# What each scenario measured, printed as one table at the end of the run.
RESULTS: list[dict] = []
QUOTA = 100  # one card's worth of shares


def pytest_collection_modifyitems(config, items):
    TIER.collect(config, items)


def pytest_terminal_summary(terminalreporter):
    TIER.summary(terminalreporter)
    if RESULTS:
        columns = ("scenario", "workloads", "quota", "admitted", "suspended or gated", "pods pinned",
                   "cards over their shares")
        terminalreporter.write_line("| " + " | ".join(columns) + " |")
        terminalreporter.write_line("|" + "---|" * len(columns))
        for row in RESULTS:
            terminalreporter.write_line("| " + " | ".join(str(row[c]) for c in columns) + " |")


def pytest_report_header(config):
    return TIER.header(lambda: f"Kueue from {FOLDER}, KUBEBUILDER_ASSETS={ASSETS}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    TIER.report(item, outcome.get_result())


@pytest.fixture(scope="session")
def queued(plane, kubectl, agent, work):
    """Kueue started beside gpushard, with the flavor and the ClusterQueue of ``QUOTA`` shares."""
    manager = TIER.started("kueue", kueue_mod.Kueue(FOLDER, plane, work))
    for doc in kueue_mod.queues(QUOTA):
        kubectl.apply(json.dumps(doc))
    yield manager
    manager.stop()


@pytest.fixture
def namespace(kubectl, queued, request):
    """An enforce namespace that Kueue manages, with its LocalQueue."""
    digest = hashlib.sha1(f"{request.node.nodeid}-{os.getpid()}".encode()).hexdigest()[:6]
    name = f"queued-{digest}"
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {
        "gpushard.io/mode": "enforce", kueue_mod.MANAGED_LABEL: "true"}}}))
    kubectl.apply(json.dumps(kueue_mod.local_queue(name)))
    yield name
    subprocess.run([kubectl.binary, f"--kubeconfig={kubectl.config}", "delete", "namespace", name,
                    "--wait=false"], capture_output=True, timeout=60)
