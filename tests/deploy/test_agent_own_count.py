"""The agent's own-count policy (deploy/overlays/dra/agent-own-count.yaml), its CEL evaluated for real.

We test, with the policy and binding as the dra overlay renders them (tests/deploy/admission_policy.py
evaluates the CEL as the API server would), for status updates (nodes/status) by the agent's ServiceAccount:
- the agent's own patch (webhook/agent/dra/nodecount.py: gpushard.io/gpu in capacity and allocatable) on the Node
  its token names passes, first written, written again after the kubelet zeroed it, and removed; on another
  Node, or with a token naming no node, it is denied;
- any other resource it adds, changes or removes in capacity or allocatable (cpu, nvidia.com/gpu, pods) is
  denied with a message naming it, even beside the count; a resource it leaves as it was is not judged;
- any other status field it changes (a condition, the addresses, the phase, nodeInfo, one it adds) is denied
  naming the field; the fields it leaves alone, present or absent, are not judged;
- requests by anyone else (the kubelet writing its whole status, an admin) and updates of the Node itself
  (the base's own-node policy judges those) are not matched;
- each way of breaking the policy (a validation dropped, any node name, any resource, removals not counted,
  the match condition widened) flips a verdict above.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_dra_overlay import OVERLAY
from webhook.agent.dra import nodecount
from webhook.core import names

AGENT = "system:serviceaccount:gpushard-system:gpushard-agent"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
ON = {NODE_NAME_KEY: ["gpu-1"]}
COUNT = names.SHARES_RESOURCE
FOREIGN_RESOURCE = "gpushard: the agent may change only gpushard.io/gpu in its Node's capacity and allocatable, not "
FOREIGN_FIELD = "gpushard: the agent may change only gpushard.io/gpu in its Node's status, not status."


@pytest.fixture(scope="module")
def shipped():
    return admission_policy.shipped(rendering.render(OVERLAY), "gpushard-agent-own-count")


def node(name: str = "gpu-1", count: str | None = None) -> dict:
    capacity = {"cpu": "16", "memory": "131900000Ki", "nvidia.com/gpu": "0", "pods": "110"}
    allocatable = {"cpu": "15800m", "memory": "129800000Ki", "nvidia.com/gpu": "0", "pods": "110"}
    if count is not None:
        capacity[COUNT] = allocatable[COUNT] = count
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {"podCIDR": "10.0.1.0/24"},
            "status": {"capacity": capacity, "allocatable": allocatable, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}],
                       "nodeInfo": {"kubeletVersion": "v1.37.2", "containerRuntimeVersion": "containerd://2.4.2"}}}


def counted(old: dict, count: int = 200) -> dict:
    """``old`` with the agent's own merge patch applied (the API server merges it into the stored Node)."""
    new = copy.deepcopy(old)
    for key, value in nodecount.status_patch(COUNT, count)["status"].items():
        new["status"][key].update(value)
    return new


def changed(old: dict, change) -> dict:
    new = counted(old)
    change(new["status"])
    return new


def admit(policy_and_binding, new: dict, old: dict, username: str = AGENT, extra: dict | None = None,
          subresource: str = "status"):
    user: dict = {"username": username}
    if extra is not None:
        user["extra"] = extra
    resource = "nodes" + (f"/{subresource}" if subresource else "")
    request = {"operation": "UPDATE", "name": new["metadata"]["name"],
               "kind": {"group": "", "version": "v1", "kind": "Node"},
               "resource": {"group": "", "version": "v1", "resource": resource}, "userInfo": user}
    return admission_policy.evaluate(*policy_and_binding, request, new, old, None)


def _removed(status: dict) -> None:
    del status["capacity"][COUNT]
    del status["allocatable"][COUNT]


def verdicts(policy_and_binding) -> dict[str, admission_policy.Outcome]:
    fresh, zeroed, other = node(), node(count="0"), node("gpu-2")
    cases = {
        "count written": admit(policy_and_binding, counted(fresh), fresh, extra=ON),
        "count written again after the kubelet zeroed it": admit(policy_and_binding, counted(zeroed), zeroed,
                                                                 extra=ON),
        "count removed": admit(policy_and_binding, changed(node(count="200"), _removed), node(count="200"),
                               extra=ON),
        "count on another node": admit(policy_and_binding, counted(other), other, extra=ON),
        "no extra": admit(policy_and_binding, counted(fresh), fresh),
        "empty node name list": admit(policy_and_binding, counted(fresh), fresh, extra={NODE_NAME_KEY: []}),
        "cpu raised": admit(policy_and_binding, changed(fresh, lambda s: s["capacity"].update(cpu="64")), fresh,
                            extra=ON),
        "nvidia.com/gpu allocatable raised": admit(
            policy_and_binding, changed(fresh, lambda s: s["allocatable"].update({"nvidia.com/gpu": "8"})), fresh,
            extra=ON),
        "pods removed": admit(policy_and_binding, changed(fresh, lambda s: s["capacity"].pop("pods")), fresh,
                              extra=ON),
        "a card resource added": admit(
            policy_and_binding, changed(fresh, lambda s: s["allocatable"].update({"gpushard.io/card-0": "100"})),
            fresh, extra=ON),
        "Ready turned False": admit(policy_and_binding, changed(fresh, lambda s: s["conditions"][0].update(
            status="False")), fresh, extra=ON),
        "addresses changed": admit(policy_and_binding, changed(fresh, lambda s: s.update(
            addresses=[{"type": "InternalIP", "address": "10.9.9.9"}])), fresh, extra=ON),
        "phase removed": admit(policy_and_binding, changed(fresh, lambda s: s.pop("phase")), fresh, extra=ON),
        "nodeInfo changed": admit(policy_and_binding, changed(fresh, lambda s: s["nodeInfo"].update(
            kubeletVersion="v1.99.0")), fresh, extra=ON),
        "images added": admit(policy_and_binding, changed(fresh, lambda s: s.update(
            images=[{"names": ["evil:latest"], "sizeBytes": 1}])), fresh, extra=ON),
        "kubelet writes its status": admit(policy_and_binding, changed(fresh, lambda s: s["capacity"].update(
            cpu="64")), fresh, username="system:node:gpu-1"),
        "admin raises cpu": admit(policy_and_binding, changed(fresh, lambda s: s["capacity"].update(cpu="64")),
                                  fresh, username="admin", extra=ON),
        "an update of the Node itself": admit(policy_and_binding, changed(fresh, lambda s: s["capacity"].update(
            cpu="64")), fresh, extra=ON, subresource=""),
    }
    for name, outcome in cases.items():
        assert not outcome.errored, (name, outcome.message)
    return cases


EXPECTED = {
    "count written": True, "count written again after the kubelet zeroed it": True, "count removed": True,
    "count on another node": False, "no extra": False, "empty node name list": False, "cpu raised": False,
    "nvidia.com/gpu allocatable raised": False, "pods removed": False, "a card resource added": False,
    "Ready turned False": False, "addresses changed": False, "phase removed": False, "nodeInfo changed": False,
    "images added": False, "kubelet writes its status": True, "admin raises cpu": True,
    "an update of the Node itself": True,
}


def test_the_agent_changes_only_the_count_in_its_own_nodes_status(shipped):
    outcomes = verdicts(shipped)
    assert {name: o.allowed for name, o in outcomes.items()} == EXPECTED
    for name in ("count on another node", "no extra", "empty node name list"):
        assert outcomes[name].message == "gpushard: the agent may change only the status of the Node it runs on"
    for name, resource in (("cpu raised", "cpu"), ("nvidia.com/gpu allocatable raised", "nvidia.com/gpu"),
                           ("pods removed", "pods"), ("a card resource added", "gpushard.io/card-0")):
        assert outcomes[name].message == f'{FOREIGN_RESOURCE}"{resource}"', name
    for name, field in (("Ready turned False", "conditions"), ("addresses changed", "addresses"),
                        ("phase removed", "phase"), ("nodeInfo changed", "nodeInfo"), ("images added", "images")):
        assert outcomes[name].message == FOREIGN_FIELD + field, name
    for name in ("kubelet writes its status", "admin raises cpu", "an update of the Node itself"):
        assert not outcomes[name].matched, name


def _validation(policy: dict, needle: str) -> dict:
    found, = [v for v in policy["spec"]["validations"] if needle in v["expression"]]
    return found


def _variable(policy: dict, name: str) -> dict:
    found, = [v for v in policy["spec"]["variables"] if v["name"] == name]
    return found


def _any_node(p: dict) -> None:
    _validation(p, NODE_NAME_KEY)["expression"] = f'has(request.userInfo.extra) && "{NODE_NAME_KEY}" in ' \
                                                   "request.userInfo.extra"


def _no_node_check(p: dict) -> None:
    p["spec"]["validations"].remove(_validation(p, NODE_NAME_KEY))


def _resources_unchecked(p: dict) -> None:
    p["spec"]["validations"].remove(_validation(p, "foreignResources"))


def _fields_unchecked(p: dict) -> None:
    p["spec"]["validations"].remove(_validation(p, "foreignFields"))


def _any_resource(p: dict) -> None:
    _variable(p, "foreignResources")["expression"] = "[]"


def _removals_not_counted(p: dict) -> None:
    # Only what the update adds or changes: a resource it removes slips through.
    _variable(p, "foreignResources")["expression"] = (
        "(variables.capacity.filter(k, !(k in variables.oldCapacity) || variables.oldCapacity[k] != "
        "variables.capacity[k]) + variables.allocatable.filter(k, !(k in variables.oldAllocatable) || "
        "variables.oldAllocatable[k] != variables.allocatable[k])).filter(k, k != 'gpushard.io/gpu')")


def _everyone(p: dict) -> None:
    p["spec"]["matchConditions"][0]["expression"] = "true"


@pytest.mark.parametrize("break_it", [_any_node, _no_node_check, _resources_unchecked, _fields_unchecked,
                                      _any_resource, _removals_not_counted, _everyone])
def test_each_break_of_the_policy_flips_a_verdict(shipped, break_it):
    policy, binding = shipped
    broken = copy.deepcopy(policy)
    break_it(broken)
    outcomes = verdicts((broken, binding))
    assert {name: o.allowed for name, o in outcomes.items()} != EXPECTED


def test_the_policy_compiles_as_the_api_server_would(shipped):
    assert admission_policy.problems(shipped[0]) == []
