"""We test `gpushard agent` with backend dra as a real process, against the local API server, a fake
device-plugin kubelet and the kubelet's DRA side from the published protos:
- it registers no device plugin and writes the sum (gpushard.io/gpu, cards x shares) into the Node's status,
  publishes the node's ResourceSlice, registers the DRA plugin and prepares a claim allocated on one of its
  cards, writing the claim's CDI spec; its metrics then put the pod's container (listed by PodResources, its
  gpushard.io/gpu from its spec) on the claim's card;
- SIGTERM ends it with status 0 and its sockets removed; the checkpoint stays for the next start;
- with --no-publish it refuses to start with backend dra (status 2, naming the flag).
"""

import os
import pathlib
import signal
import socket
import ssl
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import fakekube, polling
from tests.agent import drakubelet, draworld, fakekubelet, fakepodresources
from tests.agent.test_running import INVENTORY, agent_process
from tests.audit import world
from webhook.core import draobjects, names

ROOT = pathlib.Path(__file__).resolve().parents[2]


def eventually(check, what, proc, timeout=30.0):
    """polling.eventually, failing at once when the agent process exited."""
    return polling.eventually(check, what, timeout, interval=0.05, gone=lambda: None if proc.poll() is None else (
        f"the agent exited ({proc.returncode}): {proc.communicate()[1]}"))


@pytest.fixture
def setup(tmp_path, plugin_dir):
    root = fakekubelet.short_tempdir("gsp-")
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    (tmp_path / "config.yaml").write_text("version: v1\nbackend: dra\nisolation: memory\n")
    with fakekube.FakeKube() as api:
        (tmp_path / "kubeconfig").write_text(world.kubeconfig(api))
        api.put("nodes", {"metadata": {"name": "node-a"}, "status": {}})
        yield api, root, tmp_path
    fakekubelet.remove_tree(root)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> str:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # made at the agent's start; what it serves is under test here
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=context) as response:
        return response.read().decode()


def test_the_agent_publishes_registers_prepares_and_stops(setup, plugin_dir):
    api, root, tmp = setup
    kubelet = fakekubelet.FakeKubelet(plugin_dir).start()
    lister = fakepodresources.FakePodResources(os.path.join(root, "pod-resources.sock")).start()
    lister.set([fakepodresources.pb.PodResources(namespace="ml", name="p", containers=[fakepodresources.container(
        "c0")])])
    folders = [os.path.join(root, d) for d in ("reg", "plugins", "cdi")]
    port = _free_port()
    proc = agent_process("--config", str(tmp / "config.yaml"), "--fake-inventory", str(tmp / "inventory.yaml"),
                         "--device-plugin-dir", plugin_dir, "--node-name", "node-a", "--poll-interval", "0.1",
                         "--kubelet-registry-dir", folders[0], "--kubelet-plugins-dir", folders[1],
                         "--cdi-dir", folders[2], "--metrics-port", str(port), "--pod-resources-socket", lister.path,
                         env={"KUBECONFIG": str(tmp / "kubeconfig")})
    registration = os.path.join(folders[0], f"{names.DRA_DRIVER}-reg.sock")
    try:
        def counted():
            status = api.get("nodes", "node-a").get("status") or {}
            return [(status.get(k) or {}).get(names.SHARES_RESOURCE) for k in ("capacity", "allocatable")]
        eventually(lambda: counted() == ["200", "200"], "the count in the Node's status", proc)

        def published():
            try:
                return [d["name"] for d in api.get("resourceslices", "node-a-gpu.gpushard.io")["spec"]["devices"]]
            except KeyError:
                return None
        eventually(lambda: published() == ["card-0", "card-1"], "the slice", proc)
        eventually(lambda: os.path.exists(registration), "the registration socket", proc)
        peer = drakubelet.DraKubelet()
        peer.register(registration)
        api.put("resourceclaims", draworld.reserved(draworld.claim("ml", "c", "uid-1", "node-a", "card-1", 25), "p",
                                                    "pod-1"))
        api.put("pods", draworld.holder("ml", "p", "pod-1", 25, node="node-a"))
        entry = peer.prepare(("ml", "uid-1", "c")).claims["uid-1"]
        assert entry.error == "" and list(entry.devices[0].cdi_device_ids)[0] == "nvidia.com/gpu=GPU-bbbb"
        with open(os.path.join(folders[2], "gpushard.io-claim_uid-1.json")) as spec:
            assert f"NVIDIA_GPU_MEMORY_LIMIT={25 * 81559 // 100}" in spec.read()
        assert kubelet.requests == []  # no device plugin
        # The pod's claim is on card 1, and so are its container's shares.
        found = {(s.name, s.labels.get("gpu"), s.labels.get("container")): s.value
                 for family in text_string_to_metric_families(_metrics(port)) for s in family.samples}
        assert found[("gpushard_container_shares", "1", "c0")] == 25
        assert ("gpushard_container_shares", "0", "c0") not in found
        assert (found[("gpushard_card_shares_allocated", "1", None)],
                found[("gpushard_card_shares_allocated", "0", None)]) == (25, 0)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kubelet.stop()
        lister.stop()
    assert proc.returncode == 0, err
    assert not os.path.exists(registration)
    assert not os.path.exists(os.path.join(folders[1], names.DRA_DRIVER, "dra.sock"))
    assert os.path.exists(os.path.join(folders[1], names.DRA_DRIVER, "checkpoint.json"))
    assert draobjects.check_slice(api.get("resourceslices", "node-a-gpu.gpushard.io")) == []


def test_backend_dra_needs_the_api_server(setup, plugin_dir):
    _api, _root, tmp = setup
    proc = agent_process("--config", str(tmp / "config.yaml"), "--fake-inventory", str(tmp / "inventory.yaml"),
                         "--device-plugin-dir", plugin_dir, "--no-publish")
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.startswith("gpushard: backend dra needs the API server") and "--no-publish" in err
