"""We test, with the kubelet's side played from the published protos over real unix sockets and claims read
from a local API server:
- registration: GetInfo says DRAPlugin, our driver, v1.DRAPlugin and the dra.sock endpoint; the plugin hears
  NotifyRegistrationStatus;
- prepare: the card as the NVIDIA CDI spec names it, and gpushard's per-claim CDI device whose spec carries the
  limits computed from the claim's consumed shares and the card's memory;
- unprepare removes the spec and the checkpoint entry, and may come twice;
- after the agent restarts, preparing again answers from the checkpoint (the claim is gone from the API), and
  unprepare still removes what was prepared;
- a claim for another driver, one made again under a new UID, and one on a card this node lacks are refused
  with an error naming the claim, and leave nothing behind; one bad claim does not fail the others in a call;
- a removed socket is served again;
- with the pod check on (as the agent runs it): a claim is prepared only for the one pod it is reserved for,
  and only when its consumed shares equal the shares that pod counts (gpushard.io/gpu, what quota saw); a claim
  consuming more (a template replaced or made by another), reserved for two pods or none, for a pod made again
  under a new UID, or whose pod cannot be read, is refused naming claim and pod, and leaves nothing behind.
"""

import json
import logging
import os
import threading

import pytest

from tests.agent import drakubelet, draworld, fakekubelet
from webhook.agent.dra import cdi, kubeletplugin
from webhook.agent.node import containerlimits, nvml
from webhook.core import asks as req
from webhook.core import names
from webhook.core import policy as policy_mod

NODE = "node-a"
CARDS = {i: nvml.Card(i, f"GPU-{i}0000000-1111-2222-3333-444444444444", "NVIDIA H100 80GB HBM3", 81559)
         for i in range(2)}



@pytest.fixture
def dirs():
    root = fakekubelet.short_tempdir("gsd-")
    yield {"registry": os.path.join(root, "reg"), "plugins": os.path.join(root, "plugins"),
           "cdi": os.path.join(root, "cdi"), "checkpoint": os.path.join(root, "plugins", "state", "checkpoint.json")}
    fakekubelet.remove_tree(root)


def pod_shares(pod):
    return req.effective_shares(req.read_spec(pod["spec"], policy_mod.Policy(backend=policy_mod.DRA)))


def make_plugin(api, dirs, mode="memory", check_pods=False):
    checks = {"read_pod": kubeletplugin.api_pod_reader(api.api_client()), "pod_shares": pod_shares} \
        if check_pods else {}
    preparer = kubeletplugin.Preparer(NODE, lambda: CARDS, 100, kubeletplugin.api_claim_reader(api.api_client()),
                                  kubeletplugin.Checkpoint(dirs["checkpoint"]), cdi_dir=dirs["cdi"], mode=mode,
                                  mps_root=containerlimits.MpsRoot(os.path.join(dirs["plugins"], "mps")), **checks)
    plugin = kubeletplugin.DraPlugin(preparer, dirs["registry"], dirs["plugins"])
    plugin.start()
    return plugin


@pytest.fixture
def plugin(api, dirs):
    started = make_plugin(api, dirs)
    yield started
    started.stop()


@pytest.fixture
def kubelet(plugin):
    peer = drakubelet.DraKubelet()
    peer.register(plugin.registration_path)
    return peer


def spec_env(dirs, uid):
    with open(cdi.spec_path(dirs["cdi"], uid)) as source:
        spec = json.load(source)
    assert spec["kind"] == names.DRA_CDI_KIND and spec["cdiVersion"]
    [device] = spec["devices"]
    return device["name"], dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def test_registration(plugin, dirs):
    assert plugin.registration_path == os.path.join(dirs["registry"], f"{names.DRA_DRIVER}-reg.sock")
    peer = drakubelet.DraKubelet()
    info = peer.register(plugin.registration_path)
    assert (info.type, info.name, list(info.supported_versions)) == ("DRAPlugin", names.DRA_DRIVER, ["v1.DRAPlugin"])
    assert info.endpoint == os.path.join(dirs["plugins"], names.DRA_DRIVER, "dra.sock")
    assert plugin.registration.registered.is_set()


def test_prepare_names_the_card_and_the_claims_limits(api, dirs, kubelet):
    api.put("resourceclaims", draworld.claim("team-a", "pod-a-gpu", "uid-a", NODE, "card-1", 25))
    response = kubelet.prepare(("team-a", "uid-a", "pod-a-gpu"))
    entry = response.claims["uid-a"]
    assert entry.error == ""
    [device] = entry.devices
    assert (list(device.request_names), device.pool_name, device.device_name) == (["gpu"], NODE, "card-1")
    assert list(device.cdi_device_ids) == [f"nvidia.com/gpu={CARDS[1].uuid}", "gpushard.io/claim=uid-a-card-1"]
    name, env = spec_env(dirs, "uid-a")
    assert name == "uid-a-card-1"
    cap = str(25 * 81559 // 100)
    assert env == {"GPUSHARD_FRACTION": "0.25", "NVIDIA_GPU_MEMORY_LIMIT": cap, "NVIDIA_GPU_MEMORY_REQUEST": cap,
                   "NVIDIA_GPU_MEMORY_LIMITS": cap, "NVIDIA_GPU_MEMORY_REQUESTS": cap}


def test_without_isolation_the_spec_still_tells_the_fraction(api, dirs):
    plugin = make_plugin(api, dirs, mode="none")
    try:
        peer = drakubelet.DraKubelet()
        peer.register(plugin.registration_path)
        api.put("resourceclaims", draworld.claim("team-a", "c", "uid-n", NODE, "card-0", 50))
        assert peer.prepare(("team-a", "uid-n", "c")).claims["uid-n"].error == ""
        assert spec_env(dirs, "uid-n")[1] == {"GPUSHARD_FRACTION": "0.5"}
    finally:
        plugin.stop()


def test_unprepare_removes_what_prepare_made_and_may_come_twice(api, dirs, kubelet):
    api.put("resourceclaims", draworld.claim("team-a", "c", "uid-u", NODE, "card-0", 10))
    assert kubelet.prepare(("team-a", "uid-u", "c")).claims["uid-u"].error == ""
    assert os.path.exists(cdi.spec_path(dirs["cdi"], "uid-u"))
    for _ in range(2):
        response = kubelet.unprepare(("team-a", "uid-u", "c"))
        assert "uid-u" in response.claims and response.claims["uid-u"].error == ""
        assert not os.path.exists(cdi.spec_path(dirs["cdi"], "uid-u"))
        assert "uid-u" not in kubeletplugin.Checkpoint(dirs["checkpoint"]).claims


def test_prepare_twice_gives_the_same_answer(api, kubelet):
    api.put("resourceclaims", draworld.claim("team-a", "c", "uid-t", NODE, "card-0", 10))
    first = kubelet.prepare(("team-a", "uid-t", "c"))
    assert kubelet.prepare(("team-a", "uid-t", "c")) == first


def test_prepare_again_after_a_restart_answers_from_the_checkpoint(api, dirs, plugin, kubelet):
    api.put("resourceclaims", draworld.claim("team-a", "c", "uid-r", NODE, "card-1", 40))
    before = kubelet.prepare(("team-a", "uid-r", "c"))
    plugin.stop()
    api.delete("resourceclaims", "c", "team-a")  # the API server cannot help now
    again = make_plugin(api, dirs)
    try:
        peer = drakubelet.DraKubelet()
        peer.register(again.registration_path)
        after = peer.prepare(("team-a", "uid-r", "c"))
        assert after == before and after.claims["uid-r"].error == ""
        assert peer.unprepare(("team-a", "uid-r", "c")).claims["uid-r"].error == ""
        assert not os.path.exists(cdi.spec_path(dirs["cdi"], "uid-r"))
    finally:
        again.stop()


def test_a_claim_for_another_driver_is_refused(api, dirs, kubelet):
    api.put("resourceclaims", draworld.claim("team-a", "other", "uid-o", NODE, "gpu-0", 1, driver="gpu.nvidia.com"))
    entry = kubelet.prepare(("team-a", "uid-o", "other")).claims["uid-o"]
    assert entry.error.startswith("gpushard: claim team-a/other has no device of driver gpu.gpushard.io")
    assert not entry.devices
    assert not os.path.exists(cdi.spec_path(dirs["cdi"], "uid-o"))
    assert "uid-o" not in kubeletplugin.Checkpoint(dirs["checkpoint"]).claims


@pytest.mark.parametrize("claim,expected", [
    (draworld.claim("team-a", "c", "uid-new", NODE, "card-0", 10), "was deleted and made again"),
    (draworld.claim("team-a", "c", "uid-x", "node-b", "card-0", 10), "not a card of node"),
    (draworld.claim("team-a", "c", "uid-x", NODE, "card-7", 10), "not a card of node"),
    (draworld.claim("team-a", "c", "uid-x", NODE, None), "no device of driver"),
])
def test_claims_that_are_not_ours_to_prepare(api, dirs, kubelet, claim, expected):
    api.put("resourceclaims", claim)
    entry = kubelet.prepare(("team-a", "uid-x", "c")).claims["uid-x"]
    assert entry.error.startswith("gpushard: claim team-a/c") and expected in entry.error
    assert os.listdir(dirs["cdi"]) == [] if os.path.isdir(dirs["cdi"]) else True


def test_a_missing_claim_is_an_error_the_kubelet_retries(kubelet):
    entry = kubelet.prepare(("team-a", "uid-m", "missing")).claims["uid-m"]
    assert entry.error == "gpushard: cannot read claim team-a/missing from the API server: HTTP 404 Not Found"


def test_one_bad_claim_does_not_fail_the_others(api, kubelet):
    api.put("resourceclaims", draworld.claim("team-a", "good", "uid-g", NODE, "card-0", 30))
    response = kubelet.prepare(("team-a", "uid-b", "bad"), ("team-a", "uid-g", "good"))
    assert set(response.claims) == {"uid-b", "uid-g"}
    assert response.claims["uid-b"].error and not response.claims["uid-g"].error


def test_a_removed_socket_is_served_again(api, plugin):
    os.unlink(plugin.registration_path)
    os.unlink(plugin.endpoint)
    plugin.step()
    peer = drakubelet.DraKubelet()
    peer.register(plugin.registration_path)
    api.put("resourceclaims", draworld.claim("team-a", "c", "uid-s", NODE, "card-0", 10))
    assert peer.prepare(("team-a", "uid-s", "c")).claims["uid-s"].error == ""


def test_a_registration_the_kubelet_refuses_is_heard(plugin):
    plugin.registration.info.supported_versions[:] = ["v1beta1.DRAPlugin"]
    with pytest.raises(drakubelet.RegistrationRefused):
        drakubelet.DraKubelet().register(plugin.registration_path)
    assert not plugin.registration.registered.is_set()
    assert "v1.DRAPlugin" in plugin.registration.error


def test_with_mps_the_spec_mounts_the_cards_pipe_and_shm(api, dirs):
    plugin = make_plugin(api, dirs, mode="mps")
    try:
        peer = drakubelet.DraKubelet()
        peer.register(plugin.registration_path)
        api.put("resourceclaims", draworld.claim("team-a", "c", "uid-p", NODE, "card-0", 25))
        assert peer.prepare(("team-a", "uid-p", "c")).claims["uid-p"].error == ""
        with open(cdi.spec_path(dirs["cdi"], "uid-p")) as source:
            edits = json.load(source)["devices"][0]["containerEdits"]
        env = dict(e.split("=", 1) for e in edits["env"])
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={25 * 81559 // 100}M"
        root = containerlimits.MpsRoot(os.path.join(dirs["plugins"], "mps"))
        hosts = {m["hostPath"]: m["containerPath"] for m in edits["mounts"]}
        assert hosts[root.pipe_dir(CARDS[0])] == names.MPS_CLIENT_PIPE_DIR
        assert all(m["options"][0] == "rbind" for m in edits["mounts"])
    finally:
        plugin.stop()


@pytest.fixture
def checking(api, dirs):
    plugin = make_plugin(api, dirs, check_pods=True)
    peer = drakubelet.DraKubelet()
    peer.register(plugin.registration_path)
    yield peer
    plugin.stop()


def test_a_claim_is_prepared_for_its_pod_with_the_pods_shares(api, dirs, checking):
    # Kubernetes' count: the sum of the app containers (10 + 15), or the largest init container.
    api.put("resourceclaims", draworld.reserved(draworld.claim("team-a", "c", "uid-h", NODE, "card-0", 25), "p",
                                                "pod-h"))
    api.put("pods", draworld.holder("team-a", "p", "pod-h", 10, 15))
    assert checking.prepare(("team-a", "uid-h", "c")).claims["uid-h"].error == ""
    assert os.path.exists(cdi.spec_path(dirs["cdi"], "uid-h"))


@pytest.mark.parametrize("pods,holders,expected", [
    # A template replaced (or a claim made) asking 100 shares for a pod that counts 25.
    ([("p", "pod-h", (25,))], [("p", "pod-h")], "consumes 100 shares but pod team-a/p counts 25 (gpushard.io/gpu"),
    # A pod that asks no GPU holding gpushard's claim.
    ([("p", "pod-h", ())], [("p", "pod-h")], "consumes 100 shares but pod team-a/p counts 0"),
    # Two pods sharing one claim, or none.
    ([("p", "pod-h", (100,)), ("q", "pod-q", ())], [("p", "pod-h"), ("q", "pod-q")], "is reserved for 2 pods"),
    ([], [], "is reserved for 0 pods"),
    # The pod made again under the same name.
    ([("p", "pod-new", (100,))], [("p", "pod-h")], "is not the one claim team-a/c is reserved for"),
    # The pod cannot be read: an error the kubelet retries.
    ([], [("p", "pod-h")], "cannot read pod team-a/p from the API server: HTTP 404"),
])
def test_a_claim_that_did_not_come_from_gpushards_template_for_its_pod_is_refused(api, dirs, checking, pods,
                                                                                   holders, expected):
    claim = draworld.claim("team-a", "c", "uid-z", NODE, "card-0", 100)
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": n, "uid": u} for n, u in holders]
    api.put("resourceclaims", claim)
    for name, uid, shares in pods:
        api.put("pods", draworld.holder("team-a", name, uid, *shares))
    entry = checking.prepare(("team-a", "uid-z", "c")).claims["uid-z"]
    assert entry.error.startswith("gpushard: ") and expected in entry.error, entry.error
    assert not entry.devices
    assert not os.path.exists(cdi.spec_path(dirs["cdi"], "uid-z"))
    assert "uid-z" not in kubeletplugin.Checkpoint(dirs["checkpoint"]).claims


def test_a_slow_api_server_delays_only_the_claim_that_waits_on_it(api, dirs, plugin, kubelet):
    """The claim's read is an API round trip: while one hangs, another claim is prepared and the metrics'
    cards-by-pod is answered."""
    arrived, answer = threading.Event(), threading.Event()

    def slow(method, path):
        if "/resourceclaims/slow" in path:
            arrived.set()
            answer.wait(30)

    api.on_request = slow
    api.put("resourceclaims", draworld.claim("team-a", "slow", "uid-slow", NODE, "card-0", 10))
    api.put("resourceclaims", draworld.claim("team-a", "fast", "uid-fast", NODE, "card-1", 20))
    assert plugin.preparer._claim_lock("uid-slow") is not plugin.preparer._claim_lock("uid-fast")
    waiting = {}
    thread = threading.Thread(target=lambda: waiting.update(r=kubelet.prepare(("team-a", "uid-slow", "slow"))))
    thread.start()
    try:
        assert arrived.wait(10)
        assert kubelet.prepare(("team-a", "uid-fast", "fast")).claims["uid-fast"].error == ""
        assert os.path.exists(cdi.spec_path(dirs["cdi"], "uid-fast"))
        assert plugin.preparer.cards_by_pod() == {}
        assert thread.is_alive()  # the slow claim still waits on its answer
    finally:
        answer.set()
        thread.join(30)
    assert waiting["r"].claims["uid-slow"].error == ""
    assert set(kubeletplugin.Checkpoint(dirs["checkpoint"]).claims) == {"uid-slow", "uid-fast"}


def test_a_spec_gone_with_a_reboot_is_written_again_at_start(api, dirs, plugin, kubelet, caplog):
    """/var/run/cdi is a tmpfs: a reboot empties it, and the kubelet, whose own checkpoint still holds the claim
    prepared, starts its containers again without asking: the agent writes the spec back from its checkpoint."""
    api.put("resourceclaims", draworld.claim("team-a", "c", "uid-b", NODE, "card-1", 40))
    assert kubelet.prepare(("team-a", "uid-b", "c")).claims["uid-b"].error == ""
    path = cdi.spec_path(dirs["cdi"], "uid-b")
    with open(path) as source:
        before = json.load(source)
    plugin.stop()
    os.unlink(path)  # the reboot
    api.delete("resourceclaims", "c", "team-a")  # nor can the API server help
    with open(dirs["checkpoint"]) as source:  # a claim an older agent prepared keeps no spec
        kept = json.load(source)
    kept["claims"]["uid-old"] = {**kept["claims"]["uid-b"], "name": "old"}
    del kept["claims"]["uid-old"]["cdi"]
    with open(dirs["checkpoint"], "w") as out:
        json.dump(kept, out)
    caplog.set_level(logging.INFO, logger="webhook.agent.dra.kubeletplugin")
    again = make_plugin(api, dirs)
    try:
        with open(path) as source:
            assert json.load(source) == before
        assert not os.path.exists(cdi.spec_path(dirs["cdi"], "uid-old"))
        said = [r.getMessage() for r in caplog.records]
        assert any("wrote the CDI spec of claim team-a/c (uid-b) again" in m for m in said), said
        assert any("team-a/old (uid-old) is gone" in m and "made again" in m for m in said), said
        # Asked again (the kubelet preparing after its own restart), the same: the spec stays.
        os.unlink(path)
        peer = drakubelet.DraKubelet()
        peer.register(again.registration_path)
        assert peer.prepare(("team-a", "uid-b", "c")).claims["uid-b"].error == ""
        assert os.path.exists(path)
    finally:
        again.stop()
