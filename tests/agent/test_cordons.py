"""We test the agent's side of a card's cordon, against the local API server (tests/fakekube.py) holding its
Node and a fake kubelet (tests/agent/fakekubelet.py) reading its device plugins over real gRPC:
- with gpushard.io/card-1.cordoned on its Node, the card-1 plugin's ListAndWatch lists no device (withdrawn,
  never Unhealthy), card 0's and the node-wide gpushard.io/gpu's lists are as before, and Allocate still
  answers for an ID a pod was given before the cordon;
- the cordon added, lifted and added again by watch reaches the open streams each time, the card's IDs
  coming back Healthy on uncordon; a watch whose history expired (410) lists again and still follows;
- the agent only reads its Node for this: no request writes the cordon annotation;
- an API server that fails at first leaves the cards offered, and the cordon lands once it answers;
- with backend dra the cordoned card leaves the ResourceSlice and comes back on uncordon, while a claim
  allocated on it before is still prepared;
- the metrics say which cards are cordoned (gpushard_card_cordoned per card, gpushard_agent_cordoned_cards).
"""

from __future__ import annotations

import os
import threading

import pytest

from tests.agent import drakubelet, draworld, fakekubelet
from tests.polling import eventually
from webhook import settings
from webhook.agent import running
from webhook.agent.dra import backend
from webhook.agent.metrics import exporting
from webhook.agent.node import cordonwatching, nvml
from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.core import draobjects, names, objects
from webhook.core import policy as policy_mod

NODE = "gpu-node-1"
CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559), nvml.Card(1, "GPU-bbbb", "NVIDIA L4", 22491)]
SHARES = 4
KEY = names.card_cordon_annotation(1)


def node(cordons: dict[int, str] | None = None) -> dict:
    annotations = {"keep": "me", **{names.card_cordon_annotation(k): objects.write_cordon(objects.Cordon(why, "alice"))
                                    for k, why in (cordons or {}).items()}}
    return {"metadata": {"name": NODE, "labels": {names.HOSTNAME_LABEL: NODE}, "annotations": annotations}}



def watcher(api, **options):
    options.setdefault("watch_timeout", 5)
    options.setdefault("backoff", (0.05, 0.2))
    return lambda: cordonwatching.Watcher(api.api_client(), NODE, **options)


@pytest.fixture
def agent(api, plugin_dir, kubelet):
    api.put("nodes", node({1: "fan replaced"}))
    policy = settings.from_mapping({"sharesPerCard": SHARES}).policy
    agent = running.Agent(nvml.FakeDevices(CARDS), policy, plugin_dir, poll=0.05, tick=0.2, register_timeout=2,
                          cordons=watcher(api))
    agent.start()
    yield agent
    agent.stop()


def latest(stream: fakekubelet.Stream) -> dict[str, str]:
    with stream._cond:
        return fakekubelet.health_by_id(stream.messages[-1]) if stream.messages else None


def settles(stream: fakekubelet.Stream, wanted: dict[str, str], what: str) -> None:
    eventually(lambda: latest(stream) == wanted, what)


def ids(card: int, health: str = "Healthy") -> dict[str, str]:
    return {f"card-{card}-{s}": health for s in range(SHARES)}


def node_wide(health: str = "Healthy") -> dict[str, str]:
    """The node-wide resource's IDs, which name no card (docs/agent.md): a cordon leaves them all."""
    return {f"share-{n}": health for n in range(len(CARDS) * SHARES)}


def test_the_cordoned_card_s_shares_are_withdrawn_and_come_back(api, agent, kubelet, plugin_dir):
    kubelet.wait_for({"gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-1"})
    with fakekubelet.PluginClient(plugin_dir, "gpushard-io-card-1.sock") as c1, \
            fakekubelet.PluginClient(plugin_dir, "gpushard-io-card-0.sock") as c0, \
            fakekubelet.PluginClient(plugin_dir, "gpushard-io-gpu.sock") as everything:
        card1, card0, total = fakekubelet.Stream(c1), fakekubelet.Stream(c0), fakekubelet.Stream(everything)
        settles(card1, {}, "card 1 withdrawn")
        settles(card0, ids(0), "card 0 as before")
        settles(total, node_wide(), "every share in the node-wide resource")
        # A pod given card 1's IDs before the cordon still gets its card when the kubelet asks again.
        answer = c1.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=["card-1-0"])]), timeout=5)
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbbb"

        api.put("nodes", node())  # uncordoned
        settles(card1, ids(1), "card 1 offered again")
        api.expire_history()  # the next watch must list again
        api.drop_watches()
        api.put("nodes", node({1: "again"}))
        settles(card1, {}, "card 1 withdrawn again")
        for stream in (card1, card0, total):
            with stream._cond:
                seen = [d.health for m in stream.messages for d in m.devices]
            assert "Unhealthy" not in seen  # a cordon is no health change
        assert latest(card0) == ids(0) and latest(total) == node_wide()
        for stream in (card1, card0, total):
            stream.cancel()
    assert agent.cordoned() == frozenset({1})
    # The agent only read its Node for this: no write carried the cordon.
    assert not [body for method, _path, body in api.requests if method != "GET" and b".cordoned" in body]
    assert api.get("nodes", NODE)["metadata"]["annotations"][KEY]  # still the operator's


def test_an_api_server_that_fails_at_first_leaves_the_cards_offered(api):
    api.put("nodes", node({0: "xid"}))
    api.fail_next = [500, 500, 503]
    seen = []
    follow = watcher(api)()
    follow.on_change = lambda: seen.append(follow.cordoned)
    assert follow.cordoned == frozenset()  # not read yet: nothing withdrawn
    stop = threading.Event()
    thread = threading.Thread(target=follow.run, args=(stop,), daemon=True)
    thread.start()
    try:
        eventually(lambda: follow.cordoned == frozenset({0}), "the cordon once the API answers")
        api.put("nodes", node({0: "xid", 1: "fan"}))
        eventually(lambda: follow.cordoned == frozenset({0, 1}), "the second cordon by watch")
        assert follow.cordons()[1] == objects.Cordon("fan", "alice")
        api.delete("nodes", NODE)
        eventually(lambda: follow.cordoned == frozenset(), "no cordon once the Node is gone")
    finally:
        stop.set()
        follow.close()
        thread.join(timeout=5)
    assert not thread.is_alive()
    assert seen == [frozenset({0}), frozenset({0, 1}), frozenset()]


# --- backend dra --------------------------------------------------------------------------------------

@pytest.fixture
def dra_world(api, plugin_dir, kubelet):
    root = fakekubelet.short_tempdir("gsc-")
    folders = backend.Folders(os.path.join(root, "reg"), os.path.join(root, "plugins"), os.path.join(root, "cdi"))
    client = api.api_client()
    policy = policy_mod.Policy(backend=policy_mod.DRA, isolation="memory")
    agent = running.Agent(nvml.FakeDevices(CARDS), policy, plugin_dir, poll=0.05, tick=0.2, register_timeout=2,
                          backend=lambda a: backend.DraBackend(client, NODE, a.devices, a.cards, a.board, a.policy,
                                                               folders, poll=0.05, cordoned=a.cordoned),
                          cordons=watcher(api))
    agent.start()
    yield agent, folders
    agent.stop()
    fakekubelet.remove_tree(root)


def slice_devices(api):
    try:
        obj = api.get("resourceslices", draobjects.slice_name(NODE))
    except KeyError:
        return None
    return [d["name"] for d in obj["spec"]["devices"]]


def test_with_backend_dra_the_cordoned_card_leaves_the_slice(api, dra_world):
    agent, folders = dra_world
    api.put("nodes", node())
    eventually(lambda: slice_devices(api) == ["card-0", "card-1"], "both cards published")
    api.put("resourceclaims", draworld.reserved(draworld.claim("team-a", "c", "uid-1", NODE, "card-1", 50), "p",
                                                "pod-1"))
    api.put("pods", draworld.holder("team-a", "p", "pod-1", 50))
    api.put("nodes", node({1: "fan replaced"}))
    eventually(lambda: slice_devices(api) == ["card-0"], "the cordoned card leave the slice")
    # A claim allocated on it before the cordon is still prepared: its pod keeps the card.
    peer = drakubelet.DraKubelet()
    eventually(lambda: os.path.exists(agent.backend.plugin.registration_path), "the registration socket")
    peer.register(agent.backend.plugin.registration_path)
    entry = peer.prepare(("team-a", "uid-1", "c")).claims["uid-1"]
    assert entry.error == "" and list(entry.devices[0].cdi_device_ids)[0] == "nvidia.com/gpu=GPU-bbbb"
    api.put("nodes", node())
    eventually(lambda: slice_devices(api) == ["card-0", "card-1"], "the card come back on uncordon")


# --- metrics --------------------------------------------------------------------------------------------

def test_the_metrics_say_which_cards_are_cordoned():
    rows = [exporting.CardRow(CARDS[0], True, True, None), exporting.CardRow(CARDS[1], True, True, None, cordoned=True)]
    text = exporting.text(exporting.new_registry(lambda: exporting.Observation(NODE, 100, rows, True)))
    lines = [line for line in text.splitlines() if "cordoned" in line and not line.startswith("#")]
    assert f'gpushard_card_cordoned{{UUID="GPU-aaaa",gpu="0",modelName="NVIDIA H100 80GB HBM3",node="{NODE}"}} 0.0' \
        in lines
    assert f'gpushard_card_cordoned{{UUID="GPU-bbbb",gpu="1",modelName="NVIDIA L4",node="{NODE}"}} 1.0' in lines
    assert f'gpushard_agent_cordoned_cards{{node="{NODE}"}} 1.0' in lines
    # The observer reads the agent's cordons on every scrape.
    observer = exporting.Observer(NODE, CARDS, nvml.FakeDevices(CARDS), None, policy_mod.Policy(), lambda: [],
                                  None, None, cordoned=lambda: frozenset({0}))
    assert [r.cordoned for r in observer.observe().cards] == [True, False]
