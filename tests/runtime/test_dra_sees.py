"""We test what containers see under the DRA backend (deploy/overlays/dra) on a real containerd and runc, read
from inside each container:
- on a runtime with CDI, a 0.25 pod's container sees the node of the card its claim was allocated and no other,
  the control nodes, NVIDIA's `void`, and gpushard's own edits (GPUSHARD_FRACTION from the claim's CDI spec);
  deleting the pod unprepares the claim and removes gpushard's spec; a container without a claim sees no card;
- on a runtime without CDI (containerd 1.6), where the claim's devices would be dropped and the container would
  start without its card, the node takes no claim: the agent's slice offers no card, the pod stays Pending with
  the scheduler's reason, and the agent's log and the Node's inventory say why;
- a claim whose CDI device the runtime cannot resolve fails the container with the runtime's reason in the pod's
  events, and the container never starts without its card.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import components
from tests.runtime import node, seeing

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "gpu.gpushard.io"


def slice_devices(kubectl) -> list[str] | None:
    slices = kubectl.json("get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}")["items"]
    ours = [s for s in slices if s["spec"].get("nodeName") == components.NODE_NAME]
    return sorted(d["name"] for d in ours[0]["spec"].get("devices") or []) if ours else None


@pytest.fixture(scope="module")
def dra(kubectl, installed, agent, kubelet):
    seeing.clear(kubectl)  # the device plugin tests' pods hold gpushard.io/gpu until they are gone
    done = installed.apply(ROOT / "deploy" / "overlays" / "dra", leave=seeing.IMAGE_WORKLOADS)
    assert done.returncode == 0, f"kubectl apply -k deploy/overlays/dra:\n{done.stderr}"
    installed.reload()
    agent.reload_dra(str(100 * node.CARDS))
    components.wait_for("the agent's ResourceSlice", lambda: slice_devices(kubectl) is not None, timeout=60,
                        explain=agent.tail)
    return kubectl


def test_dra_claim_gives_its_card_or_none_is_taken(dra, runtime, agent, kubectl, namespace):
    kubectl.apply(seeing.pod("quarter", seeing.container(gpu="0.25"), seeing.container("helper")), "-n", namespace)
    if not runtime.cdi:
        components.wait_for("the slice offering no card", lambda: slice_devices(kubectl) == [], timeout=60,
                            explain=agent.tail)

        # The first verdict may still name gpushard.io/gpu while the kubelet takes the restarted agent's plugin
        # back; the node's update sends the pod round again.
        def no_claim():
            pod = kubectl.json("get", "pod", "quarter", "-n", namespace)
            return next((c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"
                         and c.get("reason") == "Unschedulable" and "cannot allocate all claims" in c["message"]),
                        None)
        components.wait_for("the scheduler's verdict: no claim can be allocated", no_claim, timeout=120,
                            explain=lambda: json.dumps(kubectl.json("get", "pod", "quarter", "-n", namespace)[
                                "status"].get("conditions"), indent=1))
        pod = kubectl.json("get", "pod", "quarter", "-n", namespace)
        assert not pod["spec"].get("nodeName") and not pod["status"].get("containerStatuses")
        assert f"{runtime.label.replace(' ', '://')}" in agent.log() and "has no CDI" in agent.log()
        inventory = json.loads(kubectl.json("get", "node", components.NODE_NAME)["metadata"]["annotations"][
            "gpushard.io/inventory"])
        assert all("has no CDI" in card["draRefused"] for card in inventory), inventory
        return
    components.wait_for("every card in the slice", lambda: slice_devices(kubectl) == [
        f"card-{k}" for k in range(node.CARDS)], timeout=60, explain=agent.tail)
    seeing.running(kubectl, namespace, "quarter", explain=runtime.tail)
    claim, card = seeing.claim_card(kubectl, namespace, "quarter")
    view = seeing.seen(kubectl, namespace, "quarter")
    assert view.cards() == {card}, view.devices
    assert set(view.devices) == {f"/dev/nvidia{card}", "/dev/nvidiactl", "/dev/nvidia-uvm"}, view.devices
    assert view.env["GPUSHARD_FRACTION"] == "0.25"
    assert view.visible == "void", view.env  # NVIDIA's spec: the devices are there, no hook is to add any
    assert seeing.seen(kubectl, namespace, "quarter", "helper").no_card()
    spec = runtime.cdi_dynamic / f"gpushard.io-claim_{claim['metadata']['uid']}.json"
    assert spec.exists()
    kubectl.run("delete", "pod", "quarter", "-n", namespace, "--grace-period=0", "--force")
    components.wait_for(f"{spec.name} removed on unprepare", lambda: not spec.exists(), timeout=90,
                        explain=agent.tail)


def test_unresolvable_cdi_device_fails_the_container_visibly(dra, runtime, cards, agent, kubectl, namespace):
    if not runtime.cdi:
        pytest.skip(f"{runtime.label} takes no DRA claim at all (the test above)")
    nvidia = cards.specs / node.NVIDIA_CDI_SPEC
    hidden = cards.folder / (node.NVIDIA_CDI_SPEC + ".hidden")
    nvidia.rename(hidden)
    try:
        kubectl.apply(seeing.pod("orphan", seeing.container(gpu="0.5")), "-n", namespace)

        def refused():
            events = kubectl.json("get", "events", "-n", namespace, "--field-selector",
                                  "involvedObject.name=orphan")["items"]
            return next((e for e in events if "unresolvable CDI devices" in e.get("message", "")), None)
        event = components.wait_for("the runtime's refusal in the pod's events", refused, timeout=120,
                                    explain=runtime.tail)
        _claim, card = seeing.claim_card(kubectl, namespace, "orphan")
        assert f"nvidia.com/gpu={node.uuid(card)}" in event["message"], event["message"]
        statuses = kubectl.json("get", "pod", "orphan", "-n", namespace)["status"].get("containerStatuses") or []
        assert statuses and not statuses[0]["state"].get("running"), statuses
    finally:
        hidden.rename(nvidia)
        kubectl.run("delete", "pod", "orphan", "-n", namespace, "--grace-period=0", "--force", check=False)
