"""We test the DRA backend end to end on a real scheduler and kubelet (deploy/overlays/dra applied on top of base):
- the overlay applies, and the agent restarted on its config publishes one ResourceSlice device per card with
  a `shares` capacity, registers its DRA kubelet plugin, and still serves gpushard.io/gpu for quota;
- a fractional pod gets a claim from the webhook's template, the real scheduler allocates it on a card,
  consuming the pod's shares of it, and binds the pod; the real kubelet has the agent prepare the claim
  (its CDI spec written with the pod's fraction);
- a pod that no card has room for stays Pending, the scheduler saying why, while two others share the cards;
- the kubelet opens the agent's DRA health stream, and a card's Xid reaches the status of the pod whose claim
  holds it (allocatedResourcesStatus `claim:<the pod's claim name>`: Healthy, then Unhealthy).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import components, objects

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.gpushard.io"


@pytest.fixture(scope="module")
def dra(kubectl, installed, agent):
    done = installed.apply(ROOT / "deploy" / "overlays" / "dra")
    assert done.returncode == 0, f"kubectl apply -k deploy/overlays/dra:\n{done.stderr}"
    installed.reload()
    agent.reload(expect={"gpushard.io/gpu": "200"})

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
