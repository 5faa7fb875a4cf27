"""We test gpushard on a real kubelet, the agent registered through the kubelet's own device-plugin API:
- the agent, with a token bound to its DaemonSet's pod, registers every card: the node advertises each card's
  shares and their sum, and carries the inventory and card count gpushard publishes;
- a fractional pod is pinned by the webhook, bound by the real scheduler, and the kubelet's Allocate gives it
  share IDs of its card only: the kubelet's checkpoint and its PodResources API both say so;
- a pod whose card is full stays Pending with the scheduler's reason;
- the agent may write gpushard's own keys on its own Node, and nothing else: not another node, not another
  label or annotation (node-restriction.kubernetes.io/ above all), not the spec, not the status;
- the agent removes the autoscaler's startup taint gpushard's node groups put on new nodes once the Node
  advertises its cards, and leaves another component's startup taint;
- after a kubelet restart the agent registers again: the node advertises its shares again and the pod keeps
  its devices;
- a card's Xid reaches the status of the pod on that card (allocatedResourcesStatus, Unhealthy) and of no
  other pod, every resource included (from 1.36, where the kubelet writes it); the card's shares leave the
  node's allocatable on every minor; after the agent restarts on the serviced card it is Healthy again;
- on a full node, a fractional pod of a higher priority is pinned to the card held by pods of a lower priority,
  not to the one held by pods of its own priority: the real scheduler preempts a pod there, and the pod binds
  to that card;
- `gpushard cordon` takes a card out of new placements on the real scheduler (its allocatable drops to 0, new
  pods land on the other card, a pod pinned to it waits with a warning, an Event says who and why, `status`
  shows it) while the pod already on it keeps it; `gpushard uncordon` gives it back and the waiting pod binds.
"""

from __future__ import annotations

import json
import subprocess
import time

import kubernetes
import pytest

from tests.e2e import components, gpushard, objects
from webhook.agent.node import podresources
from webhook.core import names

CHECKPOINT = components.DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint"
NODE = components.NODE_NAME


def checkpoint_entries(uid: str) -> list[dict]:
    data = json.loads(CHECKPOINT.read_text())["Data"]
    return [e for e in data.get("PodDeviceEntries") or [] if e["PodUID"] == uid]


def device_ids(entry: dict) -> list[str]:
    return sorted(i for ids in entry["DeviceIDs"].values() for i in ids)


def bound(kubectl, namespace: str, name: str) -> dict:
    return components.wait_for(f"pod {name} bound", lambda: (lambda p: p if p["spec"].get("nodeName") else None)(
        kubectl.json("get", "pod", name, "-n", namespace)), timeout=60)


def free_shares(kubectl, card: int) -> int:
    """What the scheduler sees free on the node's card: allocatable less what bound, live pods request."""
    resource = f"gpushard.io/card-{card}"
    allocatable = int(kubectl.json("get", "node", NODE)["status"]["allocatable"][resource])
    pods = kubectl.json("get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE}")["items"]
    held = sum(int(c.get("resources", {}).get("requests", {}).get(resource, 0))
               for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")
               for c in p["spec"]["containers"])
    return allocatable - held


def test_agent_registers_every_card(agent, kubectl):
    node = kubectl.json("get", "node", NODE)
    allocatable = node["status"]["allocatable"]
    assert (allocatable["gpushard.io/card-0"], allocatable["gpushard.io/card-1"]) == ("100", "100")
    assert allocatable["gpushard.io/gpu"] == "200"
    assert node["metadata"]["labels"]["gpushard.io/cards"] == "2"
    inventory = json.loads(node["metadata"]["annotations"]["gpushard.io/inventory"])
    assert [c["uuid"] for c in inventory] == ["GPU-fake-0000", "GPU-fake-0001"]


def test_pod_bound_and_allocated_its_cards_shares(agent, kubectl, namespace, kubelet):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("half", objects.container(gpu="0.5")))
    pod = bound(kubectl, namespace, "half")
    card = pod["metadata"]["annotations"]["gpushard.io/card"]
    assert pod["spec"]["nodeName"] == NODE
    uid = pod["metadata"]["uid"]
    entries = components.wait_for("the kubelet's checkpoint of the pod's devices",
                                  lambda: checkpoint_entries(uid) or None, timeout=60, explain=kubelet.tail)
    by_resource = {e["ResourceName"]: device_ids(e) for e in entries}
    assert set(by_resource) == {f"gpushard.io/card-{card}", "gpushard.io/gpu"}
    assert len(by_resource[f"gpushard.io/card-{card}"]) == 50
    assert all(i.startswith(f"card-{card}-") for i in by_resource[f"gpushard.io/card-{card}"])

    lister = podresources.Client(str(kubelet.pod_resources_socket))
    try:
        listed = lister.list()
    finally:
        lister.close()
    ours = [p for p in listed.pod_resources if p.name == "half" and p.namespace == namespace]
    assert len(ours) == 1
    held: dict[str, list[str]] = {}
    for c in ours[0].containers:
        for d in c.devices:
            held.setdefault(d.resource_name, []).extend(d.device_ids)
    assert sorted(held[f"gpushard.io/card-{card}"]) == by_resource[f"gpushard.io/card-{card}"]


def test_full_card_leaves_pod_pending_with_schedulers_reason(agent, kubectl, namespace):
    free = free_shares(kubectl, 1)
    if free:
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
            "filler", objects.container(gpu=str(free), resource="gpushard.io/card-1")))
        bound(kubectl, namespace, "filler")
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
        "waiting", objects.container(gpu="1", resource="gpushard.io/card-1")))

    def unschedulable():
        pod = kubectl.json("get", "pod", "waiting", "-n", namespace)
        return next((c for c in pod["status"].get("conditions", [])
                     if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"), None)
    condition = components.wait_for("the scheduler's verdict", unschedulable, timeout=60)
    assert "Insufficient gpushard.io/card-1" in condition["message"]
    assert kubectl.json("get", "pod", "waiting", "-n", namespace)["spec"].get("nodeName") is None


@pytest.fixture(scope="module")
def other_node(kubectl):
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "e2e-other",
                                                                               "labels": {"pool": "other"}}}))
    yield "e2e-other"
    kubectl.run("delete", "node", "e2e-other", "--wait=false", check=False)


class Answer:
    def __init__(self, status: int, message: str):
        self.returncode, self.stderr, self.stdout = (0 if status < 300 else 1), message, ""


def as_agent(kubectl, agent, node: str, patch: dict, status: bool = False) -> Answer:
    """A merge patch of a Node with the agent's own token, as the agent writes it (kubectl would GET first,
    which the agent may not)."""
    client = kubernetes.config.new_client_from_config(str(agent.token_config()))
    api = kubernetes.client.CoreV1Api(client)
    try:
        (api.patch_node_status if status else api.patch_node)(node, patch)
        return Answer(200, "")
    except kubernetes.client.ApiException as exc:
        return Answer(exc.status, json.loads(exc.body).get("message", exc.body))
    finally:
        client.close()


def test_agent_writes_its_own_keys_on_its_own_node(agent, kubectl):
    metadata = kubectl.json("get", "node", NODE)["metadata"]
    done = as_agent(kubectl, agent, NODE, {"metadata": {
        "labels": {"gpushard.io/cards": metadata["labels"]["gpushard.io/cards"]},
        "annotations": {"gpushard.io/inventory": metadata["annotations"]["gpushard.io/inventory"]}}})
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("node,patch", [
    (NODE, {"metadata": {"labels": {"node-restriction.kubernetes.io/tier": "secure"}}}),
    (NODE, {"metadata": {"labels": {"kubernetes.io/hostname": "e2e-other"}}}),
    (NODE, {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}),
    (NODE, {"metadata": {"labels": {"kubernetes.io/os": None}}}),
    (NODE, {"metadata": {"annotations": {"example.com/owner": "agent"}}}),
    (NODE, {"spec": {"taints": [{"key": "example.com/drain", "value": "true", "effect": "NoSchedule"}]}}),
    ("e2e-other", {"metadata": {"labels": {"gpushard.io/cards": "8"}}}),
], ids=["node-restriction-label", "hostname-label", "role-label", "removed-label", "foreign-annotation", "taint",
        "other-node"])
def test_agent_may_not_write_beyond_its_keys(agent, kubectl, other_node, node, patch):
    before = kubectl.json("get", "node", node)
    done = as_agent(kubectl, agent, node, patch)
    assert done.returncode == 1, done.stdout
    assert "gpushard: the agent may" in done.stderr, done.stderr
    after = kubectl.json("get", "node", node)
    assert after["metadata"].get("labels") == before["metadata"].get("labels")
    assert after["metadata"].get("annotations", {}).get("example.com/owner") is None
    assert after["spec"] == before["spec"]


def test_agent_lifts_its_startup_taint(agent, kubectl):
    other = "startup-taint.cluster-autoscaler.kubernetes.io/example"
    agent.wait_allocatable({"gpushard.io/card-0": "100", "gpushard.io/card-1": "100"})

    def keys() -> set[str]:
        return {t["key"] for t in kubectl.json("get", "node", NODE)["spec"].get("taints") or ()
                if t["key"].startswith("startup-taint.")}
    kubectl.run("taint", "node", NODE, f"{names.STARTUP_TAINT}=:NoSchedule", f"{other}=:NoSchedule")
    try:
        components.wait_for("the agent removing gpushard's startup taint", lambda: keys() == {other}, timeout=60,
                            explain=agent.tail)
        assert "startup taint" in agent.log()
    finally:
        for key in (other, names.STARTUP_TAINT):  # one at a time: kubectl removes none if one is missing
            kubectl.run("taint", "node", NODE, f"{key}-", check=False)
    assert keys() == set()


def test_agent_may_not_write_node_status(agent, kubectl):
    done = as_agent(kubectl, agent, NODE, {"status": {"capacity": {"gpushard.io/card-7": "100"}}}, status=True)
    assert done.returncode == 1
    assert "forbidden" in done.stderr.lower(), done.stderr
    assert "gpushard.io/card-7" not in kubectl.json("get", "node", NODE)["status"]["capacity"]


def test_kubelet_restart_registers_again(agent, kubectl, kubelet, namespace):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("before", objects.container(gpu="0.1")))
    uid = bound(kubectl, namespace, "before")["metadata"]["uid"]
    held = components.wait_for("the pod's devices in the checkpoint", lambda: checkpoint_entries(uid) or None,
                               timeout=60, explain=kubelet.tail)
    registrations = agent.log().count("registered")
    kubelet.restart()
    components.wait_for("the agent registering again", lambda: agent.log().count("registered") > registrations,
                        timeout=90, explain=agent.tail)
    agent.wait_allocatable({"gpushard.io/card-0": "100", "gpushard.io/card-1": "100"}, timeout=90)
    components.wait_for("node Ready again", lambda: components.Kubelet.ready(kubectl), timeout=90,
                        explain=kubelet.tail)
    assert {e["ResourceName"]: device_ids(e) for e in checkpoint_entries(uid)} == {
        e["ResourceName"]: device_ids(e) for e in held}


def resource_health(pod: dict) -> dict[str, set[str]]:
    """resource name -> the healths the kubelet reports for the devices the pod's first container holds."""
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return {r["name"]: {d["health"] for d in r.get("resources", [])}
            for r in statuses[0].get("allocatedResourcesStatus") or []}


def test_card_going_bad_reaches_the_pods_status(agent, kubectl, namespace, kubelet, plane):
    for card in (0, 1):
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
            f"on-{card}", objects.container(gpu="5", resource=f"gpushard.io/card-{card}")))
    uids = {card: bound(kubectl, namespace, f"on-{card}")["metadata"]["uid"] for card in (0, 1)}
    for uid in uids.values():
        components.wait_for("the pod's devices in the checkpoint", lambda u=uid: checkpoint_entries(u) or None,
                            timeout=60, explain=kubelet.tail)
    # The kubelet writes devices' health into pods' status from 1.36 (ResourceHealthStatus, alpha and off in
    # 1.34 and 1.35); the shares a bad card takes away from the node are the agent's answer on every minor.
    statuses = plane.minor >= 36

    def health(card: int) -> dict[str, set[str]]:
        return resource_health(kubectl.json("get", "pod", f"on-{card}", "-n", namespace))
    if statuses:
        components.wait_for("both pods' devices reported Healthy", lambda: health(0) and health(1) and all(
            h == {"Healthy"} for card in (0, 1) for h in health(card).values()), timeout=60, explain=kubelet.tail)

    agent.put("xid-1", "79")  # the GPU has fallen off the bus: critical, for card 1 only
    if statuses:
        components.wait_for("card 1's Xid in its pod's status", lambda: health(1).get("gpushard.io/card-1") == {
            "Unhealthy"}, timeout=60, explain=lambda: f"{health(1)}\n{agent.tail()}\n{kubelet.tail(20)}")
        # The IDs of the node-wide gpushard.io/gpu follow the card of the container holding them: Unhealthy for
        # the pod on card 1, and every device of the pod on card 0 stays Healthy.
        components.wait_for("card 1's pod's gpushard.io/gpu Unhealthy too", lambda: health(1).get(
            "gpushard.io/gpu") == {"Unhealthy"}, timeout=60, explain=lambda: f"{health(1)}\n{agent.tail()}")
        assert all(h == {"Healthy"} for h in health(0).values()), health(0)
    agent.wait_allocatable({"gpushard.io/card-1": "0", "gpushard.io/card-0": "100"})

    # The card serviced and the agent restarted (an Xid stays until then): Healthy again, shares back.
    agent.reload()
    if statuses:
        components.wait_for("card 1 Healthy again in its pod's status", lambda: health(1).get(
            "gpushard.io/card-1") == {"Healthy"}, timeout=60, explain=kubelet.tail)
    agent.wait_allocatable({"gpushard.io/card-1": "100", "gpushard.io/card-0": "100"})


def test_cordoned_card_gets_no_new_pod(agent, kubectl, namespace, plane):
    def gpushard_cli(*args: str):
        done = subprocess.run([gpushard.GPUSHARD, *args, f"--kubeconfig={plane.kubectl.config}"],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        return done
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
        "held", objects.container(gpu="5", resource="gpushard.io/card-0")))
    held = bound(kubectl, namespace, "held")
    gpushard_cli("cordon", NODE, "0", "--reason", "e2e maintenance")
    try:
        agent.wait_allocatable({"gpushard.io/card-0": "0", "gpushard.io/card-1": "100"})
        events = kubectl.json("get", "events", "-A", "--field-selector", f"involvedObject.name={NODE}")["items"]
        assert any("e2e maintenance" in (e.get("message") or "") for e in events)
        for i in range(3):
            kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(f"new-{i}", objects.container(
                gpu="0.1")))
            pod = bound(kubectl, namespace, f"new-{i}")
            assert pod["metadata"]["annotations"]["gpushard.io/card"] == "1"
        done = kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
            "pinned", objects.container(gpu="5", resource="gpushard.io/card-0")))
        assert "Warning: gpushard:" in done.stderr and "cordoned" in done.stderr, done.stderr
        status = gpushard_cli("status")
        assert "cordoned" in status.stdout, status.stdout
        # The pod that held card 0 keeps it.
        assert kubectl.json("get", "pod", "held", "-n", namespace)["metadata"]["uid"] == held["metadata"]["uid"]
    finally:
        gpushard_cli("uncordon", NODE, "0")
    agent.wait_allocatable({"gpushard.io/card-0": "100"})
    bound(kubectl, namespace, "pinned")


def test_a_higher_priority_pod_waits_where_the_scheduler_may_preempt(agent, kubectl, namespace):
    classes = {"gpushard-e2e-keeper": 1000, "gpushard-e2e-urgent": 500}
    for name, value in classes.items():
        kubectl.apply(json.dumps({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                  "metadata": {"name": name}, "value": value}))
    try:
        components.wait_for("both cards free (pods of earlier tests gone)",
                            lambda: free_shares(kubectl, 0) == free_shares(kubectl, 1) == 100, timeout=90)
        # Card 0 held by a pod of priority 1000, card 1 by one of priority 0: the node is full.
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
            "keeper", objects.container(gpu="100", resource="gpushard.io/card-0"),
            priorityClassName="gpushard-e2e-keeper"))
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
            "victim", objects.container(gpu="100", resource="gpushard.io/card-1")))
        for name in ("keeper", "victim"):
            bound(kubectl, namespace, name)
        started = time.monotonic()
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
            "urgent", objects.container(gpu="0.5"), priorityClassName="gpushard-e2e-urgent"))
        pod = kubectl.json("get", "pod", "urgent", "-n", namespace)
        assert pod["metadata"]["annotations"]["gpushard.io/card"] == "1", pod["metadata"]["annotations"]
        assert pod["spec"]["priority"] == 500
        def pods() -> str:
            return "\n".join(f"{p['metadata']['name']}: node {p['spec'].get('nodeName')}, nominated "
                             f"{p['status'].get('nominatedNodeName')}, "
                             f"deleting {p['metadata'].get('deletionTimestamp')}, "
                             f"{p['status'].get('conditions')}"
                             for p in kubectl.json("get", "pods", "-n", namespace)["items"])
        placed = components.wait_for("the urgent pod bound", lambda: (lambda p: p if p["spec"].get("nodeName")
                                     else None)(kubectl.json("get", "pod", "urgent", "-n", namespace)),
                                     timeout=120, explain=pods)
        seconds = time.monotonic() - started
        assert placed["spec"]["nodeName"] == NODE
        left = {p["metadata"]["name"] for p in kubectl.json("get", "pods", "-n", namespace)["items"]
                if not p["metadata"].get("deletionTimestamp")}
        assert left == {"keeper", "urgent"}, left
        print(f"preemption: victim (priority 0, card 1) preempted; urgent (priority 500) bound to {NODE} card 1 "
              f"{seconds:.1f} s after its create")
    finally:
        for name in classes:
            kubectl.run("delete", "priorityclass", name, "--ignore-not-found", check=False)
