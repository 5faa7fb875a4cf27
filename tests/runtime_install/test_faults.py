"""We test faults of gpushard's own pods under load, on the shipped install (webhook pods behind their Service, the
agent's DaemonSet pod), each during a bounded burst of fractional pod creations from three clients:
- one of the two webhook pods killed (SIGKILL of its container): the creates it refuses are counted with the
  API server's message and their window; every create either was rewritten by gpushard or refused, none
  admitted unchanged; the pod comes back and both replicas serve again;
- `kubectl rollout restart` of the webhook Deployment: no create fails;
- the agent's container killed with a pod running on its card: the running container keeps running (same
  container, no restart) and its card; the DaemonSet's pod comes back and the node advertises its shares again;
- kube-apiserver restarted (SIGTERM, then SIGKILL): the creates after it all pass, nothing admitted unchanged;
- etcd compacted under the webhook's watches and the API server restarted: no create fails after it;
- the re-placement leader's pod deleted at once: another replica takes the Lease.
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

from tests.e2e import components, gpushard
from tests.e2e.conftest import ASSETS
from tests.runtime import images, seeing
from tests.runtime_install import bursts

SYSTEM = gpushard.SYSTEM


def cards_within_shares(kubectl, shares_per_card: int = 100) -> dict[str, int]:
    """Shares bound pods hold per card resource on the node; each at or under a card's worth."""
    held: dict[str, int] = {}
    for pod in kubectl.json("get", "pods", "-A", "--field-selector", f"spec.nodeName={components.NODE_NAME}")[
            "items"]:
        if pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        for c in pod["spec"]["containers"]:
            for name, value in (c.get("resources", {}).get("requests") or {}).items():
                if name.startswith("gpushard.io/card-"):
                    held[name] = held.get(name, 0) + int(value)
    assert all(v <= shares_per_card for v in held.values()), held
    return held


def every_pod_rewritten(kubectl, namespace: str) -> int:
    pods = kubectl.json("get", "pods", "-n", namespace)["items"]
    unchanged = [p["metadata"]["name"] for p in pods if "gpushard.io/card" not in (p["metadata"].get("annotations")
                                                                                    or {})]
    assert not unchanged, f"admitted without gpushard: {unchanged}"
    return len(pods)


def container_of(kubectl, component: str) -> tuple[str, str]:
    pods = kubectl.json("get", "pods", "-n", SYSTEM, "-l", f"app.kubernetes.io/component={component}")["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get(
        "deletionTimestamp")]
    pod = sorted(running, key=lambda p: p["metadata"]["name"])[0]
    return pod["metadata"]["name"], pod["status"]["containerStatuses"][0]["containerID"].split("://")[1]


def ready_webhooks(kubectl) -> int:
    return kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["status"].get("readyReplicas", 0)


def report(what: str, burst: bursts.Burst, extra: str = "") -> None:
    print(f"\ngpushard fault: {what}: {burst.summary()}{extra}")


def test_a_webhook_pod_killed_under_load(installed, runtime, plane, namespace):
    kubectl = installed
    victim, container = container_of(kubectl, "webhook")
    killed = {}

    def kill():
        killed["at"] = time.monotonic()
        runtime.ctr_run("tasks", "kill", "-s", "SIGKILL", container)
    burst = bursts.run(plane.kubectl.config, namespace, images.WORKLOAD, count=300, rate=30, during=kill)
    back = components.wait_for("both webhook pods ready again", lambda: ready_webhooks(kubectl) == 2, timeout=120)
    report("a webhook pod killed", burst, f"; killed at {killed['at'] - burst.began:.1f} s")
    assert back and every_pod_rewritten(kubectl, namespace) == len(burst.outcomes) - len(burst.failed)
    for message in burst.messages():
        assert message in ("connection refused", "no endpoints available", "EOF", "connection reset",
                           "context deadline exceeded", "no route to host"), burst.messages()
    restarts = kubectl.json("get", "pod", victim, "-n", SYSTEM)["status"]["containerStatuses"][0]["restartCount"]
    assert restarts >= 1
    cards_within_shares(kubectl)


def test_a_rollout_restart_under_load_fails_no_create(installed, plane, namespace):
    kubectl = installed
    before = kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["metadata"]["generation"]

    def restart():
        kubectl.run("rollout", "restart", "deployment/gpushard-webhook", "-n", SYSTEM)
    burst = bursts.run(plane.kubectl.config, namespace, images.WORKLOAD, count=900, rate=30, limit_s=90,
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


def test_the_replacement_leader_killed(installed):
    kubectl = installed

    def holder():
        lease = kubectl.json("get", "lease", "gpushard-replacer", "-n", SYSTEM)
        return lease["spec"].get("holderIdentity")
    leader = components.wait_for("a re-placement leader", holder, timeout=120)
    duration = kubectl.json("get", "lease", "gpushard-replacer", "-n", SYSTEM)["spec"]["leaseDurationSeconds"]
    # The leader's pod gone at once, as with its node: a killed container would restart in the same pod, under
    # the same name, and could take its own Lease back.
    killed = time.monotonic()
    kubectl.run("delete", "pod", leader, "-n", SYSTEM, "--grace-period=0", "--force")
    taken = components.wait_for("the other replica holding the Lease", lambda: (lambda h: h if h and h != leader
                                                                               else None)(holder()), timeout=120)
    took = time.monotonic() - killed
    print(f"\ngpushard fault: the re-placement leader killed: {taken} took the Lease {took:.1f} s later "
          f"(leaseDurationSeconds {duration})")
    assert taken != leader
