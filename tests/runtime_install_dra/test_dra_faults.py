"""We test the DRA install (deploy/overlays/dra) running as real pods from gpushard's image on containerd 2.x, and the
faults of the shipped-install tier's table for this backend:
- a 0.25 pod: the scheduler allocates its claim from the agent's slice, the agent's pod prepares it, and the
  container sees that card only (and a container that asked none sees none);
- the agent's container killed with claims prepared: the running pods keep their containers and cards; a pod created
  meanwhile runs on its claim's card once the agent is back;
- the kubelet restarted, and containerd restarted, with GPU pods running: the same containers keep running, and a new
  pod runs after;
- a node reboot with GPU pods running (two bare pods and a Deployment's two): each pod comes back under its own
  name and UID on the card its claim holds, seeing that card only, and the Deployment makes no new pod.
No pod is refused by the kubelet (UnexpectedAdmissionError) in any of them: the count a pod asks besides its claim,
``gpushard.io/gpu`` (what ResourceQuota sees), is in the Node's status, served by no device plugin, so the kubelet's
device manager has nothing to refuse when it admits the node's pods before the agent is back; the kubelet retries
a claim whose driver is not there yet. Through all of them no card's claims consume more than its shares. The
figures are printed (docs/operations.md, "What happens when ..."), never asserted on time.
"""

from __future__ import annotations

import collections
import json
import time

from tests.e2e import components, objects
from tests.runtime import node, seeing
from tests.runtime_install.faults import SYSTEM, container_of, ready_webhooks, reboot
from tests.runtime_install_dra.conftest import DRIVER, slice_devices

SHARES = 100
REFUSED = "UnexpectedAdmissionError"


def claims_within_shares(kubectl) -> dict[str, int]:
    """Shares the allocated claims consume per device of gpushard's driver; each at or under a card's worth."""
    held: dict[str, int] = collections.Counter()
    for claim in kubectl.json("get", "resourceclaims", "-A")["items"]:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") == DRIVER:
                held[result["device"]] += int((result.get("consumedCapacity") or {}).get("shares", 0))
    assert all(v <= SHARES for v in held.values()), held
    return dict(held)


def expect_claims_card(kubectl, namespace: str, name: str, card: int, fraction: str) -> None:
    """What the pod's container sees now (kubectl exec): the card its claim holds, and no other."""
    view = seeing.seen_now(kubectl, namespace, name)
    assert view.cards() == {card}, view.devices
    assert set(view.devices) == {f"/dev/nvidia{card}", "/dev/nvidiactl", "/dev/nvidia-uvm"}, view.devices
    assert view.env.get("GPUSHARD_FRACTION") == fraction, view.env


def container_id(pod: dict) -> str:
    return ((pod["status"].get("containerStatuses") or [{}])[0]).get("containerID", "")


def live_pods(kubectl, namespace: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in kubectl.json("get", "pods", "-n", namespace)["items"]
            if not p["metadata"].get("deletionTimestamp")}


def events_by_reason(kubectl, namespace: str) -> dict[str, int]:
    counted: dict[str, int] = collections.Counter()
    for event in kubectl.json("get", "events", "-n", namespace)["items"]:
        counted[event.get("reason", "")] += event.get("count", 1)
    return dict(counted)


def slice_back(kubectl) -> bool:
    return slice_devices(kubectl) == [f"card-{k}" for k in range(node.CARDS)]


def test_a_pod_runs_on_its_claims_card_from_the_shipped_dra_install(dra, runtime, namespace):
    kubectl = dra
    kubectl.apply(seeing.pod("quarter", seeing.container(gpu="0.25"), seeing.container("helper")), "-n", namespace)
    pod = seeing.running(kubectl, namespace, "quarter", explain=runtime.tail)
    assert [c.get("resourceClaimTemplateName") for c in pod["spec"]["resourceClaims"]] == ["gpushard-shares-25"]
    claim, card = seeing.claim_card(kubectl, namespace, "quarter")
    assert claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["shares"] == "25"
    expect_claims_card(kubectl, namespace, "quarter", card, "0.25")
    assert seeing.seen_now(kubectl, namespace, "quarter", "helper").no_card()
    # The agent's pod wrote the claim's CDI spec where the runtime reads it (the host's /var/run/cdi).
    assert (runtime.cdi_dynamic / f"gpushard.io-claim_{claim['metadata']['uid']}.json").exists()
    assert claims_within_shares(kubectl) == {f"card-{card}": 25}
    kubectl.run("delete", "pod", "quarter", "-n", namespace, "--wait=true", "--timeout=90s", timeout=100)


def test_the_agent_killed_with_claims_prepared(dra, runtime, namespace):
    kubectl = dra
    kubectl.apply(seeing.pod("steady", seeing.container(gpu="0.5")), "-n", namespace)
    steady = seeing.running(kubectl, namespace, "steady", explain=runtime.tail)
    _claim, card = seeing.claim_card(kubectl, namespace, "steady")
    agent, container = container_of(kubectl, "agent")
    killed = time.monotonic()
    runtime.ctr_run("tasks", "kill", "-s", "SIGKILL", container)
    # Created while the agent is down: the scheduler may allocate its claim from the slice the agent published
    # (it stays), and the kubelet admits it (the count is in the Node's status) and prepares its claim once the
    # agent is back.
    kubectl.apply(seeing.pod("meanwhile", seeing.container(gpu="0.25")), "-n", namespace)
    components.wait_for("the agent's container restarted", lambda: kubectl.json(
        "get", "pod", agent, "-n", SYSTEM)["status"]["containerStatuses"][0]["restartCount"] >= 1, timeout=120)
    meanwhile = runs(kubectl, namespace, "meanwhile", runtime)
    ran = time.monotonic() - killed
    reasons = {r: n for r, n in events_by_reason(kubectl, namespace).items() if r.startswith("Failed")
               or r == REFUSED}
    after = kubectl.json("get", "pod", "steady", "-n", namespace)
    assert container_id(after) == container_id(steady)
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    expect_claims_card(kubectl, namespace, "steady", card, "0.5")
    print(f"\ngpushard fault (dra): the agent killed with a claim prepared: the running pod kept its container and "
          f"card {card}; a pod created meanwhile {fate(kubectl, namespace, meanwhile, '0.25', ran)}; its events: "
          f"{reasons or 'none'}")
    claims_within_shares(kubectl)
    seeing.clear_namespace(kubectl, namespace)


def runs(kubectl, namespace: str, name: str, runtime, timeout: float = 180) -> dict:
    """The pod once it runs; a pod that fails (the kubelet refusing it, UnexpectedAdmissionError) fails the test."""
    pod = components.wait_for(f"pod {namespace}/{name} running, or failed", lambda: (
        lambda p: p if seeing_running(p) or p["status"].get("phase") == "Failed" else None)(
        kubectl.json("get", "pod", name, "-n", namespace)), timeout=timeout, explain=runtime.tail)
    assert pod["status"].get("phase") != "Failed", (name, pod["status"])
    return pod


def fate(kubectl, namespace: str, pod: dict, fraction: str, seconds: float) -> str:
    """Where a running pod runs: the card its claim holds, checked from inside."""
    name = pod["metadata"]["name"]
    _claim, card = seeing.claim_card(kubectl, namespace, name)
    expect_claims_card(kubectl, namespace, name, card, fraction)
    return f"ran {seconds:.1f} s after, on card {card}"


def restarted_under_pods(kubectl, runtime, namespace: str, what: str, restart) -> None:
    """Two GPU pods running, ``restart`` done: the same containers keep running on their cards; a pod created
    right after runs on its claim's card."""
    for name, gpu in (("first", "0.5"), ("second", "0.25")):
        kubectl.apply(seeing.pod(name, seeing.container(gpu=gpu)), "-n", namespace)
    before = {}
    for name, gpu in (("first", "0.5"), ("second", "0.25")):
        pod = seeing.running(kubectl, namespace, name, explain=runtime.tail)
        before[name] = (container_id(pod), seeing.claim_card(kubectl, namespace, name)[1], gpu)
    began = time.monotonic()
    restart()
    kubectl.apply(seeing.pod("after", seeing.container(gpu="0.25")), "-n", namespace)
    after = runs(kubectl, namespace, "after", runtime)
    ran = time.monotonic() - began
    for name, (container, card, gpu) in before.items():
        pod = kubectl.json("get", "pod", name, "-n", namespace)
        assert (container_id(pod), pod["status"]["containerStatuses"][0]["restartCount"]) == (container, 0), name
        expect_claims_card(kubectl, namespace, name, card, gpu)
    print(f"\ngpushard fault (dra): {what} with 2 GPU pods running: both kept their containers and cards; a pod "
          f"created right after {fate(kubectl, namespace, after, '0.25', ran)}")
    claims_within_shares(kubectl)
    seeing.clear_namespace(kubectl, namespace)


def test_the_kubelet_restarted_with_gpu_pods_running(dra, runtime, kubelet, namespace):
    restarted_under_pods(dra, runtime, namespace, "the kubelet restarted", kubelet.restart)


def test_containerd_restarted_with_gpu_pods_running(dra, runtime, namespace):
    restarted_under_pods(dra, runtime, namespace, "containerd restarted", runtime.restart)


def test_a_node_reboot_with_gpu_pods_running(dra, runtime, kubelet, namespace):
    """GPU pods running (two bare pods and a Deployment's two) when the node reboots: /var/run (the claims' CDI specs
    among it) is a tmpfs, gone. Each pod comes back under its own name and UID on the card its claim holds, seeing
    that card only; none is refused, so the Deployment makes no new pod. The install comes back by itself."""
    kubectl = dra
    for name, gpu in (("alone-a", "0.5"), ("alone-b", "0.25")):
        kubectl.apply(seeing.pod(name, seeing.container(gpu=gpu)), "-n", namespace)
    deployment = json.loads(objects.deployment("kept", "0.25", replicas=2))
    deployment["spec"]["template"]["spec"]["containers"] = [seeing.container(gpu="0.25")]
    kubectl.apply(json.dumps(deployment), "-n", namespace)

    def all_running():
        live = {n: p for n, p in live_pods(kubectl, namespace).items() if p["status"].get("phase") != "Failed"}
        return live if len(live) == 4 and all(seeing_running(p) for p in live.values()) else None
    pods = components.wait_for("four GPU pods running", all_running, timeout=180, explain=runtime.tail)
    fraction = {n: ("0.5" if n == "alone-a" else "0.25") for n in pods}
    before = {n: (p["metadata"]["uid"], container_id(p), seeing.claim_card(kubectl, namespace, n)[1])
              for n, p in pods.items()}
    _agent, agent_container = container_of(kubectl, "agent")
    booted = time.monotonic()
    reboot(kubelet, runtime, volatile=(runtime.cdi_dynamic,))

    back: dict[str, float] = {}
    seen_states: dict[str, set[str]] = collections.defaultdict(set)

    def settled():
        now = time.monotonic() - booted
        live = live_pods(kubectl, namespace)
        for name, pod in live.items():
            waiting = ((pod["status"].get("containerStatuses") or [{}])[0].get("state") or {}).get("waiting") or {}
            seen_states[name].add(pod["status"].get("phase", "") + (f"/{waiting['reason']}" if waiting else ""))
            if name not in back and seeing_running(pod) and (name not in before or container_id(pod) != before[
                    name][1]):
                back[name] = now
        kept = [n for n, p in live.items() if n.startswith("kept-") and n in back and p["status"].get("phase")
                == "Running"]
        final = all(live[n]["status"].get("phase") == "Failed" or n in back for n in ("alone-a", "alone-b"))
        return live if len(kept) == 2 and final else None
    after = components.wait_for("every pod back, or refused and replaced", settled, timeout=300,
                                explain=lambda: json.dumps({n: p["status"] for n, p in live_pods(
                                    kubectl, namespace).items()}, indent=1)[-3000:] + "\n" + kubelet.tail(30))
    agent_running = components.wait_for("the agent running a new container", lambda: (
        lambda c: c if c and c[1] != agent_container else None)(container_of(kubectl, "agent")), timeout=120)
    components.wait_for("the agent's slice offering every card", lambda: slice_back(kubectl), timeout=120)
    sliced = time.monotonic() - booted
    came_back, refused = [], {}
    for name, (uid, _container, card) in before.items():
        pod = after.get(name)
        if pod is None:
            refused[name] = "gone"
            continue
        assert pod["metadata"]["uid"] == uid, name
        if pod["status"].get("phase") == "Failed":
            assert pod["status"].get("reason") == REFUSED, (name, pod["status"])
            refused[name] = pod["status"].get("message", "")[:160]
            continue
        # Under its old name a pod is on its claim's card, and sees it only.
        assert seeing.claim_card(kubectl, namespace, name)[1] == card, name
        expect_claims_card(kubectl, namespace, name, card, fraction[name])
        came_back.append(name)
    new = sorted(n for n, p in after.items() if n not in before and seeing_running(p))
    for name in new:
        expect_claims_card(kubectl, namespace, name, seeing.claim_card(kubectl, namespace, name)[1], "0.25")
    kubectl.run("rollout", "status", "deployment/gpushard-webhook", "-n", SYSTEM, "--timeout=240s", timeout=260)
    components.wait_for("both webhook pods ready", lambda: ready_webhooks(kubectl) == 2, timeout=120)
    reasons = {r: n for r, n in events_by_reason(kubectl, namespace).items() if r.startswith("Failed")
               or r == REFUSED}
    print("\ngpushard fault (dra): a node reboot with 4 GPU pods running (claims' CDI specs gone with /var/run): "
          f"the agent {agent_running[0]} running again and its slice whole {sliced:.1f} s after power-on; back on "
          f"their claims' cards: {sorted(came_back) or 'none'}; refused by the kubelet: {len(refused)} of "
          f"{len(before)} {refused or ''}; replacements running: {new or 'none'}; running again at: "
          + ", ".join(f"{n} {back[n]:.1f} s" for n in sorted(back))
          + "; what the pods showed meanwhile: " + "; ".join(f"{n} {sorted(seen_states[n])}" for n in sorted(before))
          + f"; their events: {reasons or 'none'}")
    claims_within_shares(kubectl)
    # No GPU pod lost: every one back under its own name and UID, none refused, none replaced.
    assert (refused, sorted(came_back), new) == ({}, sorted(before), []), (refused, came_back, new)
    assert REFUSED not in reasons, reasons
    kubectl.run("delete", "deployment", "kept", "-n", namespace, "--wait=false")
    seeing.clear_namespace(kubectl, namespace)


def seeing_running(pod: dict) -> bool:
    statuses = pod["status"].get("containerStatuses") or []
    return pod["status"].get("phase") == "Running" and bool(statuses) and all(
        s.get("state", {}).get("running") for s in statuses)

