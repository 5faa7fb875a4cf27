"""We test the real pynvml backend without a GPU, against a fake libnvidia-ml.so.1 built from fakenvml.c:
- discovery: index, UUID, model and memory in MiB for every card;
- Xid events: application Xids are ignored, a critical Xid marks only its card Unhealthy, and it stays so;
- a card that stops answering NVML is lost, and is Healthy again when it answers;
- NVML's "a GPU is lost" from the event set: the cards are probed at once and only the silent one is lost;
  another card's Xid survives that loss and its recovery, while the lost card's own Xid is cleared by it;
- `gpushard agent` on that backend registers every card and pins Allocate to the card's UUID;
- what isolation needs from NVML: driver version, MIG mode, compute mode read and set (and refused),
  and whether the driver exports the memory-limit call;
- `gpushard agent` with isolation mps on that backend and a stand-in MPS binary: the MIG card left out,
  the others exclusive-process while their daemons run and back to their earlier mode after SIGTERM,
  and Allocate's MPS answer.
- usage: memory used and total, utilization (or none where unsupported), the processes with their memory
  (through NVML's ask-for-the-size-first protocol) and their SM utilization since the last scrape (none
  where unsupported, 0 when no sample came), the count of critical Xids, and no entry for a lost card.
The library is loaded by soname, so each check runs in a child process with LD_LIBRARY_PATH set.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tests.agent import fakekubelet, mpsstandin
from webhook.agent.proto import deviceplugin_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = pathlib.Path(__file__).with_name("fakenvml.c")

DRIVER = """
import dataclasses, json, sys
from webhook.agent.node import nvml
devices = nvml.NvmlDevices(probe_interval=float(sys.argv[1]))
print(json.dumps([dataclasses.asdict(c) for c in devices.cards()]), flush=True)
for line in sys.stdin:
    event = devices.wait_event(float(line))
    print(json.dumps(dataclasses.asdict(event) if event else None), flush=True)
devices.close()
"""

USAGE = """
import dataclasses, json, sys
from webhook.agent.node import nvml
devices = nvml.NvmlDevices(probe_interval=60)
for line in sys.stdin:
    if line.strip() == "usage":
        print(json.dumps({u: dataclasses.asdict(x) for u, x in devices.usage().items()}), flush=True)
    else:
        event = devices.wait_event(float(line))
        print(json.dumps(dataclasses.asdict(event) if event else None), flush=True)
devices.close()
"""



def put(control: pathlib.Path, name: str, text: str = "") -> None:
    # Write then rename, so the library never reads half a file.
    tmp = control / f".{name}.tmp"
    tmp.write_text(text)
    tmp.rename(control / name)


class Driver:
    """The backend in a child process: one wait_event per request, answered as a JSON line."""

    def __init__(self, env, probe_interval: float = 0.05):
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(probe_interval)], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.cards = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the backend died: {self.proc.stderr.read()}")
        return json.loads(line)

    def wait_event(self, seconds: float):
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        return self._read()

    def events(self, quiet: float = 0.3, most: int = 8):
        """Every event until none comes for ``quiet`` seconds, as (uuid, healthy, present).

        Stops after ``most``, so that a card flapping between two states fails the test, not hangs it.
        """
        found = []
        while len(found) < most and (event := self.wait_event(quiet)) is not None:
            found.append((event["uuid"], event["healthy"], event["present"]))
        return found

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()


def test_discovery_and_health_through_nvml(fake_nvml):
    env, control = fake_nvml
    put(control, "cards", "2")
    driver = Driver(env)
    try:
        assert driver.cards == [
            {"index": 0, "uuid": "GPU-fake-0000", "model": "Fake GPU 16GB", "memory_mib": 16384},
            {"index": 1, "uuid": "GPU-fake-0001", "model": "Fake GPU 16GB", "memory_mib": 16384},
        ]
        assert driver.wait_event(0.2) is None

        put(control, "xid-0", "13")  # an application's fault: the card is fine
        assert driver.wait_event(0.5) is None
        assert not (control / "xid-0").exists()

        put(control, "xid-0", "79")
        event = driver.wait_event(3)
        assert (event["uuid"], event["healthy"], event["present"]) == ("GPU-fake-0000", False, True)
        assert "79" in event["reason"]

        put(control, "lost-1")
        event = driver.wait_event(3)
        assert (event["uuid"], event["healthy"], event["present"]) == ("GPU-fake-0001", False, False)

        (control / "lost-1").unlink()
        event = driver.wait_event(3)
        assert (event["uuid"], event["healthy"], event["present"]) == ("GPU-fake-0001", True, True)

        # Card 0's Xid is not forgotten while it keeps answering.
        assert driver.wait_event(0.3) is None
    finally:
        driver.close()


def test_a_lost_card_leaves_another_card_s_xid_alone(fake_nvml):
    env, control = fake_nvml
    put(control, "cards", "3")
    driver = Driver(env)
    try:
        put(control, "xid-0", "48")
        assert driver.events() == [("GPU-fake-0000", False, True)]
        put(control, "xid-2", "79")
        assert driver.events() == [("GPU-fake-0002", False, True)]

        # The event set says only that some GPU is lost; card 0 was never reset and stays Unhealthy.
        put(control, "lost-1")
        put(control, "lost-2")
        assert sorted(driver.events()) == [("GPU-fake-0001", False, False), ("GPU-fake-0002", False, False)]
        (control / "lost-1").unlink()
        (control / "lost-2").unlink()
        # Card 2 fell off the bus and came back, so it was reset: its Xid goes with it.
        assert sorted(driver.events()) == [("GPU-fake-0001", True, True), ("GPU-fake-0002", True, True)]
        assert driver.events(0.5) == []
    finally:
        driver.close()


def test_a_lost_gpu_is_probed_at_once_and_only_it_is_lost(fake_nvml):
    env, control = fake_nvml
    put(control, "cards", "2")
    # No probe is due for a minute: only the event set's answer can find the lost card in time.
    driver = Driver(env, probe_interval=60)
    try:
        put(control, "lost-1")
        started = time.monotonic()
        assert driver.events() == [("GPU-fake-0001", False, False)]
        assert time.monotonic() - started < 5
    finally:
        driver.close()


def test_the_agent_on_nvml_registers_and_pins_cards(fake_nvml):
    env, control = fake_nvml
    put(control, "cards", "3")
    plugin_dir = fakekubelet.short_tempdir()
    kubelet = fakekubelet.FakeKubelet(plugin_dir).start()
    proc = subprocess.Popen([sys.executable, "-m", "webhook.cli", "agent", "--device-plugin-dir", plugin_dir,
                             "--no-publish", "--poll-interval", "0.1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names = {"gpushard.io/gpu"} | {f"gpushard.io/card-{k}" for k in range(3)}
        requests = kubelet.wait_for(names, timeout=20)
        with fakekubelet.PluginClient(plugin_dir, requests["gpushard.io/card-2"].endpoint) as c:
            response = c.stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["card-2-0"])]), timeout=5)
        assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": "GPU-fake-0002"}
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kubelet.stop()
        fakekubelet.remove_tree(plugin_dir)


CARD_CALLS = """
import json, os
from webhook.agent.node import nvml
devices = nvml.NvmlDevices()
out = {"driver": devices.driver_version(), "memory_limits": devices.memory_limits_supported(),
       "mig": [devices.mig_enabled(c.uuid) for c in devices.cards()],
       "modes": [devices.compute_mode(c.uuid) for c in devices.cards()]}
devices.set_compute_mode("GPU-fake-0001", nvml.COMPUTE_EXCLUSIVE_PROCESS)
out["after"] = [devices.compute_mode(c.uuid) for c in devices.cards()]
open(os.environ["FAKE_NVML_DIR"] + "/no-permission", "w").close()
try:
    devices.set_compute_mode("GPU-fake-0001", nvml.COMPUTE_DEFAULT)
except nvml.DeviceError as exc:
    out["refused"] = str(exc)
try:
    devices.compute_mode("GPU-nope")
except nvml.DeviceError as exc:
    out["unknown"] = str(exc)
devices.close()
print(json.dumps(out))
"""


def test_what_isolation_asks_of_nvml(fake_nvml):
    env, control = fake_nvml
    put(control, "cards", "2")
    put(control, "mig-0")
    put(control, "driver", "615.12.01")
    done = subprocess.run([sys.executable, "-c", CARD_CALLS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["driver"] == "615.12.01"
    assert out["memory_limits"] is True
    assert out["mig"] == [True, False]
    assert out["modes"] == [0, 0] and out["after"] == [0, 3]
    assert (control / "compute-1").read_text().strip() == "3"
    assert out["refused"] == ("card GPU-fake-0001: cannot set the compute mode to Default: "
                              "Insufficient Permissions")
    assert out["unknown"].startswith("card GPU-nope: ")


def test_the_agent_on_nvml_with_mps_and_a_mig_card(fake_nvml, tmp_path):
    env, control = fake_nvml
    put(control, "cards", "3")
    put(control, "mig-1")
    put(control, "compute-2", "2")  # Prohibited before MPS: restored so, not to Default
    bin_dir, log = mpsstandin.install(tmp_path / "standin")
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", MPS_STANDIN_LOG=str(log))
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nsharesPerCard: 10\nisolation: mps\n")
    mps_root = tmp_path / "mps"
    plugin_dir = fakekubelet.short_tempdir()
    kubelet = fakekubelet.FakeKubelet(plugin_dir).start()
    proc = subprocess.Popen([sys.executable, "-m", "webhook.cli", "agent", "--config", str(config),
                             "--device-plugin-dir", plugin_dir, "--no-publish", "--poll-interval", "0.1",
                             "--mps-root", str(mps_root)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        requests = kubelet.wait_for({"gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-2"}, timeout=20)
        assert "gpushard.io/card-1" not in requests
        # Registered only once the daemons answer, with each card exclusive-process meanwhile.
        assert [(control / f"compute-{k}").read_text().strip() for k in (0, 2)] == ["3", "3"]
        assert not (control / "compute-1").exists()
        with fakekubelet.PluginClient(plugin_dir, requests["gpushard.io/card-2"].endpoint) as c:
            response = c.stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["card-2-0", "card-2-1", "card-2-2"])]), timeout=5)
        answer = response.container_responses[0]
        assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": "GPU-fake-0002",
                                     "CUDA_MPS_PIPE_DIRECTORY": "/run/gpushard/mps/pipe",
                                     "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                                     "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={3 * 16384 // 10}M"}
        assert str(mps_root / "GPU-fake-0002" / "pipe") in [m.host_path for m in answer.mounts]
        assert [c["gpu"] for c in mpsstandin.calls(log) if c["call"] == "-f"] == ["GPU-fake-0000", "GPU-fake-0002"]
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "card 1 (GPU-fake-0001) left out: MIG mode is on" in err
        assert [(control / f"compute-{k}").read_text().strip() for k in (0, 2)] == ["0", "2"]
        assert [c["call"] for c in mpsstandin.calls(log)].count("quit") == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kubelet.stop()
        fakekubelet.remove_tree(plugin_dir)


def test_usage_through_nvml(fake_nvml):
    env, control = fake_nvml
    put(control, "cards", "3")
    put(control, "procs-0", "4242 1024 30\n4343 512\n")
    put(control, "util-0", "37")
    put(control, "util-1", "unsupported")
    put(control, "procutil-1")
    proc = subprocess.Popen([sys.executable, "-c", USAGE], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def ask(line):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
            assert answer, proc.stderr.read()
            return json.loads(answer)

        first = ask("usage")
        assert set(first) == {"GPU-fake-0000", "GPU-fake-0001", "GPU-fake-0002"}
        assert first["GPU-fake-0000"] == {
            "memory_used_bytes": 1536 << 20, "memory_total_bytes": 16 << 30, "utilization_percent": 37,
            "processes": [{"pid": 4242, "used_bytes": 1024 << 20, "sm_percent": 30.0},
                          {"pid": 4343, "used_bytes": 512 << 20, "sm_percent": 0.0}],
            "xid_errors": 0, "process_utilization": True}
        put(control, "lost-2")
        usage = ask("usage")
        assert set(usage) == {"GPU-fake-0000", "GPU-fake-0001"}  # the lost card does not answer
        # No sample since the last scrape (NVML's NOT_FOUND): the processes ran nothing.
        assert [p["sm_percent"] for p in usage["GPU-fake-0000"]["processes"]] == [0.0, 0.0]
        assert usage["GPU-fake-0001"]["utilization_percent"] is None
        assert usage["GPU-fake-0001"]["processes"] == []
        assert usage["GPU-fake-0001"]["process_utilization"] is False

        (control / "lost-2").unlink()
        put(control, "xid-1", "79")
        put(control, "xid-0", "13")  # application Xids are not counted
        while ask("0.3") is not None:
            pass
        usage = ask("usage")
        assert (usage["GPU-fake-0000"]["xid_errors"], usage["GPU-fake-0001"]["xid_errors"]) == (0, 1)
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
