"""Fixtures of the runtime tier: the real control plane and kubelet over a real containerd and runc.

Every test here is marked ``e2e`` and ``runtime``. It needs what the node tier of tests/e2e needs
(``KUBEBUILDER_ASSETS``, ``GPUSHARD_E2E_KUBELET``) and ``GPUSHARD_E2E_CONTAINERD``, a containerd binary
that the tier starts itself (its ``ctr`` and shim beside it, or on PATH), and root. Without them the
whole tier is left out with one line saying what to set. ``make e2e`` runs it once per containerd
named (``GPUSHARD_E2E_CONTAINERD=/usr/bin/containerd:/opt/containerd2/bin/containerd``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.e2e import components, tiers
from tests.e2e.conftest import ASSETS, WHY_NOT, install, installed, kubectl, namespace, plane, work  # noqa: F401
from tests.runtime import images, node, nvidia, seeing

KUBELET = os.environ.get("GPUSHARD_E2E_KUBELET", "")
CONTAINERD = os.environ.get("GPUSHARD_E2E_CONTAINERD", "")


def _why_not() -> str:
    if ASSETS is None:
        return WHY_NOT
    if not KUBELET:
        return "set GPUSHARD_E2E_KUBELET (a kubelet binary) for the runtime tier"
    if not CONTAINERD:
        return "set GPUSHARD_E2E_CONTAINERD (a containerd binary) for the runtime tier"
    if os.pathsep in CONTAINERD:
        return "GPUSHARD_E2E_CONTAINERD names one containerd per run here (make e2e runs each it names)"
    if not Path(CONTAINERD).exists():
        return f"GPUSHARD_E2E_CONTAINERD={CONTAINERD} does not exist"
    if os.geteuid() != 0:
        return "the runtime tier starts containerd and runc: run it as root"
    if not images.BUSYBOX.exists():
        return f"the runtime tier builds its images from {images.BUSYBOX} (Debian: apt-get install busybox-static)"
    if not shutil.which("runc") and not Path("/usr/sbin/runc").exists():
        return "the runtime tier needs runc (Debian: apt-get install runc)"
    return ""


# The DRA backend changes the install for good: its tests go last.
TIER = tiers.Tier("gpushard runtime tier", Path(__file__).parent, _why_not(), markers=("e2e", "runtime"),
                  last=lambda item: Path(str(item.fspath)).name.startswith("test_dra"))


def pytest_collection_modifyitems(config, items):
    TIER.collect(config, items)


def pytest_terminal_summary(terminalreporter):
    TIER.summary(terminalreporter)
    for text in nvidia.tables():
        terminalreporter.write_line("")
        for line in text.splitlines():
            terminalreporter.write_line(line)


def pytest_report_header(config):
    return TIER.header(_versions)


def _versions() -> str:
    runtime = node.version_of(CONTAINERD)
    text = (f"containerd {'.'.join(map(str, runtime))} ({CONTAINERD}), "
            f"runc {shutil.which('runc') or '/usr/sbin/runc'}, CDI {'on' if runtime >= (2, 0, 0) else 'absent'}")
    if nvidia.why_not():
        return text + f"; NVIDIA's components: {nvidia.why_not()}"
    return text + (f"; NVIDIA's device plugin {nvidia.version(nvidia.PLUGIN)}, nvidia-container-runtime "
                   f"{nvidia.version(str(Path(nvidia.TOOLKIT) / 'nvidia-container-runtime'))}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    TIER.report(item, outcome.get_result())


@pytest.fixture(scope="session")
def cards(work) -> node.Cards:
    return node.Cards(work / "cards").make()


@pytest.fixture(scope="session")
def runtime(work, cards):
    containerd = node.Containerd(CONTAINERD, work, cards)
    TIER.started("containerd", containerd, lambda: (containerd.start(), images.load_tier_images(containerd, work)))
    yield containerd
    containerd.stop()


@pytest.fixture(scope="session")
def quiet(kubectl, installed):
    """The shipped workloads whose image this tier does not import, stopped before the node joins (seeing.quiet)."""
    seeing.quiet(kubectl)


@pytest.fixture(scope="session")
def kubelet(plane, installed, quiet, runtime, work):
    kubelet = TIER.started("kubelet", components.Kubelet(KUBELET, runtime.endpoint, plane, work,
                                                         address=node.NODE_IP), lines=80)
    yield kubelet
    # Pods first, so that the kubelet tears their sandboxes and networks down the runtime's own way.
    seeing.delete_all_pods(plane.kubectl, runtime)
    kubelet.stop()
    node.unmount_under(kubelet.root)


@pytest.fixture(scope="session")
def agent(plane, kubelet, runtime, work):
    """`gpushard agent` on the host over the fake NVML (four cards), its CDI specs where the runtime reads them."""
    agent = seeing.HostAgent(plane, kubelet, work, runtime)
    TIER.started("agent", agent, lambda: agent.start(expect=seeing.per_card(node.CARDS)))
    yield agent
    agent.stop()
