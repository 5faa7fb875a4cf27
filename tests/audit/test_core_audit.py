"""The pure audit core: namespace modes, per-card shares as Kubernetes counts them, usage, and the context rules.

We test:
- a namespace's mode label: enforce, audit, absent (not opted in), and a bad value read as enforce
  with a message saying why;
- per-card shares of a pod: requests defaulted from limits, init containers against app
  containers and sidecars, several cards, unreadable values and shapes;
- usage: shared nodes only, finished pods not counted, pending pinned pods listed, a card the
  node stopped offering kept with capacity 0;
- the context rules on their own: annotation and pin, nvidia.com/gpu and unpinned shares on shared
  nodes, cards the node lacks, objects that cannot be read;
- every pass golden pod, once admitted in enforce mode, audits clean (gpushard's own writing is
  never a finding);
- the admission evaluator in audit mode on a pod gpushard itself admitted finds nothing.
"""

from __future__ import annotations

import pathlib

import pytest
import yaml

from webhook.core import audit, decisions, names, policy

POLICY = policy.Policy()
GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "golden"


@pytest.mark.parametrize("labels, mode, problem", [
    ({names.MODE_LABEL: "enforce"}, "enforce", False),
    ({names.MODE_LABEL: "audit"}, "audit", False),
    ({}, None, False),
    (None, None, False),
    ({names.MODE_LABEL: "Audit"}, "enforce", True),
    ({names.MODE_LABEL: ""}, "enforce", True),
])
def test_namespace_mode(labels, mode, problem):
    got = audit.namespace_mode("ml", labels)
    assert got.mode == mode
    assert bool(got.problem) == problem
    if problem:
        assert got.problem.startswith('gpushard: namespace "ml" has gpushard.io/mode="')


def spec(*containers: dict, init: tuple[dict, ...] = ()) -> dict:
    return {"initContainers": list(init), "containers": list(containers)}


def c(name: str, card: int | None = None, shares: int | str = 0, part: str = "limits", **extra) -> dict:
    out = {"name": name, **extra}
    if card is not None:
        out["resources"] = {part: {f"gpushard.io/card-{card}": shares}}
    return out


def test_card_shares_counts_like_kubernetes():
    # App containers and sidecars add up; a regular init container runs alone (beside earlier sidecars).
    s = spec(c("a", 0, 20), c("b", 0, "30"),
             init=(c("side", 0, 10, restartPolicy="Always"), c("warm", 0, 90), c("late-side", 0, 5,
                                                                                   restartPolicy="Always")))
    assert audit.card_shares(s, POLICY) == {0: 100}  # max(90 + 10, 10 + 5 + 20 + 30)
    assert audit.card_shares(spec(c("a", 0, 20, part="requests")), POLICY) == {0: 20}
    assert audit.card_shares(spec(c("a", 0, 20), c("b", 3, 40)), POLICY) == {0: 20, 3: 40}
    assert audit.card_shares(spec(c("a", 0, "lots"), c("b")), POLICY) == {}
    assert audit.card_shares({"containers": "nope"}, POLICY) == {}


def node(name: str, cards: dict[int, str], labels: dict | None = None) -> dict:
    return {"kind": "Node", "metadata": {"name": name, "labels": labels or {}},
            "status": {"allocatable": {f"gpushard.io/card-{k}": v for k, v in cards.items()}}}


def pod(name: str, node_name: str | None, card: int, shares: int, phase: str = "Running", **meta) -> dict:
    s = spec(c("t", card, shares))
    if node_name:
        s["nodeName"] = node_name
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "ml", **meta}, "spec": s,
            "status": {"phase": phase}}


def test_usage():
    nodes = [node("a", {0: "100", 1: "0"}), node("plain", {}), node("labelled", {}, {names.CARDS_LABEL: "0"})]
    pods = [pod("p", "a", 0, 30), pod("q", "a", 1, 50), pod("done", "a", 0, 70, "Succeeded"),
            pod("gone", "a", 4, 10), pod("wait", None, 0, 5), pod("elsewhere", "plain", 0, 10)]
    use = audit.usage(nodes, pods, POLICY)
    assert [n.name for n in use.nodes] == ["a", "labelled"]
    cards = {k.index: k for k in use.nodes[0].cards}
    assert (cards[0].used, cards[0].free, cards[0].capacity) == (30, 70, 100)
    assert (cards[1].used, cards[1].free, cards[1].capacity) == (50, 0, 0)  # unhealthy: offers 0
    assert (cards[4].used, cards[4].capacity) == (10, 0)  # gone from allocatable, holder still shown
    assert [h.name for h in cards[0].holders] == ["p"]
    assert use.pending == ((audit.Holder("ml", "wait", 5), 0),)
    assert (use.capacity, use.used, use.free) == (100, 90, 70)


def rules(found) -> list[str]:
    return [x.rule for x in found]


def test_context_rules_on_pods():
    nodes = {"a": audit.node_cards(node("a", {0: "100", 1: "100"}), POLICY)}
    enforce = audit.NamespaceMode(names.MODE_ENFORCE)
    pinned = pod("p", "a", 1, 30)
    pinned["spec"]["containers"][0]["resources"]["limits"]["gpushard.io/gpu"] = 30
    assert rules(audit.audit_object(pinned, enforce, POLICY, nodes)) == []
    pinned["metadata"]["annotations"] = {names.CARD_ANNOTATION: "0"}
    assert rules(audit.audit_object(pinned, enforce, POLICY, nodes)) == [audit.ANNOTATION_MISMATCH]
    far = pod("far", "a", 7, 30)
    assert rules(audit.audit_object(far, enforce, POLICY, nodes)) == [audit.NO_SUCH_CARD]
    assert rules(audit.audit_object(far, enforce, POLICY, {})) == []  # no node in sight: nothing to compare
    loose = {"kind": "Pod", "metadata": {"name": "l", "namespace": "ml"},
             "spec": {"nodeName": "a", "containers": [{"name": "t", "resources": {"limits": {"gpushard.io/gpu": 5}}}]}}
    assert rules(audit.audit_object(loose, enforce, POLICY, nodes)) == [audit.UNPINNED]
    loose["metadata"]["annotations"] = {names.CARD_ANNOTATION: "1"}
    assert rules(audit.audit_object(loose, enforce, POLICY, nodes)) == [audit.ANNOTATION_MISMATCH, audit.UNPINNED]


def test_objects_gpushard_cannot_read():
    broken = {"kind": "Deployment", "metadata": {"name": "d", "namespace": "x"},
              "spec": {"template": {"spec": {"containers": "oops"}}}}
    not_opted_in = audit.NamespaceMode(None)
    assert "unreadable" in rules(audit.audit_object(broken, not_opted_in, POLICY))
    assert audit.audit_object({"kind": "Service", "metadata": {"name": "s"}}, not_opted_in, POLICY) == []
    gpu_less = {"kind": "Pod", "metadata": {"name": "web"}, "spec": {"containers": [{"name": "nginx"}]}}
    assert audit.audit_object(gpu_less, not_opted_in, POLICY) == []


def admitted_pods():
    for path in sorted(GOLDEN.glob("*.pass.yaml")):
        if (GOLDEN / path.name.replace(".pass.yaml", ".config.yaml")).exists():
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == names.POD_KIND:
                yield pytest.param(doc, id=path.name)


@pytest.mark.parametrize("obj", list(admitted_pods()))
def test_what_gpushard_admits_audits_clean(obj):
    decision = decisions.decide(decisions.Request(obj, names.POD_KIND), POLICY, None)
    assert decision.allowed
    for mode in (audit.UNKNOWN_NAMESPACE, audit.NamespaceMode(names.MODE_ENFORCE)):
        assert audit.audit_object(decision.obj, mode, POLICY) == []


def test_admission_audit_mode_accepts_what_enforce_mode_wrote():
    obj = {"kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]}}
    admitted = decisions.decide(decisions.Request(obj, names.POD_KIND), POLICY, None).obj
    again = decisions.decide(decisions.Request(admitted, names.POD_KIND, mode=names.MODE_AUDIT), POLICY, None)
    assert again.findings == []
