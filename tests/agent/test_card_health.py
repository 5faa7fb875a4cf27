"""We test a card's health as it reaches the kubelet's device manager, which marks each container by the health
of the device IDs it holds (allocatedResourcesStatus), over real gRPC on real unix sockets: a fake kubelet that
admits pods as the kubelet may (IDs of the node-wide gpushard.io/gpu from anywhere in its Healthy list), a
stand-in PodResources that lists what each container holds, and the fake NVML backend behind the agent:
- an Xid on card 1 turns exactly card 1's IDs Unhealthy in gpushard.io/card-1's ListAndWatch, sends nothing on
  gpushard.io/card-0's, and leaves every ID a card-0 pod holds Healthy in both resources, in every message,
  while the gpushard.io/gpu IDs a card-1 pod holds turn Unhealthy;
- gpushard.io/gpu keeps sharesPerCard x healthy cards Healthy, and lists every ID a pod holds the whole time;
- recovery turns them all Healthy again;
- a card-1 pod that leaves gives its IDs back: they are Healthy again for the next pod, the count unchanged;
- an ID the kubelet chose just before the list marked it Unhealthy is listed Healthy once allocated;
- without PodResources (no socket), no ID any pod holds of gpushard.io/gpu is marked, and card 1's resource
  still is;
- `gpushard agent` on the real pynvml backend (a fake libnvidia-ml.so.1) and a PodResources socket: a critical
  Xid on card 1 reaches both resources the same way.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.agent import fakekubelet, fakepodresources
from webhook import settings
from webhook.agent import running
from webhook.agent.node import nvml, podresources
from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.agent.proto import podresources_pb2 as prpb

ROOT = pathlib.Path(__file__).resolve().parents[2]
CARDS = [nvml.Card(0, "GPU-11111111-aaaa", "NVIDIA H100 80GB HBM3", 81559),
         nvml.Card(1, "GPU-22222222-bbbb", "NVIDIA H100 80GB HBM3", 81559)]
SHARES = 4
SUM = "gpushard.io/gpu"
ENDPOINTS = {SUM: "gpushard-io-gpu.sock", "gpushard.io/card-0": "gpushard-io-card-0.sock",
             "gpushard.io/card-1": "gpushard-io-card-1.sock"}


class Node:
    """The kubelet's side of the agent's device plugins: a ListAndWatch stream per resource, Allocate as pods are
    admitted, and what each container holds as PodResources lists it."""

    def __init__(self, plugin_dir, kubelet, lister):
        kubelet.wait_for(set(ENDPOINTS))
        self.lister = lister
        self.clients = {r: fakekubelet.PluginClient(plugin_dir, e) for r, e in ENDPOINTS.items()}
        self.streams = {r: fakekubelet.Stream(c) for r, c in self.clients.items()}
        for stream in self.streams.values():
            stream.message(0)
        self.pods: dict[str, dict[str, list[str]]] = {}

    def latest(self, resource):
        return fakekubelet.health_by_id(self.streams[resource].messages[-1])

    def admit(self, pod, card, shares, highest=False):
        """A pod of one container holding ``shares`` of ``card``; its gpushard.io/gpu IDs are the lowest (or the
        highest) the list offers Healthy and no one holds, as the kubelet may pick them."""
        resource = f"gpushard.io/card-{card}"
        taken = {i for held in self.pods.values() for ids in held.values() for i in ids}
        own = [i for i, h in self.latest(resource).items() if h == "Healthy" and i not in taken][:shares]
        offered = [i for i, h in self.latest(SUM).items() if h == "Healthy" and i not in taken]
        total = offered[-shares:] if highest else offered[:shares]
        for name, ids in ((resource, own), (SUM, total)):
            self.clients[name].stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=5)
        self.pods[pod] = {resource: own, SUM: total}
        self.publish()
        return own, total

    def leave(self, pod):
        del self.pods[pod]
        self.publish()

    def publish(self):
        if self.lister is not None:
            self.lister.set([prpb.PodResources(name=pod, namespace="team-a", containers=[
                fakepodresources.container("c", **held)]) for pod, held in self.pods.items()])

    def close(self):
        for stream in self.streams.values():
            stream.cancel()
        for client in self.clients.values():
            client.close()


def wait_for(stream, first, check, timeout=10.0):
    """Messages from number ``first`` on, until one passes ``check``; all of them, that one last."""
    seen, number, deadline = [], first, time.monotonic() + timeout
    while True:
        message = fakekubelet.health_by_id(stream.message(number, timeout=max(0.1, deadline - time.monotonic())))
        seen.append(message)
        if check(message):
            return seen
        number += 1


@pytest.fixture
def lister():
    root = fakekubelet.short_tempdir("gsc-")
    server = fakepodresources.FakePodResources(os.path.join(root, "pr.sock")).start()
    yield server
    server.stop()
    fakekubelet.remove_tree(root)


@pytest.fixture
def devices():
    return nvml.FakeDevices(CARDS)


def make_agent(plugin_dir, devices, socket):
    policy = settings.from_mapping({"sharesPerCard": SHARES}).policy
    return running.Agent(devices, policy, plugin_dir, poll=0.05, tick=0.1, register_timeout=2,
                         pod_resources=podresources.Client(socket, timeout=2), holders_refresh=0.2)


@pytest.fixture
def node(plugin_dir, kubelet, devices, lister):
    agent = make_agent(plugin_dir, devices, lister.path)
    agent.start()
    peer = Node(plugin_dir, kubelet, lister)
    yield peer
    peer.close()
    agent.stop()


def healthy(message):
    return {i for i, h in message.items() if h == "Healthy"}


def test_an_xid_marks_card_1_and_never_a_card_0_pod(node, devices):
    one_own, one_total = node.admit("on-one", 1, 2)
    zero_own, zero_total = node.admit("on-zero", 0, 2, highest=True)
    assert not set(one_total) & set(zero_total)
    sent = {r: len(s.messages) for r, s in node.streams.items()}

    devices.inject(nvml.HealthEvent(CARDS[1].uuid, healthy=False, reason="critical Xid 79"))
    card1 = wait_for(node.streams["gpushard.io/card-1"], sent["gpushard.io/card-1"],
                     lambda m: set(m.values()) == {"Unhealthy"})
    assert set(card1[-1]) == {f"card-1-{s}" for s in range(SHARES)}
    total = wait_for(node.streams[SUM], sent[SUM], lambda m: {m[i] for i in one_total} == {"Unhealthy"})
    for message in total:
        # Never, not even for one message, does a card-0 pod's ID read Unhealthy.
        assert {message[i] for i in zero_total} == {"Healthy"}
        assert set(one_total) | set(zero_total) <= set(message)
    assert len(healthy(total[-1])) == SHARES
    # Card 0's resource had nothing to say: its one message, all Healthy, holds the card-0 pod's IDs (that nothing
    # follows it is shown at the end, where card 0's own change must be its next message).
    assert len(node.streams["gpushard.io/card-0"].messages) == 1
    assert set(node.latest("gpushard.io/card-0").values()) == {"Healthy"}
    assert set(zero_own) <= set(node.latest("gpushard.io/card-0"))

    sent = {r: len(s.messages) for r, s in node.streams.items()}
    devices.inject(nvml.HealthEvent(CARDS[1].uuid, healthy=True))
    wait_for(node.streams["gpushard.io/card-1"], sent["gpushard.io/card-1"], lambda m: set(m.values()) == {"Healthy"})
    back = wait_for(node.streams[SUM], sent[SUM], lambda m: set(m.values()) == {"Healthy"})
    assert set(one_total) | set(zero_total) <= set(back[-1]) and len(back[-1]) == 2 * SHARES
    assert set(one_own) <= healthy(node.latest("gpushard.io/card-1"))

    # Card 0's stream sent nothing for card 1's Xid nor its recovery: its next message is card 0's own change.
    devices.inject(nvml.HealthEvent(CARDS[0].uuid, healthy=False, reason="critical Xid 79"))
    second = fakekubelet.health_by_id(node.streams["gpushard.io/card-0"].message(1, timeout=10))
    assert set(second.values()) == {"Unhealthy"}


def test_a_pod_leaving_the_bad_card_gives_its_ids_back(node, devices):
    _, one_total = node.admit("on-one", 1, 2)
    _, zero_total = node.admit("on-zero", 0, 2, highest=True)
    sent = len(node.streams[SUM].messages)
    devices.inject(nvml.HealthEvent(CARDS[1].uuid, healthy=False, reason="critical Xid 79"))
    marked = wait_for(node.streams[SUM], sent, lambda m: {m[i] for i in one_total} == {"Unhealthy"})

    node.leave("on-one")
    freed = wait_for(node.streams[SUM], sent + len(marked), lambda m: set(one_total) <= healthy(m))
    assert len(healthy(freed[-1])) == SHARES
    assert set(zero_total) <= healthy(freed[-1])


def test_an_id_chosen_before_the_list_marked_it_is_listed_healthy(node, devices):
    sent = len(node.streams[SUM].messages)
    devices.inject(nvml.HealthEvent(CARDS[1].uuid, healthy=False, reason="critical Xid 79"))
    shrunk = wait_for(node.streams[SUM], sent, lambda m: len(healthy(m)) == SHARES)[-1]
    late = sorted(set(shrunk) - healthy(shrunk))[0]
    # The kubelet picked it from the list before this one: our Allocate answers it, and the list follows.
    node.clients[SUM].stub.Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[late])]), timeout=5)
    kept = wait_for(node.streams[SUM], sent + 1, lambda m: m.get(late) == "Healthy")
    assert len(healthy(kept[-1])) == SHARES


def test_without_pod_resources_no_held_id_is_marked(plugin_dir, kubelet, devices):
    agent = make_agent(plugin_dir, devices, os.path.join(plugin_dir, "no-such.sock"))
    agent.start()
    peer = Node(plugin_dir, kubelet, None)
    try:
        _, one_total = peer.admit("on-one", 1, 2)
        _, zero_total = peer.admit("on-zero", 0, 2, highest=True)
        sent = {r: len(s.messages) for r, s in peer.streams.items()}
        devices.inject(nvml.HealthEvent(CARDS[1].uuid, healthy=False, reason="critical Xid 79"))
        wait_for(peer.streams["gpushard.io/card-1"], sent["gpushard.io/card-1"],
                 lambda m: set(m.values()) == {"Unhealthy"})
        total = wait_for(peer.streams[SUM], sent[SUM], lambda m: len(healthy(m)) < 2 * SHARES)
        assert set(one_total) | set(zero_total) <= healthy(total[-1])
        assert len(healthy(total[-1])) == SHARES
    finally:
        peer.close()
        agent.stop()



def test_the_agent_on_nvml_marks_card_1_s_pods_only(fake_nvml, plugin_dir, kubelet, lister, tmp_path):
    env, control = fake_nvml
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nsharesPerCard: {SHARES}\n")
    proc = subprocess.Popen([sys.executable, "-m", "webhook.cli", "agent", "--config", str(config),
                             "--device-plugin-dir", plugin_dir, "--no-publish", "--poll-interval", "0.1",
                             "--pod-resources-socket", lister.path],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peer = None
    try:
        peer = Node(plugin_dir, kubelet, lister)
        _, one_total = peer.admit("on-one", 1, 2)
        _, zero_total = peer.admit("on-zero", 0, 2, highest=True)
        sent = {r: len(s.messages) for r, s in peer.streams.items()}
        tmp = control / ".xid-1.tmp"
        tmp.write_text("79")
        tmp.rename(control / "xid-1")
        wait_for(peer.streams["gpushard.io/card-1"], sent["gpushard.io/card-1"],
                 lambda m: set(m.values()) == {"Unhealthy"}, timeout=20)
        total = wait_for(peer.streams[SUM], sent[SUM], lambda m: {m[i] for i in one_total} == {"Unhealthy"},
                         timeout=20)
        assert all({m[i] for i in zero_total} == {"Healthy"} for m in total)
        assert len(healthy(total[-1])) == SHARES
        assert set(peer.latest("gpushard.io/card-0").values()) == {"Healthy"}
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
    finally:
        if peer is not None:
            peer.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
