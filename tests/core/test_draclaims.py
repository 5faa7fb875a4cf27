"""We test the webhook's pod with backend dra:
- a fraction becomes a pod-level claim from the template gpushard-shares-<n> (n: the pod's shares as Kubernetes
  counts them), named in each GPU container's resources.claims, with the quota-able gpushard.io/gpu count kept;
- no card is chosen: no card resource, no card annotation, no node affinity; every container's
  NVIDIA_VISIBLE_DEVICES is void (the card comes by CDI), and containers without shares are hidden as today;
- the pod the API server would store passes its schema and rules; a second pass changes nothing;
- an author's card pin is denied, naming the container (audit mode reports it); pods without GPUs get no claim;
- a memory ask is sized at admission over the view (denied without one) and its claim's template asks one card
  of the size its shares were computed for;
- workload templates are rewritten as with the device plugin (shares, no claim);
- only gpushard names its claim, templates and class: a pod asking no GPU carrying gpushard-gpu, another pod
  claim naming a gpushard-shares-<n> template, a container without shares naming gpushard-gpu, or a container
  asking deviceclass.resource.kubernetes.io/gpu.gpushard.io is denied with a message naming it (audit mode
  reports it); an author's gpushard-gpu entry in a GPU pod becomes the template of the pod's own shares.
"""

import copy
from pathlib import Path

import pytest

from tests import applypatch
from webhook.cluster import static
from webhook.core import decisions, draobjects, names, placement
from webhook.core import policy as policy_mod

POLICY = policy_mod.Policy(backend=policy_mod.DRA)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.yaml"


def container(name, gpu=None, env=None, **resources):
    c = {"name": name, "image": "cuda:12"}
    if gpu is not None:
        c["resources"] = {"limits": {"nvidia.com/gpu": gpu}}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return c


def pod(*containers, init=(), claims=None):
    spec = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    if claims:
        spec["resourceClaims"] = claims
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-a"}, "spec": spec}


def decide(obj, policy=POLICY, kind="Pod"):
    return decisions.decide(decisions.Request(copy.deepcopy(obj), kind, namespace="team-a"), policy, None)


def env_of(c):
    return {e["name"]: e.get("value") for e in c.get("env") or []}


def admitted(obj, policy=POLICY):
    decision = decide(obj, policy)
    assert decision.allowed, decision.message
    return applypatch.admit(obj, applypatch.make_patch(obj, decision.obj)), decision


def test_a_fraction_becomes_a_pod_level_claim():
    stored, decision = admitted(pod(container("train", "0.25", env={"NVIDIA_VISIBLE_DEVICES": "all"}),
                                    container("web")))
    spec = stored["spec"]
    assert spec["resourceClaims"] == [{"name": "gpushard-gpu", "resourceClaimTemplateName": "gpushard-shares-25"}]
    train, web = spec["containers"]
    assert train["resources"] == {"limits": {"gpushard.io/gpu": "25"}, "requests": {"gpushard.io/gpu": "25"},
                                  "claims": [{"name": "gpushard-gpu"}]}
    assert env_of(train) == {"NVIDIA_VISIBLE_DEVICES": "void", "GPUSHARD_FRACTION": "0.25"}
    assert env_of(web) == {"NVIDIA_VISIBLE_DEVICES": "void"} and "claims" not in web.get("resources", {})
    assert stored["metadata"]["annotations"] == {names.SHARES_ANNOTATION: "25"}
    assert stored["metadata"]["labels"] == {names.SHARED_LABEL: "true"}
    assert names.CARD_ANNOTATION not in stored["metadata"]["annotations"]
    assert "affinity" not in spec and decision.card is None and decision.node is None and decision.shares == 25


def test_the_claim_holds_the_pods_shares_as_kubernetes_counts_them():
    stored, _ = admitted(pod(container("a", "0.25"), container("b", "0.5"), init=[container("setup", "0.6")]))
    assert stored["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "gpushard-shares-75"
    for c in stored["spec"]["initContainers"] + stored["spec"]["containers"]:
        assert c["resources"]["claims"] == [{"name": "gpushard-gpu"}]


def test_a_share_ask_and_a_whole_card():
    stored, _ = admitted(pod({"name": "s", "image": "x", "resources": {"limits": {"gpushard.io/gpu": "40"}}}))
    assert stored["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "gpushard-shares-40"
    stored, _ = admitted(pod(container("w", "1")))
    assert stored["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "gpushard-shares-100"


def test_other_claims_of_the_pod_are_kept():
    other = {"name": "nic", "resourceClaimTemplateName": "rdma"}
    c = container("train", "0.5")
    c["resources"]["claims"] = [{"name": "nic"}]
    stored, _ = admitted(pod(c, claims=[other]))
    assert stored["spec"]["resourceClaims"] == [other, {"name": "gpushard-gpu",
                                                        "resourceClaimTemplateName": "gpushard-shares-50"}]
    assert stored["spec"]["containers"][0]["resources"]["claims"] == [{"name": "nic"}, {"name": "gpushard-gpu"}]


def test_a_second_pass_changes_nothing():
    stored, _ = admitted(pod(container("a", "0.25"), container("b", "0.5"), container("web")))
    again = decide(stored)
    assert again.allowed and applypatch.make_patch(stored, again.obj) == []


def test_a_card_pin_is_denied():
    pinned = {"name": "t", "image": "x", "resources": {"limits": {"gpushard.io/gpu": "10",
                                                                  "gpushard.io/card-1": "10"}}}
    decision = decide(pod(pinned))
    assert not decision.allowed and decision.code == 403
    assert decision.message.startswith('gpushard: container "t" names gpushard.io/card-1; with backend dra')


def test_a_memory_ask_is_sized_at_admission_and_its_claim_asks_a_card_of_that_size():
    """Its shares depend on the card's size: placement picks a size with room (the smallest that holds it),
    the asks become that size's shares, and the claim's template asks one card of that size, so the
    scheduler cannot give it a card its shares were not computed for (break: the plain template)."""
    view = static.load(EXAMPLE, POLICY.shares_per_card)
    asking = {"name": "t", "image": "x", "resources": {"limits": {"gpushard.io/memory": "12Gi"}}}
    decision = decisions.decide(decisions.Request(pod(asking), "Pod", namespace="team-a"), POLICY, view)
    assert decision.allowed, decision.message
    # The L4 (23034 MiB) is the smallest card that holds 12 GiB: ceil(12288 x 100 / 23034) = 54 shares.
    assert (decision.shares, decision.card_memory_mib, decision.memory_mib) == (54, 23034, 12288)
    stored = applypatch.admit(pod(asking), applypatch.make_patch(pod(asking), decision.obj))
    spec = stored["spec"]
    assert spec["resourceClaims"] == [
        {"name": "gpushard-gpu", "resourceClaimTemplateName": "gpushard-shares-54-mib-23034"}]
    assert spec["containers"][0]["resources"]["limits"] == {"gpushard.io/gpu": "54"}
    assert spec["containers"][0]["resources"]["claims"] == [{"name": "gpushard-gpu"}]
    assert stored["metadata"]["annotations"][names.MEMORY_ANNOTATION] == "12288"
    assert stored["metadata"]["annotations"][names.CARD_MEMORY_ANNOTATION] == "23034"
    assert placement.preferred_node(spec) == "gpu-node-b"
    template = draobjects.claim_template("team-a", 54, size_mib=23034)
    assert template["metadata"]["name"] == "gpushard-shares-54-mib-23034"
    assert template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] == [
        {"cel": {"expression": 'device.attributes["gpu.gpushard.io"].memoryMiB == 23034'}}]
    assert draobjects.check_claim_template(template) == []


def test_a_memory_ask_without_a_view_or_above_every_card_is_denied():
    asking = {"name": "t", "image": "x", "resources": {"limits": {"gpushard.io/memory": "12Gi"}}}
    decision = decide(pod(asking))
    assert not decision.allowed and decision.code == 403
    assert decision.message.startswith("gpushard: the pod asks gpushard.io/memory (12288 MiB), and gpushard has "
                                       "no view of the cluster's cards yet")
    view = static.load(EXAMPLE, POLICY.shares_per_card)
    huge = {"name": "t", "image": "x", "resources": {"limits": {"gpushard.io/memory": "100Gi"}}}
    decision = decisions.decide(decisions.Request(pod(huge), "Pod", namespace="team-a"), POLICY, view)
    assert not decision.allowed and "more than the largest card holds" in decision.message


def test_audit_mode_reports_the_pin_it_would_deny():
    pinned = {"name": "t", "image": "x", "resources": {"limits": {"gpushard.io/gpu": "10",
                                                                  "gpushard.io/card-1": "10"}}}
    decision = decisions.decide(
        decisions.Request(pod(pinned), "Pod", mode=names.MODE_AUDIT, namespace="team-a"), POLICY, None)
    assert decision.allowed and decision.obj is None
    assert any(x.rule == "pin-with-dra" and x.severity == "deny" for x in decision.findings)


def test_pods_without_gpus_get_no_claim():
    stored, _ = admitted(pod(container("web")))
    assert "resourceClaims" not in stored["spec"]
    assert env_of(stored["spec"]["containers"][0]) == {"NVIDIA_VISIBLE_DEVICES": "void"}


def test_denials_are_the_same_as_with_the_device_plugin():
    for bad in (container("x", "1.5"), container("x", "-1"), container("x", "2")):
        assert not decide(pod(bad)).allowed


@pytest.mark.parametrize("kind", ["Deployment"])
def test_templates_get_shares_and_no_claim(kind):
    deployment = {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": "d", "namespace": "team-a"},
                  "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                      "metadata": {"labels": {"a": "b"}}, "spec": {"containers": [container("t", "0.25")]}}}}
    with_dra = decide(deployment, kind=kind).obj
    with_plugin = decide(deployment, policy_mod.Policy(), kind=kind).obj
    assert with_dra == with_plugin
    assert "resourceClaims" not in with_dra["spec"]["template"]["spec"]


# --- what only gpushard writes: its claim, its templates, its class ---------------------------------


def _gpushard_entry(shares):
    return {"name": names.DRA_POD_CLAIM, "resourceClaimTemplateName": f"{names.DRA_TEMPLATE_PREFIX}{shares}"}


def test_a_pod_asking_no_gpu_may_not_carry_gpushards_claim():
    # Its claim would take shares (the whole card by default) that no gpushard.io/gpu quota counts.
    for claims in ([_gpushard_entry(100)], [{"name": names.DRA_POD_CLAIM, "resourceClaimName": "other-gpu-x7k2p"}]):
        side = container("side")
        side["resources"] = {"claims": [{"name": names.DRA_POD_CLAIM}]}
        for obj in (pod(container("web"), claims=claims), pod(side, claims=claims)):
            decision = decide(obj)
            assert not decision.allowed and decision.code == 403
            assert decision.message.startswith(
                'gpushard: pod claim "gpushard-gpu" (spec.resourceClaims) is gpushard\'s own and this pod asks no '
                'GPU'), decision.message


def test_no_other_pod_claim_may_name_gpushards_templates():
    for obj in (pod(container("web"), claims=[{"name": "mine", "resourceClaimTemplateName": "gpushard-shares-100"}]),
                pod(container("train", "0.01"), claims=[{"name": "mine",
                                                          "resourceClaimTemplateName": "gpushard-shares-100"}])):
        decision = decide(obj)
        assert not decision.allowed and decision.code == 403
        assert decision.message.startswith(
            'gpushard: pod claim "mine" names template gpushard-shares-100, which only gpushard\'s own claim '
            '"gpushard-gpu" names'), decision.message


def test_gpushards_claim_written_by_an_author_is_made_the_pods_own():
    # The entry is rewritten to the template of the pod's shares, whatever the author named.
    for written in (_gpushard_entry(100), {"name": names.DRA_POD_CLAIM, "resourceClaimName": "other-gpu-x7k2p"}):
        stored, decision = admitted(pod(container("train", "0.25"), claims=[written]))
        assert stored["spec"]["resourceClaims"] == [_gpushard_entry(25)] and decision.shares == 25


def test_a_container_asking_no_gpu_may_not_name_gpushards_claim():
    # It would see the card by CDI (NVIDIA_VISIBLE_DEVICES=void does not hide a CDI device).
    side = container("side")
    side["resources"] = {"claims": [{"name": names.DRA_POD_CLAIM}]}
    for obj in (pod(container("train", "0.25"), side), pod(container("train", "0.25"), init=[side])):
        decision = decide(obj)
        assert not decision.allowed and decision.code == 403
        assert decision.message.startswith(
            'gpushard: container "side" names claim "gpushard-gpu" (resources.claims) but asks no GPU'), \
            decision.message


def test_gpushards_class_as_an_extended_resource_is_denied():
    # Every DeviceClass has the implicit extended resource deviceclass.resource.kubernetes.io/<class>
    # (DRAExtendedResource): the scheduler would make a claim of one device and no shares, the whole card.
    name = f"deviceclass.resource.kubernetes.io/{names.DRA_DEVICE_CLASS}"
    for part in ("limits", "requests"):
        c = {"name": "x", "image": "cuda:12", "resources": {part: {name: "1"}}}
        for obj in (pod(c), pod(container("train", "0.25"), c)):
            decision = decide(obj)
            assert not decision.allowed and decision.code == 403
            assert decision.message.startswith(f'gpushard: container "x" asks {name}'), decision.message


def test_audit_mode_reports_what_it_would_deny_about_gpushards_claim():
    side = container("side")
    side["resources"] = {"claims": [{"name": names.DRA_POD_CLAIM}]}
    for obj in (pod(container("web"), claims=[_gpushard_entry(100)]),
                pod(container("t", "0.5"), side,
                    claims=[{"name": "x", "resourceClaimTemplateName": "gpushard-shares-9"}])):
        decision = decisions.decide(decisions.Request(obj, "Pod", mode=names.MODE_AUDIT, namespace="team-a"),
                                    POLICY, None)
        assert decision.allowed and decision.obj is None
        assert any(x.rule == "dra-claim-not-gpushards" and x.severity == "deny" for x in decision.findings)


def test_the_device_plugin_backend_leaves_pod_claims_to_the_policy():
    # Without backend dra gpushard makes no templates; device-claims.yaml judges pods' claims.
    decision = decide(pod(container("web"), claims=[_gpushard_entry(100)]), policy_mod.Policy())
    assert decision.allowed
