"""Fixtures of the DRA install tier: deploy/overlays/dra running as real pods from gpushard's own image, on a
containerd that applies CDI devices (2.x, built from its module by the harness).

The node, the control plane and the image are those of the shipped-install tier (tests/runtime_install), which
this tier takes its fixtures from; only what the overlay needs differs. The agent's DaemonSet pod registers with
the kubelet's plugin watcher in /var/lib/kubelet/plugins_registry, serves the DRA plugin from
/var/lib/kubelet/plugins and writes each claim's CDI spec into /var/run/cdi: the kubelet keeps the first two in
the run's folder and containerd reads its dynamic CDI folder there too, so each is bind-mounted at the host path
the DaemonSet mounts, as the kubelet's pod-resources folder is. The node advertises ``gpushard.io/gpu`` (the count
quota reads) and publishes one device per card in its ResourceSlice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e import components, tiers
from tests.runtime import node
from tests.runtime_install import conftest as shipped
from tests.runtime_install.conftest import dns, installed, kubectl, kubelet, namespace, nvml, plane, runtime, work  # noqa: F401,E501

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.gpushard.io"
PLUGINS_REGISTRY = Path("/var/lib/kubelet/plugins_registry")
PLUGINS = Path("/var/lib/kubelet/plugins")
CDI = Path("/var/run/cdi")
# The first minor whose scheduler shares a device's capacity among claims (docs/compatibility.md).
FIRST_MINOR = 36


def _why_not() -> str:
    why = shipped._why_not()
    if why:
        return why
    if node.version_of(shipped.CONTAINERD) < (2, 0, 0):
        return (f"the DRA install tier needs a containerd that applies CDI devices (2.x); GPUSHARD_E2E_CONTAINERD="
                f"{shipped.CONTAINERD} is {'.'.join(map(str, node.version_of(shipped.CONTAINERD)))}")
    minor = components.minor_of(shipped.KUBELET)
    if minor < FIRST_MINOR:
        return f"Kubernetes 1.{minor}: backend dra needs 1.{FIRST_MINOR} (docs/compatibility.md)"
    return ""


TIER = tiers.Tier("gpushard DRA install tier", Path(__file__).parent, _why_not(), markers=("e2e", "runtime"))


def pytest_collection_modifyitems(config, items):
    TIER.collect(config, items)


def pytest_terminal_summary(terminalreporter):
    TIER.summary(terminalreporter)


def pytest_report_header(config):
    return TIER.header(lambda: f"containerd {'.'.join(map(str, node.version_of(shipped.CONTAINERD)))}, "
                               f"image {shipped.IMAGE} as {shipped.SHIPPED_IMAGE}, deploy/overlays/dra")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    TIER.report(item, outcome.get_result(), lines=30)


def _slices() -> str:
    return tiers.RUNNING["plane"].kubectl.run("get", "resourceslices,resourceclaims", "-A", "-o", "wide",
                                              check=False).stdout


TIER.extra += [shipped._cluster, _slices]


@pytest.fixture(scope="session")
def install() -> Path:
    return ROOT / "deploy" / "overlays" / "dra"


@pytest.fixture(scope="session")
def advertised() -> dict[str, str]:
    return {"gpushard.io/gpu": str(100 * node.CARDS)}


@pytest.fixture(scope="session")
def usual_paths():
    return lambda node_kubelet, containerd: [
        (node_kubelet.root / "pod-resources", shipped.POD_RESOURCES), (node_kubelet.registry_dir, PLUGINS_REGISTRY),
        (node_kubelet.plugins_dir, PLUGINS), (containerd.cdi_dynamic, CDI.resolve())]


def slice_devices(client: components.Kubectl) -> list[str] | None:
    """The devices of the agent's ResourceSlice for the node, or None while it has published none."""
    slices = client.json("get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
    ours = [s for s in slices if s["spec"].get("nodeName") == components.NODE_NAME]
    return sorted(d["name"] for s in ours for d in s["spec"].get("devices") or []) if ours else None


@pytest.fixture(scope="session")
def dra(installed):  # noqa: F811
    """The DRA install up: what ``installed`` waits for, and the agent's slice offering every card."""
    want = [f"card-{k}" for k in range(node.CARDS)]
    components.wait_for(f"the agent's ResourceSlice offering {want}", lambda: slice_devices(installed) == want,
                        timeout=120, explain=lambda: shipped._cluster())
    return installed


