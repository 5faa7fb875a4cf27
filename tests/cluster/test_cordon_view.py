"""Cordoned cards in the views the webhook chooses over: the static file and the live API view.

We test:
- a cluster file's card may say `cordoned: true`: that card has no room for new pods, keeps its
  usedShares, and the static view never picks it, through remembered choices and their expiry;
  anything but true or false there is a bad file that names the field;
- the live view reads the Node's cordon annotation (tests/fakekube.py as the API server): the card
  is cordoned, its pods still count on it, admission never picks it and warns a pod pinned to it; an
  annotation added or removed by watch reaches the next snapshot; the other cards are untouched.
"""

from __future__ import annotations

import pytest

from tests.cluster import kubeobjects as o
from webhook.cluster import static
from webhook.core import decisions, draws, names, objects, placement
from webhook.core.policy import Policy

FILE = {"nodes": [
    {"name": "a", "cards": [{"index": 0, "usedShares": 90}, {"index": 1, "usedShares": 10, "cordoned": True}]},
    {"name": "b", "cards": [{"index": 0, "usedShares": 70}, {"index": 1, "cordoned": False}]},
]}


def pod(shares, pin=None):
    resources = {names.FRACTION_RESOURCE: f"{shares / 100:g}"} if pin is None else {
        names.SHARES_RESOURCE: str(shares), f"{names.CARD_PREFIX}{pin}": str(shares)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
            "spec": {"containers": [{"name": "main", "image": "cuda", "resources": {"limits": resources}}]}}


def decide(view, obj, seed=""):
    return decisions.decide(decisions.Request(obj, "Pod", seed=seed), Policy(), view)


def test_a_cluster_file_card_may_be_cordoned():
    view = static.parse(FILE, 100)
    a, b = view.nodes
    assert a.cards[1] == placement.Card(1, 100, 10, cordoned=True) and a.cards[1].free == 0
    assert not b.cards[1].cordoned and b.cards[1].free == 100
    with pytest.raises(static.ViewFileError, match=r"nodes\[0\]\.cards\[1\]\.cordoned: must be true or false"):
        static.parse({"nodes": [{"name": "a", "cards": [{"index": 0}, {"index": 1, "cordoned": "yes"}]}]}, 100)


def test_the_static_view_never_picks_the_cordoned_card():
    clock = [0.0]
    served = static.StaticView(static.parse(FILE, 100), remember_ttl=30, clock=lambda: clock[0])
    for i in range(40):
        decision = decide(served.snapshot(), pod(20), seed=f"uid-{i}")
        assert decision.allowed
        choice = placement.choose(served.snapshot(), placement.Ask(shares=20), "spread")
        assert (choice.node, choice.card) != ("a", 1)
        if choice.fits:
            served.remember(choice.node, choice.card, 20)
    # A choice remembered on the cordoned card (another replica's) keeps it cordoned and counted.
    served.remember("a", 1, 5)
    card = served.snapshot().nodes[0].cards[1]
    assert card.cordoned and card.used == 15 and card.free == 0
    clock[0] += 31  # every remembered choice expires
    card = served.snapshot().nodes[0].cards[1]
    assert card.cordoned and card.used == 10


def test_a_pin_to_the_cordoned_card_is_admitted_with_a_warning():
    view = static.parse({"nodes": [{"name": "a", "cards": [{"index": 0}, {"index": 1, "cordoned": True}]}]}, 100)
    decision = decide(view, pod(30, pin=1))
    assert decision.allowed
    assert any("card 1 is cordoned on every node the pod may run on" in w for w in decision.warnings)


def cordoned_node(name, cordons):
    obj = o.node(name, {0: 100, 1: 100})
    obj["metadata"]["annotations"] = {names.card_cordon_annotation(k): objects.write_cordon(objects.Cordon(why))
                                      for k, why in cordons.items()}
    return obj


def test_the_live_view_reads_the_cordon_and_still_counts_its_pods(fake, start_view):
    fake.put("nodes", cordoned_node("gpu-a", {1: "fan"}))
    fake.put("pods", o.pod("holder", 1, 30, "gpu-a"))
    fake.put("pods", o.pod("other", 0, 80, "gpu-a"))
    view = start_view()
    snap = o.wait_for(view.snapshot, what="the first sync")
    (a,) = snap.nodes
    assert [(c.index, c.capacity, c.used, c.cordoned) for c in a.cards] == [(0, 100, 80, False), (1, 100, 30, True)]
    for i in range(30):
        choice = placement.choose(view.snapshot(), placement.Ask(shares=10), "binpack", draws.Draw(f"u{i}"))
        assert (choice.node, choice.card, choice.fits) == ("gpu-a", 0, True)
    decision = decide(view.snapshot(), pod(30, pin=1))
    assert decision.allowed and any("cordoned" in w for w in decision.warnings)

    # Uncordoned by watch: card 1 takes pods again.
    fake.put("nodes", cordoned_node("gpu-a", {}))
    o.wait_for(lambda: not view.snapshot().nodes[0].cards[1].cordoned, what="the uncordon")
    choice = placement.choose(view.snapshot(), placement.Ask(shares=30))
    assert (choice.card, choice.fits) == (1, True)
    # Cordoned again, now card 0: the pod on it still counts, and card 1 is the one left.
    fake.put("nodes", cordoned_node("gpu-a", {0: "xid"}))
    o.wait_for(lambda: view.snapshot().nodes[0].cards[0].cordoned, what="the cordon of card 0")
    c0, c1 = view.snapshot().nodes[0].cards
    assert (c0.used, c0.free, c1.cordoned) == (80, 0, False)
    assert placement.choose(view.snapshot(), placement.Ask(shares=10)).card == 1


def test_a_cluster_file_whose_cards_or_taints_are_no_list_is_refused_by_field():
    for key, value in (("cards", 4), ("taints", "gpu")):
        with pytest.raises(static.ViewFileError, match=rf"nodes\[0\]\.{key}: must be a list, got {value!r}"):
            static.parse({"nodes": [{"name": "a", key: value}]}, 100)
