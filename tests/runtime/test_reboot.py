"""We test what start order does to GPU pods through a node reboot, with gpushard's agent on the host (a process the
node's init system starts, as this tier runs it), under the device-plugin backend:
- the agent started before the kubelet, as a unit ordered ``Before=kubelet.service`` would be;
- the agent started once the kubelet is up, as the agent's DaemonSet pod starts after every reboot.
In each, two bare GPU pods run when the node loses power (the kubelet, containerd, every container and shim and the
agent killed at once). Each pod either comes back on the card it had, seeing that card only, or is refused by the
kubelet (UnexpectedAdmissionError: it admits the node's pods again at start, and refuses a device whose plugin has
not listed it yet). No card holds more than its shares. How many were refused is printed for docs/operations.md,
"Which backend when reboots matter", never asserted: it is a race between the kubelet's first admission and the
plugin's registration.
"""

from __future__ import annotations

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
