"""On a machine with an NVIDIA GPU (marked gpu; a test skips only for what the machine lacks, as
tests/gpu/machine.py decides: NVML or a driver, a card outside MIG mode, root's right to set the compute
mode, libcuda, the MPS control binary; anything else fails):

We test:
- the agent's MPS mode on the real card, through what a kubelet sees: `gpushard agent` (isolation: mps)
  registers its card-k resource with a fake kubelet over a unix socket, every share Healthy in
  ListAndWatch with the card exclusive-process and its control daemon running; Allocate over real
  gRPC answers, for containers of
  25 and 40 shares, the card's UUID, the pipe folder's mount and the caps; two MPS clients (plain
  processes using the CUDA driver API through ctypes) with that env, reaching the daemon at the mount's
  host folder, each allocate within their cap and fail past it, while a client of the same daemon
  without a cap allocates that same larger size, so the cap is what stops it; the daemon lists the
  clients' server; on SIGTERM the agent exits 0 and the card's compute mode is what it was;
- what the agent publishes about the driver: its version and whether its NVML exports the memory-limit
  call that the container toolkit's hook needs (the hook itself acts at container creation, which a
  test outside a container runtime cannot play).
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.agent import fakekubelet
from tests.gpu import machine
from webhook.agent.node import allocation, mps, nvml
from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.core import isolation, names

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPC = 100
MIB = 1 << 20

CLIENT = r"""
import ctypes, json, sys
cuda = ctypes.CDLL("libcuda.so.1")
out = {"init": cuda.cuInit(0)}
dev = ctypes.c_int()
out["device"] = cuda.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p()
if hasattr(cuda, "cuCtxCreate_v2"):
    out["context"] = cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
else:
    out["context"] = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) or cuda.cuCtxSetCurrent(ctx)
out["alloc"] = {}
for mib in map(int, sys.argv[1:]):
    ptr = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20))
    out["alloc"][str(mib)] = rc
    if rc == 0:
        cuda.cuMemFree_v2(ptr)
print(json.dumps(out))
"""
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


def needs(check, *args):
    """The check's answer; a skip, with what is missing, where the machine lacks it."""
    try:
        return check(*args)
    except machine.Lacking as exc:
        pytest.skip(str(exc))


@pytest.fixture
def devices():
    found = needs(machine.open_nvml)
    yield found
    found.close()


def client(env: dict[str, str], *sizes_mib: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CLIENT, *map(str, sizes_mib)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def allocate(plugin_dir: str, endpoint: str, card: nvml.Card, shares: int) -> pb.ContainerAllocateResponse:
    ids = [allocation.device_id(card.index, s) for s in range(shares)]
    with fakekubelet.PluginClient(plugin_dir, endpoint) as c:
        response = c.stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=30)
    (answer,) = response.container_responses
    return answer


def host_pipe(answer: pb.ContainerAllocateResponse) -> str:
    """Outside a container, the client reaches the daemon where the plugin's mount comes from."""
    pipe = answer.envs[names.MPS_PIPE_DIRECTORY_ENV]
    (mount,) = [m for m in answer.mounts if m.container_path == pipe]
    return mount.host_path


def test_mps_caps_hold_on_the_real_card_through_allocate(devices, tmp_path):
    needs(machine.cuda_and_mps)
    card = needs(machine.whole_card, devices)
    needs(machine.may_set_compute_mode, devices, card)
    before = devices.compute_mode(card.uuid)
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nsharesPerCard: {SPC}\nisolation: mps\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG") and
           not k.startswith("CUDA_MPS_")}
    plugin_dir = fakekubelet.short_tempdir()
    kubelet = fakekubelet.FakeKubelet(plugin_dir).start()
    # The agent's log goes to a file: a pipe nobody reads while the clients run could fill and stall it.
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        agent = subprocess.Popen([sys.executable, "-m", "webhook.cli", "agent", "--config", str(config),
                                  "--device-plugin-dir", plugin_dir, "--no-publish", "--poll-interval", "0.5",
                                  "--mps-root", str(tmp_path / "mps")],
                                 cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        resource = f"gpushard.io/card-{card.index}"
        try:
            requests = kubelet.wait_for({resource}, timeout=60)
        except AssertionError:
            raise AssertionError(f"the agent did not register {resource}: {log.read_text()}") from None
        endpoint = requests[resource].endpoint
        # What the kubelet would allocate from: every share of the card Healthy, so its daemon runs.
        with fakekubelet.PluginClient(plugin_dir, endpoint) as c:
            stream = fakekubelet.Stream(c)
            health = fakekubelet.health_by_id(stream.message(0, timeout=30))
            stream.cancel()
        assert len(health) == SPC and set(health.values()) == {"Healthy"}, (health, log.read_text())
        assert devices.compute_mode(card.uuid) == nvml.COMPUTE_EXCLUSIVE_PROCESS
        base = {k: v for k, v in env.items() if k not in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")}
        # Outside a container the toolkit does not hide the other cards: CUDA_VISIBLE_DEVICES does.
        base[names.CUDA_VISIBLE_DEVICES_ENV] = card.uuid
        results, caps, pipes = {}, {}, set()
        for shares in (25, 40):
            answer = allocate(plugin_dir, endpoint, card, shares)
            cap = isolation.memory_cap_mib(shares, card.memory_mib, SPC)
            caps[shares] = cap
            given = dict(answer.envs)
            assert given[names.VISIBLE_DEVICES_ENV] == card.uuid
            assert given["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(shares)
            assert given["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={cap}M"
            pipes.add(host_pipe(answer))
            client_env = dict(base, **{k: v for k, v in given.items() if k != names.VISIBLE_DEVICES_ENV})
            client_env[names.MPS_PIPE_DIRECTORY_ENV] = host_pipe(answer)
            results[shares] = client(client_env, cap // 2, cap + 1024)
        (pipe,) = pipes
        # The same daemon, no cap: the larger size fits the card, so only the cap refused it above.
        uncapped = client(dict(base, CUDA_MPS_PIPE_DIRECTORY=pipe), caps[40] + 1024)
        print(f"card {card.index} {card.model} {card.memory_mib} MiB; caps {caps}; clients {results}; "
              f"uncapped {uncapped}")
        for shares, out in results.items():
            assert (out["init"], out["device"], out["context"]) == (0, 0, 0), out
            assert out["alloc"][str(caps[shares] // 2)] == CUDA_SUCCESS, out
            assert out["alloc"][str(caps[shares] + 1024)] == CUDA_ERROR_OUT_OF_MEMORY, out
        assert uncapped["alloc"][str(caps[40] + 1024)] == CUDA_SUCCESS, uncapped
        servers = subprocess.run([mps.CONTROL], input="get_server_list\n", capture_output=True, text=True,
                                 env=dict(env, CUDA_MPS_PIPE_DIRECTORY=pipe), timeout=30)
        assert servers.stdout.strip(), servers  # the clients went through MPS
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0, log.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kubelet.stop()
        fakekubelet.remove_tree(plugin_dir)
    deadline = time.monotonic() + 10
    while devices.compute_mode(card.uuid) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert devices.compute_mode(card.uuid) == before


def test_driver_facts_the_inventory_publishes(devices):
    card = needs(machine.whole_card, devices)
    version = devices.driver_version()
    assert version and version[0].isdigit(), version
    exported = hasattr(ctypes.CDLL("libnvidia-ml.so.1"), nvml.MEMORY_LIMITS_SYMBOL)
    assert devices.memory_limits_supported() is exported
    print(f"driver {version}; card {card.index} {card.model}; {nvml.MEMORY_LIMITS_SYMBOL} exported: {exported}")
