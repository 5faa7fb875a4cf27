"""DRA claims in enforce namespaces (deploy/base/device-claims.yaml), its CEL evaluated for real.

We test, with the policy and binding as deploy/base renders them, and as an operator's overlay that
sets allowedDeviceClasses renders them (tests/deploy/devicepolicy.py) (cel-python, as the API server
would evaluate them):
- a ResourceClaim or ResourceClaimTemplate (resource.k8s.io/v1) in an enforce namespace that asks
  a device class of NVIDIA's DRA driver (gpu.nvidia.com, mig.nvidia.com, a class an admin made
  for one MIG profile), or any class the operator did not allow, in `exactly` or in any
  `firstAvailable` alternative, is denied with a message naming the request and the class; a claim
  the controller makes from a template, or the scheduler for an extended resource, is judged alike;
- with allowedDeviceClasses listing a class, claims asking only it pass; a class whose name
  merely contains an allowed one, or a list written with commas, allows nothing more;
- a Pod or pod template there with spec.resourceClaims (by claim or by template) is denied while no
  class is allowed, and admitted once one is (its claims are judged when they are made);
- benign: pods without claims (GPU pods asking nvidia.com/gpu included), scaling a workload from
  before, UPDATEs of claims (finalizers, status), and every namespace that does not enforce are
  not touched; pods without spec.resourceClaims are not even judged (matchConditions);
- the policy reads no params object (no paramKind, no paramRef): its list is in the policy, and by
  default it allows no class rather than every one.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, devicepolicy, rendering
from tests.deploy.test_manifests import BASE
from tests.deploy.test_opt_in_guard import ENFORCED, NOT_OPTED_IN, RESOURCES, container, pod_spec, wrap
from webhook.core import names

CLAIM_RESOURCES = {"ResourceClaim": "resourceclaims", "ResourceClaimTemplate": "resourceclaimtemplates"}
# Device classes NVIDIA's DRA driver installs (deployments/helm/.../deviceclass-*.yaml), and one an
# admin makes for a MIG profile (its demo specs): all select devices of the driver gpu.nvidia.com.
NVIDIA_CLASSES = ["gpu.nvidia.com", "mig.nvidia.com", "vfio.gpu.nvidia.com", "mig-1g-12gb.gpu.nvidia.com"]


@pytest.fixture(scope="module")
def rendered():
    return rendering.render(BASE)


@pytest.fixture(scope="module")
def policy(rendered):
    return admission_policy.shipped(rendered, "gpushard-device-claims")


def allowing(classes: str) -> tuple[dict, dict]:
    """The policy and binding as an operator's overlay that sets allowedDeviceClasses renders them."""
    return admission_policy.shipped(devicepolicy.render(BASE, allowedDeviceClasses=classes), "gpushard-device-claims")


def admit(policy, obj: dict, namespace: dict, operation: str = "CREATE", old: dict | None = None):
    if obj["kind"] in CLAIM_RESOURCES:
        group, resource = "resource.k8s.io", CLAIM_RESOURCES[obj["kind"]]
    else:
        group, resource = RESOURCES[obj["kind"]]
    request = {"operation": operation, "namespace": namespace["metadata"]["name"],
               "kind": {"group": group, "version": "v1", "kind": obj["kind"]},
               "resource": {"group": group, "version": "v1", "resource": resource},
               "userInfo": {"username": "alice"}}
    outcome = admission_policy.evaluate(*policy, request, obj, old, namespace)
    assert not outcome.errored, outcome.message  # a denial must come from the rule, not a failing expression
    return outcome


def exactly(name: str, device_class: str, **extra) -> dict:
    return {"name": name, "exactly": {"deviceClassName": device_class, **extra}}


def first_available(name: str, *classes: str) -> dict:
    return {"name": name, "firstAvailable": [{"name": f"alt{i}", "deviceClassName": c} for i, c in enumerate(classes)]}


def claim(*requests: dict, kind: str = "ResourceClaim", namespace: str = "lab") -> dict:
    spec = {"devices": {"requests": list(requests)}}
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": "c", "namespace": namespace}}
    obj["spec"] = spec if kind == "ResourceClaim" else {"spec": spec}
    return obj


def classes_asked(obj: dict) -> list[str]:
    """The device classes a claim can be allocated from, as the API defines its requests."""
    spec = obj["spec"] if obj["kind"] == "ResourceClaim" else obj["spec"]["spec"]
    found = []
    for request in spec["devices"]["requests"]:
        if "exactly" in request:
            found.append(request["exactly"]["deviceClassName"])
        found += [sub["deviceClassName"] for sub in request.get("firstAvailable", [])]
    return found


@pytest.mark.parametrize("kind", sorted(CLAIM_RESOURCES))
@pytest.mark.parametrize("device_class", [*NVIDIA_CLASSES, "gpu.example.com"])
def test_claims_asking_a_class_not_allowed_are_denied(policy, kind, device_class):
    for obj in (claim(exactly("gpu", device_class, count=1), kind=kind),
                claim(exactly("gpu", device_class, allocationMode="All", adminAccess=True), kind=kind),
                claim(first_available("gpu", device_class), kind=kind)):
        assert classes_asked(obj) == [device_class]
        outcome = admit(policy, obj, ENFORCED)
        assert outcome.matched and not outcome.allowed
        assert outcome.message.startswith(
            f'gpushard: {kind} request "gpu" asks device class "{device_class}", which is not allowed in '
            'namespace "lab"'), outcome.message
    # Allowed by the operator: passes.
    assert admit(allowing(device_class), claim(exactly("gpu", device_class), kind=kind),
                 ENFORCED).allowed


def test_allowed_classes_allow_only_themselves(policy):
    nic = allowing("nic.example.com fpga.example.com")
    assert admit(nic, claim(exactly("net", "nic.example.com")), ENFORCED).allowed
    assert admit(nic, claim(exactly("net", "nic.example.com"), first_available(
        "acc", "fpga.example.com", "nic.example.com")), ENFORCED).allowed
    # Any request, or any alternative, naming another class: denied, naming it.
    for obj, request, refused in [
            (claim(exactly("net", "nic.example.com"), exactly("gpu", "gpu.nvidia.com")), "gpu", "gpu.nvidia.com"),
            (claim(first_available("acc", "fpga.example.com", "mig.nvidia.com")), "acc", "mig.nvidia.com"),
            (claim(exactly("x", "nic.example.co")), "x", "nic.example.co"),
            (claim(exactly("x", "example.com")), "x", "example.com"),
            (claim(exactly("x", "fpga.example.com nic.example.com")), "x", "fpga.example.com nic.example.com")]:
        outcome = admit(nic, obj, ENFORCED)
        assert not outcome.allowed
        assert f'request "{request}" asks device class "{refused}"' in outcome.message
    # A list written with commas is one word that names no class.
    commas = allowing("nic.example.com,fpga.example.com")
    assert not admit(commas, claim(exactly("net", "nic.example.com")), ENFORCED).allowed


def test_claims_made_for_pods_are_judged_alike(policy):
    # What the resourceclaim controller creates from a template, and what the scheduler creates for
    # an extended resource backed by a class (NVIDIA's gpu.nvidia.com has extendedResourceName
    # nvidia.com/gpu): a ResourceClaim in the pod's namespace, made by a controller's account.
    for generated in (claim(exactly("gpu", "gpu.nvidia.com")), claim(exactly("container-0-request-0",
                                                                              "gpu.nvidia.com"))):
        generated["metadata"] = {"generateName": "train-gpu-", "name": "train-gpu-x7k2p", "namespace": "lab",
                                 "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}}
        assert not admit(policy, generated, ENFORCED).allowed


def _pod_with_claims(kind: str = "Pod") -> dict:
    spec = pod_spec(container("train", resources={"claims": [{"name": "gpu"}]}))
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"},
                              {"name": "shared", "resourceClaimName": "shared-gpu"}]
    return wrap(kind, spec)


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_pods_with_claims_are_denied_while_no_class_is_allowed(policy, kind):
    outcome = admit(policy, _pod_with_claims(kind), ENFORCED)
    assert not outcome.allowed
    assert outcome.message.startswith('gpushard: pod claim "gpu" (spec.resourceClaims) asks DRA devices in '
                                      'namespace "lab", which enforces gpushard and allows no device class')
    # Once the operator allows a class, the pod passes: each claim it names is judged when made.
    assert admit(allowing("nic.example.com"), _pod_with_claims(kind), ENFORCED).allowed


def test_benign_requests_pass(policy):
    gpu = wrap("Pod", pod_spec(container("train", {"nvidia.com/gpu": "1"}), container("side")))
    assert admit(policy, gpu, ENFORCED).allowed
    plain = wrap("Deployment", pod_spec(container("web")))
    assert admit(policy, plain, ENFORCED).allowed
    # A workload from before the namespace enforced, scaled: its template is left as it was; a
    # change to the template is judged.
    for kind in sorted(set(RESOURCES) - {"Pod"}):
        older = _pod_with_claims(kind)
        scaled = copy.deepcopy(older)
        scaled.setdefault("spec", {})["replicas"] = 4
        assert admit(policy, scaled, ENFORCED, "UPDATE", older).allowed, kind
        changed = copy.deepcopy(older)
        changed["metadata"]["labels"] = {"edited": "yes"}
        _template(changed)["spec"]["containers"][0]["image"] = "cuda:13"
        assert not admit(policy, changed, ENFORCED, "UPDATE", older).allowed, kind


def _template(obj: dict) -> dict:
    holder = obj
    for key in names.TEMPLATE_PATHS[obj["kind"]]:
        holder = holder[key]
    return holder


def test_what_it_does_not_match(policy):
    found, _ = policy
    older = claim(exactly("gpu", "gpu.nvidia.com"), )
    finalized = copy.deepcopy(older)
    finalized["metadata"]["finalizers"] = []
    assert not admit(policy, finalized, ENFORCED, "UPDATE", older).matched
    for namespace in NOT_OPTED_IN:  # no label, audit, a label value that is not "enforce"
        assert not admit(policy, claim(exactly("gpu", "gpu.nvidia.com")), namespace).matched
        assert not admit(policy, _pod_with_claims(), namespace).matched
    system = admission_policy.namespace_object("kube-system", {"gpushard.io/mode": "enforce"})
    assert not admit(policy, claim(exactly("gpu", "gpu.nvidia.com"), namespace="kube-system"), system).matched
    assert found["spec"]["failurePolicy"] == "Fail"


def test_it_reads_no_params_and_allows_no_class_by_default(policy, rendered):
    found, binding = policy
    assert "paramKind" not in found["spec"] and "paramRef" not in binding["spec"]
    assert devicepolicy.local_config_map(BASE)["data"]["allowedDeviceClasses"] == ""
    assert not [o for o in rendered if o["metadata"]["name"] == devicepolicy.CONFIG_MAP]
    outcome = admit(policy, claim(exactly("net", "nic.example.com")), ENFORCED)
    assert outcome.matched and not outcome.allowed
    # A pod without spec.resourceClaims is not judged at all.
    assert not admit(policy, wrap("Pod", pod_spec(container("web"))), ENFORCED).matched
