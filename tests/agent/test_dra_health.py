"""We test the DRA health stream of the agent with backend dra, with the kubelet's side played from our copy of
the published dra-health proto over the plugin's real socket, the local API server, a stand-in PodResources and
the fake NVML backend behind the agent:
- NodeWatchResources on the DRA plugin's socket streams both cards Healthy at once, each named by the pool and
  device name the node's ResourceSlice publishes, with a timeout and the time it was determined;
- an Xid on card 1 turns card 1 Unhealthy with NVML's reason at once and leaves card 0 Healthy; card 1 leaves
  the slice but stays in the stream (a claim prepared on it still holds it); recovery turns it Healthy;
- the stream keeps sending the full list, well within the timeout, while nothing changes;
- a client that hangs up is cleaned up (its stream ends on the agent's side), the next one starts afresh, and
  streams past the cap are refused rather than left to hold the plugin's workers;
- stopping the agent ends the stream with status OK;
- the plugin advertises dra-health v1 and v1alpha1 among its supported versions, so a 1.37 kubelet opens v1
  (it opens nothing a plugin does not advertise), and both names stream the same health. (Under backend dra
  gpushard.io/gpu is a count in the Node's status, with no IDs to mark: this stream is all a card's health
  reaches the kubelet by.)
"""

import os
import time

import grpc
import pytest

from tests.agent import drakubelet, fakekubelet, fakepodresources
from tests.polling import eventually
from webhook.agent import running
from webhook.agent.dra import backend
from webhook.agent.node import nvml, podresources
from webhook.core import draobjects
from webhook.core import policy as policy_mod

NODE = "node-a"
CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559), nvml.Card(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3",
                                                                          81559)]
RESEND = 0.3
BOTH_HEALTHY = {(NODE, "card-0"): "HEALTHY", (NODE, "card-1"): "HEALTHY"}



@pytest.fixture
def make_world(api, plugin_dir, kubelet):
    made = []

    def make():
        root = fakekubelet.short_tempdir("gsh-")
        folders = backend.Folders(os.path.join(root, "reg"), os.path.join(root, "plugins"),
                                     os.path.join(root, "cdi"))
        lister = fakepodresources.FakePodResources(os.path.join(root, "pr.sock")).start()
        devices = nvml.FakeDevices(CARDS)
        client = api.api_client()
        agent = running.Agent(
            devices, policy_mod.Policy(backend=policy_mod.DRA, shares_per_card=4), plugin_dir, poll=0.05, tick=0.1,
            register_timeout=2, pod_resources=podresources.Client(lister.path), holders_refresh=0.2,
            backend=lambda a: backend.DraBackend(client, NODE, a.devices, a.cards, a.board, a.policy, folders,
                                                 poll=0.05, health_resend=RESEND, cordoned=a.cordoned))
        agent.start()
        peer = drakubelet.DraKubelet()
        eventually(lambda: os.path.exists(agent.backend.plugin.registration_path), "the registration socket")
        peer.register(agent.backend.plugin.registration_path)
        made.append((agent, lister, root))
        return agent, devices, peer, lister

    yield make
    for agent, lister, root in made:
        agent.stop()
        lister.stop()
        fakekubelet.remove_tree(root)


@pytest.fixture
def world(make_world):
    return make_world()


def slice_names(api):
    try:
        obj = api.get("resourceslices", draobjects.slice_name(NODE))
    except KeyError:
        return None
    return {(obj["spec"]["pool"]["name"], d["name"]) for d in obj["spec"]["devices"]}


def next_message(stream, after, want, timeout=10.0):
    """The first message from number ``after`` on whose health reads ``want``, and its number."""
    deadline = time.monotonic() + timeout
    number = after
    while True:
        message = stream.message(number, timeout=max(0.1, deadline - time.monotonic()))
        if drakubelet.health_by_device(message) == want:
            return number, message
        number += 1


def test_the_stream_names_both_cards_as_the_slice_does(api, world):
    _agent, _devices, peer, _lister = world
    stream = peer.watch_health()
    try:
        first = stream.message(0)
        assert drakubelet.health_by_device(first) == BOTH_HEALTHY
        eventually(lambda: slice_names(api) == set(BOTH_HEALTHY), "both cards in the slice")
        for device in first.devices:
            assert device.health_check_timeout_seconds == 30
            assert abs(device.last_updated_time - time.time()) < 60
            assert device.message == ""
    finally:
        stream.close()


def test_an_xid_turns_its_card_unhealthy_and_the_stream_goes_on(api, world):
    _agent, devices, peer, _lister = world
    stream = peer.watch_health()
    try:
        assert drakubelet.health_by_device(stream.message(0)) == BOTH_HEALTHY
        seen = len(stream.messages)
        devices.inject(nvml.HealthEvent("GPU-bbbb", healthy=False, reason="critical Xid 79"))
        number, message = next_message(stream, seen, {(NODE, "card-0"): "HEALTHY", (NODE, "card-1"): "UNHEALTHY"})
        [card1] = [d for d in message.devices if d.device.device_name == "card-1"]
        assert card1.message == "gpushard: card 1 (GPU-bbbb) is Unhealthy: critical Xid 79"
        # Out of the slice, so no new claim lands on it, and still reported for the claims that hold it.
        eventually(lambda: slice_names(api) == {(NODE, "card-0")}, "card 1 leave the slice")

        # Nothing changes: the same list keeps coming, each well within the 30 s timeout.
        later = stream.message(number + 3, timeout=10 * RESEND + 5)
        assert drakubelet.health_by_device(later) == drakubelet.health_by_device(message)
        times = [t for t, _ in stream.messages[number:number + 4]]
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 3

        devices.inject(nvml.HealthEvent("GPU-bbbb", healthy=True))
        _, back = next_message(stream, number + 4, BOTH_HEALTHY)
        assert all(d.message == "" for d in back.devices)
        assert not stream.ended.is_set()
    finally:
        stream.close()


def test_a_client_that_hangs_up_is_cleaned_up(world):
    agent, _devices, peer, _lister = world
    health = agent.backend.health
    first = peer.watch_health()
    first.message(0)
    assert health.streams == 1
    first.close()
    eventually(lambda: health.streams == 0, "the agent end the stream of a client that hung up", timeout=5)

    again, other = peer.watch_health(), peer.watch_health()
    try:
        assert drakubelet.health_by_device(again.message(0)) == BOTH_HEALTHY
        other.message(0)
        assert health.streams == 2
        # Past the cap: refused at once, where it would otherwise hold one of the plugin's workers for good.
        refused = peer.watch_health()
        assert refused.ended.wait(5)
        assert refused.error is not None and refused.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The plugin still prepares claims meanwhile: a claim it does not know is answered, with an error.
        answer = peer.prepare(("team-a", "uid-none", "none")).claims["uid-none"]
        assert answer.error
    finally:
        again.close()
        other.close()
    eventually(lambda: health.streams == 0, "every stream ended", timeout=5)


def test_stopping_the_agent_ends_the_stream_ok(make_world):
    agent, _devices, peer, _lister = make_world()
    stream = peer.watch_health()
    stream.message(0)
    started = time.monotonic()
    agent.backend.plugin.stop()
    assert stream.ended.wait(5)
    assert time.monotonic() - started < 3
    assert stream.error is None, stream.error
    assert stream.call.code() == grpc.StatusCode.OK


def test_a_137_kubelet_negotiates_v1_and_v1alpha1_still_answers(api, world):
    _agent, _devices, peer, _lister = world
    assert peer.health_service() == "v1.DRAResourceHealth"
    assert {"v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"} <= set(peer.versions)
    for service in ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"):
        stream = peer.watch_health(service)
        try:
            assert drakubelet.health_by_device(stream.message(0)) == BOTH_HEALTHY
        finally:
            stream.close()
