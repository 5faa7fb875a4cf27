"""We test that a card another device plugin handed to a running container is not offered
(webhook/agent/node/otherplugins.py),
over real gRPC: the agent's device plugins to a fake kubelet, its PodResources reads from a fake PodResources server:
- a container of NVIDIA's nvidia.com/gpu holding replicas of card 1 (``<uuid>::<n>``, time-slicing), or card 1
  whole (its UUID, or its index with NVIDIA's ``DEVICE_ID_STRATEGY=index``: ``1``, ``1::2``), makes card 1's
  plugin list nothing, as a cordon does; card 0 stays offered; gpushard's own
  resources never count; device IDs that name no card of the node are ignored;
- when the last such container ends, card 1 is offered again; a pod that held card 1's shares before keeps its
  answer (Allocate still names its card);
- every card concerned says so in the Node's inventory (``heldBy``: the resource and its pods), in the log once
  per change, and in the metric gpushard_agent_cards_held_by_other_plugins; `gpushard status` prints a line;
- a PodResources server that fails keeps what was last read: nothing is withheld before a first answer.
"""

from __future__ import annotations

import logging
import os

import grpc
import pytest

from tests.agent import fakekubelet, fakepodresources
from tests.polling import eventually
from webhook import settings
from webhook.agent import running
from webhook.agent.metrics import exporting
from webhook.agent.node import nvml, otherplugins, podresources, publishing
from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.agent.proto import podresources_pb2 as prpb
from webhook.auditing import held_cards, node_lines
from webhook.core import auditing, names

CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559), nvml.Card(1, "GPU-bbbb", "NVIDIA L4", 22491)]
SHARES = 4
POLICY = settings.from_mapping({"sharesPerCard": SHARES}).policy


def pod(name: str, *containers: prpb.ContainerResources, namespace: str = "ml") -> prpb.PodResources:
    return prpb.PodResources(name=name, namespace=namespace, containers=list(containers))


def nvidia(*ids: str) -> prpb.ContainerResources:
    return fakepodresources.container("cuda", **{"nvidia.com/gpu": list(ids)})


def test_held_names_the_cards_of_other_resources_only():
    response = prpb.ListPodResourcesResponse(pod_resources=[
        pod("seed-a", nvidia("GPU-bbbb::3", "GPU-bbbb::17")),
        pod("seed-b", nvidia("GPU-bbbb")),
        pod("ours", fakepodresources.gpu_container("main", 0, 0, 2)),
        pod("elsewhere", nvidia("GPU-not-on-this-node::1"), fakepodresources.container(
            "nic", **{"example.com/nic": ["0000:3b:00.0"]})),
    ])
    assert otherplugins.held(response, POLICY, CARDS) == {1: {"nvidia.com/gpu": ["ml/seed-a", "ml/seed-b"]}}


def test_held_reads_nvidias_index_device_ids_too():
    response = prpb.ListPodResourcesResponse(pod_resources=[
        pod("by-index", nvidia("1::2", "1::5")), pod("whole", nvidia("0")), pod("absent", nvidia("7::1", "7"))])
    assert otherplugins.held(response, POLICY, CARDS) == {0: {"nvidia.com/gpu": ["ml/whole"]},
                                                     1: {"nvidia.com/gpu": ["ml/by-index"]}}


@pytest.fixture
def pod_resources():
    directory = fakekubelet.short_tempdir()
    server = fakepodresources.FakePodResources(os.path.join(directory, "kubelet.sock")).start()
    yield server
    server.stop()
    fakekubelet.remove_tree(directory)


@pytest.fixture
def agent(plugin_dir, kubelet, pod_resources):
    made = running.Agent(nvml.FakeDevices(CARDS), POLICY, plugin_dir, poll=0.05, tick=0.2, register_timeout=2,
                         pod_resources=podresources.Client(pod_resources.path), foreign_interval=0.1)
    made.start()
    yield made
    made.stop()


def latest(stream: fakekubelet.Stream) -> dict[str, str] | None:
    with stream._cond:
        return fakekubelet.health_by_id(stream.messages[-1]) if stream.messages else None


def ids(card: int) -> dict[str, str]:
    return {f"card-{card}-{s}": "Healthy" for s in range(SHARES)}


def test_a_card_held_by_nvidias_pods_is_withheld_until_they_end(agent, kubelet, plugin_dir, pod_resources, caplog):
    kubelet.wait_for({"gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-1"})
    with caplog.at_level(logging.INFO, logger="webhook.agent.node.otherplugins"), \
            fakekubelet.PluginClient(plugin_dir, "gpushard-io-card-1.sock") as c1, \
            fakekubelet.PluginClient(plugin_dir, "gpushard-io-card-0.sock") as c0:
        card1, card0 = fakekubelet.Stream(c1), fakekubelet.Stream(c0)
        eventually(lambda: latest(card1) == ids(1), "card 1 offered while nothing holds it")
        # A gpushard pod got card 1's shares before; then NVIDIA's plugin's pods show (a node being moved).
        pod_resources.set([pod("seed-a", nvidia("GPU-bbbb::3", "GPU-bbbb::17")), pod("seed-b", nvidia("GPU-bbbb"))])
        eventually(lambda: latest(card1) == {}, "card 1 withdrawn")
        assert latest(card0) == ids(0)
        assert agent.cordoned() == frozenset({1}) and agent.operator_cordoned() == frozenset()
        answer = c1.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=["card-1-0"])]), timeout=5)
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbbb"
        details = agent.inventory_details()["cards"]
        assert details[1]["heldBy"] == {"nvidia.com/gpu": ["ml/seed-a", "ml/seed-b"]}
        assert "heldBy" not in details[0]
        pod_resources.set([pod("seed-b", nvidia("GPU-bbbb"))])
        # The agent has read the new list (the card's holders are what it names); it still withholds the card.
        eventually(lambda: agent.inventory_details()["cards"][1].get("heldBy") == {"nvidia.com/gpu": ["ml/seed-b"]},
                   "the agent read one holder left")
        assert agent.cordoned() == frozenset({1})
        assert latest(card1) == {}, "one holder left: still withheld"
        pod_resources.set([])
        eventually(lambda: latest(card1) == ids(1), "card 1 offered again")
        for stream in (card1, card0):
            stream.cancel()
    said = [r.getMessage() for r in caplog.records if r.name == "webhook.agent.node.otherplugins"]
    assert said[0].startswith("gpushard: card 1 is held by pods of another device plugin (nvidia.com/gpu: ml/seed-a,")
    assert said[-1].startswith("gpushard: card 1 is no longer held")
    assert len(said) == 3, said  # two holders, then one, then none: one line each


def test_a_failing_pod_resources_server_keeps_the_last_answer(pod_resources):
    client = podresources.Client(pod_resources.path)
    watcher = otherplugins.Watcher(client.list, POLICY, CARDS)
    pod_resources.fail = grpc.StatusCode.UNAVAILABLE
    assert watcher.check() is False and watcher.withheld == frozenset()
    pod_resources.fail = None
    pod_resources.set([pod("seed", nvidia("GPU-aaaa::1"))])
    assert watcher.check() is True and watcher.withheld == frozenset({0})
    pod_resources.fail = grpc.StatusCode.UNAVAILABLE
    assert watcher.check() is False and watcher.withheld == frozenset({0})
    client.close()


def test_the_metric_counts_the_withheld_cards():
    class Held:
        withheld = frozenset({1})
    obs = exporting.Observer("node-a", CARDS, nvml.FakeDevices(CARDS), None, POLICY, lambda: [],
                             exporting.attributing.ProcReader("/proc"), None, withheld=Held()).observe()
    values = {m.name: s.value for m in exporting.families(obs) for s in m.samples
              if m.name == "gpushard_agent_cards_held_by_other_plugins"}
    assert values == {"gpushard_agent_cards_held_by_other_plugins": 1}


def test_status_says_which_card_is_held_and_by_whom():
    details = {"cards": {0: {}, 1: {"heldBy": {"nvidia.com/gpu": ["ml/seed-a", "ml/seed-b"]}}}}
    patch = publishing.node_patch(CARDS, details)
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-1", **patch["metadata"]}}
    assert auditing.held_by_others(node) == [
        'gpushard: card 1 of node "gpu-1" is held by pods of another device plugin: nvidia.com/gpu (ml/seed-a, '
        "ml/seed-b); its shares are not offered to new pods until those end"]
    lines = node_lines([], held_cards([node]))
    assert lines == ('node: card 1 of node "gpu-1" is held by pods of another device plugin: nvidia.com/gpu '
                     "(ml/seed-a, ml/seed-b); its shares are not offered to new pods until those end\n")
    assert held_cards([node], picked={"other"}) == []
    assert names.INVENTORY_ANNOTATION in patch["metadata"]["annotations"]
