"""We test the DRA backend end to end on a real scheduler and kubelet (deploy/overlays/dra applied on top of base):
- the overlay applies, and the agent restarted on its config publishes one ResourceSlice device per card with
  a `shares` capacity, registers its DRA kubelet plugin, and writes gpushard.io/gpu (for quota) into the Node's
  status, as the agent-own-count policy lets it: first it sees the real kubelet still count gpushard.io/gpu as
  the device-plugin backend's (its checkpoint lists it; none allocatable) and writes nothing, then, the kubelet
  started again without that checkpoint, it writes the count;
- a fractional pod gets a claim from the webhook's template, the real scheduler allocates it on a card,
  consuming the pod's shares of it, and binds the pod; the real kubelet has the agent prepare the claim
  (its CDI spec written with the pod's fraction);
- a pod that no card has room for stays Pending, the scheduler saying why, while two others share the cards;
- a cordoned card (`gpushard cordon`) leaves the agent's slice: the real allocator puts every new claim on
  the other card, `gpushard status` shows the cordon, and uncordon brings the device back;
- the kubelet opens the agent's DRA health stream, and a card's Xid reaches the status of the pod whose claim
  holds it (allocatedResourcesStatus `claim:<the pod's claim name>`: Healthy, then Unhealthy);
- the node hint on the real scheduler: over nodes without kubelets whose slices are written as the agent
  writes them, each half-card pod gets a preferred term from the webhook's view (slices and claims), the
  scheduler binds it there and its allocator takes a card there; six halves fill three cards, none half
  empty;
- memory asks: a pod asking GPU memory gets the shares of the smallest card size that holds it and a claim
  from a template asking one card of that size (which the dra overlay's policy lets the webhook make); the
  real allocator gives it a card of that size only.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.e2e import components, gpushard, objects
from webhook.core import draobjects
from webhook.core import names as gpushard_names

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.gpushard.io"
# The chart refuses backend dra before 1.36 (docs/compatibility.md): consumable capacity and the
# kubelet's device health are alpha and off there.
pytestmark = pytest.mark.kubernetes(36, "backend dra needs 1.36 (DRAConsumableCapacity, ResourceHealthStatus: "
                                        "alpha before)")


@pytest.fixture(scope="module")
def dra(kubectl, installed, agent):
    done = installed.apply(ROOT / "deploy" / "overlays" / "dra")
    assert done.returncode == 0, f"kubectl apply -k deploy/overlays/dra:\n{done.stderr}"
    installed.reload()
    # The kubelet ran the device-plugin backend: the agent waits out its hold on gpushard.io/gpu, then writes it.
    agent.reload_dra("200")

    def slice_devices():
        slices = kubectl.json("get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
        ours = [s for s in slices if s["spec"].get("nodeName") == components.NODE_NAME]
        return ours[0]["spec"]["devices"] if ours else None
    devices = components.wait_for("the agent's ResourceSlice", slice_devices, timeout=60, explain=agent.tail)
    return devices


def claim_of(kubectl, namespace: str, pod: dict) -> dict:
    statuses = pod.get("status", {}).get("resourceClaimStatuses", [])
    name = next(s["resourceClaimName"] for s in statuses if s["name"] == "gpushard-gpu")
    return kubectl.json("get", "resourceclaim", name, "-n", namespace)


def test_slice_has_a_device_per_card_with_shares(dra):
    assert sorted(d["name"] for d in dra) == ["card-0", "card-1"]
    for device in dra:
        assert device["capacity"]["shares"]["value"] == "100"
        assert device.get("allowMultipleAllocations") is True


def test_fraction_allocated_by_the_scheduler_and_prepared_by_the_agent(dra, kubectl, namespace, agent, kubelet):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("quarter", objects.container(gpu="0.25")))
    pod = kubectl.json("get", "pod", "quarter", "-n", namespace)
    assert [c.get("resourceClaimTemplateName") for c in pod["spec"]["resourceClaims"]] == ["gpushard-shares-25"]
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"gpushard.io/gpu": "25"}

    pod = components.wait_for("the pod bound", lambda: (lambda p: p if p["spec"].get("nodeName") else None)(
        kubectl.json("get", "pod", "quarter", "-n", namespace)), timeout=90, explain=agent.tail)
    claim = claim_of(kubectl, namespace, pod)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 1 and results[0]["driver"] == DRIVER and results[0]["device"] in ("card-0", "card-1")
    assert results[0]["consumedCapacity"]["shares"] == "25"
    spec = agent.folder / "cdi" / f"gpushard.io-claim_{claim['metadata']['uid']}.json"
    components.wait_for(f"the claim's CDI spec {spec.name}", spec.exists, timeout=60,
                        explain=lambda: agent.tail() + "\n" + kubelet.tail(20))
    env = [e for d in json.loads(spec.read_text())["devices"] for e in d["containerEdits"].get("env", [])]
    assert "GPUSHARD_FRACTION=0.25" in env


def test_pod_no_card_fits_pending_with_the_schedulers_reason(dra, kubectl, namespace):
    # 3 x 55 shares fit in the node's 200 (so gpushard.io/gpu is no reason), and each card holds only one.
    for name in ("big-a", "big-b", "big-c"):
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(name, objects.container(gpu="0.55")))

    def placed():
        pods = {p["metadata"]["name"]: p for p in kubectl.json("get", "pods", "-n", namespace)["items"]}
        waiting = [p for p in pods.values() if any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in p["status"].get(
                "conditions", []))]
        bound = [p for p in pods.values() if p["spec"].get("nodeName")]
        return (bound, waiting) if len(bound) + len(waiting) == 3 and waiting else None
    bound, waiting = components.wait_for("two pods bound and one left waiting", placed, timeout=90)
    # Another test's quarter may still hold a card: two of 0.55 fit beside it, and a third never does.
    assert len(bound) <= 2 and len(waiting) >= 1
    message = next(c["message"] for c in waiting[0]["status"]["conditions"] if c["type"] == "PodScheduled")
    assert "cannot allocate all claims" in message, message


def test_cordoned_card_leaves_the_slice_and_gets_no_new_claim(dra, kubectl, namespace, agent, plane):
    def cli(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([gpushard.GPUSHARD, *args, f"--kubeconfig={plane.kubectl.config}"],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    def devices() -> list[str]:
        slices = kubectl.json("get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
        return sorted(d["name"] for s in slices if s["spec"].get("nodeName") == components.NODE_NAME
                      for d in s["spec"].get("devices") or [])
    cli("cordon", components.NODE_NAME, "1", "--reason", "e2e maintenance (dra)")
    try:
        components.wait_for("card-1 out of the slice", lambda: devices() == ["card-0"], timeout=60,
                            explain=agent.tail)
        for i in range(3):
            kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(f"tenth-{i}",
                                                                               objects.container(gpu="0.1")))
            pod = components.wait_for(f"tenth-{i} bound", lambda i=i: (lambda p: p if p["spec"].get("nodeName")
                                      else None)(kubectl.json("get", "pod", f"tenth-{i}", "-n", namespace)),
                                      timeout=60, explain=agent.tail)
            result = claim_of(kubectl, namespace, pod)["status"]["allocation"]["devices"]["results"][0]
            assert result["device"] == "card-0", result
        status = cli("status", "--config", str(agent.folder / "config.yaml"))
        assert "cordoned" in status.stdout, status.stdout
    finally:
        cli("uncordon", components.NODE_NAME, "1")
    components.wait_for("card-1 back in the slice", lambda: devices() == ["card-0", "card-1"], timeout=60,
                        explain=agent.tail)
    kubectl.run("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False)


def test_card_going_bad_reaches_the_pods_status(dra, kubectl, namespace, agent, kubelet):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("watched", objects.container(gpu="0.2")))
    pod = components.wait_for("the pod bound", lambda: (lambda p: p if p["spec"].get("nodeName") else None)(
        kubectl.json("get", "pod", "watched", "-n", namespace)), timeout=90, explain=agent.tail)
    claim = claim_of(kubectl, namespace, pod)
    # The kubelet names the entry by the container's claim (resources.claims), not the generated claim.
    card = int(claim["status"]["allocation"]["devices"]["results"][0]["device"].removeprefix("card-"))

    def claim_health() -> set[str]:
        statuses = kubectl.json("get", "pod", "watched", "-n", namespace)["status"].get("containerStatuses") or [{}]
        return {d["health"] for r in statuses[0].get("allocatedResourcesStatus") or []
                if r["name"] == "claim:gpushard-gpu" for d in r.get("resources", [])}
    components.wait_for("the claim's device Healthy in the pod's status", lambda: claim_health() == {"Healthy"},
                        timeout=90, explain=lambda: f"{claim_health()}\n{agent.tail()}\n{kubelet.tail(20)}")
    agent.put(f"xid-{card}", "79")
    components.wait_for("the card's Xid in the pod's status", lambda: claim_health() == {"Unhealthy"},
                        timeout=90, explain=lambda: f"{claim_health()}\n{agent.tail()}\n{kubelet.tail(20)}")


POOL_LABEL = "e2e.gpushard.io/pool"


@contextlib.contextmanager
def nodes_without_kubelets(kubectl, names: list[str], cards: int = 2, memory_mib: int = 81559,
                           model: str = "NVIDIA H100 80GB HBM3"):
    """Nodes as the kubelet and the agent (backend dra) would report them, with their ResourceSlices; their
    Leases renewed meanwhile, so the node lifecycle controller keeps them Ready. Removed afterwards."""
    stop = threading.Event()

    def leases() -> str:
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": n, "namespace": "kube-node-lease"},
             "spec": {"holderIdentity": n, "leaseDurationSeconds": 40, "renewTime": now}} for n in names]})

    def renew() -> None:
        while not stop.wait(5):
            kubectl.run("apply", "-f", "-", input=leases(), check=False)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "gpushard.io/gpu": str(cards * 100)}
    for n in names:
        kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": {
            "kubernetes.io/hostname": n, "gpushard.io/cards": str(cards), POOL_LABEL: "hint",
            **{gpushard_names.card_memory_label(k): str(memory_mib) for k in range(cards)}}}}))
        kubectl.run("patch", "node", n, "--subresource=status", "--type=merge", "-p", json.dumps({"status": {
            "capacity": resources, "allocatable": resources, "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "no kubelet: the test's",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}]}}))
        kubectl.run("patch", "node", n, "--type=merge", "-p", json.dumps({"spec": {"taints": None}}))
        facts = [draobjects.CardFacts(k, f"GPU-{n}-{k}", model, memory_mib) for k in range(cards)]
        kubectl.apply(json.dumps(draobjects.resource_slice(n, facts, 100, 1)))
    kubectl.apply(leases())
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        yield names
    finally:
        stop.set()
        renewer.join(timeout=30)
        for n in names:
            kubectl.run("delete", "resourceslice", draobjects.slice_name(n), "--ignore-not-found", check=False)
            kubectl.run("delete", "node", n, "--ignore-not-found", "--wait=false", check=False)
            kubectl.run("delete", "lease", n, "-n", "kube-node-lease", "--ignore-not-found", check=False)


def test_node_hint_packs_on_the_real_scheduler(dra, kubectl, namespace):
    with nodes_without_kubelets(kubectl, ["hint-0", "hint-1", "hint-2"]):
        time.sleep(2)  # the webhook's view watches the slices
        placed = []
        for i in range(6):
            name = f"half-{i}"
            kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
                name, objects.container(gpu="0.5"), nodeSelector={POOL_LABEL: "hint"}))
            spec = kubectl.json("get", "pod", name, "-n", namespace)["spec"]
            terms = spec.get("affinity", {}).get("nodeAffinity", {}).get(
                "preferredDuringSchedulingIgnoredDuringExecution", [])
            hinted = [t["preference"]["matchFields"][0]["values"][0] for t in terms]
            assert len(hinted) == 1 and hinted[0].startswith("hint-"), f"{name}: {terms}"
            pod = components.wait_for(f"{name} bound", lambda name=name: (
                lambda p: p if p["spec"].get("nodeName") else None)(kubectl.json("get", "pod", name, "-n", namespace)),
                timeout=60)
            result = claim_of(kubectl, namespace, pod)["status"]["allocation"]["devices"]["results"][0]
            assert pod["spec"]["nodeName"] == hinted[0] == result["pool"], f"{name}: hinted {hinted}, {result}"
            placed.append((result["pool"], result["device"]))
            # The next choice must see this claim: the view counts it from the watch.
            time.sleep(0.5)
        cards = {(node, device): placed.count((node, device)) for node, device in placed}
        assert sorted(cards.values()) == [2, 2, 2], f"six halves over {cards}"
        kubectl.run("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False)


def bound(kubectl, namespace: str, name: str) -> dict:
    return components.wait_for(f"{name} bound", lambda: (lambda p: p if p["spec"].get("nodeName") else None)(
        kubectl.json("get", "pod", name, "-n", namespace)), timeout=60)


def test_memory_asks_get_a_card_of_the_size_their_shares_are_for(dra, kubectl, namespace):
    with nodes_without_kubelets(kubectl, ["mem-l4"], memory_mib=23034, model="NVIDIA L4"), \
            nodes_without_kubelets(kubectl, ["mem-h100"]):
        time.sleep(2)  # the webhook's view watches the slices
        asks = {"small": ("12Gi", 54, 23034, "mem-l4"),  # ceil(12288 x 100 / 23034): the L4 holds it
                "large": ("40Gi", 51, 81559, "mem-h100")}  # only the H100 holds 40 GiB
        for name, (memory, shares, size, node) in asks.items():
            kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
                name, objects.container(gpu=memory, resource="gpushard.io/memory"),
                nodeSelector={POOL_LABEL: "hint"}))
            pod = bound(kubectl, namespace, name)
            template = f"gpushard-shares-{shares}-mib-{size}"
            assert [c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]] == [template]
            assert pod["spec"]["containers"][0]["resources"]["limits"] == {"gpushard.io/gpu": str(shares)}
            assert pod["metadata"]["annotations"]["gpushard.io/card-memory-mib"] == str(size)
            made = kubectl.json("get", "resourceclaimtemplate", template, "-n", namespace)
            assert made["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gpushard"}
            result = claim_of(kubectl, namespace, pod)["status"]["allocation"]["devices"]["results"][0]
            assert (pod["spec"]["nodeName"], result["pool"]) == (node, node), result
            assert result["consumedCapacity"]["shares"] == str(shares)
        # The real allocator keeps a sized claim off cards of another size, even with room there and the
        # webhook's hint bent to name such a node: the pod binds to a card of its size.
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
            "bent", objects.container(gpu="12Gi", resource="gpushard.io/memory"),
            nodeSelector={POOL_LABEL: "hint"}, affinity={"nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
                    "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["mem-h100"]}]}}]}}))
        pod = bound(kubectl, namespace, "bent")
        assert pod["spec"]["nodeName"] == "mem-l4"
        kubectl.run("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False)


EXTENDED = "example.com/gpushard-units"


@pytest.mark.kubernetes(37, "DeviceClass extendedResourceName is GA from 1.37 (DRAExtendedResource, KEP-5004)")
@pytest.mark.parametrize("namespace", [""], indirect=True)
def test_an_extended_resource_from_gpushards_class_takes_whole_distinct_cards(dra, kubectl, namespace, agent):
    """KEP-5004 on gpushard's slice: a DeviceClass of gpushard's driver with an extendedResourceName, and pods asking
    that resource (no claim of their own). The scheduler asks one device per unit (ExactCount, no capacity), so each
    unit takes a whole card (the devices' default request is the card's every share), and the units of one pod are
    always distinct cards: a fraction cannot be asked this way, and two units are the seed's two cards."""
    # Whole cards are asked: the other tests' pods (their namespaces go away without waiting) must have let go.
    for other in kubectl.json("get", "namespaces")["items"]:
        name = other["metadata"]["name"]
        if name.startswith("e2e-") and name != namespace:
            kubectl.run("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false",
                        check=False)
    components.wait_for("no claim allocated on gpushard's cards", lambda: not [
        c for c in kubectl.json("get", "resourceclaims", "-A")["items"] if (c.get("status") or {}).get("allocation")],
        timeout=120, explain=agent.tail)
    # ... and both cards in the slice: an earlier test's Xid keeps its card out until the agent starts again.
    agent.reload(expect={"gpushard.io/gpu": "200"})

    def both_cards():
        slices = kubectl.json("get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
        return {d["name"] for s in slices if s["spec"].get("nodeName") == components.NODE_NAME
                for d in s["spec"]["devices"]} == {"card-0", "card-1"}
    components.wait_for("both cards in the agent's slice", both_cards, timeout=60, explain=agent.tail)
    kubectl.apply(json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                              "metadata": {"name": "units.gpushard.example"},
                              "spec": {"extendedResourceName": EXTENDED, "selectors": [
                                  {"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}))
    try:
        for name, units in (("units-2", "2"), ("units-25", "25")):
            kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
                name, objects.container(gpu=units, resource=EXTENDED)))

        def scheduled(name):
            def check():
                pod = kubectl.json("get", "pod", name, "-n", namespace)
                if pod["spec"].get("nodeName"):
                    return pod
                why = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"
                       and c.get("reason") == "Unschedulable"]
                return pod if why else None
            return components.wait_for(f"{name} bound or refused by the scheduler", check, timeout=90,
                                       explain=agent.tail)
        two, many = scheduled("units-2"), scheduled("units-25")
        assert two["spec"].get("nodeName") == components.NODE_NAME, [
            c.get("message") for c in two["status"].get("conditions", [])]
        status = two["status"]["extendedResourceClaimStatus"]
        claim = kubectl.json("get", "resourceclaim", status["resourceClaimName"], "-n", namespace)
        assert claim["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
        results = claim["status"]["allocation"]["devices"]["results"]
        assert sorted(r["device"] for r in results) == ["card-0", "card-1"], results  # one pod, two cards
        assert {r["consumedCapacity"]["shares"] for r in results} == {"100"}, results  # each card whole
        assert not many["spec"].get("nodeName")
        message = next(c["message"] for c in many["status"]["conditions"] if c["type"] == "PodScheduled")
        assert "Insufficient" in message or "cannot allocate" in message, message
    finally:
        kubectl.run("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False)
        kubectl.run("delete", "deviceclass", "units.gpushard.example", "--ignore-not-found", check=False)
