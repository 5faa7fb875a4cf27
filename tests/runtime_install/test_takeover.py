"""We test the chart on the install as shipped, its pods running on a real kubelet and containerd. This module runs
last in the tier: it takes the running install over and ends by uninstalling the release.
- the running Kustomize install taken over by Helm as docs/helm.md says (the objects marked, their fields
  handed to Helm's field manager, then `helm install` of the chart packaged as a release ships it): every object
  adopted, and neither the webhook's nor the agent's pods restarted by it;
- `helm test`: the chart's test pod runs on the node, finds the webhook's Service by its DNS name (the tier's
  cluster DNS), reaches it through the Service's address (routed as kube-proxy does), posts a dry-run review over
  TLS verified with the webhook's CA, and passes; its log says what the webhook answered;
- the same admission, node and CLI checks as on the Kustomize install, on the Helm-managed one: a 0.25 pod is
  rewritten, runs and sees its card and no other; 1.5 cards are denied with gpushard's message; `gpushard status`
  and `audit` with the auditor role, `gpushard top` through a real port-forward into the agent's pod with the top
  role, `gpushard replace --once --dry-run` with the replacer's ServiceAccount;
- `helm upgrade` to three webhook replicas, a value kubectl had applied: the third pod turns Ready, and `helm test`
  passes again;
- `helm uninstall` leaves only what docs/helm.md lists, and a pod in a namespace still labelled enforce is then
  admitted, not refused.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.chart import helm as chart_helm
from tests.e2e import components, gpushard, objects
from tests.runtime import seeing
from tests.runtime_install.conftest import service_route
from tests.runtime_install.test_shipped import admits_rewrites_runs_and_denies

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = gpushard.SYSTEM


def pods_of(kubectl, component: str) -> dict[str, str]:
    """name -> uid of the component's pods that are not being deleted."""
    pods = kubectl.json("get", "pods", "-n", SYSTEM, "-l", f"app.kubernetes.io/component={component}")["items"]
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}


def templates(kubectl) -> dict[str, dict]:
    return {kind: kubectl.json("get", kind, name, "-n", SYSTEM)["spec"]["template"]
            for kind, name in (("deployment", "gpushard-webhook"), ("daemonset", "gpushard-agent"))}


@pytest.fixture(scope="module")
def release(installed, plane, work):
    chart_helm.skip_module_without_helm()
    kubectl = installed
    rendered = work / "kustomize-base.yaml"
    rendered.write_text(kubectl.run("kustomize", str(ROOT / "deploy" / "base")).stdout)
    before = templates(kubectl), pods_of(kubectl, "webhook"), pods_of(kubectl, "agent")
    gpushard.mark_for_helm(kubectl, rendered)
    done = gpushard.helm(plane, "install", "gpushard", str(gpushard.packaged_chart(work / "chart")))
    return done, rendered, before


def cli(config: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [gpushard.GPUSHARD, *args] + ([f"--kubeconfig={config}", "--request-timeout=20s"] if config else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)


def helm_test(plane, kubectl) -> str:
    """`helm test` with the webhook's Service routed to one of its Ready pods; its pod's log."""
    route = service_route(kubectl, "gpushard", SYSTEM)
    try:
        done = gpushard.helm(plane, "test", "gpushard", "--logs", "--timeout", "180s", check=False)
    finally:
        route.remove()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


def test_helm_takes_the_running_install_over(release, installed, plane):
    kubectl = installed
    done, rendered, (templates_before, webhooks_before, agents_before) = release
    assert "STATUS: deployed" in done.stdout, done.stdout
    owned = {(o["kind"], o["metadata"]["name"]) for o in gpushard.release_objects(plane)}
    applied = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(rendered.read_text())
               if o and o["kind"] != "Namespace"}
    assert owned == applied
    assert templates(kubectl) == templates_before, "taking over changed a pod template (its pods would restart)"
    time.sleep(5)  # a rollout, had one begun, would have replaced a pod by now
    assert (pods_of(kubectl, "webhook"), pods_of(kubectl, "agent")) == (webhooks_before, agents_before)


def test_helm_test_reaches_the_webhook_by_its_service_name(release, installed, plane):
    logs = helm_test(plane, installed)
    assert "gpushard-test-review" in logs and "Succeeded" in logs, logs
    assert f"https://gpushard.{SYSTEM}.svc/mutate admitted the pod as gpushard.io/gpu 50 of one card" in logs, logs


def test_admission_and_the_node_on_the_helm_install(release, installed, runtime, namespace):
    admits_rewrites_runs_and_denies(installed, runtime, namespace)


def test_the_command_line_on_the_helm_install(release, installed, plane, namespace):
    kubectl = installed
    kubectl.apply(seeing.pod("shown", seeing.container(gpu="0.3")), "-n", namespace)
    card = kubectl.json("get", "pod", "shown", "-n", namespace)["metadata"]["annotations"]["gpushard.io/card"]
    components.wait_for("the pod bound", lambda: kubectl.json("get", "pod", "shown", "-n", namespace)["spec"].get(
        "nodeName"), timeout=60)
    kubectl.run("apply", "-f", str(ROOT / "examples" / "auditor-binding.yaml"))
    auditor = plane.user_config("auditor", "e2e-auditor", ("gpu-admins",))
    status = cli(auditor, "status")
    assert status.returncode == 0, status.stderr
    lines = [line for line in status.stdout.splitlines() if f"{namespace}/shown" in line]
    assert lines and any("30" in line for line in lines) and card in " ".join(lines), status.stdout
    audit = cli(auditor, "audit")
    assert audit.returncode in (0, 1) and "Traceback" not in audit.stderr, audit.stderr
    kubectl.apply(json.dumps({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "e2e-top", "namespace": SYSTEM},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gpushard-top"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "e2e-top"}]}))
    # A real runtime forwards the port: top reads the agent's metrics and shows the node's cards.
    top = cli(plane.user_config("top", "e2e-top"), "top")
    assert top.returncode == 0, top.stdout + top.stderr
    assert components.NODE_NAME in top.stdout, top.stdout
    token = kubectl.token("gpushard-replacer", SYSTEM)
    replace = cli(None, "replace", "--once", "--dry-run", f"--namespace={SYSTEM}", "--identity=e2e",
                  env={"KUBECONFIG": str(plane.token_config("replacer", token)), "PATH": "/usr/bin:/bin"})
    assert replace.returncode == 0 and "Traceback" not in replace.stderr, replace.stdout + replace.stderr


def test_helm_upgrade_to_three_webhook_replicas(release, installed, plane, work):
    kubectl = installed
    gpushard.helm(plane, "upgrade", "gpushard", str(gpushard.packaged_chart(work / "chart")), "--reuse-values",
                  "--set", "webhook.replicas=3")
    kubectl.run("rollout", "status", "deployment/gpushard-webhook", "-n", SYSTEM, "--timeout=180s", timeout=200)
    assert kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["status"].get("readyReplicas") == 3
    helm_test(plane, kubectl)


def test_helm_uninstall_leaves_only_what_the_docs_list(release, installed, plane, namespace):
    kubectl = installed
    gpushard.helm(plane, "uninstall", "gpushard", "--wait", "--timeout", "180s")
    assert gpushard.leftovers(kubectl) == set()  # the chart keeps nothing
    assert kubectl.run("get", "mutatingwebhookconfiguration", "gpushard", check=False).returncode != 0
    # Nothing fails closed: the namespace is still labelled enforce and takes pods, unchanged.
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("after", objects.container()))
    assert "gpushard.io/card" not in (kubectl.json("get", "pod", "after", "-n", namespace)["metadata"].get(
        "annotations") or {})
