"""Uninstalling never locks a cluster: nothing that refuses pods outlives what it needs.

Helm deletes a release's objects kind by kind in its UninstallOrder, each kind's deletes finished before
the next kind's start (pkg/kube/client.go, batchPerform), after the pre-delete hooks. The order is
helm's pkg/release/v1/util/kind_sorter.go (the same at tag v4.2.4, 3900f434fd3e, and on main at e9b85e4de16a,
2026-08; the pinned helm is v4.3.1): known kinds in the order below, every other kind after them sorted by
name (lessByKind). INSTALL_ORDER, from the same file, is checked against the pinned binary itself, whose
`helm template` prints objects in it; so the file and the binary agree.

We test, for the chart with the values of every kustomization (tests/chart/kustomizations.py):
- the binary sorts the rendered objects as INSTALL_ORDER says;
- in UNINSTALL_ORDER the MutatingWebhookConfiguration (failurePolicy Fail) goes before every other object,
  the webhook's Service and Deployment included, so no pod is refused for want of a webhook;
- no admission policy reads a params object (no paramKind) and no binding names one (no paramRef): a
  policy whose params go missing before it does refused every pod it matched (parameterNotFoundAction
  Deny), and kube-apiserver may stop watching params of a built-in kind for good once a policy's last
  binding is gone. So no deletion order can strand a binding, and the chart keeps nothing past `helm
  uninstall` (no helm.sh/resource-policy: keep) that a later install would collide with; every binding's
  policy is in the same release;
- each admission policy is applied before its binding, by `kubectl apply -k` (kustomize's order) and by Helm
  (its install order): an upgrade from a version whose policies read params drops paramKind from a policy
  before its binding drops paramRef (a binding without one beside a policy that still reads params
  refuses everything the policy matches; `gpushard status` tells that state);
- `kubectl delete -k` deletes in the order kustomize prints (the webhook configuration last), so
  docs/upgrade.md's Kustomize uninstall deletes the webhook configuration first, by hand, and needs no
  binding deleted by hand; docs/helm.md's Helm uninstall says what stays.
"""

from __future__ import annotations

import re

import pytest

from tests.chart import helm
from tests.chart.kustomizations import DEPLOY, VALUES, kustomize

helm.skip_module_without_helm()
pytestmark = pytest.mark.usefixtures("helm_binary")

INSTALL_ORDER = [
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
    "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass",
    "PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole", "ClusterRoleList",
    "ClusterRoleBinding", "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList",
    "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
    "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress", "APIService",
    "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
]
UNINSTALL_ORDER = [
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "APIService", "Ingress", "IngressClass",
    "Service", "CronJob", "Job", "StatefulSet", "HorizontalPodAutoscaler", "Deployment", "ReplicaSet",
    "ReplicationController", "Pod", "DaemonSet", "RoleBindingList", "RoleBinding", "RoleList", "Role",
    "ClusterRoleBindingList", "ClusterRoleBinding", "ClusterRoleList", "ClusterRole", "CustomResourceDefinition",
    "PersistentVolumeClaim", "PersistentVolume", "StorageClass", "ConfigMap", "SecretList", "Secret",
    "ServiceAccount", "PodDisruptionBudget", "PodSecurityPolicy", "LimitRange", "ResourceQuota", "NetworkPolicy",
    "Namespace", "PriorityClass",
]
KEEP = "helm.sh/resource-policy"
PAGE = (helm.ROOT / "docs/upgrade.md").read_text()
HELM_PAGE = (helm.ROOT / "docs/helm.md").read_text()


def rank(kind: str, order: list[str]) -> tuple[int, str]:
    """Where helm puts a kind: its place in the order, or after all of them, by name (lessByKind)."""
    return (order.index(kind), "") if kind in order else (len(order), kind)


def released(folder: str) -> list[dict]:
    """The objects `helm uninstall` deletes: the release's own, not its test hook."""
    return [o for o in helm.template(VALUES[folder]) if not helm.is_test_hook(o)]


@pytest.mark.parametrize("folder", sorted(VALUES))
def test_the_binary_sorts_as_the_source_says(folder):
    kinds = [o["kind"] for o in released(folder)]
    assert kinds == sorted(kinds, key=lambda k: rank(k, INSTALL_ORDER)), kinds


@pytest.mark.parametrize("folder", sorted(VALUES))
def test_the_webhook_configuration_goes_first(folder):
    objects = sorted(released(folder), key=lambda o: rank(o["kind"], UNINSTALL_ORDER))
    assert objects[0]["kind"] == "MutatingWebhookConfiguration"
    assert [o["kind"] for o in objects].count("MutatingWebhookConfiguration") == 1
    assert all(hook["failurePolicy"] in ("Fail", "Ignore") for hook in objects[0]["webhooks"])


@pytest.mark.parametrize("folder", sorted(VALUES))
def test_no_policy_reads_params_and_nothing_is_kept(folder):
    objects = released(folder)
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    bindings = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert policies and bindings
    for policy in policies.values():
        assert "paramKind" not in policy["spec"], policy["metadata"]["name"]
    for binding in bindings:
        assert "paramRef" not in binding["spec"], binding["metadata"]["name"]
        assert binding["spec"]["policyName"] in policies, binding["metadata"]["name"]
    kept = [helm.ident(o) for o in objects if (o["metadata"].get("annotations") or {}).get(KEEP)]
    assert not kept, f"helm uninstall would leave {kept} behind, and a later helm install collide with them"


def _policies_before_bindings(objects: list[dict]) -> None:
    at = {(o["kind"], o["metadata"]["name"]): i for i, o in enumerate(objects)}
    bindings = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert bindings
    for binding in bindings:
        policy = at[("ValidatingAdmissionPolicy", binding["spec"]["policyName"])]
        assert policy < at[("ValidatingAdmissionPolicyBinding", binding["metadata"]["name"])], binding["metadata"]


@pytest.mark.parametrize("folder", sorted(VALUES))
def test_each_policy_is_applied_before_its_binding(folder):
    _policies_before_bindings(kustomize(DEPLOY / folder))
    _policies_before_bindings(released(folder))  # as `helm template` prints them: Helm's install order


def section(heading: str, page: str = PAGE) -> str:
    """A page (docs/upgrade.md unless told) from a heading to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    text = page[page.index(f"\n{heading}\n") + 1:]
    ends = [m.start() for m in re.finditer(r"^(#+) ", text, flags=re.M) if len(m.group(1)) <= len(level)]
    return text[:ends[1]] if len(ends) > 1 else text


def commands(heading: str, page: str = PAGE) -> list[str]:
    """The command lines of a section's sh blocks, in order."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", section(heading, page), flags=re.S):
        lines += [line.split(" #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def test_kubectl_delete_k_goes_in_kustomizes_order_so_the_docs_go_first():
    objects = kustomize(DEPLOY / "base")
    # What `kubectl delete -k` does by itself: the webhook configuration last.
    assert objects[-1]["kind"] == "MutatingWebhookConfiguration"
    text = section("## Uninstall")
    delete_k = text.index("kubectl delete -k deploy/")
    assert -1 < text.find("kubectl delete mutatingwebhookconfiguration gpushard") < delete_k
    assert not [o for o in objects if "paramRef" in o.get("spec", {}) or "paramKind" in o.get("spec", {})]


def test_the_helm_uninstall_section_says_what_stays():
    assert any(c.startswith("helm uninstall gpushard") for c in commands("## Uninstall with Helm", HELM_PAGE))
    text = section("## Uninstall with Helm", HELM_PAGE)
    for kept in ("gpushard-tls", "pod-security.kubernetes.io", "gpushard.io/mode", "kind_sorter.go"):
        assert kept in text, f"docs/helm.md, Uninstall with Helm: say what happens to {kept}"
