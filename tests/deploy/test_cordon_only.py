"""The cordoners' policy (gpushard-cordon-only in deploy/base/rbac-cordon.yaml), its CEL evaluated for real.

We test, with the policy and binding as deploy/base renders them (tests/deploy/admission_policy.py evaluates the
CEL as the API server would, its authorizer answering from the grants below), for updates of Nodes:
- by someone holding gpushard-cordoner's rules (patch and the mark cordon-cards on nodes, not update): what
  `gpushard cordon` and `uncordon` write (one annotation gpushard.io/card-<k>.cordoned added or removed) passes;
  another annotation, a label, a taint, unschedulable (kubectl cordon), an ownerReference are refused, naming
  what changed;
- by a cluster admin (every verb), by someone with update on nodes beside the mark, by someone without the mark,
  and by a kubelet, nothing is matched;
- each way of breaking the policy (a validation dropped, any annotation taken for a cordon, the mark or the
  update check left out) flips a verdict above.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_manifests import BASE
from webhook.core import names, objects

CORDONER = frozenset({("", "nodes", "list"), ("", "nodes", "patch"), ("", "nodes", "cordon-cards")})
ADMIN = frozenset({("*", "*", "*")})
NODE_ADMIN = CORDONER | {("", "nodes", "update")}
PATCHER = frozenset({("", "nodes", "patch")})


@pytest.fixture(scope="module")
def shipped():
    return admission_policy.shipped(rendering.render(BASE), "gpushard-cordon-only")


def node() -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "gpu-1", "labels": {"kubernetes.io/hostname": "gpu-1"},
                         "annotations": {names.INVENTORY_ANNOTATION: "{}", "node.alpha.kubernetes.io/ttl": "0"}},
            "spec": {"podCIDR": "10.0.1.0/24", "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}


def changed(change) -> dict:
    new = node()
    change(new)
    return new


def admit(policy_and_binding, new: dict, grants: frozenset, username: str = "alice"):
    request = {"operation": "UPDATE", "name": new["metadata"]["name"],
               "kind": {"group": "", "version": "v1", "kind": "Node"},
               "resource": {"group": "", "version": "v1", "resource": "nodes"}, "userInfo": {"username": username}}
    return admission_policy.evaluate(*policy_and_binding, request, new, node(), None, grants=grants)


def _cordon(n: dict) -> None:
    # What `gpushard cordon gpu-1 3` merge-patches (webhook/cordoning.py).
    record = objects.write_cordon(objects.Cordon(reason="Xid 79", by="alice", at="2026-12-07T00:00:00Z"))
    n["metadata"]["annotations"][names.card_cordon_annotation(3)] = record


def verdicts(policy_and_binding) -> dict[str, admission_policy.Outcome]:
    cordoned = changed(_cordon)
    cases = {
        "a card cordoned": (cordoned, CORDONER),
        "another annotation": (changed(lambda n: n["metadata"]["annotations"].update(evil="x")), CORDONER),
        "the inventory rewritten": (changed(lambda n: n["metadata"]["annotations"].update(
            {names.INVENTORY_ANNOTATION: '{"cards": []}'})), CORDONER),
        "an annotation removed": (changed(lambda n: n["metadata"]["annotations"].pop("node.alpha.kubernetes.io/ttl")),
                                  CORDONER),
        "a label": (changed(lambda n: n["metadata"]["labels"].update({"gpushard.io/pool": "x"})), CORDONER),
        "a taint removed": (changed(lambda n: n["spec"].pop("taints")), CORDONER),
        "kubectl cordon": (changed(lambda n: n["spec"].update(unschedulable=True)), CORDONER),
        "an owner": (changed(lambda n: n["metadata"].update(ownerReferences=[{"kind": "X", "name": "y"}])), CORDONER),
        "an admin's label": (changed(lambda n: n["metadata"]["labels"].update(x="y")), ADMIN),
        "a node admin's taint": (changed(lambda n: n["spec"].pop("taints")), NODE_ADMIN),
        "a patcher without the mark": (changed(lambda n: n["metadata"]["labels"].update(x="y")), PATCHER),
    }
    out = {}
    for name, (new, grants) in cases.items():
        outcome = admit(policy_and_binding, new, grants)
        assert not outcome.errored, (name, outcome.message)
        out[name] = outcome
    kubelet = admit(policy_and_binding, changed(lambda n: n["metadata"]["labels"].update(x="y")), CORDONER,
                    username="system:node:gpu-1")
    out["a kubelet"] = kubelet
    return out


EXPECTED = {
    "a card cordoned": True, "another annotation": False, "the inventory rewritten": False,
    "an annotation removed": False, "a label": False, "a taint removed": False, "kubectl cordon": False,
    "an owner": False, "an admin's label": True, "a node admin's taint": True, "a patcher without the mark": True,
    "a kubelet": True,
}
PREFIX = "gpushard: a card cordoner may change only the annotations gpushard.io/card-<k>.cordoned of a Node, not "


def test_a_card_cordoner_changes_only_the_cordons(shipped):
    outcomes = verdicts(shipped)
    assert {name: o.allowed for name, o in outcomes.items()} == EXPECTED
    assert outcomes["another annotation"].message == PREFIX + '"evil"'
    assert outcomes["the inventory rewritten"].message == PREFIX + f'"{names.INVENTORY_ANNOTATION}"'
    assert outcomes["a label"].message == PREFIX + "metadata.labels (that needs update on nodes)"
    for name in ("a taint removed", "kubectl cordon"):
        assert outcomes[name].message == PREFIX + "spec (that needs update on nodes)", name
    for name in ("an admin's label", "a node admin's taint", "a patcher without the mark", "a kubelet"):
        assert not outcomes[name].matched, name


def _condition(p: dict, name: str) -> dict:
    found, = [c for c in p["spec"]["matchConditions"] if c["name"] == name]
    return found


def _no_annotation_check(p: dict) -> None:
    p["spec"]["validations"] = [v for v in p["spec"]["validations"] if "changed" not in v["expression"]]


def _no_field_check(p: dict) -> None:
    p["spec"]["validations"] = [v for v in p["spec"]["validations"] if "fields" not in v["expression"]]


def _any_annotation(p: dict) -> None:
    for v in p["spec"]["variables"]:
        if v["name"] == "changed":
            v["expression"] = "[]"


def _no_mark(p: dict) -> None:
    _condition(p, "a-card-cordoner")["expression"] = "!authorizer.group('').resource('nodes').check('update').allowed()"


def _no_update_check(p: dict) -> None:
    _condition(p, "a-card-cordoner")["expression"] = \
        "authorizer.group('').resource('nodes').check('cordon-cards').allowed()"


@pytest.mark.parametrize("break_it", [_no_annotation_check, _no_field_check, _any_annotation, _no_mark,
                                      _no_update_check])
def test_each_break_of_the_policy_flips_a_verdict(shipped, break_it):
    policy, binding = shipped
    broken = copy.deepcopy(policy)
    break_it(broken)
    outcomes = verdicts((broken, binding))
    assert {name: o.allowed for name, o in outcomes.items()} != EXPECTED


def test_the_policy_compiles_as_the_api_server_would(shipped):
    assert admission_policy.problems(shipped[0]) == []
