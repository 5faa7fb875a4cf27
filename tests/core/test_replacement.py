"""We test the re-placement decision (`core.replacement`), pure, over hand-made views:
- a pod is re-placed only when its card has no room on any node it may run on and another card
  has room on such a node (a node it may not run on does not count);
- the room that waiting pods whose card has room will take is set aside first, on their
  preferred node when it fits there;
- oldest first, only as many as the free cards take together; gated and young pods wait;
- owners: bare pods and unknown kinds are reported, never moved; owners still to look up are
  named (unjudged) and nothing is moved for them until they are judged;
- a Job's podFailurePolicy: the first rule matching DisruptionTarget decides;
- a pod whose card has room once the terminating pods on it are gone waits, at any age;
- a pod required on its node (policy.nodeAffinity: required) is stranded when that node's card is
  full, even where the card has room elsewhere, and moved where its remade pod may go; the
  required expression gpushard wrote is taken out of the ask, the author's terms kept; without
  that policy a node the author required holds for the move too;
- a pod placed by its memory ask is judged by where it may go when made again: the card-size
  requirement gpushard wrote is left out (the new pod is sized afresh), the author's terms kept.
"""

from webhook.core import placement as pl
from webhook.core import replacement as rp


def node(name, *used, labels=None):
    return pl.Node(name, labels or {}, cards=tuple(pl.Card(k, 100, u) for k, u in enumerate(used)))


def pod(name, card=0, shares=30, age=600.0, owner=("ReplicaSet", "web"), **kw):
    kind, owner_name = owner if owner else (None, "")
    return rp.Waiting(uid=f"uid-{name}", namespace="ns", name=name, card=card, shares=shares, age=age,
                      owner_kind=kind, owner_name=owner_name, **kw)


FOUND = rp.Owner("ReplicaSet", "web")


def plan(view, pods, owners=None, pending=120):
    owners = {p.uid: FOUND for p in pods} if owners is None else owners
    return rp.plan(view, pods, pending, owners)


def test_moves_only_where_another_card_has_room_on_a_node_the_pod_may_run_on():
    view = pl.View(nodes=(node("a", 90, 90), node("b", 90, 0, labels={"pool": "other"})))
    picky = pod("picky", ask=pl.Ask(shares=0, node_selector={"pool": "main"}))
    anywhere = pod("anywhere")
    out = plan(view, [picky, anywhere])
    assert [(m.pod.name, m.to_node, m.to_card) for m in out.moves] == [("anywhere", "b", 1)]
    assert out.waiting_for_room == 1


def test_room_for_waiting_pods_that_fit_is_set_aside_first_on_their_preferred_node():
    view = pl.View(nodes=(node("a", 95, 50), node("b", 95, 50)))
    fits = pod("fits", card=1, shares=50, age=10, preferred="b")  # fits on b (50 free): takes it
    stranded = [pod("s1", age=900), pod("s2", age=800)]
    out = plan(view, [fits, *stranded])
    assert [(m.pod.name, m.to_node) for m in out.moves] == [("s1", "a")]
    assert out.waiting_for_room == 1


def test_oldest_first_and_as_many_as_fit_together_gated_and_young_wait():
    view = pl.View(nodes=(node("a", 95, 40),))  # card 1 takes two pods of 30
    pods = [pod("young", age=60), pod("p1", age=300), pod("p2", age=900), pod("gated", age=1000, gated=True),
            pod("p3", age=600)]
    out = plan(view, pods)
    assert [m.pod.name for m in out.moves] == ["p2", "p3"]
    assert out.waiting_for_room == 1  # p1: nothing left for it


def test_owners_bare_unknown_and_unjudged():
    view = pl.View(nodes=(node("a", 95, 0),))
    bare = pod("bare", owner=None, age=900)
    daemon = pod("daemon", owner=("DaemonSet", "d"), age=800)
    web = pod("web-1", age=700)
    first = rp.plan(view, [bare, daemon, web], 120)
    assert first.moves == [] and [p.name for p in first.unjudged] == ["web-1"]
    assert [s.pod.name for s in first.stuck] == ["bare", "daemon"]
    assert "bare pod" in first.stuck[0].why and first.stuck[0].why.startswith("gpushard: ")
    second = rp.plan(view, [bare, daemon, web], 120, {web.uid: FOUND})
    assert [m.pod.name for m in second.moves] == ["web-1"]
    gone = rp.plan(view, [web], 120, {web.uid: rp.Owner("ReplicaSet", "web", found=False)})
    assert gone.moves == [] and "gone" in gone.stuck[0].why


def test_jobs_are_moved_only_when_the_eviction_does_not_count():
    view = pl.View(nodes=(node("a", 95, 0),))
    job_pod = pod("j", owner=("Job", "train"))
    counted = rp.plan(view, [job_pod], 120, {job_pod.uid: rp.Owner("Job", "train")})
    assert counted.moves == [] and "backoffLimit" in counted.stuck[0].why
    safe = rp.plan(view, [job_pod], 120, {job_pod.uid: rp.Owner("Job", "train", ignores_disruption=True)})
    assert [m.pod.name for m in safe.moves] == ["j"]
    done = rp.plan(view, [job_pod], 120, {job_pod.uid: rp.Owner("Job", "train", ignores_disruption=True,
                                                                 finished=True)})
    assert done.moves == [] and "finished" in done.stuck[0].why


def test_the_first_rule_on_disruption_target_decides():
    ignore = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    fail = {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    exit_codes = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}
    assert rp.job_ignores_disruption({"podFailurePolicy": {"rules": [exit_codes, ignore]}})
    assert not rp.job_ignores_disruption({"podFailurePolicy": {"rules": [fail, ignore]}})
    assert not rp.job_ignores_disruption({"podFailurePolicy": {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "False"}]}]}})
    assert not rp.job_ignores_disruption({"backoffLimit": 3})
    assert not rp.job_ignores_disruption({"podFailurePolicy": "odd"})


def test_one_pod_per_stateful_set_per_pass():
    view = pl.View(nodes=(node("a", 95, 0),))
    pods = [pod(f"db-{i}", shares=20, age=900 - i, owner=("StatefulSet", "db")) for i in range(3)]
    out = rp.plan(view, pods, 120, {p.uid: rp.Owner("StatefulSet", "db") for p in pods})
    assert [m.pod.name for m in out.moves] == ["db-0"]


def test_a_pod_whose_card_frees_once_terminating_pods_end_waits():
    view = pl.View(nodes=(node("a", 90, 0), node("b", 80, 100)))
    soon = pod("soon", shares=30, age=900)
    assert [m.pod.name for m in plan(view, [soon]).moves] == ["soon"]
    assert plan(view, [soon], pending=0).moves  # provably stranded: moved at any age
    waits = rp.plan(view, [soon], 0, {soon.uid: FOUND}, ending={("b", 0): 20})  # b's card 0 then has 40 free
    assert waits.moves == [] and waits.stuck == []
    too_little = rp.plan(view, [soon], 0, {soon.uid: FOUND}, ending={("b", 0): 5, ("a", 1): 50})
    assert [m.pod.name for m in too_little.moves] == ["soon"]  # 25 free on b's card 0 then: still stranded


def test_a_pod_required_on_its_node_is_stranded_when_that_node_is_full_and_moved_anywhere():
    view = pl.View(nodes=(node("a", 90, 90), node("b", 0, 90)))
    required = pl.Ask(shares=0, required_terms=({"matchFields": [pl.required_node_expression("a")]},))
    pinned = pod("pinned", card=0, preferred="a", ask=required)
    preferred_only = pod("preferred", card=0, preferred="a")
    # Only preferred: card 0 has room on b, the scheduler may take it there, nothing to move.
    assert plan(view, [preferred_only]).moves == []
    # Required on a, whose card 0 is full: stranded, and moved where the pod made again can go (b).
    out = rp.plan(view, [pinned], 120, {pinned.uid: FOUND}, required_node=True)
    assert [(m.pod.name, m.to_node, m.to_card) for m in out.moves] == [("pinned", "b", 0)]
    # Without policy.nodeAffinity: required the requirement is the author's own: the pod made again
    # can only go to a, whose cards are full, so nothing is moved.
    out = plan(view, [pinned])
    assert out.moves == [] and out.waiting_for_room == 1


def test_without_required_node_keeps_the_author_s_terms():
    mine = pl.required_node_expression("a")
    author = {"key": "pool", "operator": "In", "values": ["x"]}
    ask = pl.Ask(shares=5, required_terms=({"matchExpressions": [author], "matchFields": [mine]},
                                           {"matchFields": [mine]}))
    assert pl.without_required_node(ask, "a").required_terms == ({"matchExpressions": [author]},)
    assert pl.without_required_node(ask, "b") is ask
    assert pl.without_required_node(pl.Ask(shares=5), "a").required_terms == ()


def test_a_memory_pod_may_move_to_another_card_size():
    small = {"gpushard.io/card-0.memory-mib": "23034", "gpushard.io/card-1.memory-mib": "23034"}
    large = {"gpushard.io/card-0.memory-mib": "81559", "gpushard.io/card-1.memory-mib": "81559", "pool": "big"}
    view = pl.View(nodes=(node("small", 100, 100, labels=small), node("large", 100, 0, labels=large)))
    sized = {"matchExpressions": [pl.card_memory_expression(0, 23034)]}
    ask = pl.Ask(shares=0, required_terms=(sized,))
    out = plan(view, [pod("memory", shares=54, ask=ask, sized=True)])
    assert [(m.pod.name, m.to_node, m.to_card) for m in out.moves] == [("memory", "large", 1)]
    # Without the mark, the requirement is the author's: only cards of 23034 MiB count, all full.
    out = plan(view, [pod("authors", shares=54, ask=ask)])
    assert not out.moves and out.waiting_for_room == 1
    # The author's own expressions in the same term hold for the move.
    theirs = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["small-only"]},
                                   pl.card_memory_expression(0, 23034)]}
    out = plan(view, [pod("picky", shares=54, ask=pl.Ask(shares=0, required_terms=(theirs,)), sized=True)])
    assert not out.moves
    assert pl.without_card_memory(pl.Ask(shares=0, required_terms=(theirs,)), 0).required_terms == (
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["small-only"]}]},)
