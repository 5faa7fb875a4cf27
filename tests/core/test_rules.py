"""We test, rule by rule (docs/admission.md), what gpushard decides for a pod:
- fractions become ceil(q x sharesPerCard) shares of one card, with a warning when rounded;
- whole cards share or pass through; several cards and 1.5 are denied; 0 asks nothing;
- negative, unparsable, both-forms and requests != limits asks are denied, quoting the value;
- the shares form (gpushard.io/gpu) and explicit card pins, consistent or conflicting;
- init, sidecar and app containers add up as Kubernetes counts them, capped at one card;
- NVIDIA_VISIBLE_DEVICES is owned in every container, void where no share is held;
- annotations and label on GPU pods; every admitted pod is one the API server accepts;
- a second pass over gpushard's own output changes nothing;
- policy.runtimeClassName is set on pods that hold shares when the author set none, never on
  others, and the author's own runtime class is kept;
- policy.nodeAffinity: required leaves the scheduler the chosen node only, ANDed into each of the
  author's required terms, which all still hold; the default leaves every node with room open.
"""

import dataclasses

import pytest

from tests import applypatch
from tests.core import podmaker as pm
from webhook.core import decisions, names, placement, policy

VIEW = placement.View(nodes=(placement.Node("node-a", labels={"kubernetes.io/hostname": "node-a"}, cards=(
    placement.Card(0, 100, 60), placement.Card(1, 100, 10))),))
POLICY = policy.Policy()


def decide(obj, pol=POLICY, view=VIEW, mode="enforce", kind=None):
    return decisions.decide(decisions.Request(obj, kind or obj["kind"], mode=mode), pol, view)


def admitted(obj, pol=POLICY, view=VIEW):
    """Decide, check the API server accepts the patched pod, and that a second pass is a no-op."""
    d = decide(obj, pol, view)
    assert d.allowed, d.message
    new = applypatch.admit(obj, applypatch.make_patch(obj, d.obj))
    again = decide(new, pol, view)
    assert again.allowed and applypatch.make_patch(new, again.obj) == [], "second pass must be empty"
    return d, new


def resources(c):
    return c["resources"]["limits"], c["resources"]["requests"]


@pytest.mark.parametrize("q, shares, rounded", [("0.25", 25, False), ("250m", 25, False), (0.5, 50, False),
                                                ("0.333", 34, True), ("0.001", 1, True), ("999m", 100, True)])
def test_fraction_becomes_shares_of_one_card(q, shares, rounded):
    d, new = admitted(pm.pod(pm.container("train", q)))
    c = new["spec"]["containers"][0]
    limits, requests = resources(c)
    k = d.card
    gpu = {"gpushard.io/gpu": str(shares), f"gpushard.io/card-{k}": str(shares)}
    assert limits == {"cpu": "1", **gpu} and requests == {"cpu": "500m", **gpu}
    assert "nvidia.com/gpu" not in limits
    assert pm.env_of(c, names.VISIBLE_DEVICES_ENV) == [str(k)]
    assert pm.env_of(c, names.FRACTION_ENV) == [str(shares / 100).rstrip("0").rstrip(".")]
    assert new["metadata"]["annotations"] == {"gpushard.io/card": str(k), "gpushard.io/shares": str(shares)}
    assert new["metadata"]["labels"]["gpushard.io/shared"] == "true"
    assert any(f.rule == "rounded" for f in d.findings) == rounded
    if rounded:
        assert any(f"rounded up to {shares}" in w for w in d.warnings)


def test_cpu_and_other_resources_are_kept():
    d, new = admitted(pm.pod(pm.container("train", "0.5", extra={"example.com/foo": "2"})))
    limits, requests = resources(new["spec"]["containers"][0])
    assert limits["cpu"] == "1" and requests["cpu"] == "500m"
    assert limits["example.com/foo"] == requests["example.com/foo"] == "2"


def test_whole_card_shares_by_default_and_passes_through_on_request():
    d, new = admitted(pm.pod(pm.container("train", "1")))
    assert resources(new["spec"]["containers"][0])[0]["gpushard.io/gpu"] == "100"
    through = policy.Policy(whole_cards="passthrough")
    obj = pm.pod(pm.container("train", "1"), pm.container("log"))
    d, new = admitted(obj, through)
    train, log = new["spec"]["containers"]
    assert train == obj["spec"]["containers"][0], "a passed-through container is left untouched"
    assert pm.env_of(log, names.VISIBLE_DEVICES_ENV) == ["void"]
    assert "annotations" not in new["metadata"]


@pytest.mark.parametrize("q, rule", [("2", "multi-card"), ("8", "multi-card"), ("1.5", "fraction-above-one"),
                                     ("1500m", "fraction-above-one")])
def test_more_than_one_card_is_denied(q, rule):
    d = decide(pm.pod(pm.container("train", q)))
    assert not d.allowed and d.code == 403
    assert d.message.startswith("gpushard: ") and f"nvidia.com/gpu {q}" in d.message
    assert "train" in d.message and "at most one card" in d.message
    assert [f.rule for f in d.findings] == [rule]


def test_multi_card_passthrough_leaves_the_pod_for_whole_gpu_pools():
    obj = pm.pod(pm.container("train", "4"))
    d, new = admitted(obj, policy.Policy(multi_card="passthrough"))
    assert new["spec"]["containers"][0] == obj["spec"]["containers"][0]


def test_zero_asks_for_nothing_and_is_hidden():
    d, new = admitted(pm.pod(pm.container("cpu-only", "0")))
    assert pm.env_of(new["spec"]["containers"][0], names.VISIBLE_DEVICES_ENV) == ["void"]
    assert d.card is None and "annotations" not in new["metadata"]


@pytest.mark.parametrize("value, quoted", [("-0.5", "'-0.5'"), ("lots", "'lots'"), ("1e999999", "1e999999"),
                                           ("0.5GPU", "'0.5GPU'")])
def test_bad_values_are_denied_quoting_the_text(value, quoted):
    d = decide(pm.pod(pm.container("train", value)))
    assert not d.allowed and d.code == 403
    assert quoted in d.message and 'container "train"' in d.message


def test_both_forms_in_one_container_is_denied():
    c = pm.container("train", "0.5", extra={"gpushard.io/gpu": "50"})
    d = decide(pm.pod(c))
    assert not d.allowed and "both" in d.message and "use one" in d.message


def test_requests_different_from_limits_is_denied():
    d = decide(pm.pod(pm.container("train", "0.5", requests="0.25")))
    assert not d.allowed
    assert "0.25 in requests but 0.5 in limits" in d.message


def test_requests_only_is_read_and_limits_are_written():
    c = pm.container("train")
    c["resources"] = {"requests": {"nvidia.com/gpu": "0.5"}}
    d, new = admitted(pm.pod(c))
    limits, requests = resources(new["spec"]["containers"][0])
    assert limits == requests and limits["gpushard.io/gpu"] == "50"


@pytest.mark.parametrize("n, ok", [("30", True), ("100", True), ("0", True), ("101", False), ("2.5", False),
                                   ("-3", False)])
def test_shares_form(n, ok):
    d = decide(pm.pod(pm.container("train", n, resource="gpushard.io/gpu")))
    assert d.allowed == ok, d.message
    if ok and n != "0":
        assert d.shares == int(n)
    if not ok:
        assert f"gpushard.io/gpu {n}" in d.message or f"'{n}'" in d.message


def test_app_containers_add_up_and_share_one_card():
    d, new = admitted(pm.pod(pm.container("a", "0.25"), pm.container("b", "0.25"), pm.container("c")))
    assert d.shares == 50
    cards = applypatch.card_shares(new)
    assert list(cards) == [d.card] and cards[d.card] == 50
    a, b, c = new["spec"]["containers"]
    assert pm.env_of(a, names.VISIBLE_DEVICES_ENV) == pm.env_of(b, names.VISIBLE_DEVICES_ENV) == [str(d.card)]
    assert pm.env_of(c, names.VISIBLE_DEVICES_ENV) == ["void"]


def test_pod_over_one_card_is_denied():
    d = decide(pm.pod(pm.container("a", "0.75"), pm.container("b", "0.5")))
    assert not d.allowed and "125 shares" in d.message and "one card" in d.message


def test_init_sidecar_and_app_count_as_kubernetes_counts():
    # init 0.9 runs alone; the sidecar 0.2 runs beside the apps 0.3 + 0.3: max(90, 20 + 60) = 90.
    init = (pm.container("warmup", "0.9"), pm.container("proxy", "0.2", restart="Always"))
    d, new = admitted(pm.pod(pm.container("a", "0.3"), pm.container("b", "0.3"), init=init))
    assert d.shares == 90
    # A regular init container after the sidecar runs beside it: 0.9 + 0.2 > 1 card.
    init = (pm.container("proxy", "0.2", restart="Always"), pm.container("warmup", "0.9"))
    d = decide(pm.pod(pm.container("a", "0.3"), init=init))
    assert not d.allowed and "110 shares" in d.message


def test_sidecar_without_gpu_is_hidden():
    init = (pm.container("mesh", restart="Always"), pm.container("setup"))
    d, new = admitted(pm.pod(pm.container("a", "0.3"), init=init))
    for c in new["spec"]["initContainers"]:
        assert pm.env_of(c, names.VISIBLE_DEVICES_ENV) == ["void"]


@pytest.mark.parametrize("user_env", [
    [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
    [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}],
    [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}],
    [{"name": "OTHER", "value": "1"}, {"name": "GPUSHARD_FRACTION", "value": "1"}],
])
def test_visible_devices_is_owned_in_every_container(user_env):
    obj = pm.pod(pm.container("train", "0.5", env=user_env), pm.container("tools", env=user_env))
    d, new = admitted(obj)
    train, tools = new["spec"]["containers"]
    assert pm.env_of(train, names.VISIBLE_DEVICES_ENV) == [str(d.card)]
    assert pm.env_of(train, names.FRACTION_ENV) == ["0.5"]
    assert pm.env_of(tools, names.VISIBLE_DEVICES_ENV) == ["void"]
    assert pm.env_of(train, "OTHER") == pm.env_of(tools, "OTHER")
    if any(e["name"] == names.VISIBLE_DEVICES_ENV for e in user_env):
        assert any(f.rule == "visible-devices-set" for f in d.findings)


def test_pods_without_gpu_are_hidden_unless_policy_says_otherwise():
    obj = pm.pod(pm.container("web"))
    d, new = admitted(obj)
    assert pm.env_of(new["spec"]["containers"][0], names.VISIBLE_DEVICES_ENV) == ["void"]
    assert "gpushard.io/shared" not in new["metadata"]["labels"]
    d = decide(obj, policy.Policy(hide_unrequested_gpus=False))
    assert applypatch.make_patch(obj, d.obj) == []


def test_explicit_pin_is_kept():
    c = pm.container("train", "40", resource="gpushard.io/card-1")
    d, new = admitted(pm.pod(c))
    assert d.card == 1 and d.shares == 40
    limits, _ = resources(new["spec"]["containers"][0])
    assert limits["gpushard.io/gpu"] == limits["gpushard.io/card-1"] == "40"


def test_pin_with_matching_shares_is_kept_and_mismatch_is_denied():
    ok = pm.container("train", "30", resource="gpushard.io/gpu", extra={"gpushard.io/card-0": "30"})
    d, _ = admitted(pm.pod(ok))
    assert d.card == 0
    bad = pm.container("train", "30", resource="gpushard.io/gpu", extra={"gpushard.io/card-0": "20"})
    d = decide(pm.pod(bad))
    assert not d.allowed and "must match" in d.message


def test_conflicting_pins_are_denied():
    a = pm.container("a", "30", resource="gpushard.io/card-0")
    b = pm.container("b", "30", resource="gpushard.io/card-1")
    d = decide(pm.pod(a, b))
    assert not d.allowed and "cards 0, 1" in d.message
    both = pm.container("a", "30", resource="gpushard.io/card-0", extra={"gpushard.io/card-1": "30"})
    d = decide(pm.pod(both))
    assert not d.allowed and "one card" in d.message


def test_mixing_passthrough_and_shares_is_denied():
    obj = pm.pod(pm.container("big", "1"), pm.container("small", "0.5"))
    d = decide(obj, policy.Policy(whole_cards="passthrough"))
    assert not d.allowed and "separate pods" in d.message


def test_configured_names_and_share_count_are_honoured():
    pol = policy.Policy(shares_per_card=8, resources=policy.Resources(
        fraction="example.com/gpu", shares="example.com/shares", card_prefix="example.com/card-"))
    view = placement.View(nodes=(placement.Node("n", cards=(placement.Card(0, 8, 0),)),))
    d, new = admitted(pm.pod(pm.container("train", "0.3", resource="example.com/gpu")), pol, view)
    limits, _ = resources(new["spec"]["containers"][0])
    assert limits["example.com/shares"] == limits["example.com/card-0"] == "3"
    assert pm.env_of(new["spec"]["containers"][0], names.FRACTION_ENV) == ["0.375"]


def test_unreadable_objects_are_a_400_naming_the_field():
    for spec, field in (({"containers": "x"}, "spec.containers"), ({"containers": [1]}, "spec.containers[0]"),
                        ({"containers": [{"name": "a", "resources": {"limits": []}}]}, "resources.limits")):
        d = decide({"kind": "Pod", "metadata": {"name": "p"}, "spec": spec})
        assert not d.allowed and d.code == 400 and field in d.message and d.message.startswith("gpushard:")


def test_pod_updates_and_other_kinds_are_let_through():
    obj = pm.pod(pm.container("train", "0.5"))
    d = decisions.decide(decisions.Request(obj, "Pod", operation="UPDATE"), POLICY, VIEW)
    assert d.allowed and applypatch.make_patch(obj, d.obj) == []
    d = decisions.decide(decisions.Request({"kind": "Service", "spec": {}}, "Service"), POLICY, VIEW)
    assert d.allowed and d.obj == {"kind": "Service", "spec": {}}


def test_the_chosen_node_becomes_a_soft_preference():
    user_term = {"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "In",
                                                                   "values": ["a"]}]}}
    obj = pm.pod(pm.container("train", "0.25"), spec={"affinity": {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [user_term]}}})
    d, new = admitted(obj)
    terms = new["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == user_term and len(terms) == 2
    assert terms[1]["preference"]["matchFields"] == [
        {"key": "metadata.name", "operator": "In", "values": [d.node]}]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in new["spec"]["affinity"]["nodeAffinity"]


def test_no_preference_without_room_or_for_a_pod_bound_to_a_node():
    full = placement.View(nodes=(placement.Node("node-a", cards=(placement.Card(0, 100, 100),)),))
    d, new = admitted(pm.pod(pm.container("train", "0.25")), view=full)
    assert d.node is None and "affinity" not in new["spec"]
    d, new = admitted(pm.pod(pm.container("train", "0.25"), spec={"nodeName": "node-a"}))
    assert "affinity" not in new["spec"]


def test_hostile_values_are_quoted_short():
    d = decide(pm.pod(pm.container("n" * 5000, "9" * 10000)))
    assert not d.allowed and len(d.message) < 300 and "..." in d.message


def test_passthrough_containers_lose_a_user_visible_devices():
    obj = pm.pod(pm.container("big", "1", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                                              {"name": "OTHER", "value": "1"}]), pm.container("log"))
    d, new = admitted(obj, policy.Policy(whole_cards="passthrough"))
    big, log = new["spec"]["containers"]
    assert big["env"] == [{"name": "OTHER", "value": "1"}], "the device plugin's value must reach it"
    assert big["resources"] == obj["spec"]["containers"][0]["resources"]
    assert any("removed it" in w for w in d.warnings)
    assert pm.env_of(log, names.VISIBLE_DEVICES_ENV) == ["void"]


def test_ephemeral_debug_containers_are_hidden():
    obj = admitted(pm.pod(pm.container("train", "0.5")))[1]
    obj["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "cuda",
                                           "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]
    req = decisions.Request(obj, "Pod", operation="UPDATE", sub_resource="ephemeralcontainers")
    d = decisions.decide(req, POLICY, VIEW)
    new = applypatch.admit(obj, applypatch.make_patch(obj, d.obj))
    assert new["spec"]["ephemeralContainers"][0]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert new["spec"]["containers"] == obj["spec"]["containers"]
    again = decisions.decide(dataclasses.replace(req, obj=new), POLICY, VIEW)
    assert applypatch.make_patch(new, again.obj) == []
    audit = decisions.decide(dataclasses.replace(req, mode="audit"), POLICY, VIEW)
    assert [x.rule for x in audit.findings] == ["unhidden"]


def test_reinvocation_keeps_the_card_without_placing_again():
    d, new = admitted(pm.pod(pm.container("train", "0.6")))
    # Another webhook added a container after gpushard; the card stays, no node is counted again.
    new["spec"]["containers"].append(pm.container("mesh-proxy"))
    full = placement.View(nodes=(placement.Node("node-a", cards=(placement.Card(0, 100, 100),
                                                                   placement.Card(1, 100, 100))),))
    again = decide(new, view=full)
    assert again.allowed and again.card == d.card and again.node is None
    assert not any(x.rule == "no-room" for x in again.findings)
    assert pm.env_of(again.obj["spec"]["containers"][1], names.VISIBLE_DEVICES_ENV) == ["void"]


@pytest.mark.parametrize("key", ["gpushard.io/card-01", "gpushard.io/card-\u00b3", "gpushard.io/card-" + "9" * 50,
                                 "gpushard.io/card-x"])
def test_card_resources_that_name_no_card_are_denied(key):
    d = decide(pm.pod(pm.container("train", "20", resource="gpushard.io/gpu", extra={key: "20"})))
    assert not d.allowed and d.code == 403 and "no card resource" in d.message


def test_both_forms_are_denied_even_when_one_is_zero():
    d = decide(pm.pod(pm.container("train", "0", extra={"gpushard.io/gpu": "50"})))
    assert not d.allowed and "both" in d.message


@pytest.mark.parametrize("spec, field", [
    ({"affinity": {"nodeAffinity": [1]}}, "spec.affinity.nodeAffinity"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": 5}}}}, "nodeSelectorTerms"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": 5}]}}}}, "matchExpressions"),
    ({"tolerations": {"key": "x"}}, "spec.tolerations"),
    ({"nodeSelector": ["a"]}, "spec.nodeSelector"),
])
def test_malformed_scheduling_fields_are_a_400_naming_the_field(spec, field):
    d = decide(pm.pod(pm.container("train", "0.5"), spec=spec))
    assert not d.allowed and d.code == 400 and field in d.message


def test_resource_keys_that_are_not_text_are_no_gpu_asks():
    # YAML reads `5: 1` with an integer key; the API server would refuse the name, gpushard need not crash.
    obj = pm.pod(pm.container("train", "0.5"))
    obj["spec"]["containers"][0]["resources"]["limits"][5] = "1"
    d = decide(obj)
    assert d.allowed and d.shares == 50


def test_runtime_class_is_set_on_pods_that_hold_shares():
    pol = dataclasses.replace(POLICY, runtime_class_name="nvidia")
    d, new = admitted(pm.pod(pm.container("train", "0.25")), pol)
    assert new["spec"]["runtimeClassName"] == "nvidia"
    # Without the option nothing is set.
    _, plain = admitted(pm.pod(pm.container("train", "0.25")))
    assert "runtimeClassName" not in plain["spec"]


def test_runtime_class_of_the_author_is_kept_and_gpu_less_pods_get_none():
    pol = dataclasses.replace(POLICY, runtime_class_name="nvidia")
    own = pm.pod(pm.container("train", "0.5"))
    own["spec"]["runtimeClassName"] = "kata-nvidia"
    _, new = admitted(own, pol)
    assert new["spec"]["runtimeClassName"] == "kata-nvidia"
    _, web = admitted(pm.pod(pm.container("web")), pol)
    assert "runtimeClassName" not in web["spec"]
    # Whole cards passed through to NVIDIA's plugin hold no share: not gpushard's to decide.
    passthrough = dataclasses.replace(pol, whole_cards="passthrough")
    _, whole = admitted(pm.pod(pm.container("train", "1")), passthrough)
    assert "runtimeClassName" not in whole["spec"]


@pytest.mark.parametrize("required_terms", [
    None,
    [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
     {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}],
      "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-c"]}]}],
])
def test_required_node_affinity_leaves_the_scheduler_the_chosen_node_only(required_terms):
    nodes = tuple(placement.Node(name, labels={"pool": "a", "zone": "z"}, cards=(placement.Card(0, 100, used),))
                  for name, used in (("node-a", 50), ("node-b", 60), ("node-c", 0)))
    view = placement.View(nodes=nodes)
    obj = pm.pod(pm.container("c", "0.25"))
    if required_terms is not None:
        obj["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": required_terms}}}
    pol = dataclasses.replace(POLICY, node_affinity="required")
    d, new = admitted(obj, pol, view)
    ask = placement.ask_from_spec(new["spec"], 25, 0)
    assert [n.name for n in nodes if placement.eligible(n, ask)] == [d.node]
    assert placement.preferred_node(new["spec"]) == d.node
    if required_terms is not None:  # each of the author's terms still holds, ANDed with the node
        terms = new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert [t["matchExpressions"] for t in terms] == [t["matchExpressions"] for t in required_terms]
    # With the default, only preferred: every node whose card has room stays open to the scheduler.
    d, new = admitted(obj, POLICY, view)
    assert len([n for n in nodes if placement.eligible(n, placement.ask_from_spec(new["spec"], 25, 0))]) == 3
