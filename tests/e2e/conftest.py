"""Fixtures of the end-to-end tier: real components started once per run, gpushard installed on them.

Every test here is marked ``e2e``. Without ``KUBEBUILDER_ASSETS`` the whole tier is skipped with
one line saying what to set; without ``GPUSHARD_E2E_KUBELET`` and ``GPUSHARD_E2E_CRI`` the node
tier is. ``make test`` collects the tier too and skips it there; ``make e2e`` runs only it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e import components, gpushard

ROOT = Path(__file__).resolve().parents[2]
ASSETS, WHY_NOT = components.which_assets(os.environ)
KUBELET = os.environ.get("GPUSHARD_E2E_KUBELET", "")
CRI = os.environ.get("GPUSHARD_E2E_CRI", "")
# What this run started, for the failure reports and the summary.
_RUN: dict = {}
NODE_WHY_NOT = ("set GPUSHARD_E2E_KUBELET (a kubelet binary) and GPUSHARD_E2E_CRI (a CRI runtime's unix socket) "
                "for the node tier")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    # The DRA backend changes the install for good (the overlay, the agent's backend): it goes last.
    items.sort(key=lambda item: Path(str(item.fspath)).name == "test_dra.py")
    ours = [item for item in items if here in Path(str(item.fspath)).parents]
    if ASSETS is None:
        # One line for the whole tier (the header and the summary), not one per test file.
        if ours:
            config.hook.pytest_deselected(items=ours)
            items[:] = [item for item in items if item not in set(ours)]
            _RUN["deselected"] = len(ours)
        return
    for item in ours:
        item.add_marker(pytest.mark.e2e)
        if "kubelet" in item.fixturenames and not (KUBELET and CRI):
            item.add_marker(pytest.mark.skip(reason=f"gpushard e2e: {NODE_WHY_NOT}"))


def pytest_terminal_summary(terminalreporter):
    if _RUN.get("deselected"):
        terminalreporter.write_line(f"gpushard e2e: {_RUN['deselected']} tests not run: {WHY_NOT}")


def pytest_report_header(config):
    if ASSETS is None:
        return f"gpushard e2e: skipped: {WHY_NOT}"
    # "Kubernetes v1.36.2" and "Client Version: v1.37.1 ...": the version is the first word starting with v1.
    versions = []
    for binary, args in (("kube-apiserver", ["--version"]), ("kubectl", ["version", "--client"])):
        done = subprocess.run([str(ASSETS / binary), *args], capture_output=True, text=True, timeout=30)
        versions.append(f"{binary} {next((w for w in done.stdout.split() if w.startswith('v1.')), '?')}")
    if KUBELET and CRI:
        done = subprocess.run([KUBELET, "--version"], capture_output=True, text=True, timeout=30)
        versions.append(f"kubelet {done.stdout.split()[-1]} over the CRI at {CRI}")
    else:
        versions.append(f"no node tier ({NODE_WHY_NOT})")
    return "gpushard e2e: " + ", ".join(versions) + f" (KUBEBUILDER_ASSETS={ASSETS})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test shows the components' log tails that explain it, not only its assertion."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _RUN.get("plane") is not None:
        sections = [_RUN["plane"].logs(25)]
        for name in ("kubelet", "webhook", "agent"):
            owner = _RUN.get(name)
            if owner is not None:
                sections.append(owner.tail(25))
        report.sections.append(("component logs", "\n".join(sections)))



@pytest.fixture(scope="session")
def work():
    folder = Path(tempfile.mkdtemp(prefix="gpushard-e2e-"))
    yield folder
    if os.environ.get("GPUSHARD_E2E_KEEP"):
        print(f"gpushard e2e: logs and state kept in {folder}", file=sys.stderr)
    else:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def plane(work):
    plane = components.ControlPlane(ASSETS, work)
    _RUN["plane"] = plane
    try:
        plane.start()
    except BaseException:
        print(plane.logs(60), file=sys.stderr)
        plane.stop()
        raise
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def kubectl(plane) -> components.Kubectl:
    return plane.kubectl


@pytest.fixture(scope="session")
def install(plane, kubectl) -> dict[str, subprocess.CompletedProcess]:
    """deploy/base installed as an operator would, then taken over by server-side apply as GitOps tools do.

    Before the webhook is pointed at loopback, so the takeover sees only what the manifests say.
    """
    base = str(ROOT / "deploy" / "base")
    steps = {"apply": kubectl.run("apply", "-k", base, check=False, timeout=180)}
    steps["server-side apply"] = kubectl.run("apply", "--server-side", "-k", base, check=False, timeout=180)
    steps["diff --server-side"] = kubectl.run("diff", "--server-side", "-k", base, check=False, timeout=180)
    return steps


@pytest.fixture(scope="session")
def installed(plane, install, work):
    """The webhook served on loopback with its own ServiceAccount's token, called by the shipped configuration."""
    webhook = gpushard.Webhook(plane, work).start()
    _RUN["webhook"] = webhook
    yield webhook
    webhook.stop()


@pytest.fixture(scope="session")
def kubelet(plane, installed, work):
    kubelet = components.Kubelet(KUBELET, CRI, plane, work)
    _RUN["kubelet"] = kubelet
    try:
        kubelet.start()
    except BaseException:
        print(kubelet.tail(80), file=sys.stderr)
        kubelet.stop()
        raise
    yield kubelet
    kubelet.stop()


@pytest.fixture(scope="session")
def agent(plane, kubectl, kubelet, work):
    """`gpushard agent` on the real kubelet, with a token bound to its DaemonSet's pod, over a fake NVML."""
    agent = gpushard.Agent(plane, kubelet, work).start()
    _RUN["agent"] = agent
    yield agent
    agent.stop()


@pytest.fixture
def namespace(kubectl, request):
    """A fresh namespace per test, labelled with the mode the test's ``mode`` parameter names."""
    mode = getattr(request, "param", "enforce")
    # Readable, and unique per test and parameter: a namespace being deleted cannot be used again.
    digest = hashlib.sha1(f"{request.node.nodeid}-{os.getpid()}".encode()).hexdigest()[:6]
    short = "".join(c if c.isalnum() else "-" for c in request.node.originalname.lower().removeprefix("test_"))
    name = f"e2e-{short[:45].strip('-')}-{digest}"
    labels = {"gpushard.io/mode": mode} if mode else {}
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": name, "labels": labels}}))
    yield name
    subprocess.run([kubectl.binary, f"--kubeconfig={kubectl.config}", "delete", "namespace", name,
                    "--wait=false"], capture_output=True, timeout=60)
