"""Fixtures of the end-to-end tier: real components started once per run, gpushard installed on them.

Every test here is marked ``e2e``. Without ``KUBEBUILDER_ASSETS`` the whole tier is skipped with
one line saying what to set; without ``GPUSHARD_E2E_KUBELET`` and a CRI runtime the node tier is: either
``GPUSHARD_E2E_CRI``, the socket of a runtime already serving, or ``GPUSHARD_E2E_FAKECRI``, the fake CRI that
``e2e/build.py`` builds (e2e/fakecri), which the tier starts itself. ``make test`` collects the tier too and
skips it there; ``make e2e`` builds what it needs and runs it (e2e/run.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e import components, gpushard, tiers

ROOT = Path(__file__).resolve().parents[2]
ASSETS, WHY_NOT = components.which_assets(os.environ)
KUBELET = os.environ.get("GPUSHARD_E2E_KUBELET", "")
CRI = os.environ.get("GPUSHARD_E2E_CRI", "")
FAKECRI = os.environ.get("GPUSHARD_E2E_FAKECRI", "") if not CRI else ""
NODE_WHY_NOT = ("set GPUSHARD_E2E_KUBELET (a kubelet binary) and GPUSHARD_E2E_CRI (a CRI runtime's unix socket) "
                "or GPUSHARD_E2E_FAKECRI (e2e/build.py's fake CRI) for the node tier")
NODE = bool(KUBELET and (CRI or (FAKECRI and Path(FAKECRI).exists())))
# The DRA backend changes the install for good (the overlay, the agent's backend): it goes last.
TIER = tiers.Tier("gpushard e2e", Path(__file__).parent, WHY_NOT if ASSETS is None else "",
                  last=lambda item: Path(str(item.fspath)).name == "test_dra.py")


def pytest_collection_modifyitems(config, items):
    TIER.collect(config, items)
    if ASSETS is None:
        return
    minor = components.minor_of(str(ASSETS / "kube-apiserver"))
    for item in TIER.ours(items):
        if "kubelet" in item.fixturenames and not NODE:
            item.add_marker(pytest.mark.skip(reason=f"gpushard e2e: {NODE_WHY_NOT}"))
        # What gpushard supports only from a minor on (docs/compatibility.md): skipped before it.
        needs = item.get_closest_marker("kubernetes")
        if needs and minor < needs.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"gpushard e2e: Kubernetes 1.{minor}: {needs.args[1]}"))


def pytest_terminal_summary(terminalreporter):
    TIER.summary(terminalreporter)


def pytest_report_header(config):
    return TIER.header(_versions)


def _versions() -> str:
    # "Kubernetes v1.36.2" and "Client Version: v1.37.1 ...": the version is the first word starting with v1.
    versions = []
    for binary, args in (("kube-apiserver", ["--version"]), ("kubectl", ["version", "--client"])):
        done = subprocess.run([str(ASSETS / binary), *args], capture_output=True, text=True, timeout=30)
        versions.append(f"{binary} {next((w for w in done.stdout.split() if w.startswith('v1.')), '?')}")
    if NODE:
        done = subprocess.run([KUBELET, "--version"], capture_output=True, text=True, timeout=30)
        runtime = f"the CRI at {CRI}" if CRI else f"Kubernetes' fake CRI ({FAKECRI})"
        versions.append(f"kubelet {done.stdout.split()[-1]} over {runtime}")
    else:
        versions.append(f"no node tier ({NODE_WHY_NOT})")
    return ", ".join(versions) + f" (KUBEBUILDER_ASSETS={ASSETS})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    TIER.report(item, outcome.get_result())


@pytest.fixture(scope="session")
def work():
    yield from tiers.work_folder("gpushard-e2e-")


@pytest.fixture(scope="session")
def plane(work):
    plane = TIER.started("plane", components.ControlPlane(ASSETS, work))
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
    webhook = TIER.started("webhook", gpushard.Webhook(plane, work))
    yield webhook
    webhook.stop()


@pytest.fixture(scope="session")
def cri(work):
    """The CRI socket the kubelet talks to: the one handed in, or Kubernetes' fake CRI started here."""
    if CRI:
        yield CRI
        return
    fake = TIER.started("fakecri", components.FakeCri(FAKECRI, work))
    yield str(fake.socket)
    fake.stop()


@pytest.fixture(scope="session")
def kubelet(plane, installed, cri, work):
    kubelet = TIER.started("kubelet", components.Kubelet(KUBELET, cri, plane, work), lines=80)
    yield kubelet
    kubelet.stop()


@pytest.fixture(scope="session")
def agent(plane, kubectl, kubelet, work):
    """`gpushard agent` on the real kubelet, with a token bound to its DaemonSet's pod, over a fake NVML."""
    agent = TIER.started("agent", gpushard.Agent(plane, kubelet, work))
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
