"""DRA claims with backend dra: gpushard's own path passes, every other way to its class is closed.

We test, with every ValidatingAdmissionPolicy of the dra overlay as it renders (gpushard's own class
written into gpushard-device-claims by the overlay's replacement), its CEL evaluated with a CEL library
as the API server would:
- gpushard's own flow passes end to end in a namespace that enforces gpushard and allows no other
  class: the template the webhook's ServiceAccount makes (draobjects.claim_template), the pod as the
  webhook rewrites it (decisions with backend dra, patched as the API server would), the claim the
  resourceclaim controller makes from the template for that pod (under its ServiceAccount, or as the
  controller manager itself), and the scheduler reserving it for that pod;
- nobody else may ask gpushard's class, in any namespace (enforced, audited, not opted in, system):
  a tenant's ResourceClaim or ResourceClaimTemplate asking gpu.gpushard.io (any shares, none, or as
  a firstAvailable alternative), a template that takes a gpushard-shares-<n> name, a template of the
  webhook's account whose shares differ from its name, the claim the scheduler makes for the
  implicit extended resource deviceclass.resource.kubernetes.io/gpu.gpushard.io, a claim the
  controller makes for another pod claim name or in a namespace that does not enforce gpushard;
- a claim of gpushard's class is reserved only for the pod it was made for: a second pod naming it
  (resourceClaimName) is refused when the scheduler reserves it, and nobody may make that pod the
  claim's owner first (the garbage collector may still orphan it, and finalizers change);
- pods may carry gpushard's own entry (gpushard-gpu from gpushard-shares-<n>), and nothing else
  while no class is allowed; other classes' claims are judged as before.
"""

from __future__ import annotations

import copy

import pytest

from tests import applypatch
from tests.deploy import admission_policy, devicepolicy, rendering
from tests.deploy.test_dra_overlay import OVERLAY
from tests.deploy.test_opt_in_guard import ENFORCED, NOT_OPTED_IN, RESOURCES
from webhook.core import decisions, draobjects, names
from webhook.core import policy as policy_mod

WEBHOOK = "system:serviceaccount:gpushard-system:gpushard-webhook"
# kube-controller-manager runs the resourceclaim controller under this ServiceAccount with
# --use-service-account-credentials (kubeadm's default), else as itself.
CLAIM_CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
CONTROLLER_MANAGER = "system:kube-controller-manager"
SCHEDULER = "system:kube-scheduler"
TENANT = "alice"
CLAIM_RESOURCES = {"ResourceClaim": "resourceclaims", "ResourceClaimTemplate": "resourceclaimtemplates"}
POD_UID = "0b6f7c1e-6f63-4a8e-9a57-5a4d8a0c1d2e"
OTHER_UID = "5e7b8d2a-1c3f-4e6a-8b9d-0f1e2d3c4b5a"
SYSTEM = admission_policy.namespace_object("kube-system")
# Policies that fence the agent's own writes, which match neither pods nor claims.
AGENT_POLICIES = ("gpushard-agent-own-node", "gpushard-agent-own-slice")
EVERY_NAMESPACE = [ENFORCED, *NOT_OPTED_IN, SYSTEM]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return rendering.render(OVERLAY)


def admit(objects, obj: dict, namespace: dict, user: str, operation: str = "CREATE", old: dict | None = None,
          sub_resource: str = "") -> admission_policy.Outcome:
    """The API server's verdict under every policy of the overlay that matches the request."""
    if obj["kind"] in CLAIM_RESOURCES:
        group, resource = "resource.k8s.io", CLAIM_RESOURCES[obj["kind"]]
    else:
        group, resource = RESOURCES[obj["kind"]]
    request = {"operation": operation, "namespace": namespace["metadata"]["name"],
               "kind": {"group": group, "version": "v1", "kind": obj["kind"]},
               "resource": {"group": group, "version": "v1", "resource": resource},
               "userInfo": {"username": user}}
    if sub_resource:
        request["subResource"] = sub_resource
    matched = False
    for policy in [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]:
        binding, = [b for b in objects if b["kind"] == "ValidatingAdmissionPolicyBinding"
                    and b["spec"]["policyName"] == policy["metadata"]["name"]]
        if policy["metadata"]["name"] in AGENT_POLICIES:  # the agent's own node and slice: Nodes, ResourceSlices
            assert not admission_policy.matches(policy, request, namespace)
            continue
        outcome = admission_policy.evaluate(policy, binding, request, obj, old, namespace)
        assert not outcome.errored, outcome.message  # a denial must come from the rule, not a failing expression
        if not outcome.allowed:
            return outcome
        matched |= outcome.matched
    return admission_policy.Outcome(matched, True)


def namespaced(obj: dict, namespace: dict) -> dict:
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace["metadata"]["name"]
    return obj


def template(shares: int = 25, namespace: dict = ENFORCED) -> dict:
    """The template exactly as the webhook makes it."""
    return draobjects.claim_template(namespace["metadata"]["name"], shares)


def claim_for_pod(source: dict, pod_claim: str = names.DRA_POD_CLAIM, owner: str = POD_UID) -> dict:
    """What the resourceclaim controller creates for a pod from a template: its spec, owned by the pod."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"generateName": f"train-{pod_claim}-", "name": f"train-{pod_claim}-x7k2p",
                         "namespace": source["metadata"]["namespace"],
                         "annotations": {"resource.kubernetes.io/pod-claim-name": pod_claim},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "train", "uid": owner,
                                              "controller": True, "blockOwnerDeletion": True}]},
            "spec": copy.deepcopy(source["spec"]["spec"])}


def reserved(claim: dict, *uids: str) -> dict:
    """The claim as the scheduler writes it when it allocates it and reserves it for pods."""
    claim = copy.deepcopy(claim)
    claim["metadata"]["uid"] = "c1"
    claim["status"] = {
        "allocation": {"devices": {"results": [{
            "request": names.DRA_REQUEST, "driver": names.DRA_DRIVER, "pool": "node-a", "device": "card-0",
            "shareID": "8e4f2a3b-77c1-4d5e-9f60-1a2b3c4d5e6f", "consumedCapacity": {"shares": "25"}}]}},
        "reservedFor": [{"resource": "pods", "name": f"pod-{i}", "uid": uid} for i, uid in enumerate(uids)]}
    return claim


def tenant_claim(*requests: dict, kind: str = "ResourceClaim", name: str = "mine", namespace: dict = ENFORCED) -> dict:
    spec = {"devices": {"requests": list(requests)}}
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": kind,
           "metadata": {"name": name, "namespace": namespace["metadata"]["name"]}}
    obj["spec"] = spec if kind == "ResourceClaim" else {"spec": spec}
    return obj


def shares_request(name: str = "gpu", shares: str | None = "100", **extra) -> dict:
    exactly = {"deviceClassName": names.DRA_DEVICE_CLASS, "count": 1, **extra}
    if shares is not None:
        exactly["capacity"] = {"requests": {"shares": shares}}
    return {"name": name, "exactly": exactly}


def rewritten_pod(namespace: dict = ENFORCED) -> dict:
    """A pod asking a quarter of a card, as the API server stores it after gpushard's webhook (backend dra)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": namespace["metadata"]["name"]},
           "spec": {"containers": [{"name": "train", "image": "cuda:12",
                                    "resources": {"limits": {"nvidia.com/gpu": "0.25"}}},
                                   {"name": "side", "image": "busybox"}]}}
    decision = decisions.decide(decisions.Request(copy.deepcopy(pod), "Pod", namespace=namespace["metadata"]["name"]),
                                policy_mod.Policy(backend=policy_mod.DRA), None)
    assert decision.allowed, decision.message
    stored = applypatch.admit(pod, applypatch.make_patch(pod, decision.obj))
    assert stored["spec"]["resourceClaims"] == [{"name": names.DRA_POD_CLAIM,
                                                 "resourceClaimTemplateName": "gpushard-shares-25"}]
    return stored


def test_gpushards_own_flow_passes_end_to_end(objects):
    made = template(25)
    assert admit(objects, made, ENFORCED, WEBHOOK).allowed
    pod = rewritten_pod()
    outcome = admit(objects, pod, ENFORCED, TENANT)
    assert outcome.matched and outcome.allowed, outcome.message
    for controller in (CLAIM_CONTROLLER, CONTROLLER_MANAGER):
        claim = claim_for_pod(made)
        outcome = admit(objects, claim, ENFORCED, controller)
        assert outcome.matched and outcome.allowed, outcome.message
    # The scheduler allocates and reserves it for its pod; deallocation clears it.
    allocated = reserved(claim, POD_UID)
    outcome = admit(objects, allocated, ENFORCED, SCHEDULER, "UPDATE", claim, sub_resource="status")
    assert outcome.matched and outcome.allowed, outcome.message
    assert admit(objects, reserved(claim), ENFORCED, SCHEDULER, "UPDATE", allocated, sub_resource="status").allowed
    # Every template size the webhook makes, and a workload whose template the webhook rewrote.
    for shares in (1, 50, 100):
        assert admit(objects, template(shares), ENFORCED, WEBHOOK).allowed, shares
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "lab"},
                  "spec": {"template": {"metadata": {}, "spec": {"containers": [
                      {"name": "t", "image": "x", "resources": {"limits": {"gpushard.io/gpu": "25"}}}]}}}}
    assert admit(objects, deployment, ENFORCED, TENANT).allowed


def test_a_memory_asks_pod_passes_with_its_sized_template(objects):
    """The pod names gpushard-shares-<n>-mib-<size>: gpushard-device-claims lets gpushard's own entry name it
    (on the real API server a pod asking gpushard.io/memory was refused before this), and nothing else."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m", "namespace": ENFORCED["metadata"]["name"]},
           "spec": {"containers": [{"name": "m", "image": "cuda:12",
                                    "resources": {"limits": {"gpushard.io/gpu": "54"},
                                                  "claims": [{"name": "gpushard-gpu"}]}}],
                    "resourceClaims": [{"name": names.DRA_POD_CLAIM,
                                        "resourceClaimTemplateName": "gpushard-shares-54-mib-23034"}]}}
    outcome = admit(objects, pod, ENFORCED, TENANT)
    assert outcome.matched and outcome.allowed, outcome.message
    for bad in ("gpushard-shares-54-mib-", "gpushard-shares-54-mib-x", "gpushard-shares-54-23034"):
        wrong = copy.deepcopy(pod)
        wrong["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = bad
        assert not admit(objects, wrong, ENFORCED, TENANT).allowed, bad


@pytest.mark.parametrize("namespace", EVERY_NAMESPACE, ids=lambda n: str(n["metadata"]["labels"]))
@pytest.mark.parametrize("kind", sorted(CLAIM_RESOURCES))
def test_a_tenant_never_asks_gpushards_class(objects, namespace, kind):
    for request in (shares_request(), shares_request(shares="25"), shares_request(shares=None),
                    shares_request(allocationMode="All"),
                    {"name": "gpu", "firstAvailable": [{"name": "a", "deviceClassName": "nic.example.com"},
                                                       {"name": "b", "deviceClassName": names.DRA_DEVICE_CLASS}]}):
        obj = tenant_claim(request, kind=kind, namespace=namespace)
        outcome = admit(objects, obj, namespace, TENANT)
        assert outcome.matched and not outcome.allowed, (request, namespace)
        assert outcome.message.startswith("gpushard: "), outcome.message
        # Nor does anyone else who is not gpushard's path: the webhook making a claim, the controller a template.
        other = WEBHOOK if kind == "ResourceClaim" else CLAIM_CONTROLLER
        assert not admit(objects, obj, namespace, other).allowed
    # The same name as gpushard's own template, or any gpushard-shares-<n> name, with gpushard's shape.
    if kind == "ResourceClaimTemplate":
        copied = namespaced(template(25), namespace)
        outcome = admit(objects, copied, namespace, TENANT)
        assert not outcome.allowed
        assert "gpushard-shares-25" in outcome.message and "only gpushard's webhook" in outcome.message


def test_templates_named_like_gpushards_are_the_webhooks_only(objects):
    assert admit(objects, template(25), ENFORCED, WEBHOOK).allowed
    # Another class under gpushard's name would answer the webhook's "it exists" (409) and hold the pods.
    nic = tenant_claim({"name": "gpu", "exactly": {"deviceClassName": "nic.example.com"}},
                       kind="ResourceClaimTemplate", name="gpushard-shares-25")
    assert not admit(objects, nic, ENFORCED, TENANT).allowed
    # The webhook's account itself may make only the template its name says.
    for shares, name in (("100", "gpushard-shares-25"), ("25", "gpushard-shares-025"), ("25", "gpu-25")):
        wrong = tenant_claim(shares_request(shares=shares), kind="ResourceClaimTemplate", name=name)
        assert not admit(objects, wrong, ENFORCED, WEBHOOK).allowed, name
    two = copy.deepcopy(template(25))
    two["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    assert not admit(objects, two, ENFORCED, WEBHOOK).allowed
    # A memory ask's template: one card of the size its name says, as draobjects makes it, and only that.
    sized = namespaced(draobjects.claim_template("x", 31, size_mib=81559), ENFORCED)
    assert sized["metadata"]["name"] == "gpushard-shares-31-mib-81559"
    assert admit(objects, sized, ENFORCED, WEBHOOK).allowed
    assert not admit(objects, sized, ENFORCED, TENANT).allowed
    exactly = sized["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    for selectors in ([{"cel": {"expression": 'device.attributes["gpu.gpushard.io"].memoryMiB == 40960'}}],
                      [{"cel": {"expression": "true"}}], [], None,
                      exactly["selectors"] * 2):
        wrong = copy.deepcopy(sized)
        if selectors is None:
            del wrong["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
        else:
            wrong["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = selectors
        assert not admit(objects, wrong, ENFORCED, WEBHOOK).allowed, selectors
    for name in ("gpushard-shares-30-mib-81559", "gpushard-shares-31-mib-", "gpushard-shares-31-mib-081559"):
        wrong = copy.deepcopy(sized)
        wrong["metadata"]["name"] = name
        assert not admit(objects, wrong, ENFORCED, WEBHOOK).allowed, name
    # A plain name may not carry a selector.
    plain = copy.deepcopy(template(25))
    plain["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = exactly["selectors"]
    assert not admit(objects, plain, ENFORCED, WEBHOOK).allowed
    # Templates of other classes, named otherwise, are judged by allowedDeviceClasses as before.
    other = tenant_claim({"name": "n", "exactly": {"deviceClassName": "nic.example.com"}}, kind="ResourceClaimTemplate")
    assert not admit(objects, other, ENFORCED, TENANT).allowed
    assert admit(objects, namespaced(other, NOT_OPTED_IN[0]), NOT_OPTED_IN[0], TENANT).allowed


def test_the_schedulers_extended_resource_claim_is_refused(objects):
    # A pod asking deviceclass.resource.kubernetes.io/gpu.gpushard.io: 1 (every class has that name when
    # DRAExtendedResource is on) makes the scheduler create a claim for one device and no shares: the
    # whole card (the capacity's default), counted by no gpushard.io/gpu quota.
    for namespace in EVERY_NAMESPACE:
        made = tenant_claim(shares_request("container-0-request-0", shares=None), namespace=namespace,
                            name="train-extended-resources-9xk2p")
        made["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "train", "uid": POD_UID,
                                                "controller": True}]
        outcome = admit(objects, made, namespace, SCHEDULER)
        assert outcome.matched and not outcome.allowed


def test_the_controller_makes_gpushards_claims_only_for_gpushards_pod_claim_where_gpushard_enforces(objects):
    made = template(100)
    # A tenant's pod naming gpushard's template under its own claim name (the webhook denies that pod in
    # enforce namespaces; elsewhere no webhook runs).
    assert not admit(objects, claim_for_pod(made, pod_claim="mine"), ENFORCED, CLAIM_CONTROLLER).allowed
    own = admission_policy.namespace_object("gpushard-system", {names.MODE_LABEL: names.MODE_ENFORCE})
    for namespace in [*NOT_OPTED_IN, SYSTEM, own]:  # gpushard-system: the webhook never sees its pods
        left = namespaced(made, namespace)  # a template left from when the namespace enforced gpushard
        outcome = admit(objects, claim_for_pod(left), namespace, CLAIM_CONTROLLER)
        assert outcome.matched and not outcome.allowed, namespace
        assert "enforce" in outcome.message
    orphan = claim_for_pod(made)
    del orphan["metadata"]["ownerReferences"]
    assert not admit(objects, orphan, ENFORCED, CLAIM_CONTROLLER).allowed


def test_a_gpushard_claim_is_reserved_only_for_its_own_pod(objects):
    claim = claim_for_pod(template(25))
    # A second pod (asking no GPU, or another's) naming the claim by resourceClaimName would share its
    # card, counted once: the scheduler's reservation for it is refused, so it never runs there.
    for uids in ((POD_UID, OTHER_UID), (OTHER_UID,)):
        outcome = admit(objects, reserved(claim, *uids), ENFORCED, SCHEDULER, "UPDATE", reserved(claim, POD_UID),
                        sub_resource="status")
        assert outcome.matched and not outcome.allowed, uids
        assert "reserved only for the pod it was made for" in outcome.message
    # Nor may anyone make the second pod the claim's owner first; the garbage collector may orphan it.
    for owners in ([{"apiVersion": "v1", "kind": "Pod", "name": "other", "uid": OTHER_UID, "controller": True}],
                   claim["metadata"]["ownerReferences"] + [{"apiVersion": "v1", "kind": "Pod", "name": "other",
                                                            "uid": OTHER_UID}]):
        moved = copy.deepcopy(claim)
        moved["metadata"]["ownerReferences"] = owners
        outcome = admit(objects, moved, ENFORCED, TENANT, "UPDATE", claim)
        assert outcome.matched and not outcome.allowed and "cannot change" in outcome.message
    orphaned, finalized = copy.deepcopy(claim), copy.deepcopy(claim)
    del orphaned["metadata"]["ownerReferences"]
    finalized["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
    for changed in (orphaned, finalized):
        assert admit(objects, changed, ENFORCED, "system:serviceaccount:kube-system:generic-garbage-collector",
                     "UPDATE", claim).allowed
    # Claims of other classes may be shared as before.
    nic = claim_for_pod(tenant_claim({"name": "n", "exactly": {"deviceClassName": "nic.example.com"}},
                                     kind="ResourceClaimTemplate"))
    assert admit(objects, reserved(nic, POD_UID, OTHER_UID), ENFORCED, SCHEDULER, "UPDATE", nic,
                 sub_resource="status").allowed


def test_pods_carry_only_gpushards_own_entry_while_no_class_is_allowed(objects):
    pod = rewritten_pod()
    for extra in ({"name": "mine", "resourceClaimTemplateName": "gpushard-shares-100"},
                  {"name": "mine", "resourceClaimName": "train-gpushard-gpu-x7k2p"},
                  {"name": "mine", "resourceClaimTemplateName": "one-gpu"}):
        more = copy.deepcopy(pod)
        more["spec"]["resourceClaims"].append(extra)
        outcome = admit(objects, more, ENFORCED, TENANT)
        assert not outcome.allowed and 'pod claim "mine"' in outcome.message, extra
    # gpushard's claim name from something other than gpushard's template is not gpushard's entry.
    for entry in ({"name": names.DRA_POD_CLAIM, "resourceClaimName": "train-gpushard-gpu-x7k2p"},
                  {"name": names.DRA_POD_CLAIM, "resourceClaimTemplateName": "one-gpu"},
                  {"name": names.DRA_POD_CLAIM, "resourceClaimTemplateName": "gpushard-shares-x"}):
        other = copy.deepcopy(pod)
        other["spec"]["resourceClaims"] = [entry]
        assert not admit(objects, other, ENFORCED, TENANT).allowed, entry


def test_without_the_dra_overlay_gpushards_class_is_one_more_class_not_allowed():
    base = rendering.render(OVERLAY.parents[1] / "base")
    assert "gpushardDeviceClass" not in devicepolicy.local_config_map(OVERLAY.parents[1] / "base")["data"]
    claims, _ = admission_policy.shipped(base, "gpushard-device-claims")
    assert {v["name"]: v["expression"] for v in claims["spec"]["variables"]}["own"] == "r''''''"
    assert not admit(base, template(25), ENFORCED, WEBHOOK).allowed
    assert not admit(base, claim_for_pod(template(25)), ENFORCED, CLAIM_CONTROLLER).allowed
    entry = copy.deepcopy(rewritten_pod())
    assert not admit(base, entry, ENFORCED, TENANT).allowed


def test_the_dra_claims_policy_itself_denies_a_tenants_claim(objects):
    """gpushard-dra-claims alone, not the base policy beside it, refuses a tenant's claim of gpushard's
    class in a namespace that does not enforce gpushard (where the base policy does not look)."""
    policy, binding = admission_policy.shipped(objects, "gpushard-dra-claims")
    namespace = NOT_OPTED_IN[0]
    obj = tenant_claim(shares_request(), namespace=namespace)
    request = {"operation": "CREATE", "namespace": namespace["metadata"]["name"],
               "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
               "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
               "userInfo": {"username": TENANT}}
    outcome = admission_policy.evaluate(policy, binding, request, obj, None, namespace)
    assert not outcome.errored, outcome.message
    assert outcome.matched and not outcome.allowed and outcome.message.startswith("gpushard: ")
