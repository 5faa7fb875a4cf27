"""We test `gpushard agent` as a real process:
- with a fake inventory it serves, registers every resource with a fake kubelet, and answers Allocate;
- SIGTERM and SIGINT end it with status 0, its streams closed and its sockets removed;
- without NVML and without a fake inventory it stops with a clear `gpushard:` message and status 3;
- a bad inventory file, a bad poll interval, or publishing without a node name, stops it with status 2;
- no API credentials while publishing stops it with status 4; a device-plugin folder it cannot make, status 1;
- a socket it cannot bind (its path too long for a unix socket) stops it with a `gpushard:` message and status 1;
- its flags and their defaults (the layering is checked for every module in tests/test_layers.py).
"""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.agent import fakekubelet, test_nvml
from webhook import cli
from webhook.agent import running
from webhook.agent.proto import deviceplugin_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
INVENTORY = """
cards:
- {index: 0, uuid: GPU-aaaa, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
- {index: 1, uuid: GPU-bbbb, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
"""
NAMES = {"gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-1"}


def agent_process(*args, env=None):
    environment = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
    environment.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "webhook.cli", "agent", *args], cwd=ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_agent_serves_registers_and_shuts_down_cleanly(tmp_path, plugin_dir, signum):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    kubelet = fakekubelet.FakeKubelet(plugin_dir).start()
    proc = agent_process("--fake-inventory", str(inventory), "--device-plugin-dir", plugin_dir,
                         "--no-publish", "--poll-interval", "0.1")
    try:
        requests = kubelet.wait_for(NAMES, timeout=20)
        with fakekubelet.PluginClient(plugin_dir, requests["gpushard.io/card-1"].endpoint) as c:
            response = c.stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["card-1-42"])]), timeout=5)
            assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb"}
            stream = fakekubelet.Stream(c)
            assert len(stream.message(0).devices) == 100
            proc.send_signal(signum)
            _out, err = proc.communicate(timeout=15)
            assert stream.ended.wait(5)
            assert stream.error is None, stream.error
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kubelet.stop()
    assert proc.returncode == 0, err
    assert "agent stopped" in err
    assert os.listdir(plugin_dir) == []


def test_without_nvml_the_agent_says_so_and_exits_3(plugin_dir):
    if test_nvml.nvml_loads():
        pytest.skip("NVML loads on this machine")
    proc = agent_process("--device-plugin-dir", plugin_dir, "--no-publish")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == running.EXIT_NO_NVML == 3
    assert err.startswith("gpushard: cannot load NVML")
    assert "--fake-inventory" in err
    assert os.listdir(plugin_dir) == []


def test_a_bad_inventory_exits_2_naming_the_entry(tmp_path, plugin_dir):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("cards: [{index: 0, uuid: GPU-a, memoryMiB: -5}]")
    proc = agent_process("--fake-inventory", str(inventory), "--device-plugin-dir", plugin_dir, "--no-publish")
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.startswith("gpushard: bad inventory file:")
    assert "cards[0].memoryMiB" in err


def test_publishing_needs_a_node_name(tmp_path, plugin_dir):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    proc = agent_process("--fake-inventory", str(inventory), "--device-plugin-dir", plugin_dir)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.startswith("gpushard: no node name")


def test_a_bad_poll_interval_exits_2(plugin_dir):
    proc = agent_process("--allow-no-gpus", "--device-plugin-dir", plugin_dir, "--no-publish",
                         "--poll-interval", "0")
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.startswith("gpushard: --poll-interval must be a positive number")


def test_without_api_credentials_publishing_exits_4(tmp_path, plugin_dir):
    env = {"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "no-kubeconfig"), "KUBERNETES_SERVICE_HOST": ""}
    proc = agent_process("--allow-no-gpus", "--device-plugin-dir", plugin_dir, "--node-name", "n1", env=env)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == running.EXIT_NO_API == 4
    assert "\ngpushard: no Kubernetes API credentials" in "\n" + err
    assert "--no-publish" in err
    assert os.listdir(plugin_dir) == []


def test_a_device_plugin_dir_it_cannot_create_exits_1(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = agent_process("--allow-no-gpus", "--device-plugin-dir", str(blocker / "device-plugins"), "--no-publish")
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == running.EXIT_SERVE == 1
    assert "\ngpushard: cannot serve the device plugins in" in "\n" + err


def test_a_socket_it_cannot_bind_exits_1_with_a_message(tmp_path):
    # Too long for sockaddr_un: grpc refuses to bind, with an error of its own kind.
    folder = tmp_path / ("d" * max(1, 110 - len(str(tmp_path))))
    proc = agent_process("--allow-no-gpus", "--device-plugin-dir", str(folder), "--no-publish")
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == running.EXIT_SERVE == 1
    assert "Traceback" not in err
    assert "\ngpushard: cannot serve the device plugins in" in "\n" + err
    assert "gpushard-io-gpu.sock" in err
    assert "must be at most 107" in err
    assert os.listdir(folder) == []


def test_agent_flags_and_defaults():
    args = cli.build_parser().parse_args(["agent"])
    assert args.device_plugin_dir == "/var/lib/kubelet/device-plugins"
    assert (args.fake_inventory, args.allow_no_gpus, args.no_publish, args.poll_interval) == (None, False, False, 1.0)
    assert args.node_name is None and args.config is None
    args = cli.build_parser().parse_args(["agent", "--node-name", "n1", "--config", "c.yaml", "--fake-inventory",
                                          "f.yaml", "--allow-no-gpus", "--no-publish", "--poll-interval", "0.5",
                                          "--device-plugin-dir", "/tmp/dp"])
    assert (args.node_name, args.config, args.fake_inventory, args.allow_no_gpus, args.no_publish,
            args.poll_interval, args.device_plugin_dir) == ("n1", "c.yaml", "f.yaml", True, True, 0.5, "/tmp/dp")

