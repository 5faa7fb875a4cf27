"""Recent choices counted until the view can see their pods, in the live and the static view.

We test:
- a burst of 50 pods decided back to back (decide, then remember, as the admission server does)
  on a live view with little room: every pod that got a node fits on its card, none is left
  without a node while the view still had room for it, and no card goes over capacity;
- the pods of the burst, created unbound and then bound, are counted exactly once throughout;
- a remembered choice expires after its time to live; an unbound pod keeps its entry until
  it binds, also on another node than the one chosen;
- an unbound pod that carries gpushard's preferred affinity term counts on that node;
- with the default time to live, a choice no pod takes over (a forged review) stops counting within
  seconds while the pods watch streams, and a real pod whose watch event lags a few seconds still
  takes its choice over and counts from then on; while the pods watch is down choices are held
  (no pod could show), up to the longer time to live;
- with newNodeCards, a pod that fits nowhere counts as waiting on its card index (``View.waiting``) from its
  remembered choice until it binds; without it nothing is counted so;
- the static view: the same burst, and expiry; a remembered choice changes its card alone (cards
  listed out of order), and the view's indexes then choose as indexes built afresh do; choices
  that expire one or two at a time, or many at once, leave the shares and the choices of a view
  built afresh.
"""

from __future__ import annotations

import collections
import copy
import json

from tests.admission import objects as admission_objects
from tests.cluster import kubeobjects as o
from webhook import settings
from webhook.admission import app as app_mod
from webhook.cluster import static
from webhook.core import decisions, placement
from webhook.core.policy import Policy

CAPACITY = 100
INITIAL = {("gpu-a", 0): 60, ("gpu-a", 1): 30, ("gpu-b", 0): 85, ("gpu-b", 1): 0, ("gpu-c", 0): 90,
           ("gpu-c", 1): 50}
SIZES = ["0.1", "0.25", "0.2", "0.15", "0.33", "0.05"]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _user_pod(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"burst-{i}", "namespace": "default"},
            "spec": {"containers": [{"name": "main", "image": "cuda", "resources": {
                "limits": {"nvidia.com/gpu": SIZES[i % len(SIZES)]}}}]}}


def _burst(view, count: int = 50) -> list[decisions.Decision]:
    """Decide pods back to back as the admission server does, checking each against a ledger."""
    ledger = collections.Counter(INITIAL)
    out = []
    for i in range(count):
        decision = decisions.decide(decisions.Request(_user_pod(i), "Pod"), Policy(), view.snapshot())
        assert decision.allowed and decision.shares > 0
        room = {key for key, held in ledger.items() if CAPACITY - held >= decision.shares}
        if decision.node is None:
            assert not room, f"pod {i} found no room while {sorted(room)} had {decision.shares} free shares"
        else:
            key = (decision.node, decision.card)
            assert key in room, f"pod {i} chose {key}, which has no room for {decision.shares}"
            ledger[key] += decision.shares
            view.remember(decision.node, decision.card, decision.shares)
        out.append(decision)
    assert all(held <= CAPACITY for held in ledger.values())
    return out


def _ledger(found: list[decisions.Decision]) -> collections.Counter:
    ledger = collections.Counter(INITIAL)
    for d in found:
        if d.node is not None:
            ledger[(d.node, d.card)] += d.shares
    return ledger


def _used(view) -> dict:
    return {(n.name, c.index): c.used for n in view.nodes for c in n.cards}


def _seed(fake):
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        fake.put("nodes", o.node(name, {0: CAPACITY, 1: CAPACITY}))
    for (name, card), shares in INITIAL.items():
        if shares:
            fake.put("pods", o.pod(f"old-{name}-{card}", card, shares, name))


def test_a_burst_on_the_live_view_fits_and_is_counted_once(fake, start_view):
    _seed(fake)
    fake.put("nodes", o.node("sentinel", {0: CAPACITY}, taints=[{"key": "x", "effect": "NoSchedule"}]))
    view = start_view()
    o.wait_for(lambda: view.snapshot() and _used(view.snapshot()) == {**INITIAL, ("sentinel", 0): 0},
               what="the initial usage")

    found = _burst(view)
    placed = [d for d in found if d.node is not None]
    assert 10 <= len(placed) < 50  # the view fills up: both outcomes happen
    want = {**_ledger(found), ("sentinel", 0): 0}
    assert _used(view.snapshot()) == want

    # The API server stores the pods unbound; their entries keep counting where they were chosen.
    for i, d in enumerate(found):
        if d.node is not None:
            obj = copy.deepcopy(d.obj)
            obj["metadata"]["uid"] = f"uid-burst-{i}"
            obj["status"] = {"phase": "Pending"}
            fake.put("pods", obj)
    fake.put("pods", o.pod("sentinel-1", 0, 1, "sentinel"))
    o.wait_for(lambda: _used(view.snapshot())[("sentinel", 0)] == 1, what="the unbound pods")
    want[("sentinel", 0)] = 1
    assert _used(view.snapshot()) == want

    # The scheduler binds them where the choice pointed: still counted once.
    for i, d in enumerate(found):
        if d.node is not None:
            obj = copy.deepcopy(d.obj)
            obj["metadata"]["uid"] = f"uid-burst-{i}"
            obj["spec"]["nodeName"] = d.node
            obj["status"] = {"phase": "Running"}
            fake.put("pods", obj)
    fake.put("pods", o.pod("sentinel-2", 0, 1, "sentinel"))
    o.wait_for(lambda: _used(view.snapshot())[("sentinel", 0)] == 2, what="the bound pods")
    want[("sentinel", 0)] = 2
    assert _used(view.snapshot()) == want


def test_remembered_choices_expire_and_unbound_pods_keep_theirs(fake, start_view):
    clock = Clock()
    fake.put("nodes", o.node("gpu-a", {0: CAPACITY}))
    fake.put("nodes", o.node("gpu-b", {0: CAPACITY}))
    view = start_view(clock=clock, remember_ttl=30)
    o.wait_for(view.snapshot, what="the first sync")

    view.remember("gpu-a", 0, 40)
    view.remember(None, 0, 10)  # no node chosen: nothing to count
    assert o.used(view.snapshot(), "gpu-a", 0) == 40
    clock.now += 31
    assert o.used(view.snapshot(), "gpu-a", 0) == 0

    # Seen unbound, the pod keeps the entry; bound elsewhere, it counts where it runs.
    view.remember("gpu-a", 0, 25)
    fake.put("pods", o.pod("p1", 0, 25))
    fake.put("pods", o.pod("mark-1", 0, 1, "gpu-b"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-b", 0) == 1, what="the unbound pod")
    assert o.used(view.snapshot(), "gpu-a", 0) == 25
    fake.put("pods", o.pod("p1", 0, 25, "gpu-b"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-b", 0) == 26, what="the pod bound on gpu-b")
    assert o.used(view.snapshot(), "gpu-a", 0) == 0

    # A pod that shows up bound at once accounts for the choice made for it.
    view.remember("gpu-a", 0, 15)
    fake.put("pods", o.pod("p2", 0, 15, "gpu-a"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 15, what="the bound pod")
    fake.put("pods", o.pod("mark-2", 0, 1, "gpu-b"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-b", 0) == 27, what="a later event")
    assert o.used(view.snapshot(), "gpu-a", 0) == 15
    clock.now += 31
    assert o.used(view.snapshot(), "gpu-a", 0) == 15


def _streaming(fake, start_view, clock):
    fake.put("nodes", o.node("gpu-a", {0: CAPACITY}))
    fake.put("nodes", o.node("gpu-b", {0: CAPACITY}))
    view = start_view(clock=clock)  # the default times to live
    o.wait_for(lambda: view.snapshot() and view.watches["pods"] >= 1, what="the pods watch")
    return view


def test_a_choice_no_pod_takes_over_stops_counting_in_seconds(fake, start_view):
    clock = Clock()
    view = _streaming(fake, start_view, clock)
    # Forged reviews: choices for pods the API server never stores.
    for _ in range(3):
        view.remember("gpu-a", 0, 30)
    assert o.used(view.snapshot(), "gpu-a", 0) == 90
    clock.now += 6
    # (Polled: a watch that just ended and is reconnecting holds the choices for that instant.)
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 0, what="the forged choices to expire")

    # A real pod whose watch event lags 3 s still takes its choice over, and counts from then on.
    view.remember("gpu-b", 0, 40)
    clock.now += 3
    assert o.used(view.snapshot(), "gpu-b", 0) == 40
    affinity = {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        placement.preferred_affinity_term("gpu-b")]}}}
    fake.put("pods", o.pod("late", 0, 40, extra=affinity, phase="Pending"))
    fake.put("pods", o.pod("mark", 0, 1, "gpu-a"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 1, what="the pods' events")
    clock.now += 60
    assert o.used(view.snapshot(), "gpu-b", 0) == 40


def test_choices_are_held_while_the_pods_watch_is_down(fake, start_view):
    clock = Clock()
    view = _streaming(fake, start_view, clock)
    errors = view.watch_errors["pods"]
    fake.fail_next = [500] * 10_000
    fake.drop_watches()
    o.wait_for(lambda: view.watch_errors["pods"] > errors, what="the pods watch to fail")
    view.remember("gpu-a", 0, 30)
    clock.now += 6
    assert o.used(view.snapshot(), "gpu-a", 0) == 30  # its pod could not have shown
    clock.now += 25
    assert o.used(view.snapshot(), "gpu-a", 0) == 0
    fake.fail_next = []


def test_an_unbound_pod_with_the_preferred_term_counts_on_that_node(fake, start_view):
    clock = Clock()
    fake.put("nodes", o.node("gpu-a", {0: CAPACITY}))
    view = start_view(clock=clock, remember_ttl=30)
    o.wait_for(view.snapshot, what="the first sync")
    affinity = {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        placement.preferred_affinity_term("gpu-a")]}}}
    fake.put("pods", o.pod("p1", 0, 35, extra=affinity))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 35, what="the pod with the preferred term")
    fake.put("pods", o.pod("p1", 0, 35, "gpu-a", extra=affinity))
    fake.put("pods", o.pod("p2", 0, 5, "gpu-a"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 40, what="the bound pods")
    clock.now += 31
    assert o.used(view.snapshot(), "gpu-a", 0) == 40


def _static_view(clock):
    nodes = tuple(placement.Node(name, cards=tuple(placement.Card(k, CAPACITY, INITIAL[(name, k)]) for k in (0, 1)))
                  for name in ("gpu-a", "gpu-b", "gpu-c"))
    return static.StaticView(placement.View(nodes=nodes), remember_ttl=30, clock=clock)


def test_a_burst_on_the_static_view_fits_and_expires():
    clock = Clock()
    view = _static_view(clock)
    found = _burst(view)
    assert _used(view.snapshot()) == _ledger(found)
    clock.now += 31
    assert _used(view.snapshot()) == INITIAL
    view.remember("nowhere", 0, 10)  # a node the file does not know: nothing to count
    assert _used(view.snapshot()) == INITIAL


def test_a_remembered_choice_on_the_static_view_changes_its_card_alone_and_the_indexes_agree():
    # Cards listed out of order, so a card's position is not its index.
    nodes = tuple(placement.Node(name, cards=(placement.Card(1, CAPACITY, INITIAL[(name, 1)]),
                                              placement.Card(0, CAPACITY, INITIAL[(name, 0)])))
                  for name in ("gpu-a", "gpu-b", "gpu-c"))
    view = static.StaticView(placement.View(nodes=nodes), remember_ttl=30, clock=Clock())
    ledger = collections.Counter(INITIAL)
    ask = placement.Ask(shares=5)
    for node, card, shares in (("gpu-c", 0, 5), ("gpu-a", 1, 20), ("gpu-c", 0, 5), ("gpu-b", 1, 100)):
        before = view.snapshot()
        view.remember(node, card, shares)
        ledger[(node, card)] += shares
        after = view.snapshot()
        assert _used(after) == ledger
        assert [n for n in after.nodes if n.name != node] == [n for n in before.nodes if n.name != node]
        # The indexes carried over choose exactly as indexes built afresh over the same nodes.
        for shares_asked in (5, 10, 40, 70):
            ask = placement.Ask(shares=shares_asked)
            fresh = placement.choose(placement.View(nodes=after.nodes), ask)
            carried = placement.choose(after, ask)
            assert (carried.node, carried.card) == (fresh.node, fresh.card)
    assert (placement.choose(view.snapshot(), ask).node, placement.choose(view.snapshot(), ask).card) != (None, None)


def test_static_choices_expire_one_by_one_or_in_a_burst_and_the_indexes_agree():
    clock = Clock()
    view = _static_view(clock)
    placement.choose(view.snapshot(), placement.Ask(shares=1))  # the indexes exist, so expiries carry them
    made = []  # (deadline, node, card, shares)
    places = [(name, k) for name in ("gpu-a", "gpu-b", "gpu-c") for k in (0, 1)]
    for i in range(40):  # a few a second, some on the same card, then a burst in one instant
        clock.now = 1000.0 + (i if i < 20 else 20)
        node, card = places[(i * 5) % len(places)]
        view.remember(node, card, 1 + i % 3)
        made.append((clock.now + 30, node, card, 1 + i % 3))
    for step in [*range(1, 24), 60]:  # one or two due per snapshot, then the whole burst at once
        clock.now = 1030.0 + step * 0.5 if step < 60 else 1060.0
        snap = view.snapshot()
        ledger = collections.Counter(INITIAL)
        for deadline, node, card, shares in made:
            if deadline > clock.now:
                ledger[(node, card)] += shares
        assert _used(snap) == ledger
        for shares_asked in (1, 5, 15, 70):
            ask = placement.Ask(shares=shares_asked)
            fresh = placement.choose(placement.View(nodes=snap.nodes), ask)
            carried = placement.choose(snap, ask)
            assert (carried.node, carried.card, carried.fits) == (fresh.node, fresh.card, fresh.fits)
    assert _used(view.snapshot()) == INITIAL


def test_pods_that_fit_nowhere_wait_on_their_card_until_they_bind(fake, start_view):
    """With newNodeCards, a pod the webhook admits that fits nowhere counts as waiting on its card index
    (``View.waiting``) from its admission on: the next pods of a burst pack around it; the pod takes its choice
    over when it shows unbound, and stops waiting once it binds (a new node joined)."""
    clock = Clock()
    policy = Policy(new_node_cards=8)
    view = start_view(settings.Settings(policy=policy), clock=clock)
    o.wait_for(lambda: view.snapshot() is not None, what="the first sync")
    client = app_mod.create_app(settings.Settings(policy=policy), view).test_client()
    pods = []
    for i in range(4):
        review = admission_objects.review(admission_objects.pod(admission_objects.container("main", "0.75"),
                                                                name=f"burst-{i}"), uid=f"uid-{i}")
        answer = client.post("/mutate", data=json.dumps(review), content_type="application/json").get_json()
        assert answer["response"]["allowed"]
        pods.append(admission_objects.patched(review["request"]["object"], answer["response"]))
    cards = [int(next(r for r in p["spec"]["containers"][0]["resources"]["limits"]
                      if r.startswith("gpushard.io/card-")).removeprefix("gpushard.io/card-")) for p in pods]
    # Four pods of 0.75 wait on four different cards, each counted once: one new node holds them.
    assert len(set(cards)) == 4
    assert view.snapshot().waiting == {k: (75,) for k in cards}

    # The API server stores them unbound: each takes its choice over, still waiting once.
    for i, pod in enumerate(pods):
        pod["metadata"].update(uid=f"uid-{i}", namespace="default")
        pod["status"] = {"phase": "Pending"}
        fake.put("pods", pod)
    o.wait_for(lambda: all(f"uid-{i}" in view._pods for i in range(4)), what="the pods in the view")
    assert view.snapshot().waiting == {k: (75,) for k in cards}
    clock.now += 60  # past every time to live: only the pods count now, once each
    assert view.snapshot().waiting == {k: (75,) for k in cards}

    # A node joins and the scheduler binds them there: nothing waits any more.
    fake.put("nodes", o.node("new", {k: CAPACITY for k in range(8)}))
    for pod in pods:
        pod["spec"]["nodeName"] = "new"
        fake.put("pods", pod)
    o.wait_for(lambda: not view.snapshot().waiting and sum(c.used for c in view.snapshot().nodes[0].cards) == 300,
               what="the pods bound on the new node")


def test_without_new_node_cards_nothing_waits_on_a_card(fake, start_view):
    view = start_view()
    o.wait_for(lambda: view.snapshot() is not None, what="the first sync")
    view.remember(None, 3, 25)
    fake.put("pods", o.pod("pending", 3, 25, phase="Pending"))
    o.wait_for(lambda: "uid-default-pending" in view._pods, what="the pending pod")
    assert view.snapshot().waiting == {} and not view._queue and not view._ledger.entries
