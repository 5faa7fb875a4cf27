"""The agent's own-node policy (deploy/base/agent-node-restriction.yaml), its CEL evaluated for real.

We test, with the policy and binding as deploy/base renders them (tests/deploy/admission_policy.py
evaluates the CEL as the API server would), for requests by the agent's ServiceAccount:
- a label or annotation change (what the agent's merge patch makes) on the Node its token
  names passes; on another Node it is denied, as it is with a token naming no node (no extra
  at all, an empty list, another key);
- a change to the Node's spec (a taint, unschedulable, podCIDR), on its own Node, is denied;
- a status-only change passes, through the Node itself (spec unchanged) and through
  nodes/status (not matched: the policy's rule names only nodes);
- requests by anyone else (the kubelet, an admin, another ServiceAccount) are not matched;
- each way of breaking the policy (a validation dropped, any node name accepted, the spec left
  unchecked, the match condition widened to everyone) flips a verdict above.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_manifests import BASE

AGENT = "system:serviceaccount:gpushard-system:gpushard-agent"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"


@pytest.fixture(scope="module")
def shipped():
    return admission_policy.shipped(rendering.render(BASE), "gpushard-agent-own-node")


def node(name: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {"podCIDR": "10.0.1.0/24", **spec},
            "status": {"capacity": {"cpu": "8"}, "conditions": [{"type": "Ready", "status": "True"}]}}


def relabelled(old: dict) -> dict:
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["gpushard.io/cards"] = "2"
    new["metadata"]["annotations"] = {"gpushard.io/inventory": "{}"}
    return new


def admit(policy_and_binding, new: dict, old: dict, username: str = AGENT, extra: dict | None = None,
          subresource: str = ""):
    user: dict = {"username": username}
    if extra is not None:
        user["extra"] = extra
    resource = "nodes" + (f"/{subresource}" if subresource else "")
    request = {"operation": "UPDATE", "name": new["metadata"]["name"],
               "kind": {"group": "", "version": "v1", "kind": "Node"},
               "resource": {"group": "", "version": "v1", "resource": resource}, "userInfo": user}
    # Nodes are cluster-scoped: no namespace, namespaceObject null.
    return admission_policy.evaluate(*policy_and_binding, request, new, old, None)


ON = {NODE_NAME_KEY: ["gpu-1"]}


def verdicts(policy_and_binding) -> dict[str, bool]:
    """Each case's verdict: admitted or not."""
    own = node("gpu-1")
    other = node("gpu-2")
    tainted = node("gpu-1", taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}])
    cordoned = node("gpu-1", unschedulable=True)
    moved = node("gpu-1", podCIDR="10.9.9.0/24")
    status = copy.deepcopy(own)
    status["status"]["capacity"]["gpushard.io/gpu"] = "200"
    cases = {
        "own node relabelled": admit(policy_and_binding, relabelled(own), own, extra=ON),
        "own node, several names in the token": admit(policy_and_binding, relabelled(own), own,
                                                      extra={NODE_NAME_KEY: ["x", "gpu-1"]}),
        "other node relabelled": admit(policy_and_binding, relabelled(other), other, extra=ON),
        "no extra": admit(policy_and_binding, relabelled(own), own),
        "empty node name list": admit(policy_and_binding, relabelled(own), own, extra={NODE_NAME_KEY: []}),
        "another extra key": admit(policy_and_binding, relabelled(own), own,
                                   extra={"authentication.kubernetes.io/pod-name": ["gpu-1"]}),
        "own node tainted": admit(policy_and_binding, tainted, own, extra=ON),
        "own node cordoned": admit(policy_and_binding, cordoned, own, extra=ON),
        "own node podCIDR": admit(policy_and_binding, moved, own, extra=ON),
        "own node status only": admit(policy_and_binding, status, own, extra=ON),
        "own node status via nodes/status": admit(policy_and_binding, status, own, extra=ON, subresource="status"),
        "kubelet taints a node": admit(policy_and_binding, tainted, own, username="system:node:gpu-1"),
        "admin relabels another node": admit(policy_and_binding, relabelled(other), other, username="admin",
                                             extra=ON),
        "another account relabels": admit(policy_and_binding, relabelled(other), other,
                                          username="system:serviceaccount:default:gpushard-agent", extra=ON),
    }
    for name, outcome in cases.items():
        assert not outcome.errored, (name, outcome.message)
    return {name: outcome for name, outcome in cases.items()}


EXPECTED = {
    "own node relabelled": True, "own node, several names in the token": True, "other node relabelled": False,
    "no extra": False, "empty node name list": False, "another extra key": False, "own node tainted": False,
    "own node cordoned": False, "own node podCIDR": False, "own node status only": True,
    "own node status via nodes/status": True, "kubelet taints a node": True, "admin relabels another node": True,
    "another account relabels": True,
}


def test_the_agent_changes_only_labels_and_annotations_of_its_own_node(shipped):
    outcomes = verdicts(shipped)
    assert {name: o.allowed for name, o in outcomes.items()} == EXPECTED
    for name in ("other node relabelled", "no extra", "empty node name list", "another extra key"):
        assert outcomes[name].message == "gpushard: the agent may change only the Node it runs on"
    for name in ("own node tainted", "own node cordoned", "own node podCIDR"):
        assert outcomes[name].message == "gpushard: the agent may change a Node's labels and annotations, not its spec"
    # Who is not the agent is not matched at all (the match condition is false), nor is nodes/status.
    for name in ("kubelet taints a node", "admin relabels another node", "another account relabels",
                 "own node status via nodes/status"):
        assert not outcomes[name].matched


def _validation(policy: dict, needle: str) -> dict:
    found, = [v for v in policy["spec"]["validations"] if needle in v["expression"]]
    return found


def _any_node(p: dict) -> None:
    _validation(p, NODE_NAME_KEY)["expression"] = f'has(request.userInfo.extra) && "{NODE_NAME_KEY}" in ' \
                                                   "request.userInfo.extra"


def _spec_unchecked(p: dict) -> None:
    p["spec"]["validations"].remove(_validation(p, "object.spec"))


def _no_node_check(p: dict) -> None:
    p["spec"]["validations"].remove(_validation(p, NODE_NAME_KEY))


def _metadata_only(p: dict) -> None:
    # Compares metadata instead of spec: lets a spec change through and refuses the agent's own patch.
    _validation(p, "object.spec")["expression"] = "object.metadata.name == oldObject.metadata.name"


def _everyone(p: dict) -> None:
    p["spec"]["matchConditions"][0]["expression"] = "true"


@pytest.mark.parametrize("break_it", [_any_node, _spec_unchecked, _no_node_check, _metadata_only, _everyone])
def test_each_break_of_the_policy_flips_a_verdict(shipped, break_it):
    """Breaks: any node name accepted; the spec check dropped; the node check dropped; the spec
    check comparing metadata instead; the match condition true for everyone. Each must change at
    least one verdict of the test above (which asserts exactly the shipped verdicts)."""
    policy, binding = shipped
    broken = copy.deepcopy(policy)
    break_it(broken)
    outcomes = verdicts((broken, binding))
    assert {name: o.allowed for name, o in outcomes.items()} != EXPECTED
