"""We test the agent's per-container metrics under backend dra, where PodResources names no card and no share
(gpushard.io/gpu is a count in the Node's status, which no device plugin serves): the DRA plugin, prepared
over its real socket by the kubelet's side with claims read from a local API server, says which card each
pod's claim is on, the stand-in PodResources server which containers the kubelet runs, and the node's pods
as the local API server lists them how many shares each container asks:
- each container holding shares gets its series on the card of its pod's claim, and the card's shares
  allocated add them up; a container without shares, and a pod with no claim prepared here, get none;
- the checkpoint keeps the pod a claim is reserved for, so a restarted agent attributes the same;
  a claim prepared before the checkpoint kept its pod (no pod recorded) is left out, not guessed;
- an unprepared claim takes its pod's series with it;
- `gpushard top` reads those series as it does under the device plugin backend.
"""

from __future__ import annotations

import json
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import fakekube
from tests.agent import drakubelet, draworld, fakekubelet, fakepodresources
from webhook import top
from webhook.agent.dra import kubeletplugin
from webhook.agent.metrics import attributing, exporting, podlisting
from webhook.agent.node import health, nvml, podresources
from webhook.core import policy as policy_mod

NODE = "node-a"
CARDS = {i: nvml.Card(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559) for i in range(2)}
POLICY = policy_mod.Policy(backend=policy_mod.DRA)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found, name: str, **labels) -> float | None:
    hits = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) <= 1, f"{name} {labels}: {len(hits)} samples"
    return hits[0] if hits else None


def held(found) -> dict[tuple[str, str, str], float]:
    return {(dict(ls)["pod"], dict(ls)["container"], dict(ls)["gpu"]): v
            for (n, ls), v in found.items() if n == "gpushard_container_shares"}


def running(api, namespace: str, pod: str, **shares: int) -> podresources.pb.PodResources:
    """A pod the scheduler bound here asking ``shares`` per container (its spec, in the API server), as
    PodResources lists it: its containers, with no device of gpushard.io/gpu."""
    obj = draworld.holder(namespace, pod, f"pod-{pod}", *shares.values(), node=NODE)
    for container, name in zip(obj["spec"]["containers"], shares, strict=True):
        container["name"] = name
        if not shares[name]:
            container["resources"] = {}
    api.put("pods", obj)
    return podresources.pb.PodResources(namespace=namespace, name=pod, containers=[
        fakepodresources.container(name) for name in shares])


@pytest.fixture
def world(tmp_path):
    root = fakekubelet.short_tempdir("gdm-")
    checkpoint = os.path.join(root, "plugins", "state", "checkpoint.json")
    api = fakekube.FakeKube().start()
    lister = fakepodresources.FakePodResources(os.path.join(root, "kubelet.sock")).start()
    client = podresources.Client(lister.path, timeout=2)
    plugins = []

    def plugin() -> kubeletplugin.DraPlugin:
        """The agent's DRA plugin (started afresh: a restarted agent), registered with the kubelet's side."""
        for old in plugins:
            old.stop()
        preparer = kubeletplugin.Preparer(NODE, lambda: CARDS, 100, kubeletplugin.api_claim_reader(api.api_client()),
                                      kubeletplugin.Checkpoint(checkpoint), cdi_dir=os.path.join(root, "cdi"))
        started = kubeletplugin.DraPlugin(preparer, os.path.join(root, "reg"), os.path.join(root, "plugins"))
        started.start()
        plugins.append(started)
        peer = drakubelet.DraKubelet()
        peer.register(started.registration_path)
        return started, peer

    pods = podlisting.NodePods(api.api_client(), NODE, policy=POLICY, min_interval=0)

    def scrape(started: kubeletplugin.DraPlugin) -> dict:
        observer = exporting.Observer(NODE, list(CARDS.values()), nvml.FakeDevices(list(CARDS.values())),
                                      health.Board(list(CARDS.values())), POLICY,
                                      lambda: client.holdings(POLICY, started.preparer.cards_by_pod, pods.shares),
                                      attributing.ProcReader(str(tmp_path)), None)
        return exporting.text(exporting.new_registry(observer))

    yield type("World", (), dict(api=api, lister=lister, plugin=plugin, scrape=scrape, checkpoint=checkpoint))
    for started in plugins:
        started.stop()
    client.close()
    lister.stop()
    api.stop()
    fakekubelet.remove_tree(root)


def test_containers_are_attributed_to_their_pods_claim(world):
    world.api.put("resourceclaims", draworld.reserved(
        draworld.claim("ml", "train-gpu", "uid-t", NODE, "card-1", 30), "train", "pod-t"))
    world.api.put("resourceclaims", draworld.reserved(
        draworld.claim("ml", "infer-gpu", "uid-i", NODE, "card-0", 25), "infer", "pod-i"))
    started, kubelet = world.plugin()
    answer = kubelet.prepare(("ml", "uid-t", "train-gpu"), ("ml", "uid-i", "infer-gpu"))
    assert [answer.claims[u].error for u in ("uid-t", "uid-i")] == ["", ""]
    world.lister.set([
        running(world.api, "ml", "train", trainer=20, loader=10, log=0),
        running(world.api, "ml", "infer", server=25),
        # Shares asked without a claim prepared here (the plugin has not been asked yet): no card to put them on.
        running(world.api, "ml", "early", app=10),
    ])

    text = world.scrape(started)
    found = samples(text)
    assert held(found) == {("train", "trainer", "1"): 20, ("train", "loader", "1"): 10,
                           ("infer", "server", "0"): 25}
    assert value(found, "gpushard_container_memory_share_bytes", pod="train", container="trainer") == \
        20 * 81559 * nvml.MIB // 100
    assert value(found, "gpushard_card_shares_allocated", gpu="1") == 30
    assert value(found, "gpushard_card_shares_allocated", gpu="0") == 25

    # What `gpushard top pods` shows of it.
    _cards, pods = top.parse(text)
    assert sorted((p.pod, p.container, p.gpu, p.shares) for p in pods) == [
        ("infer", "server", 0, 25), ("train", "loader", 1, 10), ("train", "trainer", 1, 20)]

    # A restarted agent reads the pods from its checkpoint, without the API server.
    world.api.delete("resourceclaims", "train-gpu", "ml")
    started, kubelet = world.plugin()
    assert held(samples(world.scrape(started)))[("train", "trainer", "1")] == 20

    # Unprepared: the pod's series go.
    assert kubelet.unprepare(("ml", "uid-t", "train-gpu")).claims["uid-t"].error == ""
    assert set(held(samples(world.scrape(started)))) == {("infer", "server", "0")}


def test_a_claim_prepared_without_its_pod_recorded_is_left_out(world):
    # As an agent before this checkpoint field wrote it, and a claim reserved for no single pod.
    os.makedirs(os.path.dirname(world.checkpoint), exist_ok=True)
    with open(world.checkpoint, "w") as out:
        json.dump({"version": kubeletplugin.CHECKPOINT_VERSION, "claims": {"uid-o": {
            "namespace": "ml", "name": "old-gpu", "devices": [{
                "request_names": ["gpu"], "pool_name": NODE, "device_name": "card-0",
                "cdi_device_ids": ["nvidia.com/gpu=GPU-0", "gpushard.io/claim=uid-o-card-0"]}]}}}, out)
    world.api.put("resourceclaims", draworld.claim("ml", "loose-gpu", "uid-l", NODE, "card-1", 10))
    started, kubelet = world.plugin()
    assert kubelet.prepare(("ml", "uid-l", "loose-gpu")).claims["uid-l"].error == ""
    assert started.preparer.cards_by_pod() == {}
    world.lister.set([running(world.api, "ml", "old", app=10)])
    found = samples(world.scrape(started))
    assert held(found) == {}
    assert value(found, "gpushard_card_shares_allocated", gpu="0") == 0
