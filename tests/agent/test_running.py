"""We test `gpushard agent` as a real process:
- with a fake inventory it serves, registers every resource with a fake kubelet, and answers Allocate;
- SIGTERM and SIGINT end it with status 0, its streams closed and its sockets removed;
- without NVML and without a fake inventory it stops with a clear `gpushard:` message and status 3;
- a bad inventory file, a bad poll interval, or publishing without a node name, stops it with status 2;
- no API credentials while publishing stops it with status 4; a device-plugin folder it cannot make, status 1;
- a socket it cannot bind (its path too long for a unix socket) stops it with a `gpushard:` message and status 1;
- a loop of a running agent that ends (a bug it could not survive) is told, so that the agent exits for the kubelet
  to start it again; a stopping agent's loops are not;
- its liveness and readiness (the kubelet's probes): ready once the kubelet registered every resource; a gRPC
  server whose socket cannot be served again, or a loop that ended, fails both, naming it;
- its flags and their defaults (the layering is checked for every module in tests/test_layers.py);
- the config's agent timeouts reach its requests: against an API server that never answers, the inventory's
  publication gives up after agent.requestTimeout, a scrape's token review after agent.metricsRequestTimeout.
"""

import http.client
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import fakekube, polling
from tests.admission import objects
from tests.agent import fakekubelet, test_metrics_access, test_nvml
from tests.audit import world
from webhook import cli, settings
from webhook.agent import running
from webhook.agent.node import nvml
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



def _silent_agent(tmp_path, plugin_dir, silent, config: str, *extra: str):
    """`gpushard agent` with ``config``, publishing through a kubeconfig that points at ``silent``; its
    stderr lines with the time each came, on a queue."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    (tmp_path / "config.yaml").write_text(config)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(world.kubeconfig(silent))
    proc = agent_process("--config", str(tmp_path / "config.yaml"), "--fake-inventory", str(inventory),
                         "--device-plugin-dir", plugin_dir, "--node-name", "gpu-node-1", *extra,
                         env={"KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": ""})
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stderr:
            lines.put((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def _line(lines: queue.Queue, text: str, within: float) -> tuple[float, str]:
    deadline = time.monotonic() + within
    seen = []
    while time.monotonic() < deadline:
        try:
            when, line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        seen.append(line)
        if text in line:
            return when, line
    raise AssertionError(f"no line with {text!r} within {within} s: {seen}")


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_the_configs_request_timeout_reaches_the_agents_requests(tmp_path, plugin_dir):
    with fakekube.SilentServer() as silent:
        proc, lines = _silent_agent(tmp_path, plugin_dir, silent, "version: v1\nagent: {requestTimeout: 1}\n")
        try:
            started, _ = _line(lines, "card(s); serving", within=30)
            # Publishing reads the Node's labels, then patches it: two requests of 1 s each, where the
            # default of 10 s would take 20 s.
            failed, line = _line(lines, "cannot publish the inventory on node 'gpu-node-1'", within=30)
            assert failed - started < 8, line
            assert "timed out" in line
        finally:
            _stop(proc)


def test_the_configs_metrics_request_timeout_reaches_the_scrapes_token_review(tmp_path, plugin_dir):
    address = test_metrics_access.network_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    port = objects.free_port()
    with fakekube.SilentServer() as silent:
        proc, lines = _silent_agent(tmp_path, plugin_dir, silent, "version: v1\nagent: {metricsRequestTimeout: 0.5}\n",
                                    "--metrics-port", str(port))
        try:
            _line(lines, f"metrics on port {port}", within=30)
            conn = http.client.HTTPSConnection(address, port, timeout=30, context=test_metrics_access.UNVERIFIED)
            try:
                started = time.monotonic()
                conn.request("GET", "/metrics", headers={"Authorization": "Bearer some-token"})
                response = conn.getresponse()
                took = time.monotonic() - started
                # The TokenReview gives up after 0.5 s; the default would wait 5 s.
                assert response.status == 503 and response.read().startswith(b"gpushard: cannot review the token")
                assert took < 3, took
            finally:
                conn.close()
        finally:
            _stop(proc)


def one_card_agent(plugin_dir: str) -> running.Agent:
    """A started agent of one card on the device-plugin backend, polling fast."""
    agent = running.Agent(nvml.FakeDevices([nvml.Card(0, "GPU-aaaa", "NVIDIA L4", 22491)]), settings.Settings().policy,
                          plugin_dir, poll=0.05, tick=0.2, register_timeout=2)
    agent.start()
    return agent


def test_a_loop_that_ends_while_the_agent_runs_is_told(plugin_dir, kubelet):
    agent = one_card_agent(plugin_dir)
    try:
        assert agent.ended_loops() == []

        def ends():  # as a loop does whose error it could not survive (its traceback aside)
            return
        agent._thread("gpushard-broken", ends)
        polling.eventually(lambda: agent.ended_loops() == ["gpushard-broken"], "the ended loop told")
    finally:
        agent.stop()
    assert agent.ended_loops() == [], "a stopping agent's loops end by design"


def test_liveness_and_readiness_fail_when_a_server_or_a_loop_dies(plugin_dir, kubelet):
    agent = one_card_agent(plugin_dir)
    try:
        polling.eventually(lambda: agent.readiness() == [], "every resource registered with the kubelet")
        assert agent.liveness() == []

        # The card's socket replaced by something no poll can serve on again: its server is dead for good.
        [card0] = [p for p in agent.backend.plugins if p.resource.card_index == 0]
        os.unlink(card0.path)
        os.mkdir(card0.path)
        dead = f"its gRPC server on {card0.path} is not serving (the socket is gone or replaced)"
        polling.eventually(lambda: dead in agent.liveness(), "the dead server told")
        assert dead in agent.readiness()
        assert "the kubelet has not registered gpushard.io/card-0 yet" in agent.readiness()

        # Served again once the path is free: whole again.
        os.rmdir(card0.path)
        polling.eventually(lambda: agent.readiness() == [], "the server back and registered again")

        agent._thread("gpushard-broken", lambda: None)  # a loop whose work died
        polling.eventually(lambda: agent.liveness() == ["its gpushard-broken loop ended"], "the ended loop told")
        assert agent.readiness() == ["its gpushard-broken loop ended"]
    finally:
        agent.stop()
