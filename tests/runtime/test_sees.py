"""We test what containers see on a real containerd and runc, under the device plugin backend, per device-list
strategy (envvar, volume-mounts, cdi-cri, and the shipped default), read from inside each container:
- a 0.25 pod on a four-card node: its GPU container holds card k only: on a runtime with CDI and `cdi-cri`, one
  card device node, /dev/nvidia<k>, beside the control nodes; NVIDIA_VISIBLE_DEVICES naming card k (or, where
  NVIDIA's CDI spec applies, its `void`: the devices are injected, nothing is left for a hook); the device-list
  mount of card k with `volume-mounts`; GPUSHARD_FRACTION 0.25. Its init container and sidecar see no card;
- two pods on different cards each see only their own;
- a container without a share, one whose author wrote NVIDIA_VISIBLE_DEVICES=all, and a `kubectl debug`
  container see no card;
- the pod spec's NVIDIA_VISIBLE_DEVICES wins over the device plugin's of the same name (the kubelet hands the
  runtime the plugin's variables first): with `cdi-cri` alone the agent answers `void`, and a container of a
  runtime without CDI sees the webhook's index;
- `isolation: memory` on a runtime with CDI: the runtime runs the memory-limit hook NVIDIA's spec names for the
  container's card, with the arguments the docs give, and the container's OCI spec holds the limit the hook
  reads (shares x the card's memory / 100); without CDI the hook never runs;
- with containers running, the agent, the kubelet and containerd restarted in turn: each container keeps its
  card and its view of it, the kubelet's checkpoint agrees with what the containers see, and a new pod gets no
  share a running one holds.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e import components
from tests.runtime import node, seeing
from webhook import settings

STRATEGIES = {
    "envvar": ["envvar"],
    "volume-mounts": ["volume-mounts"],
    "cdi-cri": ["cdi-cri"],
    "default": None,  # the shipped config's own (no deviceListStrategy key)
}
CHECKPOINT = components.DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint"


@pytest.fixture(scope="module", params=list(STRATEGIES), ids=list(STRATEGIES))
def strategy(request, kubectl, agent) -> tuple[str, ...]:
    chosen = STRATEGIES[request.param]
    before = seeing.configure(kubectl, deviceListStrategy=chosen)
    agent.reload(expect=seeing.per_card(node.CARDS))
    effective = settings.from_mapping(yaml.safe_load(yaml_text(kubectl))).policy.device_list_strategy
    yield tuple(effective)
    seeing.set_config(kubectl, before)


def yaml_text(kubectl) -> str:
    return kubectl.json("get", "configmap", "gpushard-config", "-n", "gpushard-system")["data"]["config.yaml"]


def test_fraction_sees_its_card_and_its_other_containers_none(strategy, runtime, agent, kubectl, namespace):
    kubectl.apply(seeing.pod("quarter", seeing.container(gpu="0.25"),
                             seeing.container("sidecar-app", keep=True),
                             init=[seeing.container("setup", keep=False),
                                   seeing.container("logger", sidecar=True)]), "-n", namespace)
    seeing.running(kubectl, namespace, "quarter", explain=runtime.tail)
    card = seeing.card_of(kubectl, namespace, "quarter")
    main = seeing.seen(kubectl, namespace, "quarter")
    seeing.expect_card(main, card, strategy, runtime)
    assert main.env["GPUSHARD_FRACTION"] == "0.25"
    for other in ("sidecar-app", "setup", "logger"):
        view = seeing.seen(kubectl, namespace, "quarter", other)
        assert view.no_card(), (other, view)
        assert view.visible == "void", (other, view.env)
        assert "GPUSHARD_FRACTION" not in view.env, (other, view.env)


def test_two_pods_on_two_cards_each_see_their_own(strategy, runtime, agent, kubectl, namespace):
    for name in ("left", "right"):
        kubectl.apply(seeing.pod(name, seeing.container(gpu="0.6")), "-n", namespace)
    cards = {}
    for name in ("left", "right"):
        seeing.running(kubectl, namespace, name, explain=runtime.tail)
        cards[name] = seeing.card_of(kubectl, namespace, name)
        seeing.expect_card(seeing.seen(kubectl, namespace, name), cards[name], strategy, runtime)
    assert cards["left"] != cards["right"]


def test_no_share_sees_no_card(strategy, runtime, agent, kubectl, namespace):
    kubectl.apply(seeing.pod("plain", seeing.container(), seeing.container("greedy", env={
        "NVIDIA_VISIBLE_DEVICES": "all"})), "-n", namespace)
    seeing.running(kubectl, namespace, "plain", explain=runtime.tail)
    for name in ("main", "greedy"):
        view = seeing.seen(kubectl, namespace, "plain", name)
        assert view.no_card() and view.visible == "void", (name, view)
    # A debug container joins a running pod through pods/ephemeralcontainers: the webhook gives it void too.
    kubectl.run("debug", "plain", "-n", namespace, "--container=dbg", f"--image={seeing.images.WORKLOAD}",
                "--image-pull-policy=Never", "--profile=general", "--", "/bin/sh", "-c",
                seeing.REPORT + "; exec sleep 100000")
    view = seeing.seen(kubectl, namespace, "plain", "dbg", timeout=90)
    assert view.no_card() and view.visible == "void", view


def test_plugin_variable_loses_to_the_pods(strategy, runtime, agent, kubectl, namespace):
    """The agent answers NVIDIA_VISIBLE_DEVICES too; the runtime keeps the pod spec's value, which comes after it."""
    kubectl.apply(seeing.pod("ordered", seeing.container(gpu="0.5")), "-n", namespace)
    seeing.running(kubectl, namespace, "ordered", explain=runtime.tail)
    card = seeing.card_of(kubectl, namespace, "ordered")
    spec_value = next(e["value"] for e in kubectl.json("get", "pod", "ordered", "-n", namespace)["spec"]["containers"][
        0]["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES")
    assert spec_value == str(card)
    view = seeing.seen(kubectl, namespace, "ordered")
    if runtime.cdi and "cdi-cri" in strategy:
        assert view.visible == "void"  # the CDI spec's edit comes last of all
    else:
        assert view.visible == spec_value, view.env


@pytest.fixture
def memory_isolation(kubectl, agent, installed):
    before = seeing.configure(kubectl, isolation="memory", deviceListStrategy=["cdi-cri"])
    installed.reload()
    agent.reload(expect=seeing.per_card(node.CARDS))
    yield
    seeing.set_config(kubectl, before)
    installed.reload()
    agent.reload(expect=seeing.per_card(node.CARDS))


def test_memory_limit_hook_run_by_the_runtime(memory_isolation, runtime, cards, agent, kubectl, namespace):
    kubectl.apply(seeing.pod("capped", seeing.container(gpu="0.25")), "-n", namespace)
    seeing.running(kubectl, namespace, "capped", explain=runtime.tail)
    card = seeing.card_of(kubectl, namespace, "capped")
    pod = kubectl.json("get", "pod", "capped", "-n", namespace)
    inventory = json.loads(kubectl.json("get", "node", components.NODE_NAME)["metadata"]["annotations"][
        "gpushard.io/inventory"])
    memory = next(c["memoryMiB"] for c in inventory if c["index"] == card)
    cap = str(25 * memory // 100)
    runs = [json.loads(line) for line in cards.hook_log.read_text().splitlines()] if cards.hook_log.exists() else []
    containers = {s["containerID"].split("://")[1] for s in pod["status"]["containerStatuses"]}
    ours = [r for r in runs if r["id"] in containers]
    if not runtime.cdi:
        assert ours == [], "a runtime without CDI ran a hook from a CDI spec"
        return
    assert len(ours) == 1, runs
    assert ours[0]["argv"][1:] == ["apply-cuda-memory-limits", "--driver-root", "/", "--gpu-id", node.uuid(card)]
    assert ours[0]["env"]["NVIDIA_GPU_MEMORY_LIMIT"] == cap, ours[0]
    assert ours[0]["env"]["NVIDIA_GPU_MEMORY_LIMITS"] == cap, ours[0]
    assert ours[0]["env"]["NVIDIA_GPU_MEMORY_REQUEST"] == cap, ours[0]


def checkpoint_cards(uid: str) -> set[int]:
    data = json.loads(CHECKPOINT.read_text())["Data"]
    return {int(d.split("-")[1]) for e in data.get("PodDeviceEntries") or [] if e["PodUID"] == uid
            for ids in e["DeviceIDs"].values() for d in ids if d.startswith("card-")}


def test_restarts_keep_every_container_on_its_card(runtime, agent, kubelet, kubectl, namespace):
    for name in ("steady-a", "steady-b"):
        kubectl.apply(seeing.pod(name, seeing.container(gpu="0.6")), "-n", namespace)
    before = {}
    for name in ("steady-a", "steady-b"):
        pod = seeing.running(kubectl, namespace, name, explain=runtime.tail)
        card = seeing.card_of(kubectl, namespace, name)
        before[name] = (pod["metadata"]["uid"], card, seeing.seen_now(kubectl, namespace, name),
                        pod["status"]["containerStatuses"][0]["containerID"])
        assert checkpoint_cards(pod["metadata"]["uid"]) == {card}
    for restart, what in ((agent.reload, "the agent"), (kubelet.restart, "the kubelet"),
                          (runtime.restart, "containerd")):
        restart()
        components.wait_for("node Ready again", lambda: components.Kubelet.ready(kubectl), timeout=90,
                            explain=kubelet.tail)
        agent.wait_allocatable(seeing.per_card(node.CARDS), timeout=90)
        for name, (uid, card, view, container) in before.items():
            pod = seeing.running(kubectl, namespace, name, explain=runtime.tail)
            status = pod["status"]["containerStatuses"][0]
            assert (status["containerID"], status["restartCount"]) == (container, 0), f"{name} after {what}"
            assert seeing.seen_now(kubectl, namespace, name) == view, f"{name} after {what}"
            assert checkpoint_cards(uid) == {card}, f"{name} after {what}"
    # Two cards hold 60 each; a new 0.6 pod needs a third card, never a share they hold.
    kubectl.apply(seeing.pod("newcomer", seeing.container(gpu="0.6")), "-n", namespace)
    seeing.running(kubectl, namespace, "newcomer", explain=runtime.tail)
    newcomer = seeing.card_of(kubectl, namespace, "newcomer")
    assert newcomer not in {card for _, card, _, _ in before.values()}
    uid = kubectl.json("get", "pod", "newcomer", "-n", namespace)["metadata"]["uid"]
    assert checkpoint_cards(uid) == {newcomer}


def test_no_registry_was_asked(runtime, kubectl):
    """Every image the tier's pods ran was imported; no pull was ever tried."""
    log = runtime.process.log_path.read_text(errors="replace")
    assert "PullImage" not in log, [line for line in log.splitlines() if "PullImage" in line][:3]
    assert runtime.images() >= {seeing.images.WORKLOAD, seeing.images.SANDBOX}
