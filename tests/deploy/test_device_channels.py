"""The device-channel policy (deploy/base/device-channels.yaml), its CEL evaluated for real.

We test, with the policy and binding as deploy/base renders them (cel-python, as the API server
would evaluate them), in namespaces without the label, in audit and in enforce:
- a volume mounted under the toolkit's device-list folder (at <folder>/all, at <folder>all, at a
  path the runtime would clean to it) is denied in Pods, in init and debug containers, and in
  the template of every kind, with a message naming the container;
- annotations NVIDIA's NRI plugin, a CDI runtime, CRI-O, NRI's injectors or GKE's turn into NVIDIA
  devices are denied on
  CREATE, and on an UPDATE that adds or changes one; an UPDATE that keeps an older one (a label
  change), and CDI annotations naming other vendors' devices, pass;
- on a Pod UPDATE only the debug containers it adds are judged; a template UPDATE that leaves
  the spec as it was passes; the system namespaces are not matched.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_manifests import BASE
from tests.deploy.test_opt_in_guard import ENFORCED, NOT_OPTED_IN, RESOURCES, container, pod_spec, wrap
from webhook.core import names

NAMESPACES = [*NOT_OPTED_IN, ENFORCED]
IDS = ["no-label", "audit", "bad-label", "enforce"]
NULL = {"name": "null", "hostPath": {"path": "/dev/null"}}


@pytest.fixture(scope="module")
def policy():
    objects = rendering.render(BASE)
    found, = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"
              and o["metadata"]["name"] == "gpushard-device-channels"]
    binding, = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                and o["spec"]["policyName"] == "gpushard-device-channels"]
    return found, binding


def admit(policy, obj: dict, namespace: dict, operation: str = "CREATE", old: dict | None = None,
          sub: str = ""):
    group, resource = RESOURCES[obj["kind"]]
    request = {"operation": operation, "namespace": namespace["metadata"]["name"],
               "kind": {"group": group, "version": "v1", "kind": obj["kind"]},
               "resource": {"group": group, "version": "v1", "resource": resource + (f"/{sub}" if sub else "")},
               "userInfo": {"username": "alice"}}
    outcome = admission_policy.evaluate(*policy, request, obj, old, namespace)
    assert not outcome.errored, outcome.message  # a denial must come from the rule, not a failing expression
    return outcome


def mounting(path: str) -> dict:
    return container("app", volumeMounts=[{"name": "null", "mountPath": path}])


@pytest.mark.parametrize("namespace", NAMESPACES, ids=IDS)
@pytest.mark.parametrize("path", ["/var/run/nvidia-container-devices/all", "/var/run/nvidia-container-devicesall",
                                  "/run/nvidia-container-devices/GPU-1", "//var/run/./nvidia-container-devices/all"])
def test_device_list_mounts_are_denied_everywhere(policy, namespace, path):
    spec = {**pod_spec(mounting(path)), "volumes": [NULL]}
    outcome = admit(policy, wrap("Pod", spec), namespace)
    assert outcome.matched and not outcome.allowed
    assert outcome.message.startswith(
        'gpushard: container "app" mounts a volume under /var/run/nvidia-container-devices')


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_in_every_container_list_and_template(policy, kind):
    for spec in (pod_spec(container("main"), init=[mounting("/var/run/nvidia-container-devices/all")]),
                 {**pod_spec(container("main")), "ephemeralContainers": [mounting("/run/nvidia-container-devices/x")]}):
        assert not admit(policy, wrap(kind, {**spec, "volumes": [NULL]}), NOT_OPTED_IN[0]).allowed


@pytest.mark.parametrize("namespace", NAMESPACES, ids=IDS)
@pytest.mark.parametrize("key,value", [("nvidia.cdi.k8s.io/container.main", "nvidia.com/gpu=all"),
                                       ("nvidia.cdi.k8s.io/container.*", "nvidia.com/gpu=0"),
                                       ("cdi.k8s.io/any", "nvidia.com/gpu=all"),
                                       ("devices.crio.io", "/dev/nvidia0"),
                                       ("io.kubernetes.cri-o.Devices", "/dev/nvidiactl"),
                                       ("devices.noderesource.dev/container.main", "- path: /dev/nvidia1"),
                                       ("cdi.nri.io/container.main", "nvidia.com/gpu=all"),
                                       ("devices.gke.io/container.main", "- path: /dev/nvidia0")])
def test_nvidia_device_annotations_are_denied(policy, namespace, key, value):
    obj = wrap("Pod", pod_spec(container("main")))
    obj["metadata"]["annotations"] = {key: value}
    outcome = admit(policy, obj, namespace)
    assert not outcome.allowed and outcome.message.startswith(f'gpushard: annotation "{key}"')
    job = wrap("Job", pod_spec(container("main")))
    job["spec"]["template"]["metadata"]["annotations"] = {key: value}
    assert not admit(policy, job, namespace).allowed


def test_updates_judge_only_what_they_add(policy):
    ns = NOT_OPTED_IN[0]
    old = wrap("Pod", {**pod_spec(mounting("/var/run/nvidia-container-devices/all")), "volumes": [NULL]})
    old["metadata"]["annotations"] = {"nvidia.cdi.k8s.io/container.main": "nvidia.com/gpu=all"}
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert admit(policy, relabelled, ns, "UPDATE", old).allowed  # a pod from before stays manageable
    changed = copy.deepcopy(old)
    changed["metadata"]["annotations"]["nvidia.cdi.k8s.io/container.main"] = "nvidia.com/gpu=1"
    assert not admit(policy, changed, ns, "UPDATE", old).allowed
    added = wrap("Pod", pod_spec(container("main")))
    later = copy.deepcopy(added)
    later["metadata"]["annotations"] = {"cdi.k8s.io/x": "nvidia.com/gpu=all"}
    assert not admit(policy, later, ns, "UPDATE", added).allowed
    # kubectl debug: a new debug container mounting the folder is denied; an older one is left alone.
    debugged = copy.deepcopy(added)
    debugged["spec"]["ephemeralContainers"] = [mounting("/var/run/nvidia-container-devices/all")]
    assert not admit(policy, debugged, ns, "UPDATE", added, sub="ephemeralcontainers").allowed
    again = copy.deepcopy(debugged)
    again["spec"]["ephemeralContainers"].append(container("debugger-2"))
    assert admit(policy, again, ns, "UPDATE", debugged, sub="ephemeralcontainers").allowed
    # A template left as it was (scaling) passes; one changed to mount the folder does not.
    deploy = wrap("Deployment", pod_spec(mounting("/var/run/nvidia-container-devices/all")))
    scaled = copy.deepcopy(deploy)
    scaled["spec"]["replicas"] = 3
    assert admit(policy, scaled, ns, "UPDATE", deploy).allowed
    clean = wrap("Deployment", pod_spec(container("app")))
    assert not admit(policy, deploy, ns, "UPDATE", clean).allowed


@pytest.mark.parametrize("namespace", NAMESPACES, ids=IDS)
def test_ordinary_pods_pass(policy, namespace):
    spec = {**pod_spec(container("app", volumeMounts=[{"name": "d", "mountPath": "/var/run/nvidia-cache"}])),
            "volumes": [{"name": "d", "emptyDir": {}}]}
    obj = wrap("Pod", spec)
    obj["metadata"]["annotations"] = {"cdi.k8s.io/net": "example.com/nic=eth1", "team": "a"}
    assert admit(policy, obj, namespace).allowed


@pytest.mark.parametrize("name", ["kube-system", "gpushard-system"])
def test_system_namespaces_are_not_matched(policy, name):
    spec = {**pod_spec(mounting("/var/run/nvidia-container-devices/all")), "volumes": [NULL]}
    outcome = admit(policy, wrap("Pod", spec, name), admission_policy.namespace_object(name))
    assert not outcome.matched


def test_it_covers_pods_debug_containers_and_every_template_kind(policy):
    found, _ = policy
    covered = {(g, r, op) for rule in found["spec"]["matchConstraints"]["resourceRules"]
               for g in rule["apiGroups"] for r in rule["resources"] for op in rule["operations"]}
    expected = {(RESOURCES[k][0], RESOURCES[k][1], op) for k in [*names.TEMPLATE_PATHS, "Pod"]
                for op in ("CREATE", "UPDATE")}
    expected |= {("", "pods/ephemeralcontainers", op) for op in ("CREATE", "UPDATE")}
    assert covered == expected
    assert found["spec"]["failurePolicy"] == "Fail"
