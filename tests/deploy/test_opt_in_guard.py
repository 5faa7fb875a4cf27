"""The guard outside enforce namespaces (deploy/base/opt-in-guard.yaml), its CEL evaluated for real.

We test, with the policy and binding as deploy/base renders them (tests/deploy/admission_policy.py
evaluates the CEL with cel-python as the API server would):
- a Pod asking gpushard.io/card-<k> alone, or gpushard.io/gpu alone, in limits or only in
  requests, in an app, init or sidecar container, in a namespace without the label, in audit,
  or with a label value that is not "enforce", is denied with a message naming the container
  and telling to label the namespace gpushard.io/mode=enforce;
- the same in the template of every kind gpushard rewrites, on CREATE and on an UPDATE that
  changes the template; an UPDATE that leaves the template alone, or of an object being
  deleted, passes;
- what the guard leaves alone: enforce namespaces, pods asking no gpushard.io resource
  (nvidia.com/gpu included), the system namespaces;
- its rules cover Pods and exactly the template kinds of webhook/core/names.py.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_manifests import BASE
from webhook.core import names

# kind -> (group, resource) as the API server names them in an admission request.
RESOURCES = {"Pod": ("", "pods"), "PodTemplate": ("", "podtemplates"),
             "ReplicationController": ("", "replicationcontrollers"), "Deployment": ("apps", "deployments"),
             "StatefulSet": ("apps", "statefulsets"), "DaemonSet": ("apps", "daemonsets"),
             "ReplicaSet": ("apps", "replicasets"), "Job": ("batch", "jobs"), "CronJob": ("batch", "cronjobs")}


@pytest.fixture(scope="module")
def guard():
    return admission_policy.shipped(rendering.render(BASE), "gpushard-opt-in")


def container(name: str, resources: dict | None = None, part: str = "limits", **extra) -> dict:
    c = {"name": name, "image": "cuda:12", **extra}
    if resources:
        c["resources"] = {part: resources}
    return c


def pod_spec(*containers: dict, init: list[dict] | None = None) -> dict:
    spec = {"containers": list(containers)}
    if init:
        spec["initContainers"] = init
    return spec


def wrap(kind: str, spec: dict, namespace: str = "lab") -> dict:
    template = {"metadata": {"labels": {"app": "x"}}, "spec": spec}
    group = RESOURCES[kind][0]
    obj = {"apiVersion": f"{group}/v1" if group else "v1", "kind": kind,
           "metadata": {"name": "x", "namespace": namespace}}
    if kind == "Pod":
        obj["spec"] = spec
        return obj
    holder: dict = obj
    for key in names.TEMPLATE_PATHS[kind][:-1]:
        holder = holder.setdefault(key, {})
    holder[names.TEMPLATE_PATHS[kind][-1]] = template
    return obj


def admit(guard, obj: dict, namespace: dict, operation: str = "CREATE", old: dict | None = None):
    group, resource = RESOURCES[obj["kind"]]
    request = {"operation": operation, "namespace": namespace["metadata"]["name"],
               "kind": {"group": group, "version": "v1", "kind": obj["kind"]},
               "resource": {"group": group, "version": "v1", "resource": resource},
               "userInfo": {"username": "alice"}}
    outcome = admission_policy.evaluate(*guard, request, obj, old, namespace)
    assert not outcome.errored, outcome.message  # a denial must come from the rule, not a failing expression
    return outcome


NOT_OPTED_IN = [admission_policy.namespace_object("lab"),
                admission_policy.namespace_object("lab", {names.MODE_LABEL: names.MODE_AUDIT}),
                admission_policy.namespace_object("lab", {names.MODE_LABEL: "Enforce"})]
ENFORCED = admission_policy.namespace_object("lab", {names.MODE_LABEL: names.MODE_ENFORCE})

BYPASSES = {
    "card-k alone": pod_spec(container("train", {"gpushard.io/card-1": "25"})),
    "card-k in requests only": pod_spec(container("train", {"gpushard.io/card-0": "100"}, part="requests")),
    "shares alone": pod_spec(container("train", {"gpushard.io/gpu": "50"})),
    # Sized to a card only by the webhook: unrewritten, it names no card and no quota counts it.
    "a memory ask": pod_spec(container("train", {"gpushard.io/memory": "12Gi"})),
    "in an init container": pod_spec(container("app"), init=[container("train", {"gpushard.io/card-1": "5"})]),
    "in a sidecar": pod_spec(container("app"), init=[container("train", {"gpushard.io/gpu": "5"},
                                                               restartPolicy="Always")]),
    "beside other resources": pod_spec(container("app", {"cpu": "1"}),
                                       container("train", {"memory": "1Gi", "gpushard.io/card-3": "1"})),
}


@pytest.mark.parametrize("namespace", NOT_OPTED_IN, ids=["no-label", "audit", "bad-label"])
@pytest.mark.parametrize("case", sorted(BYPASSES))
def test_pods_asking_gpushard_resources_are_denied_outside_enforce(guard, namespace, case):
    outcome = admit(guard, wrap("Pod", BYPASSES[case]), namespace)
    assert outcome.matched and not outcome.allowed
    assert outcome.message == (
        'gpushard: container "train" asks gpushard.io/* resources in namespace "lab", which does not enforce '
        "gpushard; label the namespace gpushard.io/mode=enforce (kubectl label namespace lab gpushard.io/mode=enforce)")


@pytest.mark.parametrize("kind", sorted(names.TEMPLATE_PATHS))
def test_templates_of_every_kind_are_denied_outside_enforce(guard, kind):
    obj = wrap(kind, BYPASSES["in an init container"])
    outcome = admit(guard, obj, NOT_OPTED_IN[0])
    assert not outcome.allowed and 'container "train"' in outcome.message
    # An UPDATE that brings the resource in is denied too ...
    before = wrap(kind, pod_spec(container("app")))
    assert not admit(guard, obj, NOT_OPTED_IN[1], "UPDATE", before).allowed
    # ... one that leaves the template alone (scaling, labels) passes, as does one of an object being deleted.
    scaled = copy.deepcopy(obj)
    scaled["metadata"]["labels"] = {"team": "ml"}
    assert admit(guard, scaled, NOT_OPTED_IN[1], "UPDATE", obj).allowed
    deleting = copy.deepcopy(obj)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert admit(guard, deleting, NOT_OPTED_IN[1], "UPDATE", before).allowed
    assert admit(guard, obj, ENFORCED).allowed


@pytest.mark.parametrize("spec", [
    pod_spec(container("web")),
    pod_spec(container("train", {"nvidia.com/gpu": "1"})),
    pod_spec(container("train", {"example.com/gpushard.io-like": "1"})),
    pod_spec(container("train", {}), init=[container("setup")]),
])
def test_pods_without_gpushard_resources_pass_everywhere(guard, spec):
    for namespace in NOT_OPTED_IN + [ENFORCED]:
        assert admit(guard, wrap("Pod", spec), namespace).allowed


@pytest.mark.parametrize("case", sorted(BYPASSES))
def test_enforce_namespaces_are_left_to_the_webhook(guard, case):
    outcome = admit(guard, wrap("Pod", BYPASSES[case]), ENFORCED)
    # Not evaluated there at all (its namespaceSelector): the API server spends nothing on it per pod.
    assert outcome.allowed and not outcome.matched


@pytest.mark.parametrize("name", ["kube-system", "gpushard-system"])
def test_system_namespaces_are_not_matched(guard, name):
    outcome = admit(guard, wrap("Pod", BYPASSES["card-k alone"], name), admission_policy.namespace_object(name))
    assert not outcome.matched and outcome.allowed


def test_rules_cover_pods_and_exactly_the_template_kinds(guard):
    policy, _ = guard
    covered = {(g, r, op) for rule in policy["spec"]["matchConstraints"]["resourceRules"]
               for g in rule["apiGroups"] for r in rule["resources"] for op in rule["operations"]}
    expected = {("", "pods", "CREATE")} | {(RESOURCES[k][0], RESOURCES[k][1], op)
                                           for k in names.TEMPLATE_PATHS for op in ("CREATE", "UPDATE")}
    assert covered == expected
    assert policy["spec"]["failurePolicy"] == "Fail"
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["prefix"] == f"'{names.DOMAIN}/'"
    assert f"'{names.MODE_LABEL}'" in variables["enforced"] and f"'{names.MODE_ENFORCE}'" in variables["enforced"]
