"""We test the agent's metrics on a fake node with two cards and several pods, joined on the wire:
the stand-in PodResources server over a unix socket, the pods from a local Kubernetes API server,
a fake /proc tree with cgroup files in three runtime layouts, and NVML process lists from the fake backend:
- per card: memory used and total, utilization, shares allocated and capacity, health, Xid count;
- per container holding shares: its shares, its memory used, its share of memory, its process count
  and its processes' SM utilization;
  a container above its share is flagged; a pod whose processes exited shows zero use;
- processes of the host or of containers holding no shares count as unattributed, never as a pod's;
- only containers with shares get series (a sidecar without shares gets none), and a pod that
  leaves takes its series with it;
- a container restart (new container ID) is attributed at once through the pod's UID, and by name once
  the API shows the new ID;
- the memory cap appears only when isolation gives one;
- a pod placed by its memory ask (gpushard.io/memory-mib) gets one memory-asked series per card it holds
  shares of, however many of its containers hold them; other pods, and an unreadable annotation, get none;
  a pod that arrives after the agent listed the node's pods is found by a new list;
- PodResources down: card series stay but the shares held (unknown, not 0) and the unattributed
  figures go, container series go, and podresources_up says 0;
- the metrics served over TLS on the agent's own port, and `gpushard agent --metrics-port` end to end
  (fake inventory, stand-in PodResources, fake /proc, pods named through a kubeconfig to the local API).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agent import fakekubelet, fakenode, fakepodresources
from tests.fakekube import FakeKube
from tests.polling import eventually
from webhook.agent.metrics import attributing, exporting, podlisting
from webhook.agent.node import health, nvml, podresources
from webhook.core import policy as policy_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE = "node-a"
GIB = 1 << 30
# The agent's certificate is made at its start; these tests check what it serves, not who it is.
UNVERIFIED = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
UNVERIFIED.check_hostname = False
UNVERIFIED.verify_mode = ssl.CERT_NONE
CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA L4", 16384), nvml.Card(1, "GPU-bbbb", "NVIDIA L4", 16384)]


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(samples, name: str, **labels) -> float | None:
    """The one sample of ``name`` whose labels include ``labels`` (None if there is none)."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) <= 1, f"{name} {labels}: {len(hits)} samples"
    return hits[0] if hits else None


def pods_in(samples) -> set[tuple[str, str, str, str]]:
    return {(dict(ls)["namespace"], dict(ls)["pod"], dict(ls)["container"], dict(ls)["gpu"])
            for (n, ls) in samples if n == "gpushard_container_shares"}


@pytest.fixture
def node(tmp_path):
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    devices = nvml.FakeDevices(CARDS)
    fake = fakenode.FakeNode(str(proc_root), devices)
    fake.pods = [
        fakenode.Pod("ml", "train", [fakenode.Container("trainer", 0, 25, 0,
                                                        processes=[(1001, 3000, 40), (1002, 1500, 25)]),
                                     fakenode.Container("sidecar")], layout="cgroupfs-v1"),
        fakenode.Pod("ml", "infer", [fakenode.Container("server", 0, 50, 25, processes=[(1101, 2048)])]),
        fakenode.Pod("lab", "notebook", [fakenode.Container("jupyter", 1, 30, 0)], layout="systemd-v2-crio"),
        fakenode.Pod("lab", "batch", [fakenode.Container("worker", 1, 40, 30, processes=[(1301, 1024)])]),
    ]
    # A process of the host, and one of a pod that holds no share of card 1 yet uses it.
    stray = fakenode.Pod("lab", "cpu-only", [fakenode.Container("app")])
    stray_cgroup = fakenode.LAYOUTS["systemd-v2-containerd"](stray.uid, stray.containers[0].cid(stray))
    fake.loose = {1: [(2001, 300, "0::/system.slice/render.service\n"), (2002, 200, stray_cgroup)]}
    fake.utilization = {0: 87, 1: 12}
    fake.sync()

    socket_dir = fakekubelet.short_tempdir("gpr-")
    server = fakepodresources.FakePodResources(os.path.join(socket_dir, "kubelet.sock")).start()
    server.set(fake.pod_resources())
    kube = FakeKube().start()
    for pod in [*fake.pods, stray]:
        kube.put("pods", pod.api_object(NODE))
    kube.put("pods", fakenode.Pod("other", "elsewhere", [fakenode.Container("x", 0, 10)]).api_object("node-b"))
    client = podresources.Client(server.path, timeout=2)
    policy = policy_mod.Policy()
    board = health.Board(CARDS)
    pods = podlisting.NodePods(kube.api_client(), NODE, min_interval=0)

    def make(memory_cap=exporting.no_cap):
        observer = exporting.Observer(NODE, CARDS, devices, board, policy, lambda: client.holdings(policy),
                                      attributing.ProcReader(str(proc_root)), pods, memory_cap)
        reg = exporting.new_registry(observer)
        return lambda: parse(exporting.text(reg))

    yield type("Node", (), dict(fake=fake, server=server, kube=kube, board=board, devices=devices, make=make,
                                pods=pods))
    client.close()
    server.stop()
    kube.stop()
    fakekubelet.remove_tree(socket_dir)


def test_cards_and_containers_on_a_shared_node(node):
    s = node.make()()
    card0, card1 = dict(gpu="0", UUID="GPU-aaaa", modelName="NVIDIA L4", node=NODE), dict(gpu="1", UUID="GPU-bbbb")
    assert value(s, "gpushard_card_memory_total_bytes", **card0) == 16 * GIB
    assert value(s, "gpushard_card_memory_used_bytes", **card0) == (3000 + 1500 + 2048) << 20
    assert value(s, "gpushard_card_utilization_ratio", **card0) == 0.87
    assert value(s, "gpushard_card_shares_capacity", **card0) == 100
    assert value(s, "gpushard_card_shares_allocated", **card0) == 75
    assert value(s, "gpushard_card_shares_allocated", **card1) == 70
    assert value(s, "gpushard_card_healthy", **card0) == 1
    assert value(s, "gpushard_card_xid_errors_total", **card0) == 0
    assert value(s, "gpushard_agent_podresources_up", node=NODE) == 1

    # Only containers that hold shares get series; the sidecar of ml/train does not.
    assert pods_in(s) == {("ml", "train", "trainer", "0"), ("ml", "infer", "server", "0"),
                          ("lab", "notebook", "jupyter", "1"), ("lab", "batch", "worker", "1")}
    trainer = dict(namespace="ml", pod="train", container="trainer", gpu="0", UUID="GPU-aaaa", node=NODE)
    assert value(s, "gpushard_container_shares", **trainer) == 25
    assert value(s, "gpushard_container_memory_used_bytes", **trainer) == 4500 << 20
    assert value(s, "gpushard_container_memory_share_bytes", **trainer) == 4 * GIB
    assert value(s, "gpushard_container_gpu_processes", **trainer) == 2
    assert value(s, "gpushard_container_over_share", **trainer) == 1  # 4500 MiB > 4096 MiB
    assert value(s, "gpushard_container_utilization_ratio", **trainer) == 0.65  # two processes, 40 % + 25 %

    server = dict(pod="infer", container="server")
    assert value(s, "gpushard_container_memory_used_bytes", **server) == 2 * GIB
    assert value(s, "gpushard_container_over_share", **server) == 0

    # The notebook's processes exited: it still holds its shares, and uses nothing.
    notebook = dict(pod="notebook", container="jupyter")
    assert value(s, "gpushard_container_shares", **notebook) == 30
    assert value(s, "gpushard_container_memory_used_bytes", **notebook) == 0
    assert value(s, "gpushard_container_gpu_processes", **notebook) == 0
    assert value(s, "gpushard_container_utilization_ratio", **notebook) == 0

    # The host's process and the one of a pod without shares are nobody's share.
    assert value(s, "gpushard_card_unattributed_memory_bytes", **card1) == 500 << 20
    assert value(s, "gpushard_card_unattributed_processes", **card1) == 2
    assert value(s, "gpushard_card_unattributed_memory_bytes", **card0) == 0
    assert not any(dict(ls).get("pod") == "cpu-only" for _, ls in s)
    # No isolation configured: no cap series.
    assert value(s, "gpushard_container_memory_cap_bytes", **trainer) is None


def test_the_metrics_text_names_series_like_kube_state_metrics_and_dcgm(node):
    observer_text = node.make()
    s = observer_text()
    labels = {k for (n, ls) in s if n == "gpushard_container_memory_used_bytes" for k, _ in ls}
    assert labels == {"node", "namespace", "pod", "container", "gpu", "UUID", "modelName"}
    labels = {k for (n, ls) in s if n == "gpushard_card_memory_used_bytes" for k, _ in ls}
    assert labels == {"node", "gpu", "UUID", "modelName"}


def test_a_pod_that_leaves_takes_its_series_with_it(node):
    scrape = node.make()
    assert ("ml", "infer", "server", "0") in pods_in(scrape())
    node.fake.pods = [p for p in node.fake.pods if p.name != "infer"]
    node.fake.sync()
    node.server.set(node.fake.pod_resources())
    node.kube.delete("pods", "infer", "ml")
    s = scrape()
    assert ("ml", "infer", "server", "0") not in pods_in(s)
    assert not any(dict(ls).get("pod") == "infer" for _, ls in s)
    assert value(s, "gpushard_card_shares_allocated", gpu="0") == 25


def test_a_restarted_container_is_attributed_before_and_after_the_api_shows_it(node):
    scrape = node.make()
    worker = dict(pod="batch", container="worker")
    assert value(scrape(), "gpushard_container_memory_used_bytes", **worker) == 1 * GIB
    batch = next(p for p in node.fake.pods if p.name == "batch")
    batch.containers[0].restarts = 1
    batch.containers[0].processes = [(1302, 3000)]
    node.fake.sync()
    # The kubelet restarted the container; the API does not show the new ID yet: the pod's UID decides.
    s = scrape()
    assert value(s, "gpushard_container_memory_used_bytes", **worker) == 3000 << 20
    assert value(s, "gpushard_container_gpu_processes", **worker) == 1
    node.kube.put("pods", batch.api_object(NODE))
    lists = node.pods.lists
    s = scrape()
    assert value(s, "gpushard_container_memory_used_bytes", **worker) == 3000 << 20
    assert node.pods.lists > lists  # the unknown ID made the agent list the node's pods again
    assert node.pods.container(batch.containers[0].cid(batch)) == podlisting.ContainerName("lab", "batch", "worker")


def test_the_memory_cap_appears_only_with_isolation(node):
    s = node.make(exporting.memory_cap_for("memory", 100))()
    assert value(s, "gpushard_container_memory_cap_bytes", pod="train") == 4 * GIB
    # What the card-k plugin hands the container: whole MiB, floored (16384 x 40 / 100 = 6553.6).
    assert value(s, "gpushard_container_memory_cap_bytes", pod="batch") == 6553 << 20
    s = node.make(exporting.memory_cap_for("none", 100))()
    assert not any(n == "gpushard_container_memory_cap_bytes" for n, _ in s)


def annotated(pod: fakenode.Pod, mib: str) -> dict:
    obj = pod.api_object(NODE)
    obj["metadata"]["annotations"] = {"gpushard.io/memory-mib": mib}
    return obj


def test_a_pod_placed_by_its_memory_ask_shows_what_it_asked(node):
    by_name = {p.name: p for p in node.fake.pods}
    node.kube.put("pods", annotated(by_name["infer"], "6144"))
    node.kube.put("pods", annotated(by_name["batch"], "12Gi"))  # not gpushard's writing: no series
    s = node.make()()
    asked = {(n, ls): v for (n, ls), v in s.items() if n == "gpushard_pod_memory_asked_bytes"}
    assert asked == {("gpushard_pod_memory_asked_bytes", frozenset(dict(
        node=NODE, namespace="ml", pod="infer", gpu="0", UUID="GPU-aaaa", modelName="NVIDIA L4").items())): 6144 << 20}

    # A pod that arrives after the agent listed the node's pods: its unknown name makes the agent list them again.
    scrape = node.make()
    scrape()
    sized = fakenode.Pod("lab", "sized", [fakenode.Container("app", 1, 20, 70)])
    node.fake.pods.append(sized)
    node.fake.sync()
    node.server.set(node.fake.pod_resources())
    node.kube.put("pods", annotated(sized, "3000"))
    lists = node.pods.lists
    s = scrape()
    assert node.pods.lists > lists
    assert value(s, "gpushard_pod_memory_asked_bytes", pod="sized", gpu="1") == 3000 << 20
    assert value(s, "gpushard_pod_memory_asked_bytes", pod="infer") == 6144 << 20


def test_the_memory_asked_is_one_series_per_pod():
    card = nvml.Card(0, "GPU-aaaa", "NVIDIA L4", 16384)
    rows = [exporting.ContainerRow("ml", "pair", name, 10, 0, None, memory_asked_bytes=3 << 30)
            for name in ("a", "b")]
    rows.append(exporting.ContainerRow("ml", "plain", "c", 10, 0, None))
    obs = exporting.Observation(NODE, 100, [exporting.CardRow(card, True, True, None, 30, containers=rows)], True)
    reg = exporting.new_registry(lambda: obs)
    s = parse(exporting.text(reg))
    assert [(dict(ls)["pod"], v) for (n, ls), v in s.items() if n == "gpushard_pod_memory_asked_bytes"] == [
        ("pair", 3 << 30)]
    assert {k for (n, ls) in s if n == "gpushard_pod_memory_asked_bytes" for k, _ in ls} == {
        "node", "namespace", "pod", "gpu", "UUID", "modelName"}


def test_unhealthy_card_and_xids(node):
    node.board.apply(nvml.HealthEvent("GPU-bbbb", healthy=False, reason="critical Xid 79"))
    usage = node.devices.usage()["GPU-bbbb"]
    node.devices.set_usage("GPU-bbbb", nvml.Usage(usage.memory_used_bytes, usage.memory_total_bytes, 0,
                                                  usage.processes, xid_errors=2))
    s = node.make()()
    assert value(s, "gpushard_card_healthy", gpu="1") == 0
    assert value(s, "gpushard_card_xid_errors_total", gpu="1") == 2
    assert value(s, "gpushard_card_healthy", gpu="0") == 1


def test_pod_resources_down_keeps_cards_and_drops_containers(node):
    import grpc

    node.server.fail = grpc.StatusCode.UNAVAILABLE
    s = node.make()()
    assert value(s, "gpushard_agent_podresources_up", node=NODE) == 0
    assert pods_in(s) == set()
    assert value(s, "gpushard_card_memory_used_bytes", gpu="0") == (3000 + 1500 + 2048) << 20
    # Without the kubelet's holdings, who holds shares is unknown, not 0: no series for the shares
    # held, nor for what no container holds (nothing could be attributed).
    assert value(s, "gpushard_card_shares_capacity", gpu="0") == 100
    for name in ("gpushard_card_shares_allocated", "gpushard_card_unattributed_processes",
                 "gpushard_card_unattributed_memory_bytes"):
        assert value(s, name, gpu="0") is None, name


def test_served_on_its_own_port(node):
    observer = exporting.Observer(NODE, CARDS, node.devices, node.board, policy_mod.Policy(), lambda: [],
                                  attributing.ProcReader(node.fake.proc_root), None)
    server = exporting.Server(exporting.new_registry(observer), 0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{server.port}/metrics", timeout=5,
                                    context=UNVERIFIED) as response:
            text = response.read().decode()
        assert 'gpushard_card_memory_total_bytes{UUID="GPU-aaaa",gpu="0",modelName="NVIDIA L4",node="node-a"} ' \
               '1.7179869184e+10\n' in text
        assert value(parse(text), "gpushard_agent_podresources_up") == 1
    finally:
        server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_agent_serves_metrics_end_to_end(node, tmp_path):
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"cards": [{"index": c.index, "uuid": c.uuid, "model": c.model,
                                                "memoryMiB": c.memory_mib} for c in CARDS]}))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": node.kube.url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
    plugin_dir = fakekubelet.short_tempdir()
    kubelet = fakekubelet.FakeKubelet(plugin_dir).start()
    port = _free_port()
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), NODE_NAME=NODE)
    proc = subprocess.Popen([sys.executable, "-m", "webhook.cli", "agent", "--fake-inventory", str(inventory),
                             "--device-plugin-dir", plugin_dir, "--no-publish", "--metrics-port", str(port),
                             "--pod-resources-socket", node.server.path, "--proc-root", node.fake.proc_root],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def served() -> str | None:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5,
                                        context=UNVERIFIED) as response:
                return response.read().decode()
        except OSError:
            return None

    try:
        text = eventually(served, "the agent serving its metrics", timeout=20, interval=0.2, gone=lambda: (
            None if proc.poll() is None else f"the agent exited ({proc.returncode}): {proc.communicate()[1]}"))
        s = parse(text)
        # The fake inventory's cards are idle: the pods hold shares and use nothing.
        assert value(s, "gpushard_container_shares", pod="train", container="trainer") == 25
        assert value(s, "gpushard_container_memory_used_bytes", pod="train") == 0
        assert value(s, "gpushard_card_shares_allocated", gpu="1") == 70
        assert value(s, "gpushard_agent_podresources_up") == 1
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=15)
        kubelet.stop()
        fakekubelet.remove_tree(plugin_dir)
    assert proc.returncode == 0, err


def test_a_bad_metrics_port_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "webhook.cli", "agent", "--no-publish", "--allow-no-gpus",
                             "--metrics-port", "70000"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "gpushard: --metrics-port must be a port number (0 for none), got 70000" in result.stderr
