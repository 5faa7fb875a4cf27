"""A cordoned card in the pure core: how a Node says it, and what placement and re-placement make of it.

We test:
- the annotation gpushard.io/card-<k>.cordoned, one per card: its key round-trips through names,
  other keys (card-01, the memory label) are no cordon, its JSON value gives reason, who and when,
  and any other value still cordons the card (its text the reason); node_cards reads it;
- a cordoned card has no room for new pods (free 0, or less when over-held) while its capacity and
  the shares its pods hold stay as they are;
- the choice never picks a cordoned card, drawn or best, binpack or spread, even when it is the only
  card with room, and counts its pods as before; the next best card is chosen instead;
- a pod pinned to a card cordoned on every node it may run on is admitted with a no-room warning
  that names the cordon; pinned to a card open on another node, it goes there;
- a pod that fits nowhere never waits on an index cordoned on every node it may run on (drawn or
  not), and with every index cordoned still gets one;
- a memory ask is never sized onto a cordoned card;
- views derived by replace_nodes and replace_card (a cordon added, lifted, a node added or removed,
  shares moving) choose as a view built from scratch, on random views with cordoned cards;
- re-placement never moves a pod onto a cordoned card, and moves a pod waiting on a cordoned card
  elsewhere when its owner recreates it.
"""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from webhook.core import findings as f
from webhook.core import names, objects, replacement
from webhook.core import placement as pl
from webhook.core.policy import Policy


def node(name, *cards, labels=None):
    """cards: (used, cordoned) pairs, or just used."""
    made = []
    for k, card in enumerate(cards):
        used, cordoned = card if isinstance(card, tuple) else (card, False)
        made.append(pl.Card(k, 100, used, cordoned=cordoned))
    return pl.Node(name, labels or {}, cards=tuple(made))


# --- the annotation ------------------------------------------------------------------------------

def test_one_annotation_per_card_and_only_exact_keys_count():
    assert names.card_cordon_annotation(3) == "gpushard.io/card-3.cordoned"
    assert names.card_cordon_index("gpushard.io/card-3.cordoned") == 3
    for key in ("gpushard.io/card-03.cordoned", "gpushard.io/card-.cordoned", "gpushard.io/card-3.memory-mib",
                "gpushard.io/card-x.cordoned", "example.com/card-3.cordoned", "gpushard.io/card-3"):
        assert names.card_cordon_index(key) is None, key
    assert names.card_memory_index("gpushard.io/card-3.cordoned") is None


def test_the_value_says_why_who_and_when_and_any_value_cordons():
    written = objects.write_cordon(objects.Cordon("fan replaced", "alice", "2026-03-01T10:00:00Z"))
    assert json.loads(written) == {"reason": "fan replaced", "by": "alice", "at": "2026-03-01T10:00:00Z"}
    annotations = {"gpushard.io/card-1.cordoned": written, "gpushard.io/card-3.cordoned": "  reseating  ",
                   "gpushard.io/card-4.cordoned": "", "gpushard.io/card-5.cordoned": '{"reason": 7}',
                   "gpushard.io/card-6.cordoned": "{broken", "other": "x"}
    cordons = objects.read_cordons(annotations)
    assert list(cordons) == [1, 3, 4, 5, 6]
    assert cordons[1] == objects.Cordon("fan replaced", "alice", "2026-03-01T10:00:00Z")
    assert cordons[1].said() == "by alice at 2026-03-01T10:00:00Z: fan replaced"
    assert cordons[3] == objects.Cordon("reseating") and cordons[3].said() == "reseating"
    assert cordons[4].said() == "no reason given" and cordons[5] == objects.Cordon()
    assert cordons[6].reason == "{broken"
    assert objects.read_cordons(None) == {} and objects.read_cordons(["x"]) == {}


def test_node_cards_reads_the_cordons():
    node_obj = {"metadata": {"name": "gpu-a", "annotations": {
        names.card_cordon_annotation(1): objects.write_cordon(objects.Cordon("xid 79", "bob"))}},
        "status": {"allocatable": {"gpushard.io/card-0": "100", "gpushard.io/card-1": "100"}}}
    cards = objects.node_cards(node_obj, Policy())
    assert cards.cordoned == {1: objects.Cordon("xid 79", "bob")}
    assert cards.cards == {0: 100, 1: 100}  # capacity as the node says it


# --- the card and the choice ---------------------------------------------------------------------

def test_a_cordoned_card_has_no_room_but_keeps_capacity_and_holders():
    card = pl.Card(1, 100, 30, cordoned=True)
    assert (card.capacity, card.used, card.free) == (100, 30, 0)
    assert pl.Card(1, 0, 30, cordoned=True).free == -30  # over-held stays visible
    moved = card.with_used(45)
    assert moved.cordoned and moved.used == 45 and moved.free == 0
    assert moved == pl.Card(1, 100, 45, cordoned=True) != pl.Card(1, 100, 45)


def test_the_choice_never_picks_a_cordoned_card_and_counts_its_pods():
    # Card 1 of a has the most room and would win spread, card 0 of b is the tightest fit for binpack.
    view = pl.View(nodes=(node("a", 90, (0, True)), node("b", (75, True), 40)))
    for strategy in ("binpack", "spread"):
        got = pl.choose(view, pl.Ask(shares=20), strategy)
        assert got.fits and (got.node, got.card) == ("b", 1), strategy
        for i in range(100):
            drawn = pl.choose(view, pl.Ask(shares=20), strategy, random.Random(i))
            assert (drawn.node, drawn.card) == ("b", 1)
    # Its pods still hold their shares: card 0 of b counts 75 used, in the view's cards as before.
    assert [c.used for c in view.nodes[1].cards] == [75, 40]
    # The only card with room is cordoned: nothing fits.
    only = pl.View(nodes=(node("a", 100, (0, True)),))
    got = pl.choose(only, pl.Ask(shares=10))
    assert not got.fits and [x.rule for x in got.findings] == [f.NO_ROOM]


def test_a_pin_to_a_card_cordoned_everywhere_is_admitted_with_a_warning_that_says_so():
    view = pl.View(nodes=(node("a", 0, (0, True)), node("b", 0, (0, True))))
    for rng in (None, random.Random(1)):
        got = pl.choose(view, pl.Ask(shares=10, pin=1), "binpack", rng)
        assert (got.card, got.fits, got.node) == (1, False, None)
        (finding,) = got.findings
        assert finding.rule == f.NO_ROOM and finding.severity == f.WARN
        assert finding.message.startswith("gpushard: card 1 is cordoned on every node the pod may run on")
        assert "uncordoned" in finding.message and len(finding.message) < 120
    # Open on a node of the pool: it goes there.
    view = pl.View(nodes=(node("a", 0, (0, True)), node("b", 0, 0)))
    got = pl.choose(view, pl.Ask(shares=10, pin=1))
    assert (got.node, got.card, got.fits) == ("b", 1, True)
    # Open but full there: the usual no-room warning, not the cordon's.
    view = pl.View(nodes=(node("a", 0, (0, True)), node("b", 0, 100)))
    got = pl.choose(view, pl.Ask(shares=10, pin=1))
    assert not got.fits and "cordoned" not in got.findings[0].message


def test_a_pod_that_fits_nowhere_waits_on_an_index_open_somewhere():
    # Every card is full; card 2 is cordoned on both nodes, card 1 on one of them.
    view = pl.View(nodes=(node("a", 100, (100, True), (0, True)), node("b", 100, 100, (0, True))))
    drawn = {pl.choose(view, pl.Ask(shares=10), "binpack", random.Random(i)).card for i in range(200)}
    assert drawn == {0, 1}
    # Without a draw, the most free card's index (card 2, 100 free on paper) is cordoned everywhere.
    got = pl.choose(view, pl.Ask(shares=10))
    assert not got.fits and got.card == 0
    # Everything cordoned: an index all the same, and the pod waits.
    closed = pl.View(nodes=(node("a", (0, True), (0, True)),))
    assert pl.choose(closed, pl.Ask(shares=10), "binpack", random.Random(3)).card in (0, 1)


def test_a_memory_ask_is_never_sized_onto_a_cordoned_card():
    labels = {names.card_memory_label(0): "23034", names.card_memory_label(1): "23034"}
    view = pl.View(nodes=(pl.Node("a", labels, cards=(pl.Card(0, 100, 0, cordoned=True), pl.Card(1, 100, 90))),))
    got = pl.choose_sized(view, pl.Ask(shares=0), lambda mib: 54, 100)
    assert not got.fits and got.card == 1  # waits on the open card, never the cordoned one
    view = pl.View(nodes=(pl.Node("a", labels, cards=(pl.Card(0, 100, 0, cordoned=True), pl.Card(1, 100, 0))),))
    got = pl.choose_sized(view, pl.Ask(shares=0), lambda mib: 54, 100)
    assert got.fits and got.card == 1


# --- derived views ---------------------------------------------------------------------------------

@st.composite
def cordoned_nodes(draw, name):
    cards = tuple(pl.Card(k, draw(st.sampled_from([0, 100])), draw(st.integers(0, 100)), cordoned=draw(st.booleans()))
                  for k in draw(st.lists(st.integers(0, 3), unique=True, max_size=3)))
    return pl.Node(name, {"pool": draw(st.sampled_from(["a", "b"]))}, cards=cards)


def answers(view, asks):
    out = []
    for ask in asks:
        for rng in (None, random.Random(7)):
            got = pl.choose(view, ask, "binpack", rng)
            out.append((got.card, got.node, got.fits, tuple(x.message for x in got.findings)))
    return out


ASKS = [pl.Ask(shares=s, pin=p, node_selector=sel) for s in (1, 30, 100) for p in (None, 0, 2)
        for sel in ({}, {"pool": "a"})]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True).flatmap(
    lambda ids: st.tuples(*[cordoned_nodes(f"n{i}") for i in ids])),
    st.lists(st.tuples(st.integers(0, 7), cordoned_nodes("x") | st.none()), max_size=4))
def test_derived_views_choose_as_a_view_built_anew(start, changes):
    view = pl.View(nodes=start)
    answers(view, ASKS)  # builds and caches every index, which the derived views carry
    for pos, replacement_node in changes:
        names_now = [n.name for n in view.nodes]
        name = names_now[pos % len(names_now)] if names_now and pos < 6 else f"new{pos}"
        if replacement_node is not None:
            replacement_node = pl.Node(name, replacement_node.labels, cards=replacement_node.cards)
        view = pl.replace_nodes(view, {name: replacement_node})
        assert answers(view, ASKS) == answers(pl.View(nodes=view.nodes), ASKS)


def test_a_remembered_choice_keeps_the_cordons_of_its_view():
    view = pl.View(nodes=(node("a", 0, (0, True)), node("b", 50, 0)))
    pl.choose(view, pl.Ask(shares=10, pin=1))  # caches the cordons
    moved = pl.replace_card(view, view.nodes[1].with_card(0, view.nodes[1].cards[0].with_used(60)), 0)
    assert answers(moved, ASKS) == answers(pl.View(nodes=moved.nodes), ASKS)
    lifted = pl.replace_nodes(moved, {"a": node("a", 0, 0)})
    got = pl.choose(lifted, pl.Ask(shares=10, pin=1))
    assert got.fits and answers(lifted, ASKS) == answers(pl.View(nodes=lifted.nodes), ASKS)


# --- re-placement ----------------------------------------------------------------------------------

def waiting(name, card, shares, owner="ReplicaSet"):
    return replacement.Waiting(uid=f"uid-{name}", namespace="ml", name=name, card=card, shares=shares, age=600,
                               owner_kind=owner, owner_name="web")


def test_re_placement_never_moves_a_pod_onto_a_cordoned_card():
    # Card 0 is full everywhere; the only room is card 1 of a, cordoned.
    view = pl.View(nodes=(node("a", 100, (0, True)), node("b", 100, 100)))
    owners = {"uid-p": replacement.Owner("ReplicaSet", "web")}
    out = replacement.plan(view, [waiting("p", 0, 30)], 0, owners)
    assert out.moves == [] and out.waiting_for_room == 1
    # Room on an open card too: it goes there, never to the cordoned one.
    view = pl.View(nodes=(node("a", 100, (0, True)), node("b", 100, 60)))
    out = replacement.plan(view, [waiting("p", 0, 30)], 0, owners)
    assert [(m.to_node, m.to_card) for m in out.moves] == [("b", 1)]


def test_a_pod_waiting_on_a_cordoned_card_is_moved_where_another_has_room():
    view = pl.View(nodes=(node("a", (0, True), 20),))
    owners = {"uid-p": replacement.Owner("ReplicaSet", "web")}
    out = replacement.plan(view, [waiting("p", 0, 30)], 0, owners)
    assert [(m.pod.name, m.to_node, m.to_card) for m in out.moves] == [("p", "a", 1)]
