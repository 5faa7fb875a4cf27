"""Fixtures of the shipped-install tier: deploy/base running as real pods from gpushard's own image.

The webhook Deployment, the certificate Job and the agent DaemonSet run on a real kubelet over a real containerd
and runc (tests/runtime/node.py), from gpushard's image built from this Dockerfile (``GPUSHARD_E2E_IMAGE``, an
OCI archive: ``make image-archive``), imported under the name deploy/base gives it, never pulled. The API
server calls the webhook through its Service: ``--enable-aggregator-routing=true`` makes it dial the Service's
endpoints itself, so no kube-proxy is needed. For gpushard's pods to reach the API server, it serves on the
node's bridge address and the kubernetes Service's address (10.0.0.1:443) is routed there by one DNAT rule,
which is what kube-proxy does for it. Pods that reach a Service by name (the chart's ``helm test`` pod) ask the
tier's cluster DNS on the node's address (tests/runtime/clusterdns.py), and a test routes that Service's address
as kube-proxy would (``service_route``). The kubelet keeps its folders in the run's folder; its pod-resources
folder is bind-mounted at /var/lib/kubelet/pod-resources, where the agent's DaemonSet mounts it from. deploy/base
is applied as docs/install.md says; the test overlay then adds only what a GPU node provides, under a field
manager of its own: the fake ``libnvidia-ml.so.1`` and its control folder for the agent, and the RuntimeClass
``nvidia``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes
import pytest

from tests.e2e import components, gpushard, tiers
from tests.e2e.conftest import ASSETS, WHY_NOT
from tests.runtime import clusterdns, images, node, seeing

ROOT = Path(__file__).resolve().parents[2]
KUBELET = os.environ.get("GPUSHARD_E2E_KUBELET", "")
CONTAINERD = os.environ.get("GPUSHARD_E2E_CONTAINERD", "")
IMAGE = os.environ.get("GPUSHARD_E2E_IMAGE", "")
SHIPPED_IMAGE = "ghcr.io/gpushard/gpushard:0.1.0"  # what deploy/base's kustomization names
POD_RESOURCES = Path("/var/lib/kubelet/pod-resources")  # where deploy/base and the chart mount it from


def _why_not() -> str:
    if ASSETS is None:
        return WHY_NOT
    if not (KUBELET and CONTAINERD) or os.pathsep in CONTAINERD:
        return "set GPUSHARD_E2E_KUBELET and GPUSHARD_E2E_CONTAINERD (one containerd) for the shipped-install tier"
    if not IMAGE or not Path(IMAGE).is_file():
        return ("set GPUSHARD_E2E_IMAGE to an OCI archive of gpushard's image (make image-archive) for the "
                "shipped-install tier")
    if os.geteuid() != 0 or not shutil.which("iptables"):
        return "the shipped-install tier runs containers and routes one address with iptables: run it as root"
    return ""


TIER = tiers.Tier("gpushard shipped-install tier", Path(__file__).parent, _why_not(), markers=("e2e", "runtime"))


def pytest_collection_modifyitems(config, items):
    TIER.collect(config, items)


def pytest_terminal_summary(terminalreporter):
    TIER.summary(terminalreporter)


def pytest_report_header(config):
    return TIER.header(lambda: f"containerd {'.'.join(map(str, node.version_of(CONTAINERD)))}, "
                               f"image {IMAGE} as {SHIPPED_IMAGE}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    TIER.report(item, outcome.get_result(), lines=30)


def _cluster() -> str:
    """The pods and the last lines of gpushard's own pods, where the install as pods explains a failure."""
    kubectl = tiers.RUNNING["plane"].kubectl
    sections = [kubectl.run("get", "pods", "-A", "-o", "wide", check=False).stdout]
    for pod in ("app.kubernetes.io/component=webhook", "app.kubernetes.io/component=agent"):
        sections.append(kubectl.run("logs", "-n", gpushard.SYSTEM, "-l", pod, "--tail=20", "--prefix",
                                    check=False).stdout)
    return "\n".join(sections)


TIER.extra.append(_cluster)


@pytest.fixture(scope="session")
def work():
    yield from tiers.work_folder("gpushard-e2e-install-")


@pytest.fixture(scope="session")
def plane(work):
    node.make_bridge()  # the API server serves on the bridge's address
    plane = components.ControlPlane(ASSETS, work, address=node.NODE_IP,
                                    apiserver_flags=["--enable-aggregator-routing=true"])
    route = None

    def start():
        nonlocal route
        plane.start()
        route = node.ServiceRoute("10.0.0.1", 443, f"{node.NODE_IP}:{plane.port}").add()
    TIER.started("plane", plane, start)
    yield plane
    route.remove()
    plane.stop()
    node.remove_bridge()


@pytest.fixture(scope="session")
def kubectl(plane) -> components.Kubectl:
    return plane.kubectl


def import_as(containerd: node.Containerd, archive: Path, name: str) -> None:
    """An OCI archive imported into containerd and tagged ``name``, as a registry would serve it."""
    before = containerd.images()
    containerd.import_image(archive)
    imported = sorted(i for i in containerd.images() - before if not i.startswith("sha256:"))
    assert imported, f"ctr images import {archive} named no image"
    done = containerd.ctr_run("images", "tag", "--force", imported[0], name)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="session")
def runtime(work, plane):
    cards = node.Cards(work / "cards").make()
    containerd = node.Containerd(CONTAINERD, work, cards)

    def start():
        containerd.start()
        images.load_tier_images(containerd, work)
        import_as(containerd, Path(IMAGE), SHIPPED_IMAGE)
    TIER.started("containerd", containerd, start)
    yield containerd
    containerd.stop()


@pytest.fixture(scope="session")
def nvml(work) -> tuple[Path, Path]:
    """The fake libnvidia-ml.so.1 (four cards) and its control folder, on the host for the agent's pod."""
    lib, control = work / "nvml" / "lib", work / "nvml" / "control"
    lib.mkdir(parents=True)
    control.mkdir(parents=True)
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "gpushard e2e: the agent's fake NVML library needs a C compiler"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"), "-Wl,-soname,libnvidia-ml.so.1",
                    str(gpushard.FAKE_NVML)], check=True, timeout=60)
    (control / "cards").write_text(str(node.CARDS))
    return lib, control


def node_overlay(nvml: tuple[Path, Path]) -> dict:
    """What a GPU node provides to the agent's pod (its NVML), as a server-side apply of only those fields of the
    DaemonSet. Its own field manager keeps them out of the install's: a Helm takeover hands kubectl's fields to
    Helm and leaves these alone, as it would leave what NVIDIA's toolkit injects on a real node."""
    lib, control = nvml
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "gpushard-agent", "namespace": gpushard.SYSTEM},
            "spec": {"template": {"spec": {
                "containers": [{
                    "name": "agent",
                    "env": [{"name": "LD_LIBRARY_PATH", "value": "/gpushard-e2e/lib"},
                            {"name": "FAKE_NVML_DIR", "value": "/gpushard-e2e/nvml"}],
                    "volumeMounts": [{"name": "e2e-nvml-lib", "mountPath": "/gpushard-e2e/lib", "readOnly": True},
                                     {"name": "e2e-nvml", "mountPath": "/gpushard-e2e/nvml", "readOnly": True}]}],
                "volumes": [{"name": "e2e-nvml-lib", "hostPath": {"path": str(lib), "type": "Directory"}},
                            {"name": "e2e-nvml", "hostPath": {"path": str(control), "type": "Directory"}}]}}}}


@pytest.fixture(scope="session")
def dns(plane):
    """The tier's cluster DNS on the node's address: Service names to ClusterIPs, read from the API server."""
    client = kubernetes.config.new_client_from_config(config_file=str(plane.kubectl.config))
    api = kubernetes.client.CoreV1Api(client)

    def cluster_ip(service: str, namespace: str) -> str | None:
        try:
            address = api.read_namespaced_service(service, namespace, _request_timeout=5).spec.cluster_ip
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return address if address and address != "None" else None
    responder = clusterdns.Responder(node.NODE_IP, cluster_ip).start()
    yield responder
    responder.stop()
    client.close()


def service_route(kubectl: components.Kubectl, name: str, namespace: str) -> node.ServiceRoute:
    """A Service's ClusterIP and first port routed to one Ready endpoint of it, as kube-proxy would (``remove()``
    it after use: the endpoint's address changes when its pod does)."""
    service = kubectl.json("get", "service", name, "-n", namespace)
    port = service["spec"]["ports"][0]
    slices = kubectl.json("get", "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={name}")
    ready = []
    for endpoint_slice in slices["items"]:
        targets = [p["port"] for p in endpoint_slice.get("ports") or [] if p.get("name") == port.get("name")]
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready"):
                ready += [(endpoint["addresses"][0], target) for target in targets]
    assert ready, f"service {namespace}/{name} has no Ready endpoint: {slices['items']}"
    address, target = sorted(ready)[0]
    return node.ServiceRoute(service["spec"]["clusterIP"], port["port"], f"{address}:{target}",
                             masquerade=True).add()


@pytest.fixture(scope="session")
def install() -> Path:
    """What the tier installs, as docs/install.md applies it (the DRA install tier: deploy/overlays/dra)."""
    return ROOT / "deploy" / "base"


@pytest.fixture(scope="session")
def advertised() -> dict[str, str]:
    """The node's allocatable once the agent serves: each card's shares (the DRA install tier: the count)."""
    return {f"gpushard.io/card-{k}": "100" for k in range(node.CARDS)}


@pytest.fixture(scope="session")
def usual_paths():
    """(folder of the run, host path the install's pods mount it from): the kubelet's pod-resources folder, kept in
    the run's folder, where the agent's DaemonSet (of deploy/ and of the chart alike) mounts it from."""
    return lambda kubelet, runtime: [(kubelet.root / "pod-resources", POD_RESOURCES)]


@contextlib.contextmanager
def at_their_usual_paths(pairs: list[tuple[Path, Path]]):
    """Each folder of the run bind-mounted at the host path the install's pods mount it from; undone afterwards
    (and a host folder made for it removed again)."""
    made, mounted = [], []
    try:
        for folder, target in pairs:
            folder.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.mkdir(parents=True)
                made.append(target)
            subprocess.run(["mount", "--bind", str(folder), str(target)], check=True, capture_output=True,
                           timeout=30)
            mounted.append(target)
        yield
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)
        for target in reversed(made):
            with contextlib.suppress(OSError):
                target.rmdir()


@pytest.fixture(scope="session")
def kubelet(plane, runtime, work, nvml, dns, install, usual_paths):
    kubectl = plane.kubectl
    kubelet = components.Kubelet(KUBELET, runtime.endpoint, plane, work, address=node.NODE_IP,
                                 cluster_dns=dns.address)
    # The install as docs/install.md applies it, then what the node provides (before the node, and so any agent
    # pod, exists).
    done = kubectl.run("apply", "-k", str(install), check=False, timeout=180)
    assert done.returncode == 0, done.stderr
    done = kubectl.run("apply", "--server-side", "--field-manager=gpushard-e2e-node", "-f", "-",
                       input=json.dumps(node_overlay(nvml)), check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    kubectl.apply(json.dumps({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                              "metadata": {"name": "nvidia"}, "handler": "nvidia"}))
    # The device manager's checkpoint sits in the constant /var/lib/kubelet/device-plugins, whatever the root
    # folder: one an earlier tier's kubelet left (the shipped tier before the DRA one, in one `make e2e`) would make
    # this node one that ran the device-plugin backend. A fresh node has none.
    (components.DEVICE_PLUGIN_DIR / gpushard.KUBELET_CHECKPOINT).unlink(missing_ok=True)
    with at_their_usual_paths(usual_paths(kubelet, runtime)):
        try:
            TIER.started("kubelet", kubelet, lambda: (kubelet.start(), kubectl.run(
                "label", "node", components.NODE_NAME, "gpushard.io/shared-node=true", "--overwrite")), lines=80)
        except BaseException:
            node.unmount_under(kubelet.root)
            raise
        yield kubelet
        seeing.delete_all_pods(kubectl, runtime)
        kubelet.stop()
        node.unmount_under(kubelet.root)


@pytest.fixture(scope="session")
def installed(kubectl, kubelet, advertised):
    """The install up as pods: the certificate Job done, the webhook Deployment available, the agent advertising."""
    system = gpushard.SYSTEM
    components.wait_for("the certificate Job complete", lambda: (kubectl.json(
        "get", "job", "gpushard-certs", "-n", system).get("status") or {}).get("succeeded"), timeout=240,
        explain=kubelet.tail)
    kubectl.run("rollout", "status", "deployment/gpushard-webhook", "-n", system, "--timeout=240s", timeout=260)
    kubectl.run("rollout", "status", "daemonset/gpushard-agent", "-n", system, "--timeout=240s", timeout=260)
    components.wait_for(f"node allocatable {advertised}", lambda: all(
        kubectl.json("get", "node", components.NODE_NAME)["status"].get("allocatable", {}).get(k) == v
        for k, v in advertised.items()), timeout=120, explain=kubelet.tail)
    return kubectl


@pytest.fixture
def namespace(kubectl, request):
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]  # one per parameter too
    name = f"e2e-{request.node.originalname.removeprefix('test_').replace('_', '-')[:40].strip('-')}-{digest}"
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": name, "labels": {"gpushard.io/mode": "enforce"}}}))
    yield name
    kubectl.run("delete", "namespace", name, "--wait=false", check=False)
