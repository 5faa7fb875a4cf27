"""Where a pod that fits nowhere waits when pods have priorities: on a card where the scheduler may preempt.

The stock scheduler preempts pods of a lower priority than the pending pod's, on a node where that frees
enough of what it asks; gpushard pins the pod to one card index, so the index decides whether preemption
can help it. We test, on views whose bound pods have priorities (``View.priorities``):
- a high-priority pod waits on the card held by lower-priority pods, never on one held by pods of its own
  priority or above, for every seed; the card needing the fewest shares preempted wins;
- pods of priority 0 count as lower than a positive priority, and a negative priority as lower than 0;
- a cordoned card, or one too small for the pod, is never chosen for preemption;
- with no priorities at all (every pod 0), or no card where preemption frees enough, the pod waits as before;
- a pinned pod keeps its pin; the pod's priority comes from spec.priority (as the Priority admission set it).
The live view's side is in tests/cluster/test_priorities.py.
"""

from __future__ import annotations

from tests.core import podmaker
from webhook.core import decisions, draws, placement
from webhook.core import findings as f
from webhook.core.policy import Policy
from webhook.core.scheduling import Card, Node

HIGH, LOW = 1000, 0


def node(name: str, used: dict[int, int], cordoned: frozenset = frozenset(), capacity: int = 100) -> Node:
    return Node(name, {"kubernetes.io/hostname": name}, (), True, False,
                tuple(Card(k, capacity, u, f"GPU-{name}-{k}", "H100", 81559, k in cordoned)
                      for k, u in sorted(used.items())))


def choose(view: placement.View, shares: int, priority: int, seed: str = "s", pin: int | None = None):
    return placement.choose(view, placement.Ask(shares, pin, priority=priority), "binpack", draws.Draw(seed))


# Two full nodes: card 0 of each held by high-priority pods, card 1 by pods of priority 0.
FULL = placement.View((node("a", {0: 100, 1: 100}), node("b", {0: 100, 1: 100}))).with_priorities(
    {("a", 0): ((HIGH, 100),), ("b", 0): ((HIGH, 100),)})


def test_a_high_priority_pod_waits_where_lower_priority_pods_hold_the_card():
    for seed in range(50):
        choice = choose(FULL, 50, HIGH // 2, seed=f"u{seed}")
        assert choice.card == 1 and not choice.fits
        assert choice.findings[0].rule == f.NO_ROOM and "preempt" in choice.findings[0].message
    # Of its own priority: nothing on card 0 may go, and card 1's pods of priority 0 may.
    assert {choose(FULL, 50, HIGH, seed=f"v{s}").card for s in range(50)} == {1}


def test_the_floor_is_the_lowest_priority_holding_shares():
    assert FULL.priority_floor == 0  # card 1's pods have priority 0
    every = placement.View((node("a", {0: 100}),)).with_priorities({("a", 0): ((HIGH, 100),)})
    assert every.priority_floor == HIGH
    assert every.with_priorities(every.priorities, 7).priority_floor == 7  # as the live view says it


def test_the_card_needing_the_fewest_shares_preempted_wins():
    view = placement.View((node("a", {0: 90, 1: 70, 2: 100}),)).with_priorities({("a", 2): ((HIGH, 100),)})
    assert choose(view, 50, 10).card == 1  # 20 to preempt on card 1, 40 on card 0, card 2 not at all


def test_priority_zero_and_negative_priorities():
    view = placement.View((node("a", {0: 100, 1: 100}),)).with_priorities({("a", 1): ((-5, 60), (HIGH, 40))})
    # A pod of priority 0 may preempt only the pods of priority -5: 60 shares on card 1.
    assert choose(view, 50, 0).card == 1
    assert "preempt" not in choose(view, 70, 0).findings[0].message  # 60 is not enough: it waits as before
    # A positive priority may preempt card 0's pods of priority 0 (the card's use the pairs leave).
    assert choose(view, 100, 1).card == 0


def test_cordoned_or_small_cards_are_not_chosen_for_preemption():
    view = placement.View((node("a", {0: 100, 1: 100}, cordoned=frozenset({1})),)).with_priorities(
        {("a", 0): ((HIGH, 100),)})
    choice = choose(view, 50, 5)
    assert "preempt" not in choice.findings[0].message
    small = placement.View((node("s", {0: 10}, capacity=10),)).with_priorities({("s", 0): ((-1, 10),)})
    assert "preempt" not in choose(small, 50, 0).findings[0].message


def test_without_priorities_or_room_the_pod_waits_as_before():
    plain = placement.View((node("a", {0: 100, 1: 100}), node("b", {0: 100, 1: 100})))
    assert {choose(plain, 50, HIGH, seed=f"w{s}").card for s in range(60)} == {0, 1}
    assert all("preempt" not in choose(plain, 50, HIGH, seed=f"w{s}").findings[0].message for s in range(10))
    nothing_lower = plain.with_priorities({(n, k): ((HIGH, 100),) for n in "ab" for k in (0, 1)})
    assert "preempt" not in choose(nothing_lower, 50, HIGH).findings[0].message


def test_a_pinned_pod_keeps_its_pin():
    assert choose(FULL, 50, HIGH // 2, pin=0).card == 0


def test_the_pod_s_priority_is_read_from_its_spec():
    spec = {**podmaker.pod(podmaker.container("main", "0.5"))["spec"], "priority": HIGH // 2}
    assert placement.ask_from_spec(spec, 0, None).priority == HIGH // 2
    assert placement.ask_from_spec({"containers": []}, 0, None).priority == 0
    pod = podmaker.pod(podmaker.container("main", "0.5"))
    pod["spec"]["priority"] = HIGH // 2
    decision = decisions.decide(decisions.Request(pod, "Pod", seed="x"), Policy(), FULL)
    assert decision.allowed and decision.card == 1
