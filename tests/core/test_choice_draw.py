"""We test the randomized card choice that keeps choosers with lagging views from colliding:
- without a random source the choice is the best card, as before;
- with one, every draw fits, lies within CHOICE_SLACK of the best card's free shares, keeps a pin
  and the pod's scheduling rules, and the draws spread over the equally good cards;
- the same seed gives the same card (deterministic tests, idempotent retries);
- a card further than the slack from the best is never drawn, so packing holds;
- no view, no matching node: the same answers as without a random source; nothing fits: the
  card index the pod waits on is drawn among the indexes of the nodes it may run on, with the
  same warning (without a random source: the most free card's index, as before);
- admission seeds the draw with the request's uid: a dry run draws from its own seed and leaves
  no trace on later choices.
"""

import random

from webhook.core import decisions, names
from webhook.core import placement as pl
from webhook.core.policy import Policy


def node(name, *used, labels=None):
    return pl.Node(name, labels or {}, cards=tuple(pl.Card(k, 100, u) for k, u in enumerate(used)))


# For 25 shares: card 3 of the n nodes is the tightest fit (28 free), card 0 of every node is
# within the slack (30 free), cards 1 and 2 are looser.
VIEW = pl.View(nodes=tuple(node(f"n{i}", 70, 20, 10, 72) for i in range(4)) +
               tuple(node(f"m{i}", 70, 0, labels={"pool": "m"}) for i in range(4)))


def draws(view, ask, count=400, strategy="binpack"):
    return [pl.choose(view, ask, strategy, random.Random(i)) for i in range(count)]


def test_without_a_random_source_the_best_card_wins():
    got = pl.choose(VIEW, pl.Ask(shares=25))
    assert (got.node, got.card, got.fits) == ("n0", 3, True)


def test_draws_fit_stay_within_the_slack_and_spread_over_equal_cards():
    seen = set()
    for got in draws(VIEW, pl.Ask(shares=25)):
        assert got.fits
        card = next(c for n in VIEW.nodes if n.name == got.node for c in n.cards if c.index == got.card)
        assert card.free >= 25
        assert card.free - 28 <= pl.CHOICE_SLACK  # 28 free on card 3 of n*: the tightest fit
        seen.add((got.node, got.card))
    # The tightest (28 free, card 3 of every n node) and those within the slack (30 free, card 0).
    assert seen == {(f"n{i}", 3) for i in range(4)} | {(f"n{i}", 0) for i in range(4)} | \
        {(f"m{i}", 0) for i in range(4)}


def test_a_card_beyond_the_slack_is_never_drawn():
    view = pl.View(nodes=(node("a", 60), node("b", 50), node("c", 0)))
    assert {(g.node, g.card) for g in draws(view, pl.Ask(shares=40), 200)} == {("a", 0)}


def test_spread_draws_among_the_emptiest():
    view = pl.View(nodes=(node("a", 0, 3), node("b", 2), node("c", 50)))
    got = {(g.node, g.card) for g in draws(view, pl.Ask(shares=10), 200, "spread")}
    assert got == {("a", 0), ("a", 1), ("b", 0)}


def test_the_same_seed_gives_the_same_card():
    first = pl.choose(VIEW, pl.Ask(shares=25), "binpack", random.Random("uid-1"))
    for _ in range(5):
        assert pl.choose(VIEW, pl.Ask(shares=25), "binpack", random.Random("uid-1")) == first


def test_pins_and_scheduling_rules_hold_in_every_draw():
    for got in draws(VIEW, pl.Ask(shares=25, pin=1), 100):
        assert got.card == 1 and got.fits
    only_m = pl.Ask(shares=25, node_selector={"pool": "m"})
    assert {g.node for g in draws(VIEW, only_m, 100)} <= {f"m{i}" for i in range(4)}


def test_no_match_no_view_answer_as_before():
    full = pl.View(nodes=(node("a", 95, 90),))
    ask = pl.Ask(shares=5, node_selector={"x": "y"})
    assert pl.choose(full, ask, "binpack", random.Random(3)) == pl.choose(full, ask)
    assert pl.choose(None, pl.Ask(shares=5), "binpack", random.Random(3)) == pl.choose(None, pl.Ask(shares=5))


def test_a_pod_that_fits_nowhere_waits_on_a_drawn_index_of_the_nodes_it_may_run_on():
    # Without a random source, the most free card's index, as before; with one, waiting pods spread
    # over the indexes, so that room freed on any index finds a pod waiting for it.
    full = pl.View(nodes=(node("a", 95, 90, labels={"pool": "a"}), node("b", 99, 99, 99, labels={"pool": "b"})))
    assert pl.choose(full, pl.Ask(shares=50)).card == 1
    got = draws(full, pl.Ask(shares=50), 200)
    assert {g.card for g in got} == {0, 1, 2}
    assert all(not g.fits and g.node is None and [x.rule for x in g.findings] == ["no-room"] for g in got)
    assert all(f"card {g.card} chosen" in g.findings[0].message for g in got)
    assert {g.card for g in draws(full, pl.Ask(shares=50, node_selector={"pool": "x"}), 50)} == {0}  # no match
    only_a = {g.card for g in draws(full, pl.Ask(shares=50, node_selector={"pool": "a"}), 200)}
    assert only_a == {0, 1}  # node a has no card 2
    assert {g.card for g in draws(full, pl.Ask(shares=50, pin=1), 50)} == {1}
    assert pl.choose(full, pl.Ask(shares=50), "binpack", random.Random("u")) == \
        pl.choose(full, pl.Ask(shares=50), "binpack", random.Random("u"))


def pod():
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "c", "image": "i",
                                     "resources": {"limits": {names.FRACTION_RESOURCE: "0.25"}}}]}}


def test_admission_seeds_the_draw_with_the_request_uid():
    policy = Policy()
    cards = {}
    for i in range(60):
        d = decisions.decide(decisions.Request(pod(), "Pod", seed=f"uid-{i}"), policy, VIEW)
        cards[f"uid-{i}"] = (d.node, d.card)
        again = decisions.decide(decisions.Request(pod(), "Pod", seed=f"uid-{i}"), policy, VIEW)
        assert (again.node, again.card) == cards[f"uid-{i}"]
    assert len(set(cards.values())) > 4
    # No seed (gpushard review, offline): the best card, as before.
    d = decisions.decide(decisions.Request(pod(), "Pod"), policy, VIEW)
    assert (d.node, d.card) == ("n0", 3)
