"""We test the agent with backend dra, as `gpushard agent` runs it (a fake kubelet for device plugins, the
kubelet's DRA side from the published protos, the local API server):
- no device plugin registers: the quota-able sum gpushard.io/gpu (cards x shares) is in the Node's status,
  written by merge patch of nodes/status beside what the kubelet keeps there, and written again when the
  kubelet zeroes it (as it does once for a device plugin of that name that went away) or it goes; a card
  that turns Unhealthy leaves the slice but not the count;
- the node's ResourceSlice lists its cards, loses a card that turns Unhealthy and gets it back on recovery;
- the kubelet registers the DRA plugin and prepares a claim allocated on a card, with the card's memory cap;
- a claim allocated before its card turned Unhealthy can still be prepared.
"""

import os

import pytest

from tests.agent import drakubelet, draworld, fakekubelet
from tests.polling import eventually
from webhook.agent import running
from webhook.agent.dra import backend, nodecount
from webhook.agent.node import cordonwatching, nvml
from webhook.core import draobjects, names
from webhook.core import policy as policy_mod

NODE = "node-a"
CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559), nvml.Card(1, "GPU-bbbb", "NVIDIA L4", 22491)]
# What a kubelet writes into its Node's status, which the agent's count must leave as it is.
KUBELET_STATUS = {"capacity": {"cpu": "16", "memory": "131900000Ki", "pods": "110"},
                  "allocatable": {"cpu": "15800m", "memory": "129800000Ki", "pods": "110"},
                  "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}



@pytest.fixture
def world(api, plugin_dir, kubelet):
    root = fakekubelet.short_tempdir("gsb-")
    folders = backend.Folders(os.path.join(root, "reg"), os.path.join(root, "plugins"), os.path.join(root, "cdi"))
    devices = nvml.FakeDevices(CARDS)
    policy = policy_mod.Policy(backend=policy_mod.DRA, isolation="memory")
    client = api.api_client()
    api.put("nodes", {"metadata": {"name": NODE}, "status": KUBELET_STATUS})
    agent = running.Agent(devices, policy, plugin_dir, poll=0.05, tick=0.2, register_timeout=2,
                          backend=lambda a: backend.DraBackend(
                              client, NODE, a.devices, a.cards, a.board, a.policy, folders, poll=0.05,
                              cordoned=a.cordoned,
                              count=lambda name, shares: nodecount.Keeper(client, NODE, name, shares,
                                                                          retry=(0.05, 0.2))),
                          cordons=lambda: cordonwatching.Watcher(client, NODE, watch_timeout=5, backoff=(0.05, 0.2)))
    agent.start()
    yield agent, devices, folders
    agent.stop()
    fakekubelet.remove_tree(root)


def slice_devices(api):
    try:
        obj = api.get("resourceslices", draobjects.slice_name(NODE))
    except KeyError:
        return None
    return [d["name"] for d in obj["spec"]["devices"]]


def counted(api) -> tuple[object, object]:
    return nodecount.advertised(api.get("nodes", NODE), names.SHARES_RESOURCE)


def test_the_sum_is_in_the_node_status_and_no_device_plugin_registers(api, world, kubelet, plugin_dir):
    agent, devices, _folders = world
    whole = str(len(CARDS) * policy_mod.Policy().shares_per_card)
    eventually(lambda: counted(api) == (whole, whole), "the count in the Node's status")
    eventually(lambda: agent.backend.count.writes == 1, "the agent count its write")
    status = api.get("nodes", NODE)["status"]
    # Beside what the kubelet keeps there, untouched.
    assert status["conditions"] == KUBELET_STATUS["conditions"]
    assert {k: v for k, v in status["capacity"].items() if k != names.SHARES_RESOURCE} == KUBELET_STATUS["capacity"]
    # Only the DRA plugin's sockets are served, and nothing in the device-plugin folder.
    assert [s.path for s in agent.backend.sockets()] == [s.path for s in agent.backend.plugin.sockets()]
    assert set(os.listdir(plugin_dir)) <= {"kubelet.sock"}
    # The kubelet zeroes a device-plugin resource once after its plugin went: the agent writes it back.
    capacity = {**status["capacity"], names.SHARES_RESOURCE: "0"}
    api.put("nodes", {"metadata": {"name": NODE}, "status": {**status, "capacity": capacity,
                                                              "allocatable": capacity}})
    eventually(lambda: counted(api) == (whole, whole), "the count written again")
    eventually(lambda: agent.backend.count.writes == 2, "the agent count its second write")  # after the answer
    # A card that turns Unhealthy leaves the slice, not the count (pods on it still hold their part of it).
    devices.inject(nvml.HealthEvent("GPU-bbbb", healthy=False, reason="Xid 79"))
    eventually(lambda: slice_devices(api) == ["card-0"], "the Unhealthy card leave the slice")
    assert counted(api) == (whole, whole)
    # Nothing ever registered with the kubelet, and no plugin socket is served.
    assert kubelet.requests == []
    assert [n for n in os.listdir(plugin_dir) if n.endswith(".sock")] == ["kubelet.sock"]


def test_the_slice_follows_health(api, world):
    _agent, devices, _folders = world
    eventually(lambda: slice_devices(api) == ["card-0", "card-1"], "both cards published")
    devices.inject(nvml.HealthEvent("GPU-bbbb", healthy=False, reason="Xid 79"))
    eventually(lambda: slice_devices(api) == ["card-0"], "the Unhealthy card leave the slice")
    devices.inject(nvml.HealthEvent("GPU-bbbb", healthy=True))
    eventually(lambda: slice_devices(api) == ["card-0", "card-1"], "the card come back")
    assert api.get("resourceslices", draobjects.slice_name(NODE))["spec"]["pool"]["generation"] == 2


def test_the_kubelet_prepares_a_claim_through_the_agent(api, world):
    agent, devices, folders = world
    peer = drakubelet.DraKubelet()
    eventually(lambda: os.path.exists(agent.backend.plugin.registration_path), "the registration socket")
    peer.register(agent.backend.plugin.registration_path)
    api.put("resourceclaims", draworld.reserved(draworld.claim("team-a", "c", "uid-1", NODE, "card-1", 50), "p",
                                                "pod-1"))
    api.put("pods", draworld.holder("team-a", "p", "pod-1", 20, 30))
    devices.inject(nvml.HealthEvent("GPU-bbbb", healthy=False, reason="Xid 79"))  # after allocation
    eventually(lambda: slice_devices(api) == ["card-0"], "the Unhealthy card leave the slice")
    entry = peer.prepare(("team-a", "uid-1", "c")).claims["uid-1"]
    assert entry.error == ""
    assert list(entry.devices[0].cdi_device_ids) == ["nvidia.com/gpu=GPU-bbbb", "gpushard.io/claim=uid-1-card-1"]
    with open(os.path.join(folders.cdi, "gpushard.io-claim_uid-1.json")) as spec:
        assert f"NVIDIA_GPU_MEMORY_LIMIT={22491 // 2}" in spec.read()
