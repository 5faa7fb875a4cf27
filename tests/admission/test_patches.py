"""We test:
- a patch turns the original into the new document, applied by jsonpatch, for any pair of JSON documents
  and for pairs that differ in a few places (as the core's rewrite makes them);
- equal documents give an empty patch; keys with "/" and "~" are escaped;
- a leaf whose JSON type changes (1 -> true, 1 -> 1.0) is replaced;
- the patch the core's rewrite records for a created Pod turns the pod into the rewritten one, as the
  walk's patch does, and is empty exactly when the walk's is, over generated pods (containers,
  resources, env, metadata, affinity, nodeName, runtimeClassName of every shape) and policies; the
  rewritten pod reviewed again gets an empty patch; resources that are no mapping are set whole;
- the usual pod's recorded patch, operation by operation.
"""

from __future__ import annotations

import copy
import json

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook import settings as settings_mod
from webhook.admission import patches
from webhook.core import decisions, names, placement

LEAVES = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=5)
KEYS = st.text(alphabet="ab/~-", max_size=4)
DOCS = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                    max_leaves=25)


def _applies(a, b) -> None:
    patch = patches.make(a, b)
    result = jsonpatch.apply_patch(copy.deepcopy(a), patch)
    assert result == b and _types(result) == _types(b), (a, b, patch)


def _types(doc):
    if isinstance(doc, dict):
        return {k: _types(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_types(v) for v in doc]
    return type(doc).__name__


@settings(max_examples=300, deadline=None)
@given(a=DOCS, b=DOCS)
def test_any_two_documents(a, b):
    _applies(a, b)


@settings(max_examples=300, deadline=None)
@given(a=st.dictionaries(KEYS, DOCS, max_size=5), data=st.data())
def test_documents_changed_in_a_few_places(a, data):
    b = copy.deepcopy(a)
    for _ in range(data.draw(st.integers(0, 3))):
        node = b
        while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            if not isinstance(node[key], (dict, list)):
                break
            node = node[key]
        if isinstance(node, dict):
            node[data.draw(KEYS)] = data.draw(DOCS)
        elif isinstance(node, list):
            node.append(data.draw(DOCS))
    _applies(a, b)


def test_equal_documents_give_an_empty_patch():
    doc = {"a": [1, {"b": "c"}], "d/e~f": None}
    assert patches.make(doc, copy.deepcopy(doc)) == []


def test_keys_are_escaped_and_types_count():
    assert patches.make({"a/b~c": 1}, {"a/b~c": 2}) == [{"op": "replace", "path": "/a~1b~0c", "value": 2}]
    assert patches.make({"x": 1}, {"x": True}) == [{"op": "replace", "path": "/x", "value": True}]
    assert patches.make([1], [1.0]) == [{"op": "replace", "path": "/0", "value": 1.0}]
    assert patches.make({"env": [1]}, {"env": [1, 2]}) == [{"op": "add", "path": "/env/-", "value": 2}]


# --- the patch the rewrite records, against the walk ----------------------------------------------

CLUSTER = placement.View(nodes=(
    placement.Node("node-a", {"kubernetes.io/hostname": "node-a"}, (), True, False,
                   (placement.Card(0, 100, 40), placement.Card(1, 100, 0))),
    placement.Node("node-b", {"kubernetes.io/hostname": "node-b"}, (), True, False, (placement.Card(0, 100, 90),)),
))
POLICIES = [settings_mod.from_mapping(c).policy for c in (
    {}, {"policy": {"wholeCards": "passthrough", "multiCard": "passthrough", "runtimeClassName": "nvidia"}},
    {"sharesPerCard": 10, "policy": {"hideUnrequestedGpus": False}},
    {"isolation": "memory"}, {"policy": {"nodeAffinity": "required"}})]
TEXT = st.sampled_from(["0", "1", "25", "true", "x"])
MAPPINGS = st.none() | st.integers(0, 2) | st.dictionaries(
    st.sampled_from([names.CARD_ANNOTATION, names.SHARES_ANNOTATION, names.SHARED_LABEL, "app", "a/b~c"]),
    TEXT | st.integers(0, 3), max_size=3)
TERM = placement.preferred_affinity_term("node-z")
AFFINITIES = st.sampled_from([None, {}, {"nodeAffinity": None}, {"nodeAffinity": {}},
                              {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": None}},
                              {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
                              {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                                  {"weight": 5, "preference": {"matchExpressions": [
                                      {"key": "zone", "operator": "In", "values": ["a"]}]}}]}},
                              {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [TERM]}},
                              {"podAffinity": {}, "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                                  "nodeSelectorTerms": [{"matchExpressions": [
                                      {"key": "kubernetes.io/hostname", "operator": "Exists"}]}]}}}])


ENV = st.lists(st.one_of(
    st.fixed_dictionaries({"name": st.sampled_from([names.VISIBLE_DEVICES_ENV, names.FRACTION_ENV, "X"]),
                           "value": st.sampled_from(["all", "0", "1", "void", "0.25", ""])}),
    st.fixed_dictionaries({"name": st.just(names.VISIBLE_DEVICES_ENV),
                           "valueFrom": st.just({"fieldRef": {"fieldPath": "metadata.name"}})}),
    st.just("not a mapping")), max_size=3)


@st.composite
def gpu_containers(draw, name: str, whole: bool = False) -> dict:
    """Containers that mostly ask what gpushard grants: a fraction, shares, a pin, a whole card, or nothing."""
    c: dict = {"name": name, "image": "cuda"}
    ask = "whole" if whole else draw(st.sampled_from(["fraction", "fraction", "shares", "pin", "whole", "none"]))
    amounts: dict = {"cpu": "1"} if draw(st.booleans()) else {}
    if ask == "fraction":
        amounts["nvidia.com/gpu"] = draw(st.sampled_from(["0.25", "0.5", "250m", "0.1"]))
    elif ask == "shares":
        amounts["gpushard.io/gpu"] = draw(st.sampled_from(["10", "25", 30]))
    elif ask == "pin":
        amounts["gpushard.io/gpu"] = amounts["gpushard.io/card-1"] = "20"
    elif ask == "whole":
        amounts["nvidia.com/gpu"] = draw(st.sampled_from(["1", "2"]))
    if amounts or draw(st.booleans()):
        parts = {"limits": dict(amounts), "requests": dict(amounts)}
        if amounts and draw(st.integers(0, 3)) == 0:
            parts[draw(st.sampled_from(["limits", "requests"]))] = draw(st.sampled_from([None, {}]))
        c["resources"] = parts
    elif draw(st.integers(0, 3)) == 0:
        c["resources"] = draw(st.sampled_from([None, {}, {"limits": None}]))
    if draw(st.booleans()):
        c["env"] = draw(ENV | st.sampled_from([None, {"A": "1"}]))
    return c


@st.composite
def pods(draw) -> dict:
    whole = draw(st.integers(0, 4)) == 0  # pods of whole cards only, which passthrough may let through
    spec: dict = {"containers": [draw(gpu_containers(f"c{i}", whole)) for i in range(draw(st.integers(1, 3)))]}
    if draw(st.integers(0, 3)) == 0:
        init = [draw(gpu_containers(f"i{i}")) for i in range(draw(st.integers(1, 2)))]
        for c in init:
            if draw(st.booleans()):
                c["restartPolicy"] = "Always"
        spec["initContainers"] = init
    pod: dict = {"apiVersion": "v1", "kind": "Pod", "spec": spec}
    if draw(st.integers(0, 4)):
        meta: dict = {"name": "p", "namespace": "ml"}
        for key in ("labels", "annotations"):
            if draw(st.booleans()):
                meta[key] = draw(MAPPINGS)
        pod["metadata"] = meta
    if draw(st.booleans()):
        spec["affinity"] = copy.deepcopy(draw(AFFINITIES))
    if draw(st.integers(0, 5)) == 0:
        spec["nodeName"] = "node-b"
    if draw(st.integers(0, 3)) == 0:
        spec["runtimeClassName"] = "kata"
    return pod


@settings(max_examples=400, deadline=None)
@given(pods(), st.sampled_from(range(len(POLICIES))), st.booleans())
def test_the_walk_s_patch_makes_the_decided_pod(pod, which, with_view):
    decision = decisions.decide(decisions.Request(pod, "Pod", seed="uid-1", namespace="ml"), POLICIES[which],
                                CLUSTER if with_view else None)
    if not decision.allowed:
        return
    walk = patches.make(pod, decision.obj)
    result = jsonpatch.apply_patch(copy.deepcopy(pod), walk)
    assert result == decision.obj and _types(result) == _types(decision.obj), (pod, walk)
    assert json.loads(json.dumps(walk)) == walk
    # Reviewed again (another webhook reinvokes gpushard over its own output): nothing to change.
    again = decisions.decide(decisions.Request(decision.obj, "Pod", seed="uid-2", namespace="ml"), POLICIES[which],
                             CLUSTER if with_view else None)
    assert patches.make(decision.obj, again.obj) == [], decision.obj


def test_the_patch_for_the_usual_pod():
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "x"}},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "0.25"},
                                                              "requests": {"nvidia.com/gpu": "0.25"}},
                                    "env": [{"name": "A", "value": "1"}]}]}}
    decision = decisions.decide(decisions.Request(pod, "Pod", seed="u"), POLICIES[0], CLUSTER)
    card = f"gpushard.io~1card-{decision.card}"
    assert patches.make(pod, decision.obj) == [
        {"op": "add", "path": "/metadata/labels/gpushard.io~1shared", "value": "true"},
        {"op": "add", "path": "/metadata/annotations", "value": {"gpushard.io/card": str(decision.card),
                                                                 "gpushard.io/shares": "25"}},
        *[op for part in ("limits", "requests") for op in (
            {"op": "remove", "path": f"/spec/containers/0/resources/{part}/nvidia.com~1gpu"},
            {"op": "add", "path": f"/spec/containers/0/resources/{part}/gpushard.io~1gpu", "value": "25"},
            {"op": "add", "path": f"/spec/containers/0/resources/{part}/{card}", "value": "25"})],
        {"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "NVIDIA_VISIBLE_DEVICES",
                                                                   "value": str(decision.card)}},
        {"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "GPUSHARD_FRACTION", "value": "0.25"}},
        {"op": "add", "path": "/spec/affinity", "value": {"nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [placement.preferred_affinity_term(decision.node)]}}},
    ]


@pytest.mark.parametrize("affinity", [
    None, {"podAffinity": {}}, {"nodeAffinity": {}},
    {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "Exists"}]}]}}},
    {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [],
                      "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                          {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}]}]}}},
])
def test_the_patch_with_a_required_node(affinity):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "0.25"}}}]}}
    if affinity is not None:
        pod["spec"]["affinity"] = affinity
    decision = decisions.decide(decisions.Request(pod, "Pod", seed="u"), POLICIES[4], CLUSTER)
    assert decision.node is not None
    result = jsonpatch.apply_patch(copy.deepcopy(pod), patches.make(pod, decision.obj))
    assert result == decision.obj
    terms = result["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert all(placement.required_node_expression(decision.node) in t["matchFields"] for t in terms)
