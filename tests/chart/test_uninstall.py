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
- every admission policy binding that denies when its params are missing (parameterNotFoundAction Deny)
  loses them only after it is gone: Helm deletes ConfigMaps before any admission policy, so the params
  ConfigMap is kept by `helm uninstall` (helm.sh/resource-policy: keep), and docs/install.md says so;
- `kubectl delete -k` deletes in the order kustomize prints (the webhook configuration last, the params
  before the bindings), so docs/install.md's Kustomize uninstall deletes the webhook configuration and the
  bindings first, by hand, before `kubectl delete -k`.
"""

from __future__ import annotations

import re
import shlex

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
PAGE = (helm.ROOT / "docs/install.md").read_text()


def rank(kind: str, order: list[str]) -> tuple[int, str]:
    """Where helm puts a kind: its place in the order, or after all of them, by name (lessByKind)."""
    return (order.index(kind), "") if kind in order else (len(order), kind)


def released(folder: str) -> list[dict]:
    """The objects `helm uninstall` deletes: the release's own, not its test hook."""
    return [o for o in helm.template(VALUES[folder]) if not helm.is_test_hook(o)]


def param_objects(binding: dict, objects: list[dict]) -> list[dict]:
    ref = binding["spec"].get("paramRef") or {}
    policy = next(o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"
                  and o["metadata"]["name"] == binding["spec"]["policyName"])
    kind = policy["spec"]["paramKind"]["kind"]
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == ref.get("name")
            and o["metadata"].get("namespace") == ref.get("namespace")]


def deny_without_params(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
            and (o["spec"].get("paramRef") or {}).get("parameterNotFoundAction") == "Deny"]


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
def test_bindings_never_outlive_their_params(folder):
    objects = released(folder)
    bindings = deny_without_params(objects)
    assert bindings, "no binding denies without params any more: simplify this test and the docs"
    for binding in bindings:
        params = param_objects(binding, objects)
        assert len(params) == 1, binding["metadata"]["name"]
        param = params[0]
        deleted_after = rank(param["kind"], UNINSTALL_ORDER) > rank(binding["kind"], UNINSTALL_ORDER)
        kept = (param["metadata"].get("annotations") or {}).get(KEEP) == "keep"
        assert deleted_after or kept, (
            f"helm uninstall would delete {param['kind']} {param['metadata']['name']} before binding "
            f"{binding['metadata']['name']}, which then denies everything it matches")


def section(heading: str) -> str:
    """docs/install.md from a heading to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    text = PAGE[PAGE.index(f"\n{heading}\n") + 1:]
    ends = [m.start() for m in re.finditer(r"^(#+) ", text, flags=re.M) if len(m.group(1)) <= len(level)]
    return text[:ends[1]] if len(ends) > 1 else text


def commands(heading: str) -> list[str]:
    """The command lines of a section's sh blocks, in order."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", section(heading), flags=re.S):
        lines += [line.split(" #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def test_kubectl_delete_k_goes_in_kustomizes_order_so_the_docs_go_first():
    order = [o["kind"] for o in kustomize(DEPLOY / "base")]
    # What `kubectl delete -k` does by itself: the webhook configuration last, the params before bindings.
    assert order[-1] == "MutatingWebhookConfiguration"
    assert order.index("ConfigMap") < order.index("ValidatingAdmissionPolicyBinding")
    text = section("## Uninstall")
    delete_k = text.index("kubectl delete -k deploy/")
    assert -1 < text.find("kubectl delete mutatingwebhookconfiguration gpushard") < delete_k
    line = re.search(r"^\s*kubectl delete validatingadmissionpolicybinding (.*)$", text[:delete_k], flags=re.M)
    assert line, "docs/install.md, Uninstall: delete the bindings that deny without params before kubectl delete -k"
    for binding in deny_without_params(kustomize(DEPLOY / "base")):
        assert binding["metadata"]["name"] in shlex.split(line.group(1)), binding["metadata"]["name"]


def test_the_helm_uninstall_section_says_what_stays():
    assert any(c.startswith("helm uninstall gpushard") for c in commands("### Uninstall with Helm"))
    text = section("### Uninstall with Helm")
    for kept in ("gpushard-device-policy", "gpushard-tls", "pod-security.kubernetes.io", "gpushard.io/mode",
                 "kind_sorter.go"):
        assert kept in text, f"docs/install.md, Uninstall with Helm: say what happens to {kept}"
