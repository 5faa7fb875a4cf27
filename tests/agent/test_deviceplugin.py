"""We test, over real gRPC on real unix sockets, with a fake kubelet:
- the agent serves first, then registers every resource with version v1beta1, its socket name and options
  (the fake kubelet dials each plugin as it registers, and refuses one that does not answer yet);
- every RPC as the kubelet calls it: options, ListAndWatch, GetPreferredAllocation, Allocate, PreStartContainer;
- Allocate's env and device-list mount for each card, nothing for the shares resource, INVALID_ARGUMENT for a
  foreign ID;
- a health change (and its recovery) arriving on open ListAndWatch streams, and only where it matters;
- a kubelet restart (sockets wiped, new kubelet.sock): served and registered again within seconds;
- a kubelet that starts after the agent, a recreated kubelet.sock, a stale socket from an earlier run;
- shutdown: streams end with status OK and our sockets are removed.
"""

import os
import time

import grpc
import pytest

from tests.agent import fakekubelet
from webhook import settings
from webhook.agent import running
from webhook.agent.deviceplugin import registration as agent_kubelet
from webhook.agent.node import nvml
from webhook.agent.proto import deviceplugin_pb2 as pb

CARDS = [nvml.Card(0, "GPU-11111111-aaaa", "NVIDIA H100 80GB HBM3", 81559),
         nvml.Card(1, "GPU-22222222-bbbb", "NVIDIA H100 80GB HBM3", 81559)]
SHARES = 4
NAMES = {"gpushard.io/gpu": "gpushard-io-gpu.sock",
         "gpushard.io/card-0": "gpushard-io-card-0.sock",
         "gpushard.io/card-1": "gpushard-io-card-1.sock"}


@pytest.fixture
def devices():
    return nvml.FakeDevices(CARDS)


def make_agent(directory, devices, tick=0.2):
    policy = settings.from_mapping({"sharesPerCard": SHARES}).policy
    return running.Agent(devices, policy, directory, poll=0.05, tick=tick, register_timeout=2)


@pytest.fixture
def agent(plugin_dir, devices, kubelet):
    agent = make_agent(plugin_dir, devices)
    agent.start()
    yield agent
    agent.stop()


def client(plugin_dir, resource):
    return fakekubelet.PluginClient(plugin_dir, NAMES[resource])


def test_every_resource_registers_with_version_endpoint_and_options(agent, kubelet, plugin_dir):
    requests = kubelet.wait_for(set(NAMES))
    for name, endpoint in NAMES.items():
        request = requests[name]
        assert request.version == "v1beta1"
        assert request.endpoint == endpoint
        assert not os.path.isabs(request.endpoint)
        assert request.options.get_preferred_allocation_available is True
        assert request.options.pre_start_required is False
        # Served before registering: the fake kubelet dialled it while registering, and it still answers.
        with fakekubelet.PluginClient(plugin_dir, endpoint) as c:
            assert c.stub.GetDevicePluginOptions(pb.Empty(), timeout=2) == request.options


def test_the_fake_kubelet_refuses_a_plugin_that_is_not_serving(kubelet):
    # Without this, the serve-before-register checks above could never fail.
    with pytest.raises(grpc.RpcError) as err:
        agent_kubelet.register(kubelet.path, "nobody-here.sock", "gpushard.io/gpu", timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "nobody-here.sock" in err.value.details()
    assert [r.endpoint for r, _ in kubelet.refused] == ["nobody-here.sock"]
    with pytest.raises(AssertionError, match="gpushard.io/gpu registered while not serving"):
        kubelet.wait_for({"gpushard.io/gpu"}, timeout=1)


def test_list_and_watch_sends_each_resource_s_shares(agent, kubelet, plugin_dir):
    kubelet.wait_for(set(NAMES))
    expected = {
        # The node-wide resource's IDs name no card: the kubelet hands them out without knowing the container's.
        "gpushard.io/gpu": {f"share-{n}" for n in range(2 * SHARES)},
        "gpushard.io/card-0": {f"card-0-{s}" for s in range(SHARES)},
        "gpushard.io/card-1": {f"card-1-{s}" for s in range(SHARES)},
    }
    for resource, ids in expected.items():
        with client(plugin_dir, resource) as c:
            stream = fakekubelet.Stream(c)
            first = stream.message(0)
            assert fakekubelet.health_by_id(first) == {i: "Healthy" for i in ids}
            assert all(len(d.ID) <= 63 for d in first.devices)
            stream.cancel()


def test_allocate_pins_each_card_by_uuid(agent, kubelet, plugin_dir):
    kubelet.wait_for(set(NAMES))
    for card in CARDS:
        with client(plugin_dir, f"gpushard.io/card-{card.index}") as c:
            request = pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[f"card-{card.index}-0", f"card-{card.index}-1"]),
                pb.ContainerAllocateRequest(devices_ids=[f"card-{card.index}-3"]),
            ])
            response = c.stub.Allocate(request, timeout=2)
            assert len(response.container_responses) == 2
            for container in response.container_responses:
                # The default device-list strategy: envvar and volume-mounts (test_device_lists.py).
                assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": card.uuid}
                assert [(m.host_path, m.container_path, m.read_only) for m in container.mounts] == [
                    ("/dev/null", f"/var/run/nvidia-container-devices/{card.uuid}", True)]
                assert not container.devices and not container.cdi_devices


def test_allocate_of_the_shares_resource_leaves_the_card_env_alone(agent, kubelet, plugin_dir):
    kubelet.wait_for(set(NAMES))
    with client(plugin_dir, "gpushard.io/gpu") as c:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["card-1-2"])])
        response = c.stub.Allocate(request, timeout=2)
    assert len(response.container_responses) == 1
    assert response.container_responses[0] == pb.ContainerAllocateResponse()


def test_allocate_refuses_a_share_of_another_card(agent, kubelet, plugin_dir):
    kubelet.wait_for(set(NAMES))
    with client(plugin_dir, "gpushard.io/card-0") as c:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["card-1-0"])])
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Allocate(request, timeout=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "card-1-0" in err.value.details()


def test_preferred_allocation_and_prestart(agent, kubelet, plugin_dir):
    kubelet.wait_for(set(NAMES))
    with client(plugin_dir, "gpushard.io/card-1") as c:
        request = pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=["card-1-3", "card-1-1", "card-1-2"],
                                                   must_include_deviceIDs=["card-1-3"], allocation_size=2)])
        response = c.stub.GetPreferredAllocation(request, timeout=2)
        assert [list(r.deviceIDs) for r in response.container_responses] == [["card-1-3", "card-1-1"]]
        prestart = c.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["card-1-1"]), timeout=2)
        assert prestart == pb.PreStartContainerResponse()


def test_health_changes_arrive_on_open_streams(agent, kubelet, plugin_dir, devices):
    kubelet.wait_for(set(NAMES))
    with client(plugin_dir, "gpushard.io/gpu") as g, client(plugin_dir, "gpushard.io/card-1") as c1, \
            client(plugin_dir, "gpushard.io/card-0") as c0:
        total, card1, card0 = fakekubelet.Stream(g), fakekubelet.Stream(c1), fakekubelet.Stream(c0)
        for stream in (total, card1, card0):
            stream.message(0)

        devices.inject(nvml.HealthEvent(CARDS[1].uuid, healthy=False, reason="Xid 79"))
        assert set(fakekubelet.health_by_id(card1.message(1)).values()) == {"Unhealthy"}
        health = fakekubelet.health_by_id(total.message(1))
        assert sum(1 for h in health.values() if h == "Healthy") == SHARES
        # No pod holds any: the lowest IDs stay Healthy, the others count the card that went.
        assert {i for i, h in health.items() if h == "Unhealthy"} == {f"share-{n}" for n in range(SHARES, 2 * SHARES)}

        # Card 0's stream sent nothing for card 1: its next message is card 0's own change.
        devices.inject(nvml.HealthEvent(CARDS[0].uuid, healthy=False, present=False, reason="gone"))
        assert set(fakekubelet.health_by_id(card0.message(1)).values()) == {"Unhealthy"}
        assert set(fakekubelet.health_by_id(total.message(2)).values()) == {"Unhealthy"}

        devices.inject(nvml.HealthEvent(CARDS[1].uuid, healthy=True))
        assert set(fakekubelet.health_by_id(card1.message(2)).values()) == {"Healthy"}
        health = fakekubelet.health_by_id(total.message(3))
        assert {i for i, h in health.items() if h == "Healthy"} == {f"share-{n}" for n in range(SHARES)}
        assert len(card0.messages) == 2
        for stream in (total, card1, card0):
            stream.cancel()


def test_kubelet_restart_serves_and_registers_again(agent, kubelet, plugin_dir):
    kubelet.wait_for(set(NAMES))
    with client(plugin_dir, "gpushard.io/card-0") as c:
        old_stream = fakekubelet.Stream(c)
        old_stream.message(0)
        fresh = fakekubelet.restart_kubelet(kubelet)
        try:
            started = time.monotonic()
            requests = fresh.wait_for(set(NAMES), timeout=5)
            assert time.monotonic() - started < 5
            assert {r.endpoint for r in requests.values()} == set(NAMES.values())
            for endpoint in NAMES.values():
                with fakekubelet.PluginClient(plugin_dir, endpoint) as again:
                    assert again.stub.GetDevicePluginOptions(pb.Empty(), timeout=2).get_preferred_allocation_available
                    first = fakekubelet.Stream(again).message(0)
                    assert first.devices
            # The old server was stopped: its stream ended instead of hanging on.
            assert old_stream.ended.wait(5)
        finally:
            fresh.stop()


def test_recreated_kubelet_socket_alone_triggers_registration(agent, kubelet, plugin_dir):
    kubelet.wait_for(set(NAMES))
    kubelet.stop()
    # A real kubelet takes seconds to come back; without a pause the new socket could reuse
    # the old one's inode and change time on a coarse clock, which no poll can tell apart.
    time.sleep(0.05)  # the stimulus, not a wait
    fresh = fakekubelet.FakeKubelet(plugin_dir).start()
    try:
        fresh.wait_for(set(NAMES), timeout=5)
    finally:
        fresh.stop()


def test_agent_started_before_the_kubelet_registers_when_it_comes(plugin_dir, devices):
    agent = make_agent(plugin_dir, devices)
    agent.start()
    try:
        for endpoint in NAMES.values():
            assert os.path.exists(os.path.join(plugin_dir, endpoint))
        time.sleep(0.2)  # the stimulus, not a wait: the agent polls (every 0.05 s) a while before the kubelet comes
        late = fakekubelet.FakeKubelet(plugin_dir).start()
        try:
            late.wait_for(set(NAMES), timeout=5)
        finally:
            late.stop()
    finally:
        agent.stop()


def test_a_stale_socket_file_is_replaced(plugin_dir, devices, kubelet):
    stale = os.path.join(plugin_dir, NAMES["gpushard.io/card-0"])
    with open(stale, "w") as f:
        f.write("left over")
    agent = make_agent(plugin_dir, devices)
    agent.start()
    try:
        kubelet.wait_for(set(NAMES))
        with client(plugin_dir, "gpushard.io/card-0") as c:
            assert c.stub.GetDevicePluginOptions(pb.Empty(), timeout=2).get_preferred_allocation_available
    finally:
        agent.stop()


def test_stop_ends_streams_cleanly_and_removes_sockets(plugin_dir, devices, kubelet):
    # A long tick: the streams must end because they are told to, not because a timer ran out.
    agent = make_agent(plugin_dir, devices, tick=30)
    agent.start()
    kubelet.wait_for(set(NAMES))
    with client(plugin_dir, "gpushard.io/gpu") as c:
        stream = fakekubelet.Stream(c)
        stream.message(0)
        started = time.monotonic()
        agent.stop()
        assert stream.ended.wait(5)
        assert time.monotonic() - started < 3
        assert stream.error is None, stream.error
        assert stream.call.code() == grpc.StatusCode.OK
    assert sorted(os.listdir(plugin_dir)) == ["kubelet.sock"]
