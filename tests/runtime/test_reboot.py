"""We test what start order does to GPU pods through a node reboot, with gpushard's agent on the host (a process the
node's init system starts, as this tier runs it), under the device-plugin backend:
- the agent started before the kubelet, as a unit ordered ``Before=kubelet.service`` would be;
- the agent started once the kubelet is up, as the agent's DaemonSet pod starts after every reboot.
In each, two bare GPU pods run when the node loses power (the kubelet, containerd, every container and shim and the
agent killed at once). Each pod either comes back on the card it had, seeing that card only, or is refused by the
kubelet (UnexpectedAdmissionError: it admits the node's pods again at start, and refuses a device whose plugin has
not listed it yet). No card holds more than its shares. How many were refused is printed for docs/operations.md,
"Which backend when reboots matter", never asserted: it is a race between the kubelet's first admission and the
plugin's registration. And, through a kubelet restart and two reboots, a count the Node's status advertises (no
device plugin serves it, as the DRA backend's ``gpushard.io/gpu`` could be) is never refused.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.e2e import components
from tests.runtime import node, seeing

STRATEGY = ("envvar", "volume-mounts", "cdi-cri")
ORDERS = {"before": "the agent started before the kubelet", "after": "the agent started after the kubelet"}


def power_cut(kubelet, runtime, agent) -> None:
    os.killpg(kubelet.process.proc.pid, signal.SIGKILL)
    kubelet.process.proc.wait(10)
    os.killpg(agent.process.proc.pid, signal.SIGKILL)
    agent.process.proc.wait(10)
    runtime.power_cut()
    node.unmount_under(kubelet.root)


def settled(kubectl, namespace: str, before: dict) -> dict | None:
    """Each pod running a new container, or Failed; None until every one is."""
    pods = {p["metadata"]["name"]: p for p in kubectl.json("get", "pods", "-n", namespace)["items"]}
    for name, (_uid, _card, container) in before.items():
        pod = pods.get(name)
        if pod is None:
            return None
        if pod["status"].get("phase") == "Failed":
            continue
        statuses = pod["status"].get("containerStatuses") or []
        if not (statuses and statuses[0].get("state", {}).get("running") and statuses[0].get("containerID")
                != container):
            return None
    return pods


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_reboot_with_the_agent_on_the_host(order, runtime, agent, kubelet, kubectl, namespace):
    for name, gpu in (("alone-a", "0.5"), ("alone-b", "0.25")):
        kubectl.apply(seeing.pod(name, seeing.container(gpu=gpu)), "-n", namespace)
    before = {}
    for name in ("alone-a", "alone-b"):
        pod = seeing.running(kubectl, namespace, name, explain=runtime.tail)
        before[name] = (pod["metadata"]["uid"], seeing.card_of(kubectl, namespace, name),
                        pod["status"]["containerStatuses"][0]["containerID"])
    power_cut(kubelet, runtime, agent)
    booted = time.monotonic()
    if order == "before":
        agent.process.start()
        runtime.start()
        kubelet.process.start()
    else:
        runtime.start()
        kubelet.process.start()
        components.wait_for("node Ready again", lambda: components.Kubelet.ready(kubectl), timeout=90,
                            explain=kubelet.tail)
        agent.process.start()
    agent.wait_allocatable(seeing.per_card(node.CARDS), timeout=120)
    advertised = time.monotonic() - booted
    after = components.wait_for("every pod back, or refused", lambda: settled(kubectl, namespace, before),
                                timeout=240, explain=kubelet.tail)
    came_back, refused = [], {}
    for name, (uid, card, _container) in before.items():
        pod = after[name]
        assert pod["metadata"]["uid"] == uid
        if pod["status"].get("phase") == "Failed":
            refused[name] = pod["status"].get("reason", "")
            continue
        assert seeing.card_of(kubectl, namespace, name) == card
        seeing.expect_card(seeing.seen_now(kubectl, namespace, name), card, STRATEGY, runtime)
        came_back.append(name)
    assert set(refused.values()) <= {"UnexpectedAdmissionError"}, refused
    print(f"\ngpushard reboot ({ORDERS[order]}, {runtime.label}): shares advertised {advertised:.1f} s after "
          f"power-on; back on their cards: {sorted(came_back) or 'none'}; refused by the kubelet: "
          f"{sorted(refused) or 'none'} ({len(refused)} of {len(before)})")
    seeing.clear_namespace(kubectl, namespace)


COUNT = "reboot.gpushard.io/count"


def count_on_node(kubectl) -> tuple[str | None, str | None]:
    status = kubectl.json("get", "node", components.NODE_NAME)["status"]
    return status.get("capacity", {}).get(COUNT), status.get("allocatable", {}).get(COUNT)


def test_a_count_the_node_status_advertises_is_never_refused(runtime, agent, kubelet, kubectl):
    """What a count served without a device plugin would do through the same faults: an extended resource written
    into the Node's status (``nodes/status``, as docs/dra.md says the DRA backend's count could be), asked by two
    pods, through a kubelet restart, a reboot with the agent started after the kubelet, and a reboot of a node
    whose device manager keeps no checkpoint (no device plugin ever registered there). The kubelet never refuses
    them, and keeps the count: it is no device-plugin resource, so its device manager never judges it."""
    namespace = "e2e-node-status-count"
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}))
    kubectl.run("patch", "node", components.NODE_NAME, "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"capacity": {COUNT: "400"}, "allocatable": {COUNT: "400"}}}))
    asking = seeing.container()
    asking["resources"] = {"limits": {COUNT: "25"}, "requests": {COUNT: "25"}}
    containers = {}
    for name in ("count-a", "count-b"):
        kubectl.apply(seeing.pod(name, asking), "-n", namespace)
    for name in ("count-a", "count-b"):
        containers[name] = seeing.running(kubectl, namespace, name, explain=runtime.tail)["status"][
            "containerStatuses"][0]["containerID"]

    def again(what: str, restarted: bool) -> None:
        """Both pods running again (in new containers after a reboot: until the kubelet has said so, the API
        still shows the old ones), neither ever refused, the count as it was."""
        def back():
            pods = {n: kubectl.json("get", "pod", n, "-n", namespace) for n in containers}
            failed = {n: p["status"].get("reason") for n, p in pods.items() if p["status"].get("phase") == "Failed"}
            assert not failed, f"refused after {what}: {failed}"
            ids = {n: ((p["status"].get("containerStatuses") or [{}])[0]) for n, p in pods.items()}
            return ids if all(s.get("state", {}).get("running") and (s.get("containerID") != containers[n]) ==
                              restarted for n, s in ids.items()) else None
        found = components.wait_for(f"both pods running after {what}", back, timeout=180, explain=kubelet.tail)
        assert count_on_node(kubectl) == ("400", "400"), (what, count_on_node(kubectl))
        containers.update({n: s["containerID"] for n, s in found.items()})

    kubelet.restart()
    time.sleep(10)  # the kubelet back and its pods synced: a refusal would have been written by now
    again("a kubelet restart", restarted=False)
    power_cut(kubelet, runtime, agent)
    runtime.start()
    kubelet.process.start()
    components.wait_for("node Ready again", lambda: components.Kubelet.ready(kubectl), timeout=90,
                        explain=kubelet.tail)
    agent.process.start()
    again("a reboot, the agent started after the kubelet", restarted=True)
    power_cut(kubelet, runtime, agent)
    for entry in components.DEVICE_PLUGIN_DIR.iterdir():
        entry.unlink()  # the device manager's checkpoint among them: a node no device plugin ever served
    runtime.start()
    kubelet.process.start()
    again("a reboot with no device-manager checkpoint", restarted=True)
    agent.process.start()
    agent.wait_allocatable(seeing.per_card(node.CARDS), timeout=120)
    print(f"\ngpushard reboot ({runtime.label}): a count in the Node's status ({COUNT}): 2 of 2 pods kept through "
          "a kubelet restart (same containers) and two reboots (new containers; the second with no device-manager "
          "checkpoint); refused: none; the count kept at 400")
    kubectl.run("patch", "node", components.NODE_NAME, "--subresource=status", "--type=json", "-p", json.dumps(
        [{"op": "remove", "path": f"/status/capacity/{COUNT.replace('/', '~1')}"}]), check=False)
    kubectl.run("delete", "namespace", namespace, "--wait=false")
