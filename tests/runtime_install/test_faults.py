"""We test faults of gpushard's own pods under load, on the shipped install (webhook pods behind their Service, the
agent's DaemonSet pod), each during a bounded burst of fractional pod creations from three to six clients:
- one of the two webhook pods killed (SIGKILL of its container): the creates it refuses are counted with the
  API server's message and their window; every create either was rewritten by gpushard or refused, none
  admitted unchanged; the pod comes back and both replicas serve again;
- `kubectl rollout restart` of the webhook Deployment: no create fails;
- the agent's container killed with a pod running on its card: the running container keeps running (same
  container, no restart) and its card; the DaemonSet's pod comes back and the node advertises its shares again;
- kube-apiserver restarted (SIGTERM, then SIGKILL): the creates after it all pass, nothing admitted unchanged;
- etcd compacted under the webhook's watches and the API server restarted: no create fails after it;
- the re-placement leader's pod deleted at once while it evicts pods stranded on cordoned cards: another replica
  takes the Lease, every stranded pod is evicted once, and the replacements run on other cards;
- a node reboot (the kubelet, containerd and every container killed at once, then started again) with GPU pods
  running: each comes back on the card it had, or the kubelet refuses it (UnexpectedAdmissionError) and its
  Deployment replaces it; the install comes back by itself.
Through all of them no card holds more than its shares. The figures are printed (docs/operations.md,
"What happens when ..."), never asserted on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e import components, gpushard, objects
from tests.e2e.conftest import ASSETS
from tests.runtime import images, seeing
from tests.runtime_install import bursts
from tests.runtime_install.faults import container_of, ready_webhooks, reboot, seeing_ready
from webhook.core import names

SYSTEM = gpushard.SYSTEM


def held_shares(kubectl) -> dict[str, int]:
    """Shares bound pods hold per card resource on the node."""
    held: dict[str, int] = {}
    for pod in kubectl.json("get", "pods", "-A", "--field-selector", f"spec.nodeName={components.NODE_NAME}")[
            "items"]:
        if pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        for c in pod["spec"]["containers"]:
            for name, value in (c.get("resources", {}).get("requests") or {}).items():
                if name.startswith("gpushard.io/card-"):
                    held[name] = held.get(name, 0) + int(value)
    return held


def cards_within_shares(kubectl, shares_per_card: int = 100) -> dict[str, int]:
    """Shares bound pods hold per card resource on the node; each at or under a card's worth."""
    held = held_shares(kubectl)
    assert all(v <= shares_per_card for v in held.values()), held
    return held


def every_pod_rewritten(kubectl, namespace: str) -> int:
    pods = kubectl.json("get", "pods", "-n", namespace)["items"]
    unchanged = [p["metadata"]["name"] for p in pods if "gpushard.io/card" not in (p["metadata"].get("annotations")
                                                                                    or {})]
    assert not unchanged, f"admitted without gpushard: {unchanged}"
    return len(pods)


def report(what: str, burst: bursts.Burst, extra: str = "") -> None:
    print(f"\ngpushard fault: {what}: {burst.summary()}{extra}")


def test_a_webhook_pod_killed_under_load(installed, runtime, plane, namespace):
    kubectl = installed
    victim, container = container_of(kubectl, "webhook")
    killed = {}

    def kill():
        killed["at"] = time.monotonic()
        runtime.ctr_run("tasks", "kill", "-s", "SIGKILL", container)
    burst = bursts.run(plane.kubectl.config, namespace, images.WORKLOAD, count=600, clients=6, rate=40, during=kill)
    back = components.wait_for("both webhook pods ready again", lambda: ready_webhooks(kubectl) == 2, timeout=120)
    report("a webhook pod killed", burst, f"; killed at {killed['at'] - burst.began:.1f} s")
    assert back and every_pod_rewritten(kubectl, namespace) == len(burst.outcomes) - len(burst.failed)
    for message in burst.messages():
        # The transport failing under the killed pod: a write to its dead connection is a broken pipe.
        assert message in ("connection refused", "no endpoints available", "EOF", "connection reset", "broken pipe",
                           "context deadline exceeded", "no route to host"), burst.messages()
    restarts = kubectl.json("get", "pod", victim, "-n", SYSTEM)["status"]["containerStatuses"][0]["restartCount"]
    assert restarts >= 1
    cards_within_shares(kubectl)


def test_a_rollout_restart_under_load_fails_no_create(installed, plane, namespace):
    kubectl = installed
    before = kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["metadata"]["generation"]

    def restart():
        kubectl.run("rollout", "restart", "deployment/gpushard-webhook", "-n", SYSTEM)
    burst = bursts.run(plane.kubectl.config, namespace, images.WORKLOAD, count=1200, clients=6, rate=40, limit_s=90,
                       during=restart, at=0.1)
    kubectl.run("rollout", "status", "deployment/gpushard-webhook", "-n", SYSTEM, "--timeout=180s", timeout=200)
    assert kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["metadata"]["generation"] > before
    report("the webhook Deployment restarted (rollout restart)", burst)
    assert burst.failed == [], burst.summary()
    every_pod_rewritten(kubectl, namespace)
    cards_within_shares(kubectl)


def test_the_agent_killed_with_a_pod_on_its_card(installed, runtime, namespace):
    kubectl = installed
    kubectl.apply(seeing.pod("steady", seeing.container(gpu="0.5")), "-n", namespace)
    pod = seeing.running(kubectl, namespace, "steady", explain=runtime.tail)
    card = int(pod["metadata"]["annotations"]["gpushard.io/card"])
    view = seeing.seen_now(kubectl, namespace, "steady")
    steady = pod["status"]["containerStatuses"][0]["containerID"]
    agent, container = container_of(kubectl, "agent")
    killed = time.monotonic()
    runtime.ctr_run("tasks", "kill", "-s", "SIGKILL", container)
    components.wait_for("the agent's container restarted", lambda: kubectl.json(
        "get", "pod", agent, "-n", SYSTEM)["status"]["containerStatuses"][0]["restartCount"] >= 1, timeout=120)
    want = {f"gpushard.io/card-{k}": "100" for k in range(4)}

    def advertised():
        allocatable = kubectl.json("get", "node", components.NODE_NAME)["status"].get("allocatable", {})
        return all(allocatable.get(k) == v for k, v in want.items())
    components.wait_for("the node advertising its shares again", advertised, timeout=120)
    print(f"\ngpushard fault: the agent killed: its pod restarted and the node advertised its shares "
          f"{time.monotonic() - killed:.1f} s after the kill")
    after = seeing.running(kubectl, namespace, "steady", explain=runtime.tail)
    status = after["status"]["containerStatuses"][0]
    assert (status["containerID"], status["restartCount"]) == (steady, 0)
    assert seeing.seen_now(kubectl, namespace, "steady") == view
    assert json.loads(json.dumps(card)) == seeing.card_of(kubectl, namespace, "steady")
    cards_within_shares(kubectl)


def webhook_logs(kubectl) -> str:
    return kubectl.run("logs", "-n", SYSTEM, "-l", "app.kubernetes.io/component=webhook", "--tail=-1", "--prefix",
                       check=False, timeout=60).stdout


def restart_apiserver(plane, signal_name: str) -> float:
    """The API server stopped (SIGTERM, or SIGKILL) and started again; seconds until it is ready."""
    apiserver = plane.process("kube-apiserver")
    began = time.monotonic()
    if signal_name == "SIGKILL":
        os.killpg(apiserver.proc.pid, signal.SIGKILL)
        apiserver.proc.wait(10)
    else:
        apiserver.stop()
    apiserver.start()
    components.wait_for("kube-apiserver ready again", plane.ready, timeout=120, explain=apiserver.tail)
    return time.monotonic() - began


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_the_api_server_restarted_under_load(installed, plane, namespace, signal_name):
    kubectl = installed
    down = {}

    def restart():
        down["ready"] = restart_apiserver(plane, signal_name)
        down["at"] = time.monotonic()
    burst = bursts.run(plane.kubectl.config, namespace, images.WORKLOAD, count=1500, rate=30, limit_s=100,
                       during=restart, at=0.05)
    report(f"kube-apiserver restarted ({signal_name})", burst,
           f"; signalled at {down['at'] - down['ready'] - burst.began:.1f} s, ready again {down['ready']:.1f} s "
           "later")
    # Every create that reached the API server while it served was rewritten, none admitted unchanged.
    every_pod_rewritten(kubectl, namespace)
    components.wait_for("both webhook pods ready", lambda: ready_webhooks(kubectl) == 2, timeout=120)
    # The creates after the restart all pass: the webhook's view came back by itself.
    late = [o for o in burst.outcomes if o.started > burst.outcomes[-1].started - 5]
    assert late and not [o for o in late if o.error], burst.summary()
    cards_within_shares(kubectl)


def test_etcd_compacted_under_the_webhooks_watches(installed, plane, namespace):
    """etcd compacted to its head while the webhook watches, then the API server restarted (its watch cache then
    starts after the compaction): the webhook's watches come back, by resuming or by listing again (which its log
    says), and no admission fails meanwhile."""
    kubectl = installed
    etcdctl = ASSETS / "etcdctl"
    if not etcdctl.exists():
        pytest.skip(f"no etcdctl in KUBEBUILDER_ASSETS={ASSETS}")
    status = json.loads(subprocess.run([str(etcdctl), f"--endpoints={plane.etcd_url}", "endpoint", "status",
                                        "-w", "json"], capture_output=True, text=True, timeout=30, check=True).stdout)
    revision = status[0]["Status"]["header"]["revision"]
    subprocess.run([str(etcdctl), f"--endpoints={plane.etcd_url}", "compact", str(revision)], capture_output=True,
                   text=True, timeout=60, check=True)
    restart_apiserver(plane, "SIGTERM")
    components.wait_for("both webhook pods ready", lambda: ready_webhooks(kubectl) == 2, timeout=120)
    burst = bursts.run(plane.kubectl.config, namespace, images.WORKLOAD, count=300, rate=30)
    logs = webhook_logs(kubectl).splitlines()
    relisted = sorted({line.split("gpushard: the ")[1].split(" watch")[0] for line in logs
                       if "history expired" in line})
    resumed = sum(1 for line in logs if "listing or watching" in line and "failed" in line)
    report(f"etcd compacted to revision {revision}, then the API server restarted", burst,
           f"; the webhook's watches: {resumed} reconnects logged, lists again after 410: {relisted or 'none'}")
    assert burst.failed == [], burst.summary()
    every_pod_rewritten(kubectl, namespace)


def leader(kubectl) -> str | None:
    return kubectl.json("get", "lease", "gpushard-replacer", "-n", SYSTEM)["spec"].get("holderIdentity")


def events_of(kubectl, namespace: str, reason: str) -> dict[str, tuple[int, str]]:
    """The Events of one reason per pod name, with how many there were and the last one's message: the
    replacer records one on each pod it evicts (naming the card the pod waited on), and one on each pod the
    kubelet refused at admission."""
    counted: dict[str, tuple[int, str]] = {}
    for event in kubectl.json("get", "events", "-n", namespace)["items"]:
        if event.get("reason") == reason:
            name = event["involvedObject"]["name"]
            counted[name] = (counted.get(name, (0, ""))[0] + event.get("count", 1), event.get("message", ""))
    return counted


def replaced_events(kubectl, namespace: str) -> dict[str, tuple[int, str]]:
    return events_of(kubectl, namespace, names.REPLACED_REASON)


def gpushard_cli(plane, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([gpushard.GPUSHARD, *args, f"--kubeconfig={plane.kubectl.config}"], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_replacement_leader_killed_while_it_evicts(installed, plane, runtime, namespace):
    """Four pods of a Deployment pinned to cards that are then cordoned, held off the node by a label it lacks; the
    label is put on and the leader's pod deleted at once, so the evictions fall across the change of leader. The
    other replica takes the Lease, every stranded pod is evicted exactly once (one Event each), and their
    replacements run on cards that are not cordoned."""
    kubectl = installed
    components.wait_for("no shares held from earlier tests", lambda: not cards_within_shares(kubectl), timeout=120)
    old = components.wait_for("a re-placement leader", lambda: leader(kubectl), timeout=120)
    duration = kubectl.json("get", "lease", "gpushard-replacer", "-n", SYSTEM)["spec"]["leaseDurationSeconds"]
    deployment = json.loads(objects.deployment("moved", "0.25", replicas=4))
    template = deployment["spec"]["template"]["spec"]
    template["containers"] = [seeing.container(gpu="0.25")]
    template["nodeSelector"] = {"gpushard-e2e/replace": "yes"}
    kubectl.apply(json.dumps(deployment), "-n", namespace)

    def pinned():
        pods = kubectl.json("get", "pods", "-n", namespace, "-l", "app=moved")["items"]
        return pods if len(pods) == 4 else None
    first = components.wait_for("four pods pinned", pinned, timeout=60)
    cards = sorted({int(p["metadata"]["annotations"]["gpushard.io/card"]) for p in first})
    assert len(cards) <= 2, cards  # 100 shares on cards nobody uses: binpack fills one, or two
    for card in cards:
        gpushard_cli(plane, "cordon", components.NODE_NAME, str(card), "--reason", "e2e re-placement")
    try:
        # Until the node advertises the cordon (the agent, then the kubelet's status), the scheduler may still bind
        # a pod there, and the kubelet then refuses it (UnexpectedAdmissionError): the label waits for it.
        components.wait_for("the node advertising no share of the cordoned cards", lambda: all(
            kubectl.json("get", "node", components.NODE_NAME)["status"].get("allocatable", {}).get(
                f"gpushard.io/card-{k}") == "0" for k in cards), timeout=120)
        killed = time.monotonic()
        kubectl.run("label", "node", components.NODE_NAME, "gpushard-e2e/replace=yes", "--overwrite")
        kubectl.run("delete", "pod", old, "-n", SYSTEM, "--grace-period=0", "--force")
        taken = components.wait_for("the other replica holding the Lease", lambda: (
            lambda h: h if h and h != old else None)(leader(kubectl)), timeout=120)
        took = time.monotonic() - killed

        def replaced():
            pods = [p for p in kubectl.json("get", "pods", "-n", namespace, "-l", "app=moved")["items"]
                    if not p["metadata"].get("deletionTimestamp")]
            running = [p for p in pods if p["status"].get("phase") == "Running"]
            return pods if len(running) == 4 == len(pods) else None
        def why() -> str:
            pods = kubectl.json("get", "pods", "-n", namespace, "-l", "app=moved")["items"]
            status = [(p["metadata"]["name"], p["metadata"]["annotations"].get("gpushard.io/card"),
                       p["status"].get("phase"), p["status"].get("reason"), p["status"].get("message")) for p in pods]
            return "\n".join([" ".join(map(str, line)) for line in status]
                             + [str(replaced_events(kubectl, namespace)), kubectl.run(
                                 "logs", "-n", SYSTEM, "-l", "app.kubernetes.io/component=replacer", "--tail=30",
                                 "--prefix", check=False).stdout])
        now = components.wait_for("four replacements running", replaced, timeout=240, explain=why)
        events = replaced_events(kubectl, namespace)
        stranded = {p["metadata"]["name"] for p in first}
        # A replacement the webhook placed before its view had the cordon (it lags while its watches recover,
        # e.g. after an API server restart) waits on a cordoned card too, and is evicted in turn: never twice.
        again = {n for n in events if n not in stranded}
        print(f"\ngpushard fault: the re-placement leader killed while it evicts: {taken} took the Lease "
              f"{took:.1f} s later (leaseDurationSeconds {duration}); {sum(c for c, _ in events.values())} "
              f"evictions of {len(events)} pods, the most of one pod {max((c for c, _ in events.values()), default=0)}"
              f"; replacements placed on a cordoned card and evicted in turn: {len(again)}")
        assert taken != old
        assert set(events) >= stranded and {c for c, _ in events.values()} == {1}, events
        for name in again:
            assert any(f"card {k} has no room" in events[name][1] for k in cards), events[name]
        assert all(int(p["metadata"]["annotations"]["gpushard.io/card"]) not in cards for p in now)
    finally:
        for card in cards:
            gpushard_cli(plane, "uncordon", components.NODE_NAME, str(card))
        kubectl.run("label", "node", components.NODE_NAME, "gpushard-e2e/replace-")
        kubectl.run("delete", "deployment", "moved", "-n", namespace, "--wait=false")
    cards_within_shares(kubectl)


def test_a_node_reboot_with_gpu_pods_running(installed, plane, runtime, kubelet, namespace):
    """GPU pods running (two bare pods and a Deployment's two) when the node reboots. Each pod either comes back on
    the card it had, seeing that card only, or is refused by the kubelet with UnexpectedAdmissionError (its card's
    plugin not registered yet: the agent is a pod on the same node), and then a Deployment's pod is replaced by a new
    one that runs. No pod runs on another card under its old name, no card holds more than its shares, and the
    install (webhooks, agent, replacers) comes back by itself."""
    kubectl = installed
    for name, gpu in (("alone-a", "0.5"), ("alone-b", "0.25")):
        kubectl.apply(seeing.pod(name, seeing.container(gpu=gpu)), "-n", namespace)
    deployment = json.loads(objects.deployment("kept", "0.25", replicas=2))
    deployment["spec"]["template"]["spec"]["containers"] = [seeing.container(gpu="0.25")]
    kubectl.apply(json.dumps(deployment), "-n", namespace)

    def all_running():
        pods = kubectl.json("get", "pods", "-n", namespace)["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in (
            "Failed", "Succeeded")]
        return live if len(live) == 4 and all(p["status"].get("phase") == "Running" for p in live) else None
    before = {p["metadata"]["name"]: (p["metadata"]["uid"], int(p["metadata"]["annotations"]["gpushard.io/card"]))
              for p in components.wait_for("four GPU pods running", all_running, timeout=180, explain=runtime.tail)}
    agent, agent_container = container_of(kubectl, "agent")
    booted = time.monotonic()
    reboot(kubelet, runtime)

    def agent_again():
        pod = kubectl.json("get", "pod", agent, "-n", SYSTEM)
        statuses = pod["status"].get("containerStatuses") or [{}]
        return statuses[0].get("state", {}).get("running") and statuses[0].get("containerID", "").split("://")[
            -1] != agent_container
    components.wait_for("the agent's pod running a new container", agent_again, timeout=240, explain=kubelet.tail)
    ready_at = time.monotonic() - booted
    want = {f"gpushard.io/card-{k}": "100" for k in range(4)}
    components.wait_for("the node advertising its shares again", lambda: all(
        kubectl.json("get", "node", components.NODE_NAME)["status"].get("allocatable", {}).get(k) == v
        for k, v in want.items()), timeout=240, explain=kubelet.tail)
    advertised_at = time.monotonic() - booted

    def settled():
        pods = {p["metadata"]["name"]: p for p in kubectl.json("get", "pods", "-n", namespace)["items"]}
        kept = [p for p in pods.values() if p["metadata"].get("labels", {}).get("app") == "kept"
                and p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
        alone = [pods[n] for n in ("alone-a", "alone-b") if n in pods]
        final = all(p["status"].get("phase") in ("Running", "Failed") for p in alone)
        return pods if len(kept) == 2 and final and all(
            p["status"].get("phase") == "Failed" or seeing_ready(p) for p in alone) else None
    after = components.wait_for("every pod back, or refused and replaced", settled, timeout=300,
                                explain=kubelet.tail)
    settled_at = time.monotonic() - booted
    came_back, refused = [], {}
    for name, (uid, card) in before.items():
        pod = after.get(name)
        if pod is None:
            refused[name] = "gone"
            continue
        assert pod["metadata"]["uid"] == uid
        if pod["status"].get("phase") == "Failed":
            refused[name] = pod["status"].get("reason", "")
            continue
        # Under its old name a pod is on its old card, and sees it only.
        assert int(pod["metadata"]["annotations"]["gpushard.io/card"]) == card
        seeing.expect_card(seeing.seen_now(kubectl, namespace, name), card, ("envvar", "volume-mounts", "cdi-cri"),
                           runtime)
        came_back.append(name)
    for name, reason in refused.items():
        assert reason in ("UnexpectedAdmissionError", "gone"), (name, reason)
    # The replacer says so on each refused pod still there: one Event, naming what brings it back.
    still_there = {n for n, r in refused.items() if r != "gone"}

    def told_each():
        found = events_of(kubectl, namespace, names.REFUSED_AT_ADMISSION_REASON)
        return found if set(found) >= still_there else None
    told = components.wait_for("the replacer's Event on each refused pod", told_each, timeout=120,
        explain=lambda: kubectl.run("logs", "-n", SYSTEM, "-l", "app.kubernetes.io/component=replacer",
                                    "--tail=20", "--prefix", check=False).stdout) if refused else {}
    for name, (count, message) in told.items():
        assert count == 1, (name, count)
        assert ("nothing makes it again" if name.startswith("alone-") else "its controller ReplicaSet/") in message
    new = [n for n, p in after.items() if n not in before and p["status"].get("phase") == "Running"]
    for name in new:
        seeing.expect_card(seeing.seen_now(kubectl, namespace, name), seeing.card_of(kubectl, namespace, name),
                           ("envvar", "volume-mounts", "cdi-cri"), runtime)
    kubectl.run("rollout", "status", "deployment/gpushard-webhook", "-n", SYSTEM, "--timeout=240s", timeout=260)
    components.wait_for("both webhook pods ready", lambda: ready_webhooks(kubectl) == 2, timeout=120)
    print(f"\ngpushard fault: a node reboot with 4 GPU pods running: the agent running again {ready_at:.1f} s "
          "after power-on, "
          f"shares advertised {advertised_at:.1f} s, settled {settled_at:.1f} s; back on their cards: "
          f"{sorted(came_back) or 'none'}; refused by the kubelet: {refused or 'none'}; replacements running: "
          f"{sorted(new) or 'none'}; the replacer's Events on them: {len(told)}")
    cards_within_shares(kubectl)


