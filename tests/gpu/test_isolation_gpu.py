"""On a machine with an NVIDIA GPU (marked gpu; each test skips where what it needs cannot load):

We test:
- the agent's MPS mode on the real card: the supervisor starts the card's control daemon with the card
  exclusive-process, and restores the earlier compute mode when it stops;
- two MPS clients (plain processes using the CUDA driver API through ctypes) with the env the card-k
  plugin hands containers of 25 and 40 shares: each allocates within its cap and fails past it, while a
  client of the same daemon without a cap allocates that same larger size, so the cap is what stops it;
- what the agent publishes about the driver: its version and whether its NVML exports the memory-limit
  call that the container toolkit's hook needs (the hook itself acts at container creation, which a
  test outside a container runtime cannot play).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from webhook.agent import health, isolation, mps, nvml

pytestmark = pytest.mark.gpu

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


def open_nvml() -> nvml.NvmlDevices:
    try:
        return nvml.NvmlDevices()
    except nvml.NvmlUnavailable as exc:
        pytest.skip(f"NVML cannot load here: {exc}")


def whole_card(devices: nvml.NvmlDevices) -> nvml.Card:
    cards = [c for c in devices.cards() if not devices.mig_enabled(c.uuid)]
    if not cards:
        pytest.skip("no card outside MIG mode")
    return cards[0]


@pytest.fixture
def devices():
    found = open_nvml()
    yield found
    found.close()


def client(env: dict[str, str], *sizes_mib: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CLIENT, *map(str, sizes_mib)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_mps_caps_hold_on_the_real_card(devices, tmp_path):
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        pytest.skip(f"libcuda.so.1 cannot load here: {exc}")
    if shutil.which(mps.CONTROL) is None:
        pytest.skip(f"{mps.CONTROL} is not on PATH")
    card = whole_card(devices)
    before = devices.compute_mode(card.uuid)
    root = isolation.MpsRoot(str(tmp_path / "mps"))
    board = health.Board([card])
    supervisor = mps.Supervisor(devices, [card], board, root, interval=1.0)
    supervisor.start()
    try:
        problem = supervisor.states()[card.index].get("problem")
        if problem and "compute mode" in problem:
            pytest.skip(f"cannot run MPS here: {problem}")
        assert problem is None, problem
        assert devices.compute_mode(card.uuid) == nvml.COMPUTE_EXCLUSIVE_PROCESS
        assert board.snapshot().healthy == {card.index: True}

        base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        # Outside a container the client reaches the daemon at the host folder the plugin would mount.
        base.update({"CUDA_VISIBLE_DEVICES": card.uuid, "CUDA_MPS_PIPE_DIRECTORY": root.pipe_dir(card)})
        results, caps = {}, {}
        for shares in (25, 40):
            given = isolation.answer(card, shares, SPC, "mps", root)
            cap = isolation.memory_cap_mib(shares, card.memory_mib, SPC)
            caps[shares] = cap
            env = dict(base, **{k: v for k, v in given.envs.items() if k != "CUDA_MPS_PIPE_DIRECTORY"})
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={cap}M"
            results[shares] = client(env, cap // 2, cap + 1024)
        # The same daemon, no cap: the larger size fits the card, so only the cap refused it above.
        uncapped = client(base, caps[40] + 1024)
        print(f"card {card.index} {card.model} {card.memory_mib} MiB; caps {caps}; clients {results}; "
              f"uncapped {uncapped}")
        for shares, out in results.items():
            assert (out["init"], out["device"], out["context"]) == (0, 0, 0), out
            assert out["alloc"][str(caps[shares] // 2)] == CUDA_SUCCESS, out
            assert out["alloc"][str(caps[shares] + 1024)] == CUDA_ERROR_OUT_OF_MEMORY, out
        assert uncapped["alloc"][str(caps[40] + 1024)] == CUDA_SUCCESS, uncapped
        assert supervisor.daemons[card.index].command("get_server_list").strip()  # the clients went through MPS
    finally:
        supervisor.stop()
    deadline = time.monotonic() + 10
    while devices.compute_mode(card.uuid) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert devices.compute_mode(card.uuid) == before


def test_driver_facts_the_inventory_publishes(devices):
    card = whole_card(devices)
    version = devices.driver_version()
    assert version and version[0].isdigit(), version
    exported = hasattr(ctypes.CDLL("libnvidia-ml.so.1"), nvml.MEMORY_LIMITS_SYMBOL)
    assert devices.memory_limits_supported() is exported
    print(f"driver {version}; card {card.index} {card.model}; {nvml.MEMORY_LIMITS_SYMBOL} exported: {exported}")
