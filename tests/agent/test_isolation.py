"""We test each container's limits at Allocate:
- as plain data per mode: none gives nothing; memory gives the toolkit hook's limit and request in MiB from
  that card's own memory (mixed card models on one node each get their own figure); mps gives the pipe
  folder, thread percentage and pinned-memory limit with the pipe and shm mounts; a card of unknown memory
  gets no cap, never a cap of 0;
- the count of device IDs is the container's shares, and the aggregate resource answers nothing;
- over real gRPC with a fake kubelet: the card-k plugin answers env and mounts per container, next to its
  card's UUID, in memory mode and in mps mode (with a stand-in MPS daemon running), and the inventory says
  what each card gives;
- memory mode sets the plural NVIDIA_GPU_MEMORY_LIMITS/_REQUESTS beside the singular names, so an image
  that sets the plurals cannot raise its cap under either revision of the toolkit's memory hook
  (tests/agent/toolkit.py: the kubelet's merge and each revision's reading).
"""

import json
import os

import pytest

from tests.agent import fakekubelet, mpsstandin, toolkit
from webhook import settings
from webhook.agent import running
from webhook.agent.node import allocation, containerlimits, nvml
from webhook.agent.proto import deviceplugin_pb2 as pb

H100 = nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559)
L4 = nvml.Card(1, "GPU-bbbb", "NVIDIA L4", 22491)
ROOT = containerlimits.MpsRoot("/run/gpushard/mps")


def test_none_gives_nothing():
    assert containerlimits.answer(H100, 25, 100, "none") == allocation.Allocation()


@pytest.mark.parametrize("card, shares, cap", [(H100, 25, "20389"), (H100, 100, "81559"), (L4, 25, "5622"),
                                               (L4, 1, "224")])
def test_memory_mode_caps_each_card_by_its_own_memory(card, shares, cap):
    got = containerlimits.answer(card, shares, 100, "memory")
    assert got == allocation.Allocation({"NVIDIA_GPU_MEMORY_LIMIT": cap, "NVIDIA_GPU_MEMORY_REQUEST": cap,
                                         "NVIDIA_GPU_MEMORY_LIMITS": cap, "NVIDIA_GPU_MEMORY_REQUESTS": cap})


def test_mps_mode_gives_pipe_limits_and_mounts():
    got = containerlimits.answer(L4, 30, 100, "mps", ROOT)
    assert got.envs == {"CUDA_MPS_PIPE_DIRECTORY": "/run/gpushard/mps/pipe",
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6747M"}
    assert got.mounts == (
        allocation.Mount(host_path="/run/gpushard/mps/GPU-bbbb/pipe", container_path="/run/gpushard/mps/pipe"),
        allocation.Mount(host_path="/run/gpushard/mps/shm", container_path="/dev/shm"))


def test_a_card_of_unknown_memory_gets_no_cap():
    card = nvml.Card(0, "GPU-x", "fake", 0)
    assert containerlimits.answer(card, 50, 100, "memory") == allocation.Allocation()
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in containerlimits.answer(card, 50, 100, "mps").envs


def test_the_count_of_ids_is_the_shares_and_the_aggregate_answers_nothing():
    policy = settings.from_mapping({"isolation": "memory"}).policy
    gpu, card0, card1 = allocation.resources([H100, L4], policy)
    limits = containerlimits.Limits("memory", 100, ROOT)
    ids = [allocation.device_id(1, s) for s in range(40)]
    assert limits.for_request(card1, ids, [H100, L4]).envs["NVIDIA_GPU_MEMORY_LIMIT"] == "8996"
    assert limits.for_request(gpu, ids, [H100, L4]) == allocation.Allocation()


def allocate(plugin_dir, endpoint, *containers):
    with fakekubelet.PluginClient(plugin_dir, endpoint) as c:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)
                                                         for ids in containers])
        return c.stub.Allocate(request, timeout=5).container_responses


def start(plugin_dir, mode, devices, **options):
    policy = settings.from_mapping({"sharesPerCard": 8, "isolation": mode}).policy
    agent = running.Agent(devices, policy, plugin_dir, poll=0.05, tick=0.2, register_timeout=2, **options)
    agent.start()
    return agent


def test_memory_mode_over_grpc(plugin_dir, kubelet):
    agent = start(plugin_dir, "memory", nvml.FakeDevices([H100, L4], memory_limits=True))
    try:
        kubelet.wait_for({"gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-1"})
        one, three = allocate(plugin_dir, "gpushard-io-card-1.sock", ["card-1-0"], ["card-1-1", "card-1-2", "card-1-5"])
        assert dict(one.envs) == {"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb", "NVIDIA_GPU_MEMORY_LIMIT": "2811",
                                  "NVIDIA_GPU_MEMORY_REQUEST": "2811", "NVIDIA_GPU_MEMORY_LIMITS": "2811",
                                  "NVIDIA_GPU_MEMORY_REQUESTS": "2811"}
        assert dict(three.envs)["NVIDIA_GPU_MEMORY_LIMIT"] == str(3 * 22491 // 8)
        (h100,) = allocate(plugin_dir, "gpushard-io-card-0.sock", ["card-0-0", "card-0-1"])
        assert dict(h100.envs)["NVIDIA_GPU_MEMORY_LIMIT"] == str(2 * 81559 // 8)
        (aggregate,) = allocate(plugin_dir, "gpushard-io-gpu.sock", ["card-0-3"])
        assert dict(aggregate.envs) == {} and not aggregate.mounts
        assert agent.inventory_details()["cards"][1] == {
            "isolation": {"mode": "memory", "driver": "fake", "memoryLimits": True}}
    finally:
        agent.stop()


def test_the_webhook_removes_every_limit_name_the_plugin_sets_from_an_authors_env():
    # Any name the card-k plugin hands the runtime, plural names included, is one an author may not write.
    from webhook.core import isolation as core_isolation

    given = {*containerlimits.answer(H100, 25, 100, "memory").envs,
             *containerlimits.answer(H100, 25, 100, "mps", ROOT).envs}
    assert {"NVIDIA_GPU_MEMORY_LIMITS", "NVIDIA_GPU_MEMORY_REQUESTS"} <= given
    assert all(core_isolation.guarded(name) for name in given)


GREEDY_IMAGE_ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_GPU_MEMORY_LIMITS": "81559",
                    "NVIDIA_GPU_MEMORY_REQUESTS": "81559"}


@pytest.mark.parametrize("revision", toolkit.HOOK_REVISIONS)
def test_an_images_plural_limits_do_not_win_under_any_hook_revision(plugin_dir, kubelet, revision):
    agent = start(plugin_dir, "memory", nvml.FakeDevices([H100, L4], memory_limits=True))
    try:
        kubelet.wait_for({"gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-1"})
        answers = [*allocate(plugin_dir, "gpushard-io-gpu.sock", ["card-0-3"]),
                   *allocate(plugin_dir, "gpushard-io-card-1.sock", ["card-1-0", "card-1-1"])]
        # The image's env comes first, the plugin's after it: the runtime keeps the last value of a name.
        c = toolkit.container(answers, image_env=GREEDY_IMAGE_ENV)
        cap = 2 * 22491 // 8
        assert toolkit.memory_limits(c, revision) == (cap, cap)
    finally:
        agent.stop()


def test_mps_mode_over_grpc_with_a_running_daemon(plugin_dir, kubelet, tmp_path, monkeypatch):
    bin_dir, log = mpsstandin.install(tmp_path / "standin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("MPS_STANDIN_LOG", str(log))
    root = str(tmp_path / "mps")
    devices = nvml.FakeDevices([H100, L4])
    agent = start(plugin_dir, "mps", devices, mps_root=root, mps_options={"interval": 0.1})
    try:
        kubelet.wait_for({"gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-1"})
        (two,) = allocate(plugin_dir, "gpushard-io-card-0.sock", ["card-0-0", "card-0-1"])
        assert dict(two.envs) == {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa",
                                  "CUDA_MPS_PIPE_DIRECTORY": "/run/gpushard/mps/pipe",
                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={2 * 81559 // 8}M"}
        assert [(m.host_path, m.container_path, m.read_only) for m in two.mounts] == [
            ("/dev/null", "/var/run/nvidia-container-devices/GPU-aaaa", True),  # the default strategy's
            (os.path.join(root, "GPU-aaaa", "pipe"), "/run/gpushard/mps/pipe", False),
            (os.path.join(root, "shm"), "/dev/shm", False)]
        assert [c["gpu"] for c in mpsstandin.calls(log) if c["call"] == "-f"] == ["GPU-aaaa", "GPU-bbbb"]
        details = agent.inventory_details()["cards"]
        assert details[0]["isolation"]["mps"] == {"running": True}
        json.dumps(details)  # goes into the Node's annotation as it is
    finally:
        agent.stop()
    assert devices.compute_modes == {"GPU-aaaa": nvml.COMPUTE_DEFAULT, "GPU-bbbb": nvml.COMPUTE_DEFAULT}
    assert [c["call"] for c in mpsstandin.calls(log)].count("quit") == 2
