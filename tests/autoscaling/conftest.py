"""Fixtures of the autoscaling tier: a control plane, gpushard's webhook, and real Karpenter (its kwok cloud
provider) with kwok playing the kubelets of the nodes Karpenter makes.

Every test here is marked ``e2e``. It needs ``KUBEBUILDER_ASSETS`` (the control plane), ``GPUSHARD_E2E_KARPENTER``
and ``GPUSHARD_E2E_KWOK`` (e2e/build.py build --autoscaling: each a folder with the ``kwok`` command, and
Karpenter's CRDs or kwok's stages beside it); without them the tier is skipped with one line saying what to set.
``make e2e`` builds them and runs it (e2e/run.py, tier ``autoscaling``).

No gpushard agent runs: a node Karpenter makes carries its instance type's resources (each card's
``gpushard.io/card-<k>`` shares, as the agent advertises them) and its NodePool's labels (the card count, as
the agent publishes it), which is what the webhook's view and the scheduler read of a shared node.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.autoscaling import karpenter
from tests.e2e import components, gpushard, tiers

# The e2e tier's control plane fixtures, taken by name (as tests/runtime does).
from tests.e2e.conftest import kubectl, plane, work  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ASSETS, WHY_NOT = components.which_assets(os.environ)
KARPENTER = Path(os.environ.get("GPUSHARD_E2E_KARPENTER", "/nonexistent"))
KWOK = Path(os.environ.get("GPUSHARD_E2E_KWOK", "/nonexistent"))
if ASSETS is not None and not ((KARPENTER / "kwok").exists() and (KWOK / "kwok").exists()):
    WHY_NOT = ("set GPUSHARD_E2E_KARPENTER and GPUSHARD_E2E_KWOK to the folders e2e/build.py build --autoscaling "
               "makes, to run the autoscaling tier")
TIER = tiers.Tier("gpushard autoscaling", Path(__file__).parent, WHY_NOT if ASSETS is None or WHY_NOT else "")
# What each scenario measured, printed as one table at the end of the run.
RESULTS: list[dict] = []


def pytest_collection_modifyitems(config, items):
    TIER.collect(config, items)


def pytest_terminal_summary(terminalreporter):
    TIER.summary(terminalreporter)
    if RESULTS:
        terminalreporter.write_line(karpenter.table(RESULTS))


def pytest_report_header(config):
    return TIER.header(lambda: f"Karpenter from {KARPENTER}, kwok from {KWOK}, KUBEBUILDER_ASSETS={ASSETS}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    TIER.report(item, outcome.get_result())


@pytest.fixture(scope="session")
def installed(plane, kubectl, work):
    """deploy/base applied, and the webhook served on loopback with its own ServiceAccount's token."""
    done = kubectl.run("apply", "-k", str(ROOT / "deploy" / "base"), check=False, timeout=180)
    assert done.returncode == 0, done.stderr
    # The webhook runs on this machine (below); the replacer's and the certificate Job's pods would run on a
    # system pool, which this cluster has none of: left to the GPU pool, they would have Karpenter add nodes
    # before any GPU pod exists. The agent's DaemonSet stays, as on a real GPU pool.
    kubectl.run("delete", "deployments,jobs", "-n", "gpushard-system", "--all", "--wait=true", timeout=120)
    webhook = TIER.started("webhook", gpushard.Webhook(plane, work))
    yield webhook
    webhook.stop()


@pytest.fixture(scope="session")
def autoscaler(plane, kubectl, installed, work):
    """kwok, then Karpenter with the pool of 8-card nodes."""
    kwok = TIER.started("kwok", karpenter.Kwok(KWOK, plane, work))
    provider = TIER.started("karpenter", karpenter.Karpenter(KARPENTER, plane, work))
    yield provider
    provider.stop()
    kwok.stop()


@pytest.fixture
def namespace(kubectl, request):
    digest = hashlib.sha1(f"{request.node.nodeid}-{os.getpid()}".encode()).hexdigest()[:6]
    name = f"scale-{digest}"
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": name, "labels": {"gpushard.io/mode": "enforce"}}}))
    yield name
    subprocess.run([kubectl.binary, f"--kubeconfig={kubectl.config}", "delete", "namespace", name,
                    "--wait=false"], capture_output=True, timeout=60)


@pytest.fixture
def new_node_cards(request, kubectl, installed):
    """policy.newNodeCards as the scenario sets it (the ``new_node_cards`` parameter), as docs/autoscaling.md tells
    an operator to; the webhook started again on it."""
    cards = request.param
    config = kubectl.json("get", "configmap", "gpushard-config", "-n", "gpushard-system")
    text = re.sub(r"newNodeCards: \d+, ", "", config["data"]["config.yaml"])
    assert text.count("policy: {") == 1, text
    config["data"]["config.yaml"] = text.replace("policy: {", f"policy: {{newNodeCards: {cards}, ")
    kubectl.apply(json.dumps(config))
    installed.reload()
    return cards
