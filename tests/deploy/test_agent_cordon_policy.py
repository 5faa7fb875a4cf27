"""The own-node policy keeps a card's cordon an operator's word: the agent may not write it.

We test, with the policy as deploy/base renders it and its CEL evaluated as the API server would
(tests/deploy/admission_policy.py), for UPDATEs of the agent's own Node:
- the agent's inventory patch passes on a Node with cordons, which it leaves as they are;
- the agent adding, changing or removing a cordon annotation (gpushard.io/card-<k>.cordoned) is
  denied with a message that says who cordons; a Node with no annotations before or after passes;
- an operator (anyone but the agent) cordoning or uncordoning is not matched at all;
- dropping the validation flips a verdict.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_agent_own_node import ON, admit, node, relabelled
from tests.deploy.test_manifests import BASE

KEY = "gpushard.io/card-1.cordoned"
MESSAGE = ("gpushard: the agent may not cordon or uncordon a card (gpushard.io/card-<k>.cordoned); an operator "
           "does, with gpushard cordon and uncordon")


@pytest.fixture(scope="module")
def shipped():
    return admission_policy.shipped(rendering.render(BASE), "gpushard-agent-own-node")


def with_annotations(obj: dict, annotations: dict | None) -> dict:
    out = copy.deepcopy(obj)
    if annotations is None:
        out["metadata"].pop("annotations", None)
    else:
        out["metadata"]["annotations"] = annotations
    return out


def verdicts(policy_and_binding) -> dict:
    bare = node("gpu-1")
    cordoned = with_annotations(bare, {KEY: '{"reason":"fan"}', "gpushard.io/inventory": "[]"})
    patched = relabelled(cordoned)  # the agent's patch: its labels and the inventory, the cordon kept
    patched["metadata"]["annotations"][KEY] = '{"reason":"fan"}'
    cases = {
        "agent publishes beside a cordon": admit(policy_and_binding, patched, cordoned, extra=ON),
        "agent publishes, no annotations before": admit(policy_and_binding, relabelled(bare), bare, extra=ON),
        "agent cordons": admit(policy_and_binding, with_annotations(bare, {KEY: "x"}), bare, extra=ON),
        "agent changes a cordon": admit(policy_and_binding, with_annotations(cordoned, {KEY: "other"}), cordoned,
                                        extra=ON),
        "agent uncordons": admit(policy_and_binding, with_annotations(cordoned, {"gpushard.io/inventory": "[]"}),
                                 cordoned, extra=ON),
        "agent drops every annotation": admit(policy_and_binding, with_annotations(cordoned, None), cordoned,
                                              extra=ON),
        "agent writes card-01 (no cordon)": admit(policy_and_binding, with_annotations(
            bare, {"gpushard.io/card-01.cordoning": "x"}), bare, extra=ON),
        "operator cordons": admit(policy_and_binding, with_annotations(bare, {KEY: "x"}), bare, username="alice"),
        "operator uncordons": admit(policy_and_binding, with_annotations(cordoned, None), cordoned, username="alice"),
    }
    for name, outcome in cases.items():
        assert not outcome.errored, (name, outcome.message)
    return cases


EXPECTED = {"agent publishes beside a cordon": True, "agent publishes, no annotations before": True,
            "agent cordons": False, "agent changes a cordon": False, "agent uncordons": False,
            "agent drops every annotation": False, "agent writes card-01 (no cordon)": False,
            "operator cordons": True, "operator uncordons": True}


def test_the_agent_may_not_write_a_cordon(shipped):
    outcomes = verdicts(shipped)
    assert {name: o.allowed for name, o in outcomes.items()} == EXPECTED
    for name, allowed in EXPECTED.items():
        if not allowed and name != "agent writes card-01 (no cordon)":
            assert outcomes[name].message == MESSAGE, name
    # Not a cordon (the cordon rule leaves it alone), but no key of the agent's either: refused as foreign.
    assert outcomes["agent writes card-01 (no cordon)"].message == (
        'gpushard: the agent may change only gpushard\'s own labels and annotations on its Node, not '
        '"gpushard.io/card-01.cordoning"')
    assert not outcomes["operator cordons"].matched and not outcomes["operator uncordons"].matched


def test_without_the_validation_the_agent_is_refused_without_being_told_who_cordons(shipped):
    # The rule that the agent writes only gpushard's own keys refuses a cordon too; the cordon rule, first,
    # makes the message say who cordons.
    policy, binding = shipped
    broken = copy.deepcopy(policy)
    broken["spec"]["validations"] = [v for v in broken["spec"]["validations"] if ".cordoned" not in v["expression"]]
    assert len(broken["spec"]["validations"]) == len(policy["spec"]["validations"]) - 1
    outcomes = verdicts((broken, binding))
    assert {name: o.allowed for name, o in outcomes.items()} == EXPECTED
    assert outcomes["agent uncordons"].message != MESSAGE
