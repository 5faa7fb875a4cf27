"""We test the Helm chart on a real API server (a control plane of its own, so the Kustomize install of the other
tests is untouched), with the pinned helm:
- `helm install` into a labelled namespace exits 0; every object of the release is stored, and every admission
  policy compiles (`status.typeChecking` clean);
- admission through the chart's webhook configuration (the webhook served on this machine, as in the rest of
  the tier): a fraction is rewritten to one card's shares, a pod asking 1.5 cards is denied with gpushard's
  message, an audit namespace gets the warning and no change;
- `helm upgrade` switching isolation (the webhook then denies a GPU container's unprefixed envFrom), the webhook
  replicas, and the backend (the DeviceClass appears and a fraction becomes a claim from gpushard's template);
- `helm uninstall` leaves only what docs/helm.md lists, the webhook configuration first of all: with the
  webhook process gone, a pod in a namespace still labelled enforce is admitted, not refused;
- a Kustomize install taken over by Helm as docs/helm.md says: `helm install` adopts every object, and
  `helm uninstall` then removes them as its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.chart import helm as chart_helm
from tests.e2e import components, gpushard, objects
from tests.e2e.conftest import ASSETS
from tests.e2e.gpushard import helm, leftovers, release_objects

ROOT = Path(__file__).resolve().parents[2]
CHART = gpushard.CHART
SYSTEM = gpushard.SYSTEM
POD_SECURITY = {f"pod-security.kubernetes.io/{k}": "privileged" for k in ("enforce", "warn", "audit")}


@pytest.fixture(scope="module")
def cluster(work):
    chart_helm.skip_module_without_helm()
    yield from components.own_plane(ASSETS, work / "helm")


def upgrade(plane: components.ControlPlane, webhook: gpushard.Webhook, *sets: str) -> None:
    """`helm upgrade --reuse-values` with ``sets``, the webhook then started on the new config.

    The tier points the webhook configuration at this machine by a URL (tests/e2e/gpushard.py); Helm applies
    server-side and would merge its Service reference beside that URL, which the API server refuses. So the
    release's own clientConfig is put back first, as the chart renders it, and the URL after."""
    configuration = next(o for o in release_objects(plane) if o["kind"] == "MutatingWebhookConfiguration")
    patch = [{"op": "replace", "path": f"/webhooks/{i}/clientConfig", "value": hook["clientConfig"]}
             for i, hook in enumerate(configuration["webhooks"])]
    plane.kubectl.run("patch", "mutatingwebhookconfiguration", "gpushard", "--type=json", "-p", json.dumps(patch))
    args = [a for s in sets for a in ("--set", s)]
    helm(plane, "upgrade", "gpushard", str(CHART), "--reuse-values", *args)
    webhook.reload()
    webhook.point_configuration()


def namespace(kubectl: components.Kubectl, name: str, mode: str | None) -> str:
    labels = {"gpushard.io/mode": mode} if mode else {}
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name,
                                                                                      "labels": labels}}))
    return name


@pytest.fixture(scope="module")
def release(cluster, work):
    kubectl = cluster.kubectl
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": SYSTEM, "labels": POD_SECURITY}}))
    done = helm(cluster, "install", "gpushard", str(CHART))
    webhook = gpushard.Webhook(cluster, work / "helm").start()
    yield done, webhook
    webhook.stop()


def test_helm_install_stores_every_object(cluster, release):
    done, _webhook = release
    assert "STATUS: deployed" in done.stdout, done.stdout
    kubectl = cluster.kubectl
    for obj in release_objects(cluster):
        kind, name = obj["kind"], obj["metadata"]["name"]
        ns = ["-n", obj["metadata"]["namespace"]] if obj["metadata"].get("namespace") else []
        stored = kubectl.run("get", kind, name, *ns, "-o", "json", check=False)
        assert stored.returncode == 0, f"{kind}/{name} is not stored: {stored.stderr}"
        labels = json.loads(stored.stdout)["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", (kind, name, labels)
    for policy in kubectl.json("get", "validatingadmissionpolicies")["items"]:
        checking = (policy.get("status") or {}).get("typeChecking") or {}
        assert not checking.get("expressionWarnings"), (policy["metadata"]["name"], checking)


def test_admission_through_the_charts_configuration(cluster, release):
    kubectl = cluster.kubectl
    enforce = namespace(kubectl, "helm-enforce", "enforce")
    kubectl.run("apply", "-n", enforce, "-f", "-", input=objects.pod("quarter", objects.container(gpu="0.25")))
    pod = kubectl.json("get", "pod", "quarter", "-n", enforce)
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    card = pod["metadata"]["annotations"]["gpushard.io/card"]
    assert limits == {"gpushard.io/gpu": "25", f"gpushard.io/card-{card}": "25"}
    denied = kubectl.run("apply", "-n", enforce, "-f", "-", check=False,
                         input=objects.pod("too-big", objects.container(gpu="1.5")))
    assert denied.returncode != 0 and "gpushard: container \"main\" asks nvidia.com/gpu 1500m" in denied.stderr, \
        denied.stderr
    audit = namespace(kubectl, "helm-audit", "audit")
    container = objects.container(gpu="1")
    container["securityContext"] = {"privileged": True}
    done = kubectl.run("apply", "-n", audit, "-f", "-", input=objects.pod("asked", container))
    assert "Warning: gpushard:" in done.stderr and "privileged" in done.stderr, done.stderr  # the audit finding
    stored = kubectl.json("get", "pod", "asked", "-n", audit)
    assert stored["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert "gpushard.io/card" not in (stored["metadata"].get("annotations") or {})


def test_helm_upgrade_switches_isolation_replicas_and_backend(cluster, release):
    _done, webhook = release
    kubectl = cluster.kubectl
    upgrade(cluster, webhook, "isolation=memory", "webhook.replicas=3")
    assert kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["spec"]["replicas"] == 3
    config = yaml.safe_load(kubectl.json("get", "configmap", "gpushard-config", "-n", SYSTEM)["data"]["config.yaml"])
    assert config["isolation"] == "memory"
    enforce = namespace(kubectl, "helm-isolated", "enforce")
    container = objects.container(gpu="0.5")
    container["envFrom"] = [{"configMapRef": {"name": "settings"}}]
    denied = kubectl.run("apply", "-n", enforce, "-f", "-", check=False, input=objects.pod("from-env", container))
    assert denied.returncode != 0 and 'takes env from configMap "settings" with no prefix' in denied.stderr, \
        denied.stderr

    if cluster.minor < 36:
        # Refused while rendering, naming the cluster's version: nothing reaches the API server, the release
        # stays as it was (docs/compatibility.md).
        done = helm(cluster, "upgrade", "gpushard", str(CHART), "--reuse-values", "--set", "backend=dra",
                    "--set", "isolation=none", check=False)
        assert done.returncode != 0 and "backend: dra needs Kubernetes 1.36 or newer" in done.stderr, done.stderr
        assert f"this cluster is v1.{cluster.minor}." in done.stderr, done.stderr
        assert kubectl.run("get", "deviceclass", "gpu.gpushard.io", check=False).returncode != 0
    else:
        upgrade(cluster, webhook, "backend=dra", "isolation=none")
        assert kubectl.run("get", "deviceclass", "gpu.gpushard.io", check=False).returncode == 0
        drans = namespace(kubectl, "helm-dra", "enforce")
        kubectl.run("apply", "-n", drans, "-f", "-", input=objects.pod("claimed", objects.container(gpu="0.25")))
        pod = kubectl.json("get", "pod", "claimed", "-n", drans)
        assert [c.get("resourceClaimTemplateName") for c in pod["spec"]["resourceClaims"]] == ["gpushard-shares-25"]
    assert helm(cluster, "history", "gpushard").stdout.count("deployed") == 1  # the last; the others superseded


def test_helm_uninstall_leaves_only_what_the_docs_list(cluster, release):
    _done, webhook = release
    kubectl = cluster.kubectl
    helm(cluster, "uninstall", "gpushard", "--wait", "--timeout", "120s")
    assert leftovers(kubectl) == set()  # the chart keeps nothing (docs/helm.md, "Uninstall with Helm")
    assert kubectl.run("get", "mutatingwebhookconfiguration", "gpushard", check=False).returncode != 0
    # The namespace keeps its labels: it was not the chart's.
    assert kubectl.json("get", "namespace", SYSTEM)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] \
        == "privileged"
    # Nothing fails closed: with the webhook process gone too, a namespace still labelled enforce takes pods.
    webhook.stop()
    kubectl.run("apply", "-n", "helm-enforce", "-f", "-", input=objects.pod("after", objects.container()))


def test_a_kustomize_install_taken_over_by_helm(cluster, release, work):
    kubectl = cluster.kubectl
    base = str(ROOT / "deploy" / "base")
    kubectl.run("apply", "-k", base, timeout=180)
    rendered = work / "helm" / "gpushard-objects.yaml"
    rendered.write_text(kubectl.run("kustomize", base).stdout)
    before = kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["spec"]["template"]
    gpushard.mark_for_helm(kubectl, rendered)
    # Helm's field manager owns what kubectl applied: no conflict, config.yaml's other text included
    # (docs/helm.md, "Taking a Kustomize install over with Helm").
    done = helm(cluster, "install", "gpushard", str(CHART))
    assert "STATUS: deployed" in done.stdout
    after = kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["spec"]["template"]
    assert after == before, "taking over changed the webhook's pod template (its pods would restart)"
    owned = {(o["kind"], o["metadata"]["name"]) for o in release_objects(cluster)}
    applied = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(rendered.read_text())
               if o and o["kind"] != "Namespace"}
    assert owned == applied
    # Nothing is left co-owned by kubectl's client-side apply: an upgrade changes a value it had set.
    helm(cluster, "upgrade", "gpushard", str(CHART), "--reuse-values", "--set", "webhook.replicas=3")
    assert kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)["spec"]["replicas"] == 3
    managers = {f["manager"] for f in kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM,
                                                   "--show-managed-fields")["metadata"]["managedFields"]}
    assert "kubectl-client-side-apply" not in managers, managers
    helm(cluster, "uninstall", "gpushard", "--wait", "--timeout", "120s")
    assert leftovers(kubectl) == set()  # the chart keeps nothing (docs/helm.md, "Uninstall with Helm")
