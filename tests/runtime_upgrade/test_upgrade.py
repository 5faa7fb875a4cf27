"""We test an upgrade from the version before to this one and a rollback, on a real kubelet, containerd and API
server, with GPU pods holding shares and a stream of creates during every step. The tests run in order; each is one
step from the state the one before left:
- the Kustomize way: `kubectl apply -k` of this version's deploy/base over the version before's, then of the
  version before's again (the certificate Job deleted first, as docs/upgrade.md says);
- the version-skew rule (docs/upgrade.md): the webhook's Deployment, the agent's DaemonSet and the config (the
  ConfigMap as each version's chart writes it with its defaults, every key written out, which is more than
  deploy/base's holds) each at either version, every mix of them, with the other shared objects (RBAC, admission
  policies, the webhook configuration) of the config's version; each pod started again so that it reads the
  config it is given;
- with Helm: the version before's install taken over by the version before's chart, `helm upgrade` to this
  version's packaged chart, and `helm rollback` to the first revision.
In each step the stream sends creates of fractional pods from two clients (every twelfth placed on the node, the
rest waiting off it, so that they measure admission only), and afterwards:
- no create was refused: each version alone admits all of them;
- no card holds more than its shares (the node's bound pods);
- the pods that held shares before the first step run on, in the same container (no restart), on the same card,
  seeing it and no other;
- each component runs the version the step gave it, and a 0.25 pod is rewritten, runs and sees its card and no
  other, while 1.5 cards are denied with gpushard's message.
Each step's row of the table in docs/upgrade.md is printed at the end of the run ("gpushard upgrade table").
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import pytest
import yaml

from tests.chart import helm as chart_helm
from tests.e2e import components, gpushard
from tests.runtime import images, seeing
from tests.runtime_install import bursts
from tests.runtime_install import conftest as shipped
from tests.runtime_install.test_faults import held_shares
from tests.runtime_install.test_shipped import admits_rewrites_runs_and_denies
from tests.runtime_upgrade.conftest import CURRENT_IMAGE, PREVIOUS_IMAGE, PREVIOUS_TAG, PREVIOUS_TREE, ROWS

SYSTEM = gpushard.SYSTEM
PLACED_EVERY = 12  # one create in so many asks 0.2 and is placed on the node
HOLDERS = {"holder-most": "0.6", "holder-half": "0.5", "holder-quarter": "0.25"}
IMAGES = {"previous": PREVIOUS_IMAGE, "current": CURRENT_IMAGE}


@dataclass
class Row:
    step: str
    sent: int
    refused: int
    over: int
    restarted: int
    seconds: float
    longest_ms: float

    def line(self) -> str:
        return (f"gpushard upgrade: {self.step}: {self.sent} creates, {self.refused} refused, {self.over} cards over "
                f"their shares, {self.restarted} running pods restarted; {self.seconds:.0f} s, longest create "
                f"{self.longest_ms:.0f} ms")


def create(name: str, image: str) -> dict:
    pod = bursts.pod(name, image)
    if int(name.rsplit("-", 1)[1]) % PLACED_EVERY == 0:
        del pod["spec"]["nodeSelector"]
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "0.2"
    return pod


@pytest.fixture(scope="module")
def holders(installed, runtime):
    """Pods holding shares on the version before, running through every step: name -> what they must keep."""
    kubectl = installed
    namespace = "upgrade-holders"
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": namespace, "labels": {"gpushard.io/mode": "enforce"}}}))
    for name, gpu in HOLDERS.items():
        kubectl.apply(seeing.pod(name, seeing.container(gpu=gpu)), "-n", namespace)
    kept = {}
    for name in HOLDERS:
        pod = seeing.running(kubectl, namespace, name, explain=runtime.tail)
        status = pod["status"]["containerStatuses"][0]
        card = int(pod["metadata"]["annotations"]["gpushard.io/card"])
        view = seeing.seen_now(kubectl, namespace, name)
        seeing.expect_card(view, card, ("envvar", "volume-mounts", "cdi-cri"), runtime)
        kept[name] = (pod["metadata"]["uid"], status["containerID"], status["restartCount"], card, view)
    yield namespace, kept
    kubectl.run("delete", "namespace", namespace, "--wait=false", check=False)


def disturbed(kubectl, holders) -> list[str]:
    """The holders that no longer run as they did: another pod, container, restart count, card or view."""
    namespace, kept = holders
    changed = []
    for name, before in kept.items():
        pod = kubectl.json("get", "pod", name, "-n", namespace)
        status = (pod["status"].get("containerStatuses") or [{}])[0]
        now = (pod["metadata"]["uid"], status.get("containerID"), status.get("restartCount"),
               int(pod["metadata"]["annotations"]["gpushard.io/card"]))
        if now != before[:4] or not status.get("state", {}).get("running") or \
                seeing.seen_now(kubectl, namespace, name) != before[4]:
            changed.append(f"{name}: {before[:4]} -> {now}, {status.get('state')}")
    return changed


def over_shares(kubectl, shares_per_card: int = 100) -> int:
    held = held_shares(kubectl)
    over = {k: v for k, v in held.items() if v > shares_per_card}
    if over:
        print(f"\ngpushard upgrade: cards over their shares: {over}")
    return len(over)


def settled(kubectl, namespace: str) -> bool:
    """Every placed create of the step bound to the node, or found unschedulable by the scheduler."""
    for pod in kubectl.json("get", "pods", "-n", namespace)["items"]:
        if pod["spec"].get("nodeSelector"):
            continue
        scheduled = next((c for c in pod["status"].get("conditions") or [] if c["type"] == "PodScheduled"), {})
        if not pod["spec"].get("nodeName") and scheduled.get("reason") != "Unschedulable":
            return False
    return True


def running_versions(kubectl) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for component in ("webhook", "agent"):
        pods = kubectl.json("get", "pods", "-n", SYSTEM, "-l", f"app.kubernetes.io/component={component}")["items"]
        found[component] = {p["spec"]["containers"][0]["image"] for p in pods
                            if not p["metadata"].get("deletionTimestamp")}
    return found


def step(name: str, kubectl, plane, runtime, namespace: str, holders, action, webhook: str, agent: str) -> None:
    """``action`` run while the stream sends creates; then every check of the module's docstring."""
    stop, failures = threading.Event(), []

    def during():
        try:
            action()
        except BaseException as exc:  # reported after the stream, in the test's own thread
            failures.append(exc)
        finally:
            stop.set()
    began = time.monotonic()
    burst = bursts.run(plane.kubectl.config, namespace, images.WORKLOAD, count=100_000, clients=2, rate=6,
                       limit_s=600, during=during, at=0.0, stop=stop, make=create)
    seconds = time.monotonic() - began
    if failures:
        raise failures[0]
    components.wait_for("the step's placed pods bound or unschedulable", lambda: settled(kubectl, namespace),
                        timeout=120)
    changed = disturbed(kubectl, holders)
    row = Row(name, len(burst.outcomes), len(burst.failed), over_shares(kubectl), len(changed), seconds,
              burst.longest * 1000)
    print("\n" + row.line())
    ROWS.append((name, str(row.sent), str(row.refused), str(row.over), str(row.restarted), f"{seconds:.0f}",
                 f"{row.longest_ms:.0f}"))
    assert not burst.failed, burst.summary()
    assert row.over == 0
    assert not changed, changed
    assert running_versions(kubectl) == {"webhook": {IMAGES[webhook]}, "agent": {IMAGES[agent]}}
    seeing.clear_namespace(kubectl, namespace)
    admits_rewrites_runs_and_denies(kubectl, runtime, namespace)


def rollouts(kubectl, restart: bool = False) -> None:
    if restart:
        kubectl.run("rollout", "restart", "deployment/gpushard-webhook", "daemonset/gpushard-agent", "-n", SYSTEM)
    for what in ("deployment/gpushard-webhook", "daemonset/gpushard-agent"):
        kubectl.run("rollout", "status", what, "-n", SYSTEM, "--timeout=240s", timeout=260)


def apply_kustomization(kubectl, kustomization) -> None:
    """docs/upgrade.md's Kustomize step: the certificate Job (its template immutable) deleted, the apply, both
    rollouts."""
    kubectl.run("delete", "job", "gpushard-certs", "-n", SYSTEM, "--ignore-not-found")
    done = kubectl.run("apply", "-k", str(kustomization), check=False, timeout=180)
    assert done.returncode == 0, done.stderr
    rollouts(kubectl)


def test_kustomize_upgrade(installed, plane, runtime, namespace, holders, versions):
    step("kubectl apply -k: the version before to this one", installed, plane, runtime, namespace, holders,
         lambda: apply_kustomization(installed, versions["current"]), "current", "current")


def test_kustomize_rollback(installed, plane, runtime, namespace, holders, versions):
    step("kubectl apply -k: back to the version before", installed, plane, runtime, namespace, holders,
         lambda: apply_kustomization(installed, versions["previous"]), "previous", "previous")


def chart_config(version: str) -> dict:
    """The ConfigMap as the version's chart writes it with its defaults."""
    chart = PREVIOUS_TREE / "charts" / "gpushard" if version == "previous" else chart_helm.CHART
    done = chart_helm.run("template", "gpushard", str(chart), "-n", SYSTEM)
    return next(o for o in yaml.safe_load_all(done.stdout) if o and o["kind"] == "ConfigMap"
                and o["metadata"]["name"] == "gpushard-config")


def workload(kubectl, kustomization, kind: str, name: str) -> dict:
    text = kubectl.run("kustomize", str(kustomization)).stdout
    return next(o for o in yaml.safe_load_all(text) if o and o["kind"] == kind and o["metadata"]["name"] == name)


SKEWS = [(config, webhook, agent) for config in ("current", "previous") for webhook in ("current", "previous")
         for agent in ("current", "previous") if len({config, webhook, agent}) == 2]


@pytest.mark.parametrize(("config", "webhook", "agent"), SKEWS,
                         ids=[f"config-{c}-webhook-{w}-agent-{a}" for c, w, a in SKEWS])
def test_version_skew(installed, plane, runtime, namespace, holders, versions, config, webhook, agent):
    kubectl = installed

    def mix():
        apply_kustomization(kubectl, versions[config])
        kubectl.apply(json.dumps(chart_config(config)))
        for version, kind, name in ((webhook, "Deployment", "gpushard-webhook"),
                                    (agent, "DaemonSet", "gpushard-agent")):
            kubectl.apply(json.dumps(workload(kubectl, versions[version], kind, name)))
        rollouts(kubectl, restart=True)
    step(f"config {config}, webhook {webhook}, agent {agent}", kubectl, plane, runtime, namespace, holders, mix,
         webhook, agent)


@pytest.fixture(scope="module")
def helm_release(installed, plane, work, versions, nvml):
    """The version before's install, back as it was, taken over by the version before's chart (docs/helm.md)."""
    chart_helm.skip_module_without_helm()
    apply_kustomization(installed, versions["previous"])
    rendered = work / "previous-rendered.yaml"
    rendered.write_text(installed.run("kustomize", str(versions["previous"])).stdout)
    gpushard.mark_for_helm(installed, rendered)
    # The node's own fields applied again by their manager. Its first server-side apply, over kubectl's client-side
    # install, took kubectl's fields over with it (kubectl's csaupgrade); now that Helm holds them too, this apply
    # lets go of all but the node's own, as a node's injector holds only what it adds, so that an upgrade that
    # changes the agent's image meets no conflict with it.
    done = installed.run("apply", "--server-side", "--field-manager=gpushard-e2e-node", "-f", "-", check=False,
                         input=json.dumps(shipped.node_overlay(nvml)), timeout=60)
    assert done.returncode == 0, done.stderr
    return work


def test_helm_takeover_of_the_version_before(installed, plane, runtime, namespace, holders, helm_release):
    def take_over():
        installed.run("delete", "job", "gpushard-certs", "-n", SYSTEM, "--ignore-not-found")
        gpushard.helm(plane, "install", "gpushard", str(PREVIOUS_TREE / "charts" / "gpushard"),
                      "--set", f"image.tag={PREVIOUS_TAG}")
        rollouts(installed)
    step("helm install: the version before's chart takes its install over", installed, plane, runtime, namespace,
         holders, take_over, "previous", "previous")


def test_helm_upgrade(installed, plane, runtime, namespace, holders, helm_release):
    def upgrade():
        installed.run("delete", "job", "gpushard-certs", "-n", SYSTEM, "--ignore-not-found")
        # The new chart's own values: the release's image.tag (the version before's) would otherwise be kept,
        # and this version's DaemonSet, whose probes the version before's agent does not answer, would never
        # turn ready (docs/upgrade.md says to set the new tag).
        gpushard.helm(plane, "upgrade", "gpushard", str(gpushard.packaged_chart(helm_release / "chart")),
                      "--reset-values")
        rollouts(installed)
    step("helm upgrade: to this version's packaged chart", installed, plane, runtime, namespace, holders, upgrade,
         "current", "current")


def test_helm_rollback(installed, plane, runtime, namespace, holders, helm_release):
    def rollback():
        installed.run("delete", "job", "gpushard-certs", "-n", SYSTEM, "--ignore-not-found")
        gpushard.helm(plane, "rollback", "gpushard", "1", "--wait", "--timeout", "240s")
        rollouts(installed)
    step("helm rollback: to the version before", installed, plane, runtime, namespace, holders, rollback,
         "previous", "previous")
