"""The live view under backend dra, over tests/fakekube.py as the API server, and the node hint it gives.

We test:
- the cards are gpushard's ResourceSlices' devices (another driver's slices count for nothing), on
  nodes as their Node objects show them (taints, readiness); a node without a slice has no cards;
- the shares held are the allocated claims' consumed shares, on the device and pool of each result;
  a claim of another driver, or not allocated yet, counts nothing; a claim deallocated or deleted
  gives its shares back;
- a pod the webhook hinted counts on its hinted node, on the card the allocator would take there,
  until its claim shows allocated, then only the claim counts (never both, in either order of events);
- a card that left its slice (cordoned, Unhealthy) is no longer offered, while its claims still count;
- admission under backend dra: the pod gets a preferred term naming the node of the binpack choice,
  no card pin, and the choice counts at once (a burst does not pile onto one card); with no card
  that fits, a warning in the scheduler's words and no term; without a view, no term and no warning.
"""

from __future__ import annotations

import pytest

from tests.cluster import kubeobjects as o
from webhook import settings as settings_mod
from webhook.core import decisions, draobjects, names, placement
from webhook.core import policy as policy_mod

POLICY = policy_mod.Policy(backend=policy_mod.DRA)


def dra_node(name: str, **extra) -> dict:
    """A node as the agent labels it under backend dra: no per-card resources in allocatable."""
    node = o.node(name, **extra)
    node["metadata"]["labels"][names.CARDS_LABEL] = "2"
    return node


def card(index: int, shares: int = 100, memory: int = 81559) -> draobjects.CardFacts:
    return draobjects.CardFacts(index=index, uuid=f"GPU-{index}", model="NVIDIA H100", memory_mib=memory,
                                isolation="none", memory_limits=False)


def slice_of(node: str, indexes=(0, 1), driver: str = names.DRA_DRIVER) -> dict:
    obj = draobjects.resource_slice(node, [card(k) for k in indexes], 100, 1, driver=driver)
    obj["metadata"]["uid"] = f"slice-{node}-{driver}"
    return obj


def claim(name: str, node: str, k: int, shares: int, pod_uid: str = "", driver: str = names.DRA_DRIVER,
          allocated: bool = True) -> dict:
    obj = {"metadata": {"name": name, "namespace": "ml", "uid": f"claim-{name}",
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name,
                                             "uid": pod_uid or f"pod-{name}"}]},
           "spec": {"devices": {"requests": [{"name": names.DRA_REQUEST}]}}, "status": {}}
    if allocated:
        obj["status"] = {"allocation": {"devices": {"results": [{
            "request": names.DRA_REQUEST, "driver": driver, "pool": node, "device": f"card-{k}",
            "consumedCapacity": {names.DRA_SHARES_CAPACITY: str(shares)}, "shareID": "a1"}]}}}
    return obj


def dra_pod(name: str, shares: int, hinted: str | None = None, node_name: str | None = None,
            phase: str = "Pending") -> dict:
    spec: dict = {"containers": [{"name": "main", "image": "cuda", "resources": {
        "limits": {names.SHARES_RESOURCE: str(shares)}, "claims": [{"name": names.DRA_POD_CLAIM}]}}]}
    if hinted:
        spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            placement.preferred_affinity_term(hinted)]}}
    if node_name:
        spec["nodeName"] = node_name
    return {"metadata": {"name": name, "namespace": "ml", "uid": f"pod-{name}",
                         "labels": {names.SHARED_LABEL: names.SHARED_LABEL_VALUE},
                         "annotations": {names.SHARES_ANNOTATION: str(shares)}},
            "spec": spec, "status": {"phase": phase}}


@pytest.fixture
def dra_view(start_view):
    def start(**options):
        view = start_view(settings_mod.Settings(policy=POLICY), **options)
        o.wait_for(view.synced, what="the view's first sync")
        return view

    return start


def capacity(view, node: str, k: int) -> int | None:
    for n in view.snapshot().nodes:
        if n.name == node:
            return next((c.capacity for c in n.cards if c.index == k), None)
    return None


def gpu_pod(fraction: str = "0.25") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
            "spec": {"containers": [{"name": "main", "image": "cuda",
                                     "resources": {"limits": {names.FRACTION_RESOURCE: fraction}}}]}}


def decide(view, obj, seed=""):
    return decisions.decide(decisions.Request(obj, "Pod", seed=seed), POLICY, view)


def test_cards_come_from_gpushards_slices_and_shares_from_allocated_claims(fake, dra_view):
    for name in ("a", "b", "c"):
        fake.put("nodes", dra_node(name))
    fake.put("resourceslices", slice_of("a"))
    fake.put("resourceslices", slice_of("b", indexes=(0,)))
    fake.put("resourceslices", slice_of("c", driver="gpu.nvidia.com"))  # another driver's: not gpushard's cards
    fake.put("resourceclaims", claim("x", "a", 1, 40))
    fake.put("resourceclaims", claim("y", "a", 1, 25))
    fake.put("resourceclaims", claim("z", "b", 0, 30, driver="gpu.nvidia.com"))  # not ours: counts nothing
    fake.put("resourceclaims", claim("w", "b", 0, 50, allocated=False))  # not allocated yet
    view = dra_view()
    snap = view.snapshot()
    assert sorted(n.name for n in snap.nodes) == ["a", "b"]
    assert capacity(view, "a", 0) == 100 and capacity(view, "a", 1) == 100
    assert o.used(snap, "a", 1) == 65 and o.used(snap, "a", 0) == 0 and o.used(snap, "b", 0) == 0
    node_a = next(n for n in snap.nodes if n.name == "a")
    assert node_a.cards[0].uuid == "GPU-0" and node_a.cards[0].memory_mib == 81559

    # The scheduler allocates the waiting claim; then it is deallocated, and another is deleted.
    fake.put("resourceclaims", claim("w", "b", 0, 50))
    o.wait_for(lambda: o.used(view.snapshot(), "b", 0) == 50, what="the allocated claim")
    fake.put("resourceclaims", claim("w", "b", 0, 50, allocated=False))
    fake.delete("resourceclaims", "x", "ml")
    o.wait_for(lambda: o.used(view.snapshot(), "b", 0) == 0 and o.used(view.snapshot(), "a", 1) == 25,
               what="the shares given back")

    # A card that leaves the slice (cordoned, or Unhealthy) is offered no more; its claim still counts.
    fake.put("resourceslices", slice_of("a", indexes=(0,)))
    o.wait_for(lambda: capacity(view, "a", 1) is None, what="card 1 gone from the view")
    # A node whose slice goes has no shared cards at all.
    fake.delete("resourceslices", draobjects.slice_name("b"))
    o.wait_for(lambda: "b" not in [n.name for n in view.snapshot().nodes], what="node b without cards")
    # ... and a node that is NotReady is still listed, as the scheduler's predicates read it.
    fake.put("nodes", dra_node("a", ready=False))
    o.wait_for(lambda: not next(n for n in view.snapshot().nodes if n.name == "a").ready, what="not ready")


@pytest.mark.parametrize("claim_first", [False, True])
def test_a_hinted_pod_counts_on_its_node_until_its_claim_does(fake, dra_view, claim_first):
    fake.put("nodes", dra_node("a"))
    fake.put("resourceslices", slice_of("a"))
    fake.put("resourceclaims", claim("old", "a", 0, 90))
    view = dra_view()
    # Hinted to a: the allocator would take card 1 there (card 0 has 10 free), so it counts on card 1.
    fake.put("pods", dra_pod("p", 30, hinted="a"))
    o.wait_for(lambda: o.used(view.snapshot(), "a", 1) == 30, what="the hinted pod counted")
    if claim_first:
        fake.put("resourceclaims", claim("p", "a", 1, 30, pod_uid="pod-p"))
        fake.put("pods", dra_pod("p", 30, hinted="a", node_name="a"))
    else:
        fake.put("pods", dra_pod("p", 30, hinted="a", node_name="a"))
        o.wait_for(lambda: o.used(view.snapshot(), "a", 1) == 30, what="the bound pod still counted once")
        fake.put("resourceclaims", claim("p", "a", 1, 30, pod_uid="pod-p"))
    fake.put("pods", dra_pod("q", 5))  # unhinted and unbound: counts nowhere yet
    fake.put("pods", dra_pod("p", 30, hinted="a", node_name="a", phase="Running"))
    o.wait_for(lambda: view.snapshot() is not None and o.used(view.snapshot(), "a", 1) == 30
               and "pod-p" not in view._pods, what="the claim counting instead of the pod")
    # The pod ends and the claim goes: its shares are free again.
    fake.delete("resourceclaims", "p", "ml")
    fake.put("pods", dra_pod("p", 30, hinted="a", node_name="a", phase="Succeeded"))
    o.wait_for(lambda: o.used(view.snapshot(), "a", 1) == 0, what="the shares given back")
    assert o.used(view.snapshot(), "a", 0) == 90  # q, unhinted and unbound, counted nowhere


def test_admission_hints_the_binpack_node_and_counts_the_choice_at_once(fake, dra_view):
    for name in ("a", "b"):
        fake.put("nodes", dra_node(name))
        fake.put("resourceslices", slice_of(name))
    fake.put("resourceclaims", claim("old", "b", 0, 60))
    view = dra_view()
    decision = decide(view.snapshot(), gpu_pod("0.25"))
    assert decision.allowed and decision.node == "b" and decision.card == 0
    spec = decision.obj["spec"]
    assert placement.preferred_node(spec) == "b"
    assert spec["resourceClaims"] == [{"name": names.DRA_POD_CLAIM,
                                       "resourceClaimTemplateName": "gpushard-shares-25"}]
    limits = spec["containers"][0]["resources"]["limits"]
    assert not any(key.startswith(names.CARD_PREFIX) for key in limits)  # never a card pin
    assert not decision.warnings
    # The webhook remembers the choice (reviews.py does this after a real admission): the next one sees it.
    view.remember(decision.node, decision.card, decision.shares)
    assert o.used(view.snapshot(), "b", 0) == 85
    following = decide(view.snapshot(), gpu_pod("0.25"))
    # b's card 0 has 15 free, too little: the other cards tie, and a tie goes to the lower index, then the
    # earlier node.
    assert (following.node, following.card) == ("a", 0)
    # The pod shows, hinted: it takes the choice over (counted once, on the same card).
    fake.put("pods", dra_pod("p1", 25, hinted="b"))
    o.wait_for(lambda: "pod-p1" in view._pods, what="the pod in the view")
    assert o.used(view.snapshot(), "b", 0) == 85


def test_admission_with_no_room_warns_in_the_schedulers_words_and_hints_nothing(fake, dra_view):
    fake.put("nodes", dra_node("a"))
    fake.put("resourceslices", slice_of("a", indexes=(0,)))
    fake.put("resourceclaims", claim("old", "a", 0, 90))
    view = dra_view()
    decision = decide(view.snapshot(), gpu_pod("0.5"))
    assert decision.allowed and decision.node is None
    assert placement.preferred_node(decision.obj["spec"]) is None
    assert decision.warnings == ["gpushard: no card has 50 free shares now; the pod stays Pending until the "
                                 "scheduler finds one with room"]
    # Without a view the scheduler still chooses: no hint, and nothing to warn of.
    blind = decide(None, gpu_pod("0.5"))
    assert blind.allowed and blind.node is None and not blind.warnings
    assert placement.preferred_node(blind.obj["spec"]) is None


def test_node_affinity_none_gives_no_hint_under_either_backend(fake, dra_view):
    fake.put("nodes", dra_node("a"))
    fake.put("resourceslices", slice_of("a"))
    view = dra_view()
    quiet = policy_mod.Policy(backend=policy_mod.DRA, node_affinity="none")
    decision = decisions.decide(decisions.Request(gpu_pod("0.25"), "Pod"), quiet, view.snapshot())
    assert decision.allowed and decision.node == "a"  # chosen (and remembered), not written
    assert "affinity" not in decision.obj["spec"]
    # Under backend dra "required" is a preference still: the scheduler alone keeps the card.
    required = policy_mod.Policy(backend=policy_mod.DRA, node_affinity="required")
    decision = decisions.decide(decisions.Request(gpu_pod("0.25"), "Pod"), required, view.snapshot())
    node_affinity = decision.obj["spec"]["affinity"]["nodeAffinity"]
    assert list(node_affinity) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    # The device plugin: the card pinned, no node term.
    plugin = policy_mod.Policy(node_affinity="none")
    static_view = placement.View((placement.Node("a", cards=(placement.Card(0, 100),)),))
    decision = decisions.decide(decisions.Request(gpu_pod("0.25"), "Pod"), plugin, static_view)
    assert decision.allowed and decision.card == 0 and "affinity" not in decision.obj["spec"]
    assert decision.obj["spec"]["containers"][0]["resources"]["limits"][f"{names.CARD_PREFIX}0"] == "25"
