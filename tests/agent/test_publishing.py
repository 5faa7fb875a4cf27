"""We test, against a real local HTTP server speaking the Kubernetes API (tests/fakekube.py):
- the Node gets the inventory annotation (index, uuid, model, memoryMiB, what isolation each card gives)
  and the cards label by merge patch, and keeps its other labels and annotations;
- a card in MIG mode is left out of the plugins and the count, and listed with the reason;
- each card's memory is a label (gpushard.io/card-<k>.memory-mib, MiB), which memory asks' node
  affinity matches; a lost card loses its label and gets it back, and an agent that starts after a
  card left removes the label it had published before;
- a lost card updates both; a card coming back restores them;
- an API server that fails, or a Node not there yet, is retried until the patch lands;
- the patch body itself is a merge patch of our two keys only.
"""

import http.server
import json
import threading

import kubernetes
import pytest

from tests import fakekube
from tests.cluster import kubeobjects
from webhook import settings
from webhook.agent import running
from webhook.agent.node import nvml, publishing
from webhook.cluster import kube as kube_view
from webhook.core import auditing, decisions, names, placement

CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559),
         nvml.Card(1, "GPU-bbbb", "NVIDIA L4", 22491)]
NODE = "gpu-node-1"


def node(labels=None, annotations=None):
    return {"metadata": {"name": NODE, "labels": labels or {"kubernetes.io/hostname": NODE},
                         "annotations": annotations or {"keep": "me"}}}


def published(kube, count):
    def check():
        meta = kube.get("nodes", NODE)["metadata"]
        if (meta.get("labels") or {}).get(names.CARDS_LABEL) == str(count):
            return meta
        return None
    return check


@pytest.fixture
def kube():
    with fakekube.FakeKube() as server:
        yield server


def start_agent(kube, plugin_dir, devices, retry=5.0):
    api = kube.api_client()
    agent = running.Agent(devices, settings.Settings().policy, plugin_dir,
                          publisher=lambda cards: publishing.Publisher(api, NODE, cards, retry=retry),
                          poll=0.05, tick=0.2)
    agent.start()
    return agent


def test_node_patch_sets_only_our_keys():
    patch = publishing.node_patch(reversed(CARDS))
    assert patch == {"metadata": {
        "annotations": {names.INVENTORY_ANNOTATION: publishing.inventory_json(CARDS)},
        "labels": {names.CARDS_LABEL: "2", "gpushard.io/card-0.memory-mib": "81559",
                   "gpushard.io/card-1.memory-mib": "22491"}}}
    assert json.loads(publishing.inventory_json(CARDS)) == [
        {"index": 0, "uuid": "GPU-aaaa", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559},
        {"index": 1, "uuid": "GPU-bbbb", "model": "NVIDIA L4", "memoryMiB": 22491}]


def test_the_agent_publishes_its_inventory_on_its_node(kube, plugin_dir):
    kube.put("nodes", node())
    agent = start_agent(kube, plugin_dir, nvml.FakeDevices(CARDS))
    try:
        meta = kubeobjects.wait_for(published(kube, 2))
    finally:
        agent.stop()
    given = {"isolation": {"mode": "none", "driver": "fake", "memoryLimits": False}}
    assert json.loads(meta["annotations"][names.INVENTORY_ANNOTATION]) == [
        {"index": 0, "uuid": "GPU-aaaa", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, **given},
        {"index": 1, "uuid": "GPU-bbbb", "model": "NVIDIA L4", "memoryMiB": 22491, **given}]
    assert meta["annotations"]["keep"] == "me"
    assert meta["labels"]["kubernetes.io/hostname"] == NODE
    assert meta["labels"]["gpushard.io/card-0.memory-mib"] == "81559"
    assert meta["labels"]["gpushard.io/card-1.memory-mib"] == "22491"
    patches = [(path, json.loads(body)) for method, path, body in kube.requests if method == "PATCH"]
    assert patches and all(path == f"/api/v1/nodes/{NODE}" for path, _ in patches)
    assert set(patches[0][1]["metadata"]) == {"annotations", "labels"}


def test_a_lost_card_is_unpublished_and_comes_back(kube, plugin_dir):
    kube.put("nodes", node())
    devices = nvml.FakeDevices(CARDS)
    agent = start_agent(kube, plugin_dir, devices)
    try:
        kubeobjects.wait_for(published(kube, 2))
        devices.inject(nvml.HealthEvent("GPU-aaaa", healthy=False, present=False, reason="fell off the bus"))
        meta = kubeobjects.wait_for(published(kube, 1))
        assert [c["uuid"] for c in json.loads(meta["annotations"][names.INVENTORY_ANNOTATION])] == ["GPU-bbbb"]
        assert "gpushard.io/card-0.memory-mib" not in meta["labels"]
        assert meta["labels"]["gpushard.io/card-1.memory-mib"] == "22491"
        # An unhealthy card is still there: the inventory does not change, so nothing is sent.
        patches_before = sum(1 for r in kube.requests if r[0] == "PATCH")
        devices.inject(nvml.HealthEvent("GPU-bbbb", healthy=False, reason="Xid 48"))
        devices.inject(nvml.HealthEvent("GPU-aaaa", healthy=True))
        meta = kubeobjects.wait_for(published(kube, 2))
        assert [c["index"] for c in json.loads(meta["annotations"][names.INVENTORY_ANNOTATION])] == [0, 1]
        assert meta["labels"]["gpushard.io/card-0.memory-mib"] == "81559"
        assert sum(1 for r in kube.requests if r[0] == "PATCH") == patches_before + 1
    finally:
        agent.stop()


def test_an_agent_started_after_a_card_left_removes_its_label(kube, plugin_dir):
    kube.put("nodes", node(labels={"kubernetes.io/hostname": NODE, names.CARDS_LABEL: "3",
                                   "gpushard.io/card-0.memory-mib": "81559", "gpushard.io/card-1.memory-mib": "22491",
                                   "gpushard.io/card-2.memory-mib": "22491", "gpushard.io/card-2.other": "kept"}))
    agent = start_agent(kube, plugin_dir, nvml.FakeDevices(CARDS))
    try:
        meta = kubeobjects.wait_for(published(kube, 2))
    finally:
        agent.stop()
    assert {k: v for k, v in meta["labels"].items() if k.startswith("gpushard.io/card-")} == {
        "gpushard.io/card-0.memory-mib": "81559", "gpushard.io/card-1.memory-mib": "22491",
        "gpushard.io/card-2.other": "kept"}


def test_node_patch_removes_stale_memory_labels_only():
    patch = publishing.node_patch(CARDS[1:], stale={"gpushard.io/card-0.memory-mib", "gpushard.io/card-1.memory-mib"})
    assert patch["metadata"]["labels"] == {names.CARDS_LABEL: "1", "gpushard.io/card-0.memory-mib": None,
                                           "gpushard.io/card-1.memory-mib": "22491"}


def test_failures_are_retried_until_the_patch_lands(kube, plugin_dir):
    kube.fail_next = [500, 503]
    agent = start_agent(kube, plugin_dir, nvml.FakeDevices(CARDS), retry=0.05)
    try:
        # First the two injected failures, then 404s: the Node is not registered yet.
        kubeobjects.wait_for(lambda: sum(1 for r in kube.requests if r[0] == "PATCH") >= 4)
        kube.put("nodes", node())
        kubeobjects.wait_for(published(kube, 2))
    finally:
        agent.stop()


def test_a_node_without_gpus_publishes_zero(kube, plugin_dir):
    kube.put("nodes", node(labels={names.CARDS_LABEL: "3"}))
    agent = start_agent(kube, plugin_dir, nvml.NullDevices())
    try:
        meta = kubeobjects.wait_for(published(kube, 0))
    finally:
        agent.stop()
    assert meta["annotations"][names.INVENTORY_ANNOTATION] == "[]"


def test_the_patch_goes_out_as_a_json_merge_patch():
    # fakekube merges every patch type alike, so the media type is checked on a bare recorder.
    seen = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self):
            seen.append((self.path, self.headers["Content-Type"],
                         json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            body = json.dumps({"kind": "Node", "apiVersion": "v1", "metadata": {"name": NODE}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = kubernetes.client.Configuration()
        config.host = f"http://127.0.0.1:{server.server_address[1]}"
        publisher = publishing.Publisher(kubernetes.client.ApiClient(config), NODE, lambda: CARDS[:1])
        assert publisher.publish_once()
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [(f"/api/v1/nodes/{NODE}", "application/merge-patch+json", publishing.node_patch(CARDS[:1]))]


def test_a_mig_card_is_left_out_and_listed_with_the_reason(kube, plugin_dir):
    kube.put("nodes", node())
    devices = nvml.FakeDevices(CARDS, mig=frozenset({"GPU-aaaa"}), driver="615.10", memory_limits=True)
    agent = start_agent(kube, plugin_dir, devices)
    try:
        meta = kubeobjects.wait_for(published(kube, 1))
        assert [r.name for r in agent.backend.resources] == ["gpushard.io/gpu", "gpushard.io/card-1"]
    finally:
        agent.stop()
    listed = json.loads(meta["annotations"][names.INVENTORY_ANNOTATION])
    assert listed[0] == {"index": 0, "uuid": "GPU-aaaa", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559,
                         "excluded": "MIG mode is on: not shared as a whole card (turn MIG off to share it)"}
    assert listed[1]["isolation"] == {"mode": "none", "driver": "615.10", "memoryLimits": True}
    # The webhook's cluster view and the audit read the same annotation and skip the left-out card.
    view_node = kube_view.read_node({"metadata": meta, "status": {"allocatable": {"gpushard.io/card-1": "100"}}},
                                    settings.Settings().policy)
    assert [c.index for c in view_node.cards] == [1]
    assert list(auditing.node_cards({"metadata": meta}, settings.Settings().policy).inventory) == [1]


def test_the_webhooks_view_sizes_memory_asks_by_the_published_labels(kube, plugin_dir):
    kube.put("nodes", node())
    agent = start_agent(kube, plugin_dir, nvml.FakeDevices(CARDS))
    try:
        meta = kubeobjects.wait_for(published(kube, 2))
    finally:
        agent.stop()
    allocatable = {"gpushard.io/card-0": "100", "gpushard.io/card-1": "100"}
    view = placement.View((kube_view.read_node({"metadata": meta, "status": {"allocatable": allocatable}},
                                               settings.Settings().policy),))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {names.MEMORY_RESOURCE: "12Gi"}}}]}}
    decision = decisions.decide(decisions.Request(pod, "Pod"), settings.Settings().policy, view)
    # The smallest card that holds 12 GiB is card 1 (22491 MiB): ceil(12288 x 100 / 22491) = 55 shares.
    assert (decision.card, decision.shares) == (1, 55)
    terms = decision.obj["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "gpushard.io/card-1.memory-mib", "operator": "In", "values": ["22491"]}]
