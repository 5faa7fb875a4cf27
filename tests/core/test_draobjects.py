"""We test:
- the node's ResourceSlice, the DeviceClass and each ResourceClaimTemplate gpushard writes pass the API's rules;
- each rule fails when broken: name formats, 128 devices, 32 attributes+capacities, qualified names, attribute
  values, requestPolicy (default in range, step multiples, min + step, allowMultipleAllocations), request counts;
- a request rounds as the allocator rounds it under the policy gpushard publishes;
- a claim's allocation is read as the scheduler writes it (results, consumedCapacity, shareID), and a claim
  with no device of our driver, or a device we never published, is refused with a message naming it.
"""

import copy

import pytest

from webhook.core import draobjects as dra
from webhook.core import names

CARDS = [dra.CardFacts(i, f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd", "NVIDIA H100 80GB HBM3", 81559, "memory", True)
         for i in range(8)]


def slice_of(cards=CARDS, spc=100):
    return dra.resource_slice("node-a", cards, spc, generation=3)


def test_what_gpushard_writes_passes():
    assert dra.check_slice(slice_of()) == []
    assert dra.check_slice(slice_of(spc=1)) == []
    assert dra.check_slice(slice_of(spc=1000)) == []
    assert dra.check_device_class(dra.device_class()) == []
    for shares in (1, 25, 100, 1000):
        assert dra.check_claim_template(dra.claim_template("team-a", shares)) == []


def test_the_slice_has_one_shareable_device_per_card():
    spec = slice_of()["spec"]
    assert spec["driver"] == names.DRA_DRIVER and spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    first = spec["devices"][0]
    assert [d["name"] for d in spec["devices"]] == [f"card-{i}" for i in range(8)]
    assert first["allowMultipleAllocations"] is True
    assert first["attributes"]["uuid"] == {"string": CARDS[0].uuid}
    assert first["attributes"]["index"] == {"int": 0}
    assert first["attributes"]["memoryMiB"] == {"int": 81559}
    assert first["attributes"]["isolation"] == {"string": "memory"}
    assert first["capacity"]["shares"] == {"value": "100", "requestPolicy": {
        "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}}


def test_long_models_are_cut_to_the_attribute_limit():
    card = dra.CardFacts(0, "GPU-x", "M" * 100, 1)
    assert dra.check_slice(slice_of([card])) == []


def test_long_node_names_still_give_a_valid_slice_name():
    node = ("a" * 60 + ".") * 4
    node = node[:253].rstrip(".")
    obj = dra.resource_slice(node, CARDS[:1], 100, 1)
    assert len(obj["metadata"]["name"]) <= 253
    assert dra.check_slice(obj) == []


def broken(mutate):
    obj = slice_of()
    mutate(obj)
    return dra.check_slice(obj)


@pytest.mark.parametrize("mutate,expected", [
    (lambda o: o["metadata"].update(name="Node_A"), "metadata.name"),
    (lambda o: o["spec"].update(driver="GPU.gpushard.io"), "spec.driver"),
    (lambda o: o["spec"].update(driver="a" * 64), "spec.driver"),
    (lambda o: o["spec"]["pool"].update(name="node_a"), "spec.pool.name"),
    (lambda o: o["spec"]["pool"].update(resourceSliceCount=0), "resourceSliceCount"),
    (lambda o: o["spec"]["pool"].update(generation=-1), "generation"),
    (lambda o: o["spec"].update(allNodes=True), "exactly one of nodeName"),
    (lambda o: o["spec"]["devices"][0].update(name="card.0"), "DNS label"),
    (lambda o: o["spec"]["devices"][1].update(name="card-0"), "listed twice"),
    (lambda o: o["spec"].update(devices=[dict(o["spec"]["devices"][0], name=f"card-{i}") for i in range(129)]),
     "at most 128"),
    (lambda o: o["spec"]["devices"][0].update(taints=[{"key": "k", "effect": "NoSchedule"}]) or o["spec"].update(
        devices=[dict(o["spec"]["devices"][0], name=f"card-{i}") for i in range(65)]), "at most 64"),
    (lambda o: o["spec"]["devices"][0]["attributes"].update({f"a{i}": {"int": i} for i in range(27)}),
     "at most 32 together"),
    (lambda o: o["spec"]["devices"][0]["attributes"].update({"memory-mib": {"int": 1}}), "qualified name"),
    (lambda o: o["spec"]["devices"][0]["attributes"].update({"x" * 33: {"int": 1}}), "qualified name"),
    (lambda o: o["spec"]["devices"][0]["attributes"].update({"Bad_Domain/x": {"int": 1}}), "qualified name"),
    (lambda o: o["spec"]["devices"][0]["attributes"].update(model={"string": "m" * 65}), "at most 64"),
    (lambda o: o["spec"]["devices"][0]["attributes"].update(index={"int": 1, "string": "1"}), "exactly one of"),
    (lambda o: o["spec"]["devices"][0].update(allowMultipleAllocations=False), "allowMultipleAllocations"),
    (lambda o: o["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"].update(default="0"),
     "outside the valid range"),
    (lambda o: o["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"].pop("default"), "must be set"),
    (lambda o: o["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"]["validRange"].update(max="101"),
     "validRange.max"),
    (lambda o: o["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"]["validRange"].update(step="3"),
     "not a multiple of step"),
    (lambda o: o["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"]["validRange"].update(min="100"),
     "min + step"),
    (lambda o: o["spec"]["devices"][0]["capacity"]["shares"].update(value="1.5"), "whole quantity"),
])
def test_each_rule_fails_when_broken(mutate, expected):
    problems = broken(mutate)
    assert problems and any(expected in p for p in problems), problems


@pytest.mark.parametrize("mutate,expected", [
    (lambda o: o["metadata"].update(namespace="Team A"), "metadata.namespace"),
    (lambda o: o["spec"]["spec"]["devices"]["requests"][0].update(name="GPU"), "DNS label"),
    (lambda o: o["spec"]["spec"]["devices"]["requests"][0]["exactly"].update(count=0), "count"),
    (lambda o: o["spec"]["spec"]["devices"]["requests"][0]["exactly"].update(deviceClassName="A B"),
     "deviceClassName"),
    (lambda o: o["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"].update(shares="0"),
     "positive quantity"),
    (lambda o: o["spec"]["spec"]["devices"].update(requests=[]), "1 to 32"),
])
def test_template_rules_fail_when_broken(mutate, expected):
    obj = dra.claim_template("team-a", 25)
    mutate(obj)
    problems = dra.check_claim_template(obj)
    assert problems and any(expected in p for p in problems), problems


def test_device_class_needs_an_expression():
    obj = dra.device_class()
    obj["spec"]["selectors"][0]["cel"]["expression"] = " "
    assert dra.check_device_class(obj)


@pytest.mark.parametrize("asked,consumed", [(1, 1), (25, 25), (100, 100), (0, 1), (101, None)])
def test_requests_round_as_the_allocator_rounds(asked, consumed):
    policy = slice_of()["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"]
    assert dra.rounded(asked, policy) == consumed


def test_rounding_to_steps():
    policy = {"default": "10", "validRange": {"min": "10", "max": "100", "step": "10"}}
    assert [dra.rounded(n, policy) for n in (1, 11, 20, 95, 101)] == [10, 20, 20, 100, None]


def allocated(results, namespace="team-a", name="pod-gpu"):
    return {"metadata": {"namespace": namespace, "name": name, "uid": "u-1"},
            "status": {"allocation": {"devices": {"results": results}}}}


def scheduler_result(device="card-3", shares="25", share_id="8c1d7f1e-3c84-4a4e-9a42-1b1e7e9c0a01",
                     driver=names.DRA_DRIVER):
    return {"request": "gpu", "driver": driver, "pool": "node-a", "device": device,
            "shareID": share_id, "consumedCapacity": {"shares": shares}}


def test_a_claim_is_read_as_the_scheduler_writes_it():
    [result] = dra.our_results(allocated([scheduler_result()]), names.DRA_DRIVER, 100)
    assert result == dra.Result("gpu", "node-a", "card-3", 3, 25, "8c1d7f1e-3c84-4a4e-9a42-1b1e7e9c0a01")


def test_consumed_capacity_may_name_the_driver():
    entry = scheduler_result()
    entry["consumedCapacity"] = {f"{names.DRA_DRIVER}/shares": "40"}
    assert dra.our_results(allocated([entry]), names.DRA_DRIVER, 100)[0].shares == 40


def test_other_drivers_results_are_skipped():
    other = scheduler_result(driver="gpu.nvidia.com", device="gpu-0")
    assert [r.card for r in dra.our_results(allocated([other, scheduler_result()]), names.DRA_DRIVER, 100)] == [3]


@pytest.mark.parametrize("claim,expected", [
    (allocated([scheduler_result(driver="gpu.nvidia.com", device="gpu-0")]), "no device of driver"),
    (allocated([]), "no device of driver"),
    ({"metadata": {"namespace": "a", "name": "b"}, "status": {}}, "is not allocated"),
    (allocated([scheduler_result(device="gpu-0")]), "none of"),
    (allocated([scheduler_result(shares="250m")]), "whole shares"),
    (allocated([scheduler_result(shares="101")]), "whole shares"),
    (allocated([scheduler_result(shares="lots")]), "not a quantity"),
])
def test_claims_gpushard_cannot_prepare(claim, expected):
    with pytest.raises(dra.ClaimError) as caught:
        dra.our_results(copy.deepcopy(claim), names.DRA_DRIVER, 100)
    assert str(caught.value).startswith("gpushard: claim ") and expected in str(caught.value)


def test_the_published_schema_takes_every_object():
    # The OpenAPI schema of resource.k8s.io/v1 at Kubernetes 1.37, strict: an unknown or misspelled field fails.
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in (slice_of(), slice_of(spc=1), dra.device_class(), dra.claim_template("team-a", 25)):
        kubernetes_validate.validate(obj, "1.37", strict=True)
    misspelled = slice_of()
    misspelled["spec"]["devices"][0]["allowMultipleAllocation"] = True
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        kubernetes_validate.validate(misspelled, "1.37", strict=True)
