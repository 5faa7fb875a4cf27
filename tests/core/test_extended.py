"""We test DeviceClasses that serve an extended resource (DRAExtendedResource), as the core reads and judges them:
- a class of another driver naming spec.extendedResourceName serves that name, with the driver its CEL selector
  names (either side of ==, either quote) when it names one; gpushard's own class, a class naming none (its
  implicit deviceclass.resource.kubernetes.io/<class> name), and every shape that cannot be read serve nothing,
  and never raise; a name served twice goes to the newest class, then to the first by name, as the scheduler
  picks; what is read is immutable;
- gpushard writes its shares name, and with the device-plugin backend every card name (never card-01);
- a pod or template that would hold shares is denied in enforce mode while another driver's class serves a
  name gpushard writes, with one message naming the class, the field, the value and what to do; audit mode
  admits it and reports the same finding; pods asking no GPU, and classes serving other names, are untouched;
- a class serving nvidia.com/gpu leaves fractions rewritten into shares, with a warning under the 120-character
  clip; a whole card passed through stays nvidia.com/gpu with a warning naming its container;
- with backend dra a class serving a card name changes nothing (gpushard writes none), one serving the shares
  name still denies;
- for an audit, each such class is a finding of its own: taken names denied, the fraction name warned.
"""

import copy

import pytest

from tests.core import podmaker as pm
from webhook.core import decisions, extended, names
from webhook.core import findings as f
from webhook.core import policy as policy_mod

POLICY = policy_mod.Policy()
PASSTHROUGH = policy_mod.Policy(whole_cards="passthrough", multi_card="passthrough")
DRA = policy_mod.Policy(backend=policy_mod.DRA)


def device_class(name, resource=None, driver=None, created=None, **spec):
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}
    if resource is not None:
        obj["spec"]["extendedResourceName"] = resource
    if driver is not None:
        obj["spec"]["selectors"] = [{"cel": {"expression": f'device.driver == "{driver}"'}}]
    if created is not None:
        obj["metadata"]["creationTimestamp"] = created
    return obj


NVIDIA = device_class("gpu.nvidia.com", "nvidia.com/gpu", "gpu.nvidia.com")
TAKES_SHARES = device_class("gpu.example.com", "gpushard.io/gpu", "gpu.example.com")
TAKES_CARD = device_class("card.example.com", "gpushard.io/card-3")


def decide(obj, served, policy=POLICY, mode=names.MODE_ENFORCE, kind="Pod"):
    request = decisions.Request(copy.deepcopy(obj), kind, mode=mode, served=extended.served_by(served))
    return decisions.decide(request, policy, None)


def rules(decision):
    return [x.rule for x in decision.findings]


# --- reading classes -------------------------------------------------------------------------------

def test_a_class_serves_its_extended_resource_with_the_driver_its_selector_names():
    assert extended.served_by([NVIDIA]) == {"nvidia.com/gpu": extended.Served("gpu.nvidia.com", "gpu.nvidia.com")}
    reversed_ = device_class("b", "example.com/b",
                             selectors=[{"cel": {"expression": "'drv.example.com' == device.driver"}}])
    later = device_class("c", "example.com/c", selectors=[{"cel": {"expression": "device.attributes['x'].y"}},
                                                          {"cel": {"expression": 'device.driver=="two.example.com"'}}])
    served = extended.served_by([reversed_, later, device_class("d", "example.com/d")])
    assert {k: v.driver for k, v in served.items()} == {
        "example.com/b": "drv.example.com", "example.com/c": "two.example.com", "example.com/d": ""}


@pytest.mark.parametrize("obj", [
    None, [], "DeviceClass", {}, {"metadata": None, "spec": {}}, {"metadata": {"name": "x"}, "spec": None},
    {"metadata": {"name": "x"}, "spec": []}, {"metadata": {}, "spec": {"extendedResourceName": "a.io/b"}},
    {"metadata": {"name": 5}, "spec": {"extendedResourceName": "a.io/b"}},
    {"metadata": {"name": ""}, "spec": {"extendedResourceName": "a.io/b"}},
    device_class("x"), device_class("x", ""), device_class("x", 7), device_class("x", ["a.io/b"]),
    device_class("x", "deviceclass.resource.kubernetes.io/x"),
    device_class(names.DRA_DEVICE_CLASS, "gpushard.io/gpu", names.DRA_DRIVER),
])
def test_classes_that_serve_nothing_of_note_or_cannot_be_read_are_skipped(obj):
    assert extended.served_by([obj]) == {}
    assert extended.class_findings([obj], POLICY) == []


@pytest.mark.parametrize("selectors", [None, "x", [None], [{"cel": None}], [{"cel": {"expression": 5}}],
                                       [{"cel": {"expression": "device.driver == driverName"}}]])
def test_odd_selectors_name_no_driver(selectors):
    (served,) = extended.served_by([device_class("x", "a.io/b", selectors=selectors)]).values()
    assert served.driver == ""


def test_a_name_served_twice_goes_to_the_newest_class_then_to_the_first_by_name():
    old = device_class("a-old", "nvidia.com/gpu", created="2026-01-01T00:00:00Z")
    new = device_class("z-new", "nvidia.com/gpu", created="2026-02-01T00:00:00Z")
    twin = device_class("b-twin", "nvidia.com/gpu", created="2026-02-01T00:00:00Z")
    assert extended.served_by([old, new])["nvidia.com/gpu"].device_class == "z-new"
    assert extended.served_by([new, old])["nvidia.com/gpu"].device_class == "z-new"
    assert extended.served_by([new, twin, old])["nvidia.com/gpu"].device_class == "b-twin"
    assert extended.served_by([twin, new])["nvidia.com/gpu"].device_class == "b-twin"


def test_what_is_read_cannot_be_changed():
    served = extended.served_by([NVIDIA])
    with pytest.raises(TypeError):
        served["gpushard.io/gpu"] = extended.Served("x")
    with pytest.raises(TypeError):
        extended.NONE["x"] = extended.Served("x")


def test_the_names_gpushard_writes():
    assert extended.writes("gpushard.io/gpu", POLICY)
    assert extended.writes("gpushard.io/card-0", POLICY) and extended.writes("gpushard.io/card-12", POLICY)
    for name in ("gpushard.io/card-01", "gpushard.io/card-", "gpushard.io/memory", "nvidia.com/gpu", "example.com/x"):
        assert not extended.writes(name, POLICY), name
    assert extended.writes("gpushard.io/gpu", DRA) and not extended.writes("gpushard.io/card-0", DRA)
    renamed = policy_mod.Policy(resources=policy_mod.Resources(shares="example.com/shares",
                                                               card_prefix="example.com/c"))
    assert extended.writes("example.com/shares", renamed) and extended.writes("example.com/c2", renamed)
    assert not extended.writes("gpushard.io/gpu", renamed)


# --- the decision --------------------------------------------------------------------------------------

def test_a_pod_that_would_hold_shares_is_denied_while_another_driver_serves_the_shares_name():
    decision = decide(pm.pod(pm.container("train", "0.25")), [TAKES_SHARES])
    assert not decision.allowed and decision.code == 403
    assert decision.message == (
        "gpushard: DeviceClass gpu.example.com has spec.extendedResourceName gpushard.io/gpu, a resource gpushard "
        "writes, so the scheduler would serve it with devices of driver gpu.example.com; the pod is denied: remove "
        "extendedResourceName from that class, or give gpushard other resource names in its config (resources)")
    assert rules(decision) == [f.EXTENDED_RESOURCE_TAKEN]
    assert decision.warnings == []  # the denial says it


@pytest.mark.parametrize("container", [pm.container("a", "25", resource="gpushard.io/gpu"), pm.container("a", "1"),
                                       pm.container("a", "20Gi", resource="gpushard.io/memory"),
                                       pm.container("a", "10", extra={"gpushard.io/card-3": "10"},
                                                    resource="gpushard.io/gpu")])
def test_every_ask_that_becomes_shares_is_denied_and_a_card_name_taken_denies_too(container):
    for taken in (TAKES_SHARES, TAKES_CARD):
        decision = decide(pm.pod(container), [taken])
        assert not decision.allowed and rules(decision) == [f.EXTENDED_RESOURCE_TAKEN]
        assert f"DeviceClass {taken['metadata']['name']} has spec.extendedResourceName " \
               f"{taken['spec']['extendedResourceName']}" in decision.message
    assert "devices of that class's driver" in decide(pm.pod(container), [TAKES_CARD]).message


def test_two_classes_taking_names_are_both_named():
    decision = decide(pm.pod(pm.container("a", "0.5")), [TAKES_CARD, TAKES_SHARES])
    assert rules(decision) == [f.EXTENDED_RESOURCE_TAKEN] * 2
    assert "card.example.com" in decision.message and "gpu.example.com" in decision.message


def test_a_workload_template_is_denied_alike():
    decision = decide(pm.deployment(pm.container("serve", "0.25")), [TAKES_SHARES], kind="Deployment")
    assert not decision.allowed and rules(decision) == [f.EXTENDED_RESOURCE_TAKEN]


def test_audit_mode_admits_and_reports_the_same_finding():
    decision = decide(pm.pod(pm.container("train", "0.25")), [TAKES_SHARES], mode=names.MODE_AUDIT)
    assert decision.allowed and decision.obj is None
    (taken,) = [x for x in decision.findings if x.rule == f.EXTENDED_RESOURCE_TAKEN]
    assert taken.severity == f.DENY and "; enforce mode denies the pod: remove extendedResourceName" in taken.message
    assert f.EXTENDED_RESOURCE_TAKEN in decision.audit_annotations
    assert any(w.startswith("gpushard: DeviceClass gpu.example.com has spec.extendedResourceName gpushard.io/gpu")
               for w in decision.warnings)


@pytest.mark.parametrize("obj", [pm.pod(pm.container("web")), pm.pod(pm.container("web", "0"))])
def test_pods_asking_no_gpu_are_untouched(obj):
    for served in ([TAKES_SHARES, TAKES_CARD, NVIDIA],):
        with_classes, without = decide(obj, served), decide(obj, [])
        assert with_classes.allowed and with_classes.findings == without.findings == []
        assert with_classes.obj == without.obj


def test_classes_serving_other_names_change_nothing():
    obj = pm.pod(pm.container("train", "0.25"))
    other = [device_class("fpga.example.com", "example.com/fpga", "fpga.example.com"),
             device_class("odd", "gpushard.io/card-01")]
    assert decide(obj, other).obj == decide(obj, []).obj
    assert rules(decide(obj, other)) == rules(decide(obj, []))


def test_a_fraction_is_still_rewritten_while_another_driver_serves_its_name_with_a_warning():
    obj = pm.pod(pm.container("train", "0.25"))
    decision, plain = decide(obj, [NVIDIA]), decide(obj, [])
    assert decision.allowed and decision.obj == plain.obj
    limits = decision.obj["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and limits["gpushard.io/gpu"] == "25"
    (shared,) = [x for x in decision.findings if x.rule == f.EXTENDED_RESOURCE_SHARED]
    assert shared.severity == f.WARN
    assert shared.message == ("gpushard: DeviceClass gpu.nvidia.com serves nvidia.com/gpu too; the fraction became "
                              "gpushard.io/gpu shares")
    assert shared.message in decision.warnings
    audited = decide(obj, [NVIDIA], mode=names.MODE_AUDIT)
    assert "the fraction would become gpushard.io/gpu shares" in " ".join(decisions.warnings_for(audited.findings))
    template = decide(pm.deployment(pm.container("serve", "0.25")), [NVIDIA], kind="Deployment")
    assert template.allowed and f.EXTENDED_RESOURCE_SHARED in rules(template)


def test_a_fraction_warning_fits_the_warning_clip():
    obj = pm.pod(pm.container("train", "0.25"))
    for mode in names.MODES:
        (shared,) = [x for x in decide(obj, [NVIDIA], mode=mode).findings if x.rule == f.EXTENDED_RESOURCE_SHARED]
        assert len(shared.message) <= decisions.WARNING_MAX


def test_shares_asked_directly_get_no_fraction_warning():
    decision = decide(pm.pod(pm.container("a", "25", resource="gpushard.io/gpu")), [NVIDIA])
    assert decision.allowed and f.EXTENDED_RESOURCE_SHARED not in rules(decision)


@pytest.mark.parametrize("gpu", ["1", "2"])
def test_a_whole_card_passed_through_stays_the_fraction_name_with_a_warning(gpu):
    obj = pm.pod(pm.container("render", gpu), pm.container("web"))
    decision = decide(obj, [NVIDIA], policy=PASSTHROUGH)
    assert decision.allowed
    assert decision.obj["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpu
    (shared,) = [x for x in decision.findings if x.rule == f.EXTENDED_RESOURCE_SHARED]
    assert shared.container == "render" and shared.severity == f.WARN
    assert shared.message == (f'gpushard: container "render" keeps nvidia.com/gpu {gpu}, which DeviceClass '
                              "gpu.nvidia.com serves where no device plugin does")
    assert len(shared.message) <= decisions.WARNING_MAX
    # Passed through, the pod holds no shares: a class taking gpushard's names does not deny it.
    assert decide(obj, [TAKES_SHARES], policy=PASSTHROUGH).allowed


def test_with_backend_dra_only_the_shares_name_is_gpushards():
    obj = pm.pod(pm.container("train", "0.25"))
    card_taken = decide(obj, [TAKES_CARD], policy=DRA)
    assert card_taken.allowed and card_taken.obj == decide(obj, [], policy=DRA).obj
    assert not decide(obj, [TAKES_SHARES], policy=DRA).allowed


def test_classes_found_for_an_audit():
    found = extended.class_findings([NVIDIA, TAKES_SHARES, TAKES_CARD, device_class("x", "example.com/x")], POLICY)
    assert [(name, x.rule, x.severity) for name, x in found] == [
        ("gpu.nvidia.com", f.EXTENDED_RESOURCE_SHARED, f.WARN),
        ("gpu.example.com", f.EXTENDED_RESOURCE_TAKEN, f.DENY),
        ("card.example.com", f.EXTENDED_RESOURCE_TAKEN, f.DENY)]
    assert found[0][1].message.startswith("gpushard: DeviceClass gpu.nvidia.com (driver gpu.nvidia.com) serves "
                                          "nvidia.com/gpu (spec.extendedResourceName)")
    assert "the webhook denies every pod that would hold shares while it does" in found[1][1].message
    assert [name for name, _x in extended.class_findings([TAKES_CARD], DRA)] == []
