"""Where a pod waits when an autoscaler adds nodes (``policy.newNodeCards``): the card index a pod that fits
nowhere is pinned to, so that the pods waiting fit on as few new nodes as a packing of them needs.

We test:
- from zero (no shared node yet), a burst decided back to back, each choice counted as waiting as the live
  view counts it, waits on indexes that pack it onto the nodes first-fit decreasing needs, where without
  newNodeCards every pod waits on card 0 (one new node per four pods of a quarter);
- with no pod waiting every index ties, and the draw spreads pods over them all;
- on a full pool a pod waits only on an index every node it may run on has and a new node has, never on one
  a smaller node lacks, and not on an index cordoned on all of them;
- without newNodeCards nothing changes: the index is drawn among the indexes of the nodes;
- a pinned pod keeps its pin;
- newNodeCards is read from the config, and a bad value is refused naming the field;
- memory asks (policy.newNodeCardMemoryMiB): from zero a memory ask is sized for a new node's card and
  required on that card's memory label, a burst of them waits on indexes that pack it as fractions do, an
  ask above the new card is denied naming it, a card with room now still wins, and without the setting
  (or under backend dra) the ask from zero is denied as before; the setting needs newNodeCards.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.autoscaling.karpenter import packing_needs
from tests.core import podmaker
from tests.core.test_memory import H100, admitted, decide, memory_container, node, required_terms
from webhook import settings
from webhook.core import draws, names, placement
from webhook.core import findings as f
from webhook.core import policy as policy_mod
from webhook.core.scheduling import Card, Node

CAPACITY = 100


def full_node(name: str, cards: int, cordoned: frozenset = frozenset()) -> Node:
    return Node(name, {"kubernetes.io/hostname": name}, (), True, False,
                tuple(Card(k, CAPACITY, CAPACITY, f"GPU-{name}-{k}", "H100", 81559, k in cordoned)
                      for k in range(cards)))


def new_nodes(waiting: dict[int, list[int]]) -> int:
    """The new nodes the waiting pods need, each index first-fit over its own cards."""
    most = 0
    for sizes in waiting.values():
        cards: list[int] = []
        for size in sizes:
            i = next((i for i, used in enumerate(cards) if used + size <= CAPACITY), None)
            if i is None:
                cards.append(size)
            else:
                cards[i] += size
        most = max(most, len(cards))
    return most


def burst(view: placement.View, sizes: list[int], new_cards: int, salt: str = "") -> dict[int, list[int]]:
    """Each pod decided on the view as it stands, then counted as waiting on its card (as the live view does)."""
    waiting: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):
        current = view.with_waiting({k: tuple(v) for k, v in waiting.items()})
        choice = placement.choose(current, placement.Ask(size), "binpack", draws.Draw(f"uid-{salt}{i}"), None,
                                  new_cards, CAPACITY)
        assert not choice.fits
        waiting.setdefault(choice.card, []).append(size)
    return waiting


@pytest.mark.parametrize("sizes", [
    [75] * 4 + [50] * 6 + [25] * 12,  # the autoscaling tier's burst: 900 shares, two 8-card nodes
    [25] * 33,  # one past a node's worth of quarters
    [60] * 9 + [40] * 9,  # pairs that fill a card exactly
    [10, 20, 25, 33, 50, 60, 75, 100] * 3,
])
def test_a_burst_from_zero_waits_on_the_indexes_a_packing_needs(sizes):
    waiting = burst(placement.View(()), sorted(sizes, reverse=True), 8)
    assert new_nodes(waiting) == packing_needs(sizes, 8)
    assert set(waiting) <= set(range(8))


@hsettings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([10, 20, 25, 30, 33, 40, 50, 60, 70, 75, 100]), min_size=1, max_size=40),
       st.integers(2, 8), st.text(max_size=4))
def test_a_burst_in_decreasing_order_never_needs_more_new_nodes_than_a_packing(sizes, cards, salt):
    # Whatever each request's uid draws among the indexes that tie.
    waiting = burst(placement.View(()), sorted(sizes, reverse=True), cards, salt)
    assert new_nodes(waiting) <= packing_needs(sizes, cards)


def test_without_new_node_cards_every_pod_waits_on_card_0_from_zero():
    waiting = burst(placement.View(()), [25] * 12, 0)
    assert waiting == {0: [25] * 12}
    assert new_nodes(waiting) == 3  # where one node holds them


def test_with_nobody_waiting_the_draw_spreads_over_every_index():
    seen = {placement.choose(placement.View(()), placement.Ask(25), "binpack", draws.Draw(f"u{i}"), None, 8,
                             CAPACITY).card for i in range(200)}
    assert seen == set(range(8))


def test_a_full_pool_waits_on_an_index_every_node_and_a_new_node_have_open():
    one = frozenset({1})
    view = placement.View((full_node("big", 8, cordoned=one), full_node("small", 4, cordoned=one)))
    rng = random.Random(7)
    seen = {placement.choose(view, placement.Ask(50), "binpack", rng, None, 8, CAPACITY).card for _ in range(200)}
    assert seen == {0, 2, 3}
    # A new node of 2 cards: only what it has.
    assert {placement.choose(view, placement.Ask(50), "binpack", rng, None, 2, CAPACITY).card
            for _ in range(50)} == {0}


def test_without_new_node_cards_the_index_is_drawn_among_the_nodes_indexes_as_before():
    view = placement.View((full_node("big", 8), full_node("small", 4)))
    rng = random.Random(3)
    assert {placement.choose(view, placement.Ask(50), "binpack", rng).card for _ in range(400)} == set(range(8))


def test_a_pinned_pod_keeps_its_pin():
    choice = placement.choose(placement.View(()), placement.Ask(25, pin=5), "binpack", draws.Draw("u"), None, 8,
                              CAPACITY)
    assert choice.card == 5 and not choice.fits


def test_new_node_cards_is_read_and_a_bad_value_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\npolicy: {newNodeCards: 8}\n")
    assert settings.load(str(path)).policy.new_node_cards == 8
    for bad in ("-1", "65", "eight", "true", "2.5"):
        path.write_text(f"version: v1\npolicy: {{newNodeCards: {bad}}}\n")
        with pytest.raises(settings.SettingsError, match="policy.newNodeCards"):
            settings.load(str(path))


# --- memory asks (policy.newNodeCardMemoryMiB) --------------------------------------------------------------

POOL = policy_mod.Policy(new_node_cards=8, new_node_card_memory_mib=H100[1])


def test_from_zero_a_memory_ask_is_sized_for_a_new_node_s_card():
    pod = podmaker.pod(memory_container(ask="20Gi"))
    decision = decide(pod, placement.View(()), POOL, seed="from-zero")
    out = admitted(pod, decision)
    assert decision.shares == 26  # ceil(20480 x 100 / 81559)
    assert decision.card_memory_mib == H100[1] and 0 <= decision.card < 8
    assert [x.rule for x in decision.findings] == [f.NO_MATCHING_NODE, f.MEMORY_SIZED]
    assert "of the 8 cards of a node the autoscaler adds" in decision.findings[0].message
    assert required_terms(out)[0]["matchExpressions"] == [
        {"key": names.card_memory_label(decision.card), "operator": "In", "values": [str(H100[1])]}]
    assert out["spec"]["containers"][0]["resources"]["limits"][f"gpushard.io/card-{decision.card}"] == "26"


def test_a_burst_of_memory_asks_from_zero_packs_as_fractions_do():
    view, waiting = placement.View(()), {}
    for i in range(16):  # 16 pods of 40Gi: 51 shares each, one per card of two new 8-card nodes
        decision = decide(podmaker.pod(memory_container(ask="40Gi")),
                          view.with_waiting({k: tuple(v) for k, v in waiting.items()}), POOL, seed=f"m{i}")
        assert decision.allowed and decision.shares == 51
        waiting.setdefault(decision.card, []).append(decision.shares)
    assert new_nodes(waiting) == 2 == packing_needs([51] * 16, 8)


def test_an_ask_above_a_new_node_s_card_is_denied_naming_it():
    decision = decide(podmaker.pod(memory_container(ask="100Gi")), placement.View(()), POOL)
    assert not decision.allowed
    assert decision.message == ("gpushard: the pod asks 102400 MiB of GPU memory, more than the largest card holds "
                                "(a card of the nodes the autoscaler adds, 81559 MiB); ask at most 81559Mi")


def test_a_card_with_room_now_still_wins():
    view = placement.View((node("h", [H100] * 2, {0: 100}),))
    decision = decide(podmaker.pod(memory_container(ask="20Gi")), view, POOL, seed="s")
    assert (decision.node, decision.card, decision.findings[0].rule) == ("h", 1, f.MEMORY_SIZED)
    full = placement.View((node("h", [H100] * 2, {0: 100, 1: 100}),))
    waits = decide(podmaker.pod(memory_container(ask="20Gi")), full, POOL, seed="s")
    assert waits.allowed and waits.node is None and waits.card in (0, 1)  # an index node h has too
    assert waits.findings[0].rule == f.NO_ROOM


@pytest.mark.parametrize("policy", [policy_mod.Policy(new_node_cards=8),
                                    policy_mod.Policy(new_node_cards=8, new_node_card_memory_mib=H100[1],
                                                      backend=policy_mod.DRA)], ids=["no-size", "dra"])
def test_without_the_size_or_under_dra_a_memory_ask_from_zero_is_denied(policy):
    decision = decide(podmaker.pod(memory_container(ask="20Gi")), placement.View(()), policy)
    assert not decision.allowed and "no shared node publishes its cards' memory" in decision.message


def test_new_node_card_memory_is_read_and_a_bad_value_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\npolicy: {newNodeCards: 8, newNodeCardMemoryMiB: 81559}\n")
    assert settings.load(str(path)).policy.new_node_card_memory_mib == 81559
    for bad in ("newNodeCards: 8, newNodeCardMemoryMiB: -1", "newNodeCards: 8, newNodeCardMemoryMiB: 80Gi",
                "newNodeCards: 8, newNodeCardMemoryMiB: 2000000", "newNodeCardMemoryMiB: 81559"):
        path.write_text(f"version: v1\npolicy: {{{bad}}}\n")
        with pytest.raises(settings.SettingsError, match="policy.newNodeCardMemoryMiB"):
            settings.load(str(path))
