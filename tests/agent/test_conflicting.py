"""We test how the agent finds another DRA driver offering its node's GPUs, against the local API server:
- a known GPU driver's ResourceSlices for this node conflict (with no card named when its devices carry
  no UUID); any driver whose device names one of this node's cards by UUID conflicts, with that card;
  a driver of other devices (a NIC), and slices of other nodes, do not;
- the running agent lists the slices for its node (fieldSelector spec.nodeName), puts the drivers into the
  Node's inventory annotation (draConflict on each card concerned), logs a line, and takes them out again
  when the slices go;
- the metrics say how many drivers conflict (0 once checked, nothing before) and how many devices each
  publishes;
- an API without resource.k8s.io/v1 (404) or an agent without the right to list (403) reports nothing, and
  the 403 is logged once, naming the missing right.
"""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import fakekube
from tests.cluster import kubeobjects
from webhook import settings
from webhook.agent import running
from webhook.agent.metrics import attributing, exporting
from webhook.agent.node import nvml, otherdrivers, publishing
from webhook.core import names

NODE = "gpu-node-1"
CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559),
         nvml.Card(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 81559)]


def resource_slice(name: str, driver: str, node: str = NODE, uuids: tuple[str, ...] = ()) -> dict:
    devices = [{"name": f"dev-{i}", "attributes": {"uuid": {"string": u}, "productName": {"string": "H100"}}}
               for i, u in enumerate(uuids)] or [{"name": "gpu-0", "attributes": {"index": {"int": 0}}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                  "resourceSliceCount": 1},
                     "devices": devices}}


def test_which_slices_conflict():
    slices = [resource_slice("nv", "gpu.nvidia.com"),
              resource_slice("other", "gpu.example.com", uuids=("GPU-bbbb", "GPU-zzzz")),
              resource_slice("nic", "net.example.com", uuids=("MAC-1",)),
              resource_slice("elsewhere", "gpu.nvidia.com", node="gpu-node-2")]
    assert otherdrivers.conflicts(slices, NODE, CARDS) == [
        otherdrivers.Conflict("gpu.example.com", ("other",), 2, (1,)),
        otherdrivers.Conflict("gpu.nvidia.com", ("nv",), 1, ())]
    assert otherdrivers.conflicts(slices[2:], NODE, CARDS) == []


@pytest.fixture
def kube():
    with fakekube.FakeKube() as server:
        yield server


def start_agent(kube, plugin_dir):
    api = kube.api_client()
    agent = running.Agent(nvml.FakeDevices(CARDS), settings.Settings().policy, plugin_dir,
                          publisher=lambda cards: publishing.Publisher(api, NODE, cards, retry=0.05),
                          poll=0.05, tick=0.2,
                          conflicts=lambda cards: otherdrivers.Watcher(api, NODE, cards, interval=0.1))
    agent.start()
    return agent


def inventory(kube) -> list[dict]:
    """The Node's inventory, or [] until the agent's publisher has written it (its first patch is its own thread's)."""
    written = (kube.get("nodes", NODE)["metadata"].get("annotations") or {}).get(names.INVENTORY_ANNOTATION)
    return json.loads(written) if written else []


def metrics(agent) -> dict[tuple, float]:
    observer = exporting.Observer(NODE, CARDS, agent.devices, agent.board, agent.policy, lambda: [],
                                  attributing.ProcReader("/nonexistent"), None, conflicts=agent.conflicts)
    text = exporting.text(exporting.new_registry(observer))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if "dra" in s.name}


def test_the_agent_reports_a_conflicting_driver_in_its_inventory_metrics_and_log(kube, plugin_dir, caplog):
    caplog.set_level(logging.INFO, logger="webhook.agent.node.otherdrivers")
    kube.put("nodes", {"metadata": {"name": NODE}})
    kube.put("resourceslices", resource_slice("nic", "net.example.com", uuids=("MAC-1",)))
    agent = start_agent(kube, plugin_dir)
    try:
        kubeobjects.wait_for(lambda: agent.conflicts.checked, what="the first ResourceSlice list")
        assert all("draConflict" not in c for c in kubeobjects.wait_for(lambda: inventory(kube)))
        assert metrics(agent) == {("gpushard_agent_dra_conflicts", (("node", NODE),)): 0}

        kube.put("resourceslices", resource_slice("nv-1", "gpu.nvidia.com", uuids=("GPU-bbbb",)))
        kube.put("resourceslices", resource_slice("nv-2", "gpu.nvidia.com", node="gpu-node-2",
                                                  uuids=("GPU-aaaa",)))
        cards = kubeobjects.wait_for(lambda: [c for c in inventory(kube) if "draConflict" in c],
                                     what="the conflict in the inventory")
        assert cards == [{"index": 1, "uuid": "GPU-bbbb", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559,
                          "isolation": {"mode": "none", "driver": "fake", "memoryLimits": False},
                          "draConflict": ["gpu.nvidia.com"]}]
        assert metrics(agent) == {
            ("gpushard_agent_dra_conflicts", (("node", NODE),)): 1,
            ("gpushard_agent_dra_conflict_devices", (("driver", "gpu.nvidia.com"), ("node", NODE))): 1}
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert said == ["gpushard: DRA driver gpu.nvidia.com publishes cards [1] of node 'gpu-node-1' "
                        "(ResourceSlices nv-1): a pod claiming them gets a card outside every share; remove the "
                        "driver from shared nodes (docs/install.md)"]
        lists = [p for m, p, _ in kube.requests if m == "GET" and "resourceslices" in p]
        assert lists and all("fieldSelector=spec.nodeName%3Dgpu-node-1" in p for p in lists)

        kube.delete("resourceslices", "nv-1")
        kubeobjects.wait_for(lambda: all("draConflict" not in c for c in inventory(kube)),
                             what="the conflict gone from the inventory")
        assert metrics(agent)[("gpushard_agent_dra_conflicts", (("node", NODE),))] == 0
    finally:
        agent.stop()


@pytest.mark.parametrize("status", [403, 404])
def test_no_right_or_no_dra_api_reports_nothing(kube, status, caplog):
    caplog.set_level(logging.INFO, logger="webhook.agent.node.otherdrivers")
    kube.put("resourceslices", resource_slice("nv-1", "gpu.nvidia.com"))
    kube.fail_next = [status, status]
    watcher = otherdrivers.Watcher(kube.api_client(), NODE, lambda: CARDS)
    assert watcher.check_once() == [] and watcher.check_once() == [] and not watcher.checked
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1
    if status == 403:
        assert "the agent's ClusterRole needs list on resourceslices" in said[0]
    assert watcher.check_once() == [otherdrivers.Conflict("gpu.nvidia.com", ("nv-1",), 1, ())]


def test_gpushard_s_own_slice_is_no_conflict():
    """Backend dra publishes gpushard's own slice naming the node's cards; it must not report itself
    (break: drop the own-driver check in conflicting.conflicts and this fails)."""
    own = resource_slice("mine", names.DRA_DRIVER, uuids=("GPU-aaaa", "GPU-bbbb"))
    assert otherdrivers.conflicts([own], NODE, CARDS) == []
