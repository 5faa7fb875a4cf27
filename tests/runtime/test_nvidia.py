"""We test gpushard beside NVIDIA's own components, real binaries on the real kubelet, containerd and runc, read from
inside each container (tests/runtime/nvidia.py says how they run):
- the seed's setup: NVIDIA's device plugin with the seed's ConfigMap (nvidia.com/gpu, 100 time-slicing
  replicas per card) and NVIDIA's container runtime at the toolkit's defaults. Twelve pods asking 10 to 60
  replicas, in a namespace that never opted in, are each handed replicas of several cards and see the
  device nodes of every card named: what the seed set out to fix. The kubelet's checkpoint agrees with what
  each container sees, and bench/costs.py's replay of the plugin's allocation, from the same loads, takes
  from the same cards and is one of the plugin's choices (it breaks the plugin's ties its own way);
- with ``failRequestsGreaterThanOne`` (the seed's first remedy) every ask above one replica is refused at
  admission, and a one-replica pod sees its whole card;
- the same asks as fractions through gpushard on the same node: each pod sees exactly one card, and no card
  holds more than 100 shares;
- NVIDIA's runtime in the loop for every device-list strategy of gpushard's agent, with the toolkit's
  settings hardened (docs/install.md's node setup) and at their defaults: what each container sees is what
  tests/agent/toolkit.py predicts from the agent's Allocate answer and the pod's env; a 0.25 pod sees its
  card under the shipped strategy list on both; its sidecar, a container without a share, an author's
  ``NVIDIA_VISIBLE_DEVICES=all`` and a ``kubectl debug`` container see none; a pod of a namespace that never
  opted in, its image asking ``all``, sees no card on the hardened node and every card at the defaults;
- gpushard's agent reads the same toolkit config files and says where the defaults break that promise;
- moving the node from NVIDIA's plugin to gpushard with the seed's pods running, as docs/install.md says:
  the cards they hold are withheld from gpushard's pods until they end, none of them loses its card, and no
  card is handed out by both plugins; back to NVIDIA's plugin, `gpushard audit` names the node while
  gpushard's pods still hold cards, and NVIDIA's plugin takes over once they ended.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from bench import costs
from tests.agent import toolkit
from tests.e2e import components, gpushard
from tests.runtime import images, nvidia, seeing
from tests.runtime import node as node_mod
from webhook.agent.node import allocation, nvml
from webhook.core import names

pytestmark = pytest.mark.skipif(bool(nvidia.why_not()), reason=f"gpushard e2e: {nvidia.why_not()}")

SEED_ASKS = (10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 10)  # 395 of the node's 400 replicas
FRACTION_ASKS = (10, 20, 30, 40, 50, 60, 10, 20, 30, 10, 10, 10)  # 300 of its 400 shares
IMAGE_ENV = {"NVIDIA_VISIBLE_DEVICES": "all"}  # tests/runtime/images.py: the workload image's own
# Each strategy alone, and the shipped list (deploy/base/config.yaml, the chart's config.deviceListStrategy).
STRATEGIES = {"envvar": ["envvar"], "volume-mounts": ["volume-mounts"], "cdi-cri": ["cdi-cri"],
              "shipped": ["envvar", "volume-mounts", "cdi-cri"]}


@pytest.fixture(scope="module")
def toolkit_runtime(work, runtime, cards, agent):
    made = nvidia.Toolkit(work, runtime, cards)
    yield made
    made.remove()


@pytest.fixture(scope="module")
def nvidia_plugin(work, agent, kubectl, kubelet):
    made = nvidia.Plugin(work, agent, kubectl)
    yield made
    made.stop()


@pytest.fixture
def outsider(kubectl):
    """A namespace that never opted in to gpushard."""
    name = "e2e-outsider"
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))
    yield name
    seeing.clear_namespace(kubectl, name)


def replicas_of(uid: str) -> list[str]:
    """The nvidia.com/gpu device IDs the kubelet's checkpoint holds for pod ``uid`` (``<uuid>::<replica>``)."""
    data = json.loads((components.DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint").read_text())["Data"]
    return [d for e in data.get("PodDeviceEntries") or [] if e["PodUID"] == uid and e["ResourceName"] ==
            nvidia.RESOURCE for ids in e["DeviceIDs"].values() for d in ids]


def card_by_uuid(uuid: str) -> int:
    return next(k for k in range(node_mod.CARDS) if node_mod.uuid(k) == uuid)


def seed_pod(name: str, replicas: int) -> str:
    return seeing.pod(name, seeing.container(gpu=str(replicas)))


def table(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    nvidia.record(title, header, *rows)


def test_the_seeds_pods_see_several_cards_and_the_replay_agrees(toolkit_runtime, nvidia_plugin, runtime, kubectl,
                                                                 outsider):
    toolkit_runtime.install(hardened=False)
    nvidia_plugin.start(nvidia.seed_config())
    loads = [0] * node_mod.CARDS  # replicas held per card, from the kubelet's checkpoint
    rows, differ = [], []
    for n, asked in enumerate(SEED_ASKS):
        name = f"seed-{n}"
        kubectl.apply(seed_pod(name, asked), "-n", outsider)
        pod = seeing.running(kubectl, outsider, name, explain=lambda: nvidia_plugin.tail() + runtime.tail())
        held = replicas_of(pod["metadata"]["uid"])
        assert len(held) == asked, held
        split = [sum(1 for d in held if d.split("::")[0] == node_mod.uuid(k)) for k in range(node_mod.CARDS)]
        view = seeing.seen(kubectl, outsider, name)
        held_cards = {k for k in range(node_mod.CARDS) if split[k]}
        # What the kubelet recorded and what NVIDIA's runtime gave the container are the same cards.
        assert held_cards == view.cards(), (view, split)
        assert len(view.cards()) > 1, f"{name} asked {asked} replicas and sees {view.cards()}"
        # The replay, from the same loads: the plugin takes one replica at a time from a least-loaded card, any of
        # them on a tie (its candidates come out of a Go map); the replay takes the one it took fewest from.
        replayed = costs.allocate(list(loads), nvidia.REPLICAS, asked, costs.DISTRIBUTED)
        after = [loads[k] + split[k] for k in range(node_mod.CARDS)]
        greedy = all(after[k] - 1 <= min(after) for k in held_cards)
        if not greedy or {k for k in range(node_mod.CARDS) if replayed[k]} != held_cards:
            differ.append((name, loads, split, replayed))
        loads = after
        rows.append((name, asked, split, sorted(view.cards()), replayed,
                     "same" if replayed == split else "a tie broken otherwise" if greedy else "differs"))
    table("The seed's pods (NVIDIA's device plugin, 100 replicas per card, toolkit defaults)",
          ("pod", "replicas asked", "replicas per card (checkpoint)", "cards seen inside",
           "replay's split (from the same loads)", "replay"), rows)
    assert not differ, f"bench/costs.py's replay is not what NVIDIA's plugin does: {differ}"
    # A card is anyone's whole card: the pods that see card 0 may use the sum of their asks there.
    assert all(sum(r[1] for r in rows if k in r[3]) > nvidia.REPLICAS for k in range(node_mod.CARDS))
    seeing.clear_namespace(kubectl, outsider)


def test_fail_requests_greater_than_one_refuses_every_fraction(toolkit_runtime, nvidia_plugin, runtime, kubectl,
                                                               outsider):
    toolkit_runtime.install(hardened=False)
    nvidia_plugin.stop()
    nvidia_plugin.start(nvidia.seed_config(fail_requests_greater_than_one=True))
    kubectl.apply(seed_pod("ten", 10), "-n", outsider)
    refused = components.wait_for("the 10-replica pod refused", lambda: (lambda p: p if p["status"].get(
        "phase") == "Failed" else None)(kubectl.json("get", "pod", "ten", "-n", outsider)), timeout=90)
    assert refused["status"]["reason"] == "UnexpectedAdmissionError", refused["status"]
    assert "maximum request size for shared resources is 1" in refused["status"]["message"], refused["status"]
    kubectl.apply(seed_pod("one", 1), "-n", outsider)
    seeing.running(kubectl, outsider, "one", explain=nvidia_plugin.tail)
    view = seeing.seen(kubectl, outsider, "one")
    assert len(view.cards()) == 1, view  # one replica, and the whole card to use
    table("failRequestsGreaterThanOne: true", ("pod", "replicas asked", "result"),
          [("ten", 10, f"{refused['status']['reason']}: {refused['status']['message'][:90]}"),
           ("one", 1, f"runs, sees /dev/nvidia{min(view.cards())} (the whole card)")])
    nvidia_plugin.stop()
    nvidia_plugin.start(nvidia.seed_config())
    seeing.clear_namespace(kubectl, outsider)


def test_the_same_asks_through_gpushard_see_one_card_each(toolkit_runtime, nvidia_plugin, runtime, kubectl,
                                                         namespace):
    toolkit_runtime.install(hardened=False)
    rows, by_card = [], {}
    for n, asked in enumerate(FRACTION_ASKS):
        # One after the other, as the seed's pods reached their node: each placed on what the last left.
        kubectl.apply(seeing.pod(f"frac-{n}", seeing.container(gpu=f"{asked / 100:.2f}")), "-n", namespace)
        seeing.running(kubectl, namespace, f"frac-{n}", explain=runtime.tail)
        card = seeing.card_of(kubectl, namespace, f"frac-{n}")
        view = seeing.seen(kubectl, namespace, f"frac-{n}")
        assert view.cards() == {card}, view
        by_card[card] = by_card.get(card, 0) + asked
        rows.append((f"frac-{n}", f"{asked / 100:.2f}", card, sorted(view.cards())))
    assert max(by_card.values()) <= 100, by_card
    table("The same asks as fractions through gpushard (same node, toolkit defaults)",
          ("pod", "nvidia.com/gpu", "card (gpushard.io/card)", "cards seen inside"), rows)


def model_sees(strategy: tuple[str, ...], card: int | None, pod_env: dict, hardened: bool, cdi: bool,
               extra_env: dict | None = None) -> set[int]:
    """What tests/agent/toolkit.py says the container sees: the agent's Allocate answer for card ``card`` (None: the
    container holds no share), merged as the kubelet merges it, through the toolkit's rules."""
    cards = [nvml.Card(k, node_mod.uuid(k), "Fake GPU 16GB", 16384) for k in range(node_mod.CARDS)]
    answer = allocation.Allocation()
    if card is not None:
        resource = allocation.Resource(f"gpushard.io/card-{card}", "x.sock", card)
        answer = allocation.allocate(resource, [f"card-{card}-0"], cards, 100, strategy)
    env = list(IMAGE_ENV.items()) + sorted(answer.envs.items()) + list(pod_env.items()) + list(
        (extra_env or {}).items())
    container = toolkit.Container(env, [(m.host_path, m.container_path) for m in answer.mounts],
                                  list(answer.cdi_devices))
    node = toolkit.Node(accept_envvar_unprivileged=not hardened, accept_volume_mounts=hardened, runtime_cdi=cdi)
    return {card_by_uuid(u) for u in toolkit.visible_cards(container, node, [(c.index, c.uuid) for c in cards])}


def pod_env(kubectl, namespace: str, name: str, container: str = "main") -> dict:
    spec = kubectl.json("get", "pod", name, "-n", namespace)["spec"]
    every = spec["containers"] + spec.get("initContainers", []) + spec.get("ephemeralContainers", [])
    chosen = next(c for c in every if c["name"] == container)
    return {e["name"]: e.get("value", "") for e in chosen.get("env") or []}


@pytest.mark.parametrize("hardened", [True, False], ids=["hardened", "toolkit-defaults"])
@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_what_containers_see_with_nvidias_runtime(strategy_name, hardened, toolkit_runtime, nvidia_plugin, agent,
                                                  runtime, kubectl, namespace, outsider):
    nvidia_plugin.stop()  # NVIDIA's plugin would hand out the same cards: only gpushard's agent here
    toolkit_runtime.install(hardened=hardened)
    before = seeing.configure(kubectl, deviceListStrategy=STRATEGIES[strategy_name])
    try:
        agent.reload(expect=seeing.per_card(node_mod.CARDS))
        strategy = tuple(STRATEGIES[strategy_name])
        kubectl.apply(seeing.pod("quarter", seeing.container(gpu="0.25"), seeing.container("sidecar-app"),
                                 seeing.container("greedy", env={"NVIDIA_VISIBLE_DEVICES": "all"})), "-n", namespace)
        kubectl.apply(seeing.pod("outside", seeing.container()), "-n", outsider)
        seeing.running(kubectl, namespace, "quarter", explain=lambda: runtime.tail() + "\n".join(
            toolkit_runtime.errors()))
        seeing.running(kubectl, outsider, "outside", explain=runtime.tail)
        card = seeing.card_of(kubectl, namespace, "quarter")
        kubectl.run("debug", "quarter", "-n", namespace, "--container=dbg", f"--image={images.WORKLOAD}",
                    "--image-pull-policy=Never", "--profile=general", "--", "/bin/sh", "-c",
                    seeing.REPORT + "; exec sleep 100000")
        observed, predicted = {}, {}
        for who, ns, pod, container, holds in (("0.25 pod", namespace, "quarter", "main", card),
                                               ("its sidecar", namespace, "quarter", "sidecar-app", None),
                                               ("author's all", namespace, "quarter", "greedy", None),
                                               ("kubectl debug", namespace, "quarter", "dbg", None),
                                               ("outsider, image all", outsider, "outside", "main", None)):
            view = seeing.seen(kubectl, ns, pod, container, timeout=90)
            observed[who] = view.cards()
            predicted[who] = model_sees(strategy, holds, pod_env(kubectl, ns, pod, container), hardened, runtime.cdi)
        row = (strategy_name, "hardened" if hardened else "defaults", runtime.label,
               *(",".join(map(str, sorted(observed[w]))) or "none" for w in observed))
        nvidia.record("Cards seen inside with NVIDIA's runtime (cdi mode) in the loop, gpushard's agent alone",
                      ("strategy", "toolkit", "runtime", *observed), row)
        assert observed == predicted, f"NVIDIA's runtime against tests/agent/toolkit.py: {observed} != {predicted}"
        for who in ("its sidecar", "author's all", "kubectl debug"):
            assert observed[who] == set(), (who, observed)
        if strategy_name == "shipped":
            assert observed["0.25 pod"] == {card}, observed
        if hardened:
            assert observed["outsider, image all"] == set(), observed
        else:
            assert observed["outsider, image all"] == set(range(node_mod.CARDS)), observed
    finally:
        seeing.clear_namespace(kubectl, namespace)
        seeing.clear_namespace(kubectl, outsider)
        seeing.set_config(kubectl, before)


def test_the_agent_says_where_the_toolkit_breaks_the_promise(toolkit_runtime, agent, kubectl):
    """The same config files NVIDIA's runtime just ran with, read by gpushard's agent: the Node's annotation, the
    agent's log and `gpushard status` name the toolkit's defaults (each card's inventory entry says it); the
    hardened file is named as such."""
    seen = {}
    for hardened in (False, True):
        toolkit_runtime.install(hardened=hardened)
        agent.reload(expect=seeing.per_card(node_mod.CARDS))
        def published(want=hardened):
            raw = kubectl.json("get", "node", components.NODE_NAME)["metadata"]["annotations"].get(
                names.INVENTORY_ANNOTATION)
            said = [e.get(names.INVENTORY_TOOLKIT) for e in json.loads(raw or "[]")]
            return said[0] if said and all(s and s["hardened"] is want for s in said) else None
        verdict = components.wait_for("the toolkit's verdict in the Node's inventory", published, timeout=60,
                                      explain=agent.tail)
        assert verdict["config"] == str(toolkit_runtime.config), verdict
        assert verdict["acceptVolumeMounts"] is hardened and verdict["acceptEnvvarWhenUnprivileged"] is not hardened
        status = subprocess.run([gpushard.GPUSHARD, "status", f"--kubeconfig={kubectl.config}"], capture_output=True,
                                text=True, timeout=90)
        assert status.returncode == 0, status.stderr
        seen[hardened] = status.stdout
    assert f'node: on shared node "{components.NODE_NAME}" NVIDIA\'s container toolkit accepts' in seen[False]
    assert "accepts NVIDIA_VISIBLE_DEVICES from unprivileged containers" in agent.log()
    assert "toolkit accepts" not in seen[True], seen[True]
    nvidia.record("gpushard's agent on the toolkit's config (the files NVIDIA's runtime ran with)",
                  ("toolkit", "inventory: toolkit.hardened", "gpushard status says"),
                  ("defaults", False, seen[False].split("node: ", 1)[1].splitlines()[0][:110]),
                  ("hardened", True, "nothing of the toolkit"))


def cards_of_replicas(uid: str) -> set[int]:
    return {card_by_uuid(d.split("::")[0]) for d in replicas_of(uid)}


def gpushard_cli(kubectl, *args: str) -> str:
    done = subprocess.run([gpushard.GPUSHARD, *args, f"--kubeconfig={kubectl.config}"], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode in (0, 1), done.stderr  # audit exits 1 when it finds something
    return done.stdout


def test_moving_a_node_from_nvidias_plugin_to_gpushard_and_back(toolkit_runtime, nvidia_plugin, agent, runtime,
                                                               kubectl, namespace, outsider):
    """docs/install.md's move with the seed's pods running: none loses its card, no card is handed out by both."""
    toolkit_runtime.install(hardened=False)
    agent.stop()  # the seed's node: NVIDIA's plugin alone
    nvidia_plugin.stop()
    nvidia_plugin.start(nvidia.seed_config())
    seed = {}
    for name in ("seed-a", "seed-b"):
        kubectl.apply(seed_pod(name, 1), "-n", outsider)
        pod = seeing.running(kubectl, outsider, name, explain=nvidia_plugin.tail)
        seed[name] = (pod["metadata"]["uid"], pod["status"]["containerStatuses"][0]["containerID"],
                      seeing.seen_now(kubectl, outsider, name))
    held = set().union(*(cards_of_replicas(uid) for uid, _, _ in seed.values()))
    assert len(held) == 2, held  # one replica each, on the two least-loaded cards
    free = sorted(set(range(node_mod.CARDS)) - held)

    # The move: NVIDIA's plugin leaves the node, gpushard's agent comes.
    nvidia_plugin.stop()
    moved = time.monotonic()
    want = seeing.per_card(node_mod.CARDS)
    want.update({f"gpushard.io/card-{k}": "0" for k in held})
    agent.start(expect=want)
    offered_after = time.monotonic() - moved
    status = gpushard_cli(kubectl, "status")
    for k in sorted(held):
        assert f"node: card {k} of node \"{components.NODE_NAME}\" is held by pods of another device plugin" in status
    placed = {}
    for n in range(2 * len(free)):  # two halves fill each free card
        name = f"half-{n}"
        kubectl.apply(seeing.pod(name, seeing.container(gpu="0.5")), "-n", namespace)
        seeing.running(kubectl, namespace, name, explain=runtime.tail)
        placed[name] = seeing.card_of(kubectl, namespace, name)
        assert seeing.seen(kubectl, namespace, name).cards() == {placed[name]}
    assert set(placed.values()) == set(free), placed  # no card held by a seed pod was handed out
    kubectl.apply(seeing.pod("waiting", seeing.container(gpu="0.5")), "-n", namespace)
    time.sleep(5)
    assert kubectl.json("get", "pod", "waiting", "-n", namespace)["status"]["phase"] == "Pending"
    for name, (_uid, container, view) in seed.items():
        pod = seeing.running(kubectl, outsider, name)
        status_now = pod["status"]["containerStatuses"][0]
        assert (status_now["containerID"], status_now["restartCount"]) == (container, 0), name
        assert seeing.seen_now(kubectl, outsider, name) == view, f"{name} lost its card"
    # The seed's pods end: their cards come back. (The waiting pod stays on the card the webhook pinned it to, with
    # its no-room warning, until re-placement moves it: the tier runs no replacer, so it is deleted here.)
    kubectl.run("delete", "pod", "waiting", "-n", namespace, "--grace-period=0", "--force", check=False)
    seeing.clear_namespace(kubectl, outsider)
    ended = time.monotonic()
    agent.wait_allocatable(seeing.per_card(node_mod.CARDS), timeout=60)
    back_after = time.monotonic() - ended
    kubectl.apply(seeing.pod("after-move", seeing.container(gpu="0.5")), "-n", namespace)
    seeing.running(kubectl, namespace, "after-move", explain=runtime.tail)
    placed["after-move"] = seeing.card_of(kubectl, namespace, "after-move")
    assert placed["after-move"] in held, placed

    # And back: the agent leaves while gpushard's pods run; NVIDIA's plugin must wait until they end.
    agent.stop()
    nvidia_plugin.start(nvidia.seed_config())
    findings = gpushard_cli(kubectl, "audit", "-A")
    assert "nvidia-plugin-on-shared-node" in findings, findings
    for name in placed:
        seeing.running(kubectl, namespace, name)  # still running on their cards
    seeing.clear_namespace(kubectl, namespace)
    kubectl.apply(seed_pod("seed-after", 1), "-n", outsider)
    seeing.running(kubectl, outsider, "seed-after", explain=nvidia_plugin.tail)
    assert len(seeing.seen(kubectl, outsider, "seed-after").cards()) == 1
    seeing.clear_namespace(kubectl, outsider)
    nvidia_plugin.stop()
    agent.start(expect=seeing.per_card(node_mod.CARDS))
    table("Moving the node from NVIDIA's plugin to gpushard and back",
          ("step", "what happened"), [
              ("seed pods running (1 replica each)", f"cards {sorted(held)}"),
              ("gpushard's agent in, NVIDIA's plugin out", f"cards {sorted(held)} withheld ({offered_after:.1f} s "
               f"to registered); 0.5 pods on cards {sorted(set(placed.values()) - held)}; 5th pod Pending"),
              ("seed pods during the move", "running throughout, same containers, same device nodes"),
              ("seed pods deleted", f"held cards offered again {back_after:.1f} s later; the next 0.5 pod ran on "
               f"card {placed['after-move']}"),
              ("back: agent out, NVIDIA's plugin in", "gpushard audit: nvidia-plugin-on-shared-node while "
               "gpushard's pods run; after they ended a seed pod ran on 1 card"),
              ("cards handed out by both plugins at once", "0"),
          ])


def test_the_node_goes_back_to_runc(toolkit_runtime, agent, runtime, kubectl, namespace):
    """What the tier's other tests expect: no NVIDIA runtime, no NVIDIA plugin, gpushard's agent as shipped."""
    toolkit_runtime.remove()
    agent.reload(expect=seeing.per_card(node_mod.CARDS))
    calls = toolkit_runtime.calls()
    kubectl.apply(seeing.pod("after", seeing.container(gpu="0.25")), "-n", namespace)
    seeing.running(kubectl, namespace, "after", explain=runtime.tail)
    card = seeing.card_of(kubectl, namespace, "after")
    view = seeing.seen(kubectl, namespace, "after")
    assert toolkit_runtime.calls() == calls, "NVIDIA's runtime still ran"
    if runtime.cdi:
        assert view.cards() == {card}, view  # the shipped list's cdi-cri, injected by containerd itself
    else:
        assert view.devices == {}, view  # nothing turns the agent's answer into a device node
