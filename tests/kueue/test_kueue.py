"""We test gpushard beside real Kueue, on a real control plane and kubelet with gpushard's agent (two cards of 100
shares), under a ClusterQueue whose quota is 100 shares of gpushard.io/gpu (one card's worth) and with Kueue set to
leave gpushard.io/card-<k> out of quota (resources.excludeResourcePrefixes), as docs/neighbours.md says:
- Jobs of nvidia.com/gpu: 0.4: gpushard gives each Job's template 40 shares, and Kueue counts them: it admits
  two (80 shares), keeps the third suspended with no pod, and resumes it once an admitted Job is deleted; every
  pod of an admitted Job is pinned to one card as without Kueue, and no card goes over its shares;
- plain pods of 0.4 with the queue label: Kueue lets two through its admission gate and keeps the third gated;
  the gated pod holds no room in gpushard's view once its remembered choice expired (a pod outside the queue that
  asks all the room left on the gated pod's card gets no warning), and it binds once quota frees and its card has
  room.
"""

from __future__ import annotations

import json

from tests.e2e import components, objects
from tests.kueue import conftest
from tests.kueue import kueue as kueue_mod

NODE = components.NODE_NAME
GATE = kueue_mod.ADMISSION_GATE


def job(name: str, gpu: str) -> str:
    container = objects.container(gpu=gpu)
    return json.dumps({"apiVersion": "batch/v1", "kind": "Job",
                       "metadata": {"name": name, "labels": {kueue_mod.QUEUE_LABEL: kueue_mod.LOCAL_QUEUE}},
                       "spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": {
                           "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                           "containers": [container]}}}})


def pods(kubectl, namespace: str) -> list[dict]:
    return [p for p in kubectl.json("get", "pods", "-n", namespace)["items"]
            if not p["metadata"].get("deletionTimestamp")]


def card_of(pod: dict) -> int:
    """The card gpushard pinned the pod to, checked three ways: its annotation, its limit and its variable."""
    card = int(pod["metadata"]["annotations"]["gpushard.io/card"])
    container = pod["spec"]["containers"][0]
    assert f"gpushard.io/card-{card}" in container["resources"]["limits"], container["resources"]
    env = {e["name"]: e.get("value") for e in container.get("env") or ()}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == str(card), env
    return card


def over_shares(kubectl) -> int:
    """The node's cards whose bound, live pods ask more shares than the card has."""
    node = kubectl.json("get", "node", NODE)
    bound = [p for p in kubectl.json("get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE}")["items"]
             if p["status"].get("phase") not in ("Succeeded", "Failed")]
    over = 0
    for key, allocatable in node["status"]["allocatable"].items():
        if key.startswith(kueue_mod.CARD_PREFIX):
            held = sum(int(c.get("resources", {}).get("requests", {}).get(key, 0))
                       for p in bound for c in p["spec"]["containers"])
            over += held > int(allocatable)
    return over


def suspended(kubectl, namespace: str) -> dict[str, bool]:
    return {j["metadata"]["name"]: bool(j["spec"].get("suspend"))
            for j in kubectl.json("get", "jobs", "-n", namespace)["items"]}


def gated(pod: dict) -> bool:
    return any(g.get("name") == GATE for g in pod["spec"].get("schedulingGates") or ())


def free_cards(kubectl) -> bool:
    return over_shares(kubectl) == 0 and not [
        p for p in kubectl.json("get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE}")["items"]
        if p["status"].get("phase") not in ("Succeeded", "Failed") and "gpushard.io/card" in (
            p["metadata"].get("annotations") or {})]


def test_jobs_are_admitted_up_to_the_quota_in_shares_and_resumed(kubectl, namespace, queued):
    components.wait_for("no gpushard pod left on the node", lambda: free_cards(kubectl), timeout=90)
    for name in ("train-a", "train-b", "train-c"):
        kubectl.run("apply", "-n", namespace, "-f", "-", input=job(name, "0.4"))
    template = kubectl.json("get", "job", "train-a", "-n", namespace)["spec"]["template"]["spec"]["containers"][0]
    assert template["resources"]["limits"] == {"gpushard.io/gpu": "40"}, template["resources"]
    components.wait_for("two Jobs admitted, one held", lambda: sorted(suspended(kubectl, namespace).values()) == [
        False, False, True], timeout=90, explain=queued.tail)
    held = [name for name, s in suspended(kubectl, namespace).items() if s]
    components.wait_for("the admitted Jobs' pods bound", lambda: len([
        p for p in pods(kubectl, namespace) if p["spec"].get("nodeName")]) == 2, timeout=90, explain=queued.tail)
    running = pods(kubectl, namespace)
    assert {p["metadata"]["labels"]["job-name"] for p in running} == {"train-a", "train-b", "train-c"} - set(held)
    cards = [card_of(p) for p in running]
    assert over_shares(kubectl) == 0
    workloads = kubectl.json("get", "workloads.kueue.x-k8s.io", "-n", namespace)["items"]
    assert len(workloads) == 3
    asked = {w["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["gpushard.io/gpu"]
             for w in workloads}
    assert asked == {"40"}

    # An admitted Job deleted: the held one is resumed, its pod pinned as any other.
    done = next(name for name, s in suspended(kubectl, namespace).items() if not s)
    kubectl.run("delete", "job", done, "-n", namespace, "--cascade=foreground", "--wait=true", timeout=120)
    components.wait_for("the held Job resumed", lambda: not suspended(kubectl, namespace)[held[0]], timeout=90,
                        explain=queued.tail)
    resumed = components.wait_for("its pod bound", lambda: next((
        p for p in pods(kubectl, namespace) if p["metadata"]["labels"].get("job-name") == held[0]
        and p["spec"].get("nodeName")), None), timeout=90, explain=queued.tail)
    cards.append(card_of(resumed))
    assert over_shares(kubectl) == 0
    conftest.RESULTS.append({"scenario": "Jobs of 0.4", "workloads": 3, "quota": f"{conftest.QUOTA} shares",
                             "admitted": "2, then the third once one was deleted", "suspended or gated": 1,
                             "pods pinned": f"{len(cards)} (cards {sorted(cards)})", "cards over their shares": 0})


def test_plain_pods_are_gated_past_the_quota_and_hold_no_room_meanwhile(kubectl, namespace, queued):
    components.wait_for("no gpushard pod left on the node", lambda: free_cards(kubectl), timeout=90)
    for name in ("infer-a", "infer-b", "infer-c"):
        pod = json.loads(objects.pod(name, objects.container(gpu="0.4")))
        pod["metadata"]["labels"] = {kueue_mod.QUEUE_LABEL: kueue_mod.LOCAL_QUEUE}
        kubectl.run("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    components.wait_for("two pods let through and bound, one gated", lambda: (
        lambda ps: sorted((gated(p), bool(p["spec"].get("nodeName"))) for p in ps) == [
            (False, True), (False, True), (True, False)])(pods(kubectl, namespace)), timeout=90, explain=queued.tail)
    waiting = next(p for p in pods(kubectl, namespace) if gated(p))
    admitted = [p for p in pods(kubectl, namespace) if not gated(p)]
    cards = [card_of(p) for p in admitted]
    # Once the gated pod's remembered choice expired (5 s) it holds no room in gpushard's view: a pod outside the
    # queue that asks all the room its card has left fits there, and gpushard says nothing about room (asked with
    # server-side dry runs until then; while the gated pod counted, each would warn that no card has room).
    card = card_of(waiting)
    room = 100 - sum(int(c["resources"]["requests"].get(f"gpushard.io/card-{card}", 0))
                     for p in admitted for c in p["spec"]["containers"])
    outside_pod = objects.pod("outside", objects.container(gpu=str(room), resource=f"gpushard.io/card-{card}"))
    components.wait_for(f"{room} shares of card {card} placed without a warning", lambda: "free shares" not in
                        kubectl.run("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=outside_pod).stderr,
                        timeout=60)
    done = kubectl.run("apply", "-n", namespace, "-f", "-", input=outside_pod)
    assert "free shares" not in done.stderr, done.stderr
    outside = components.wait_for("the pod outside the queue bound", lambda: (lambda p: p if p["spec"].get(
        "nodeName") else None)(kubectl.json("get", "pod", "outside", "-n", namespace)), timeout=60)
    assert over_shares(kubectl) == 0

    # Quota freed: the gated pod is let through, and binds once its card has room.
    kubectl.run("delete", "pod", admitted[0]["metadata"]["name"], "-n", namespace, "--wait=true", timeout=120)
    components.wait_for("the gated pod let through", lambda: not gated(kubectl.json(
        "get", "pod", waiting["metadata"]["name"], "-n", namespace)), timeout=90, explain=queued.tail)
    # Its card is full (the pod outside took what was left): it waits for room, as any pod pinned to a full card.
    assert card_of(outside) == card
    kubectl.run("delete", "pod", "outside", "-n", namespace, "--wait=true", timeout=120)
    bound = components.wait_for("the pod let through bound", lambda: (lambda p: p if p["spec"].get("nodeName")
                                else None)(kubectl.json("get", "pod", waiting["metadata"]["name"], "-n", namespace)),
                                timeout=90)
    cards.append(card_of(bound))
    assert over_shares(kubectl) == 0
    conftest.RESULTS.append({"scenario": "plain pods of 0.4", "workloads": 3, "quota": f"{conftest.QUOTA} shares",
                             "admitted": "2, then the third once one was deleted", "suspended or gated": 1,
                             "pods pinned": f"{len(cards)} (cards {sorted(cards)})", "cards over their shares": 0})
