"""We test card choice against outcomes worked out by hand from the Kubernetes scheduler's rules:
- node selector, nodeName, required node affinity (In, NotIn, Exists, DoesNotExist, Gt, Lt, matchFields,
  ORed terms, an empty term matching nothing);
- taints and tolerations (Equal and Exists, empty key, effects; PreferNoSchedule never filters);
- cordoned and not-ready nodes, reachable only with the matching toleration;
- binpack takes the fullest card with room, spread the emptiest, ties by node order then index;
- pins, nothing fits, nothing matches, and no view at all;
- a card and a node made for a remembered choice (with_used, with_card) equal what the constructors
  make, and stay frozen.
"""

import pytest

from webhook.core import placement as pl

A = pl.Node("a", labels={"zone": "z1", "gpus": "8", "pool": "train"}, cards=(pl.Card(0, 100, 70), pl.Card(1, 100, 10)))
B = pl.Node("b", labels={"zone": "z2", "gpus": "2"}, taints=(pl.Taint("nvidia.com/gpu", "present", "NoSchedule"),),
            cards=(pl.Card(0, 100, 50),))
C = pl.Node("c", labels={"zone": "z3", "gpus": "4"}, unschedulable=True, cards=(pl.Card(0, 100, 0),))
D = pl.Node("d", labels={"zone": "z4", "gpus": "x"}, ready=False, cards=(pl.Card(0, 100, 0),))
E = pl.Node("e", labels={"zone": "z5"}, taints=(pl.Taint("soft", "", "PreferNoSchedule"),
                                                 pl.Taint("evict", "y", "NoExecute")), cards=(pl.Card(2, 100, 90),))
VIEW = pl.View(nodes=(A, B, C, D, E))
EXISTS_ALL = {"operator": "Exists"}


def nodes_for(**ask) -> set[str]:
    a = pl.Ask(shares=1, **ask)
    return {n.name for n in VIEW.nodes if pl.eligible(n, a)}


def term(*exprs, fields=()):
    return {"matchExpressions": list(exprs), "matchFields": list(fields)}


def expr(key, op, *values):
    out = {"key": key, "operator": op}
    if values:
        out["values"] = list(values)
    return out


@pytest.mark.parametrize("ask, expected", [
    ({}, {"a"}),
    ({"tolerations": (EXISTS_ALL,)}, {"a", "b", "c", "d", "e"}),
    ({"tolerations": ({"key": "nvidia.com/gpu", "operator": "Exists"},)}, {"a", "b"}),
    ({"tolerations": ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},)}, {"a", "b"}),
    ({"tolerations": ({"key": "nvidia.com/gpu", "value": "absent"},)}, {"a"}),
    ({"tolerations": ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"},)}, {"a"}),
    ({"tolerations": ({"key": "node.kubernetes.io/unschedulable", "operator": "Exists"},)}, {"a", "c"}),
    ({"tolerations": ({"key": "node.kubernetes.io/not-ready", "operator": "Exists"},)}, {"a", "d"}),
    ({"tolerations": ({"key": "evict", "value": "y", "effect": "NoExecute"},)}, {"a", "e"}),
    ({"node_selector": {"zone": "z1"}}, {"a"}),
    ({"node_selector": {"zone": "z2"}}, set()),
    ({"node_name": "b", "tolerations": (EXISTS_ALL,)}, {"b"}),
    ({"required_terms": (term(expr("zone", "In", "z1", "z2")),), "tolerations": (EXISTS_ALL,)}, {"a", "b"}),
    ({"required_terms": (term(expr("zone", "NotIn", "z1")),), "tolerations": (EXISTS_ALL,)}, {"b", "c", "d", "e"}),
    ({"required_terms": (term(expr("pool", "Exists")),), "tolerations": (EXISTS_ALL,)}, {"a"}),
    ({"required_terms": (term(expr("pool", "DoesNotExist")),), "tolerations": (EXISTS_ALL,)},
     {"b", "c", "d", "e"}),
    # Gt/Lt compare integers; a label that is no integer, or absent, never matches.
    ({"required_terms": (term(expr("gpus", "Gt", "2")),), "tolerations": (EXISTS_ALL,)}, {"a", "c"}),
    ({"required_terms": (term(expr("gpus", "Lt", "8")),), "tolerations": (EXISTS_ALL,)}, {"b", "c"}),
    ({"required_terms": (term(fields=[expr("metadata.name", "In", "e")]),), "tolerations": (EXISTS_ALL,)}, {"e"}),
    # Terms are ORed, expressions within a term ANDed.
    ({"required_terms": (term(expr("zone", "In", "z1"), expr("gpus", "Lt", "4")),
                         term(expr("zone", "In", "z2"))), "tolerations": (EXISTS_ALL,)}, {"b"}),
    ({"required_terms": (term(),), "tolerations": (EXISTS_ALL,)}, set()),
])
def test_eligibility_as_the_scheduler_decides(ask, expected):
    assert nodes_for(**ask) == expected


def pick(ask: pl.Ask, strategy: str) -> tuple[int, str | None]:
    choice = pl.choose(VIEW, ask, strategy)
    return choice.card, choice.node


def test_binpack_takes_the_fullest_card_with_room_and_spread_the_emptiest():
    everywhere = (EXISTS_ALL,)
    assert pick(pl.Ask(shares=30, tolerations=everywhere), "binpack") == (0, "a")  # 70 used: the fullest
    assert pick(pl.Ask(shares=5, tolerations=everywhere), "binpack") == (2, "e")  # 90 used leaves room for 5
    assert pick(pl.Ask(shares=30, tolerations=everywhere), "spread") == (0, "c")  # empty; c comes before d
    assert pick(pl.Ask(shares=31), "binpack") == (1, "a")  # only node a is open, and its card 0 has 30 free


def test_pins_fallbacks_and_no_view():
    pinned = pl.choose(VIEW, pl.Ask(shares=30, pin=0, tolerations=(EXISTS_ALL,)), "binpack")
    assert (pinned.card, pinned.node, pinned.fits) == (0, "a", True)
    full = pl.choose(VIEW, pl.Ask(shares=95), "binpack")
    assert full.card == 1 and not full.fits and full.findings[0].rule == "no-room"
    nowhere = pl.choose(VIEW, pl.Ask(shares=5, node_selector={"zone": "mars"}), "binpack")
    assert nowhere.card == 0 and nowhere.findings[0].rule == "no-matching-node"
    missing_card = pl.choose(VIEW, pl.Ask(shares=5, pin=7), "binpack")
    assert missing_card.card == 7 and "card 7" in missing_card.findings[0].message
    blind = pl.choose(None, pl.Ask(shares=5), "binpack")
    assert blind.card == 0 and blind.findings[0].rule == "no-view"


def test_a_card_and_node_made_for_a_remembered_choice_equal_those_the_constructors_make():
    card = pl.Card(3, 100, 20, "GPU-x", "A100", 40960)
    moved = card.with_used(45)
    assert moved == pl.Card(3, 100, 45, "GPU-x", "A100", 40960)
    assert hash(moved) == hash(pl.Card(3, 100, 45, "GPU-x", "A100", 40960)) and moved.free == 55
    assert card.used == 20  # the card it came from is unchanged
    node = pl.Node("a", {"zone": "z1"}, (pl.Taint("t"),), False, True, (pl.Card(0, 100), card, pl.Card(5, 100)))
    changed = node.with_card(1, moved)
    assert changed == pl.Node("a", {"zone": "z1"}, (pl.Taint("t"),), False, True,
                              (pl.Card(0, 100), moved, pl.Card(5, 100)))
    assert changed.effective_taints() == node.effective_taints() and node.cards[1] is card
    for obj, field in ((moved, "used"), (changed, "cards")):
        with pytest.raises(AttributeError):  # still frozen
            setattr(obj, field, None)
