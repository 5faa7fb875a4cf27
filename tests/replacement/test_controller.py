"""The re-placement loop against the local API server (`gpushard replace`).

We test:
- leader election on a Lease: of two replacers one leads and the other does nothing; the
  leader renews; after the leader stops renewing for the lease's duration the other takes over
  (a transition is counted), and the old leader then stands by; a leader that stops releases
  the lease and the other takes it at once; the loop runs passes until stopped;
- each owner kind: a ReplicaSet's and a StatefulSet's pods are evicted (one per StatefulSet per
  pass), a Job's only when its podFailurePolicy ignores DisruptionTarget; a Job that would count
  the eviction, a bare pod and a pod whose ReplicaSet is gone are not evicted but reported;
- the eviction goes through the Eviction API (the pod gets DisruptionTarget, then is deleted)
  and a core/v1 Event on the pod says why;
- a PodDisruptionBudget's 429 (the pod bound and started between the list and the eviction)
  means skip: the pod stays, no Event;
- nothing is evicted when no other card has room, nor before pendingSeconds, nor while a
  terminating pod on its card makes room for it, nor when the off switch is set; only as many
  as the free cards can take together, oldest first;
- the leader lists once and then follows by watch: a pass after a watch event (a pod deleted, a
  node's card offered again) acts on the new state with no list; a 410 Gone relists, and the pass
  sees what the watch missed; nothing is evicted before the first list is in, nor while a relist
  runs (a stale cache would move a pod onto a card that filled meanwhile); a pod the cache still
  shows but that is gone is skipped (404); a standby, and a leader that lost the Lease (in a pass
  or in the loop's wait), hold no watch;
- lists are read page by page; objects of odd shapes are skipped, never a crash;
- a slow pass (a large cluster's lists) stretches the wait so that listing takes at most a fifth
  of the time, and a leader renews its Lease while it waits;
- a Lease read the API refuses (401, a 500) raises rather than passing for another leader; the
  loop outlives such passes with one plain log line each and leads once the API answers;
- a changed config file is read before the next pass (the off switch, then on again), and one
  that does not validate leaves the settings in use; /healthz answers 503 once the loop stalls.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from tests.cluster import kubeobjects as o
from tests.replacement.conftest import STARTED
from webhook import settings as settings_mod
from webhook.cluster import kube
from webhook.core import names, placement
from webhook.replacement import controller

NOW = 1_800_000_000.0
NS = "gpushard-system"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stamp(seconds_ago: float) -> str:
    return datetime.datetime.fromtimestamp(NOW - seconds_ago, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def waiting_pod(name: str, card: int, shares: int, owner: tuple[str, str] | None, age: float = 600,
                preferred: str | None = "gpu-a", namespace: str = "team") -> dict:
    extra = {}
    if preferred:
        extra["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            placement.preferred_affinity_term(preferred)]}}
    obj = o.pod(name, card, shares, phase="Pending", namespace=namespace, extra=extra)
    obj["metadata"]["creationTimestamp"] = stamp(age)
    obj["metadata"]["labels"]["app"] = name.rsplit("-", 1)[0]
    if owner:
        kind, owner_name = owner
        obj["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1" if kind != "Job" else "batch/v1",
                                               "kind": kind, "name": owner_name, "uid": f"uid-{owner_name}",
                                               "controller": True, "blockOwnerDeletion": True}]
    return obj


def workload(kind: str, name: str, namespace: str = "team", spec: dict | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"}, "spec": spec or {},
            "status": {}}


IGNORE_DISRUPTION = {"podFailurePolicy": {"rules": [
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}, "backoffLimit": 0}


def seed_cluster(fake, free_card1: int = 60):
    """Card 0 is full on both nodes (90 of 100 used); card 1 of gpu-b has ``free_card1`` free."""
    fake.put("nodes", o.node("gpu-a", {0: 100, 1: 100}))
    fake.put("nodes", o.node("gpu-b", {0: 100, 1: 100}))
    fake.put("pods", o.pod("full-a0", 0, 90, "gpu-a"))
    fake.put("pods", o.pod("full-b0", 0, 90, "gpu-b"))
    fake.put("pods", o.pod("full-a1", 1, 100, "gpu-a"))
    if free_card1 < 100:
        fake.put("pods", o.pod("part-b1", 1, 100 - free_card1, "gpu-b"))




def make(fake, identity="r1", clock=None, follow=True, **options):
    replacement = {k: options.pop(k) for k in ("pending_seconds", "interval", "enabled") if k in options}
    settings = settings_mod.Settings(replacement=settings_mod.Replacement(**{
        "pending_seconds": 120, "interval": 5, **replacement}))
    options.setdefault("backoff", (0.05, 0.3))
    replacer = controller.Replacer(fake.api_client(), settings, identity, NS, clock=clock or Clock(), wall=lambda: NOW,
                                  follow=follow, **options)
    STARTED.append(replacer)
    return replacer


def pods(fake) -> set[str]:
    return {name for (_ns, name) in fake.objects["pods"]}


def events(fake) -> list[dict]:
    return list(fake.objects["events"].values())


def test_one_of_two_leads_and_the_other_takes_over_after_the_lease_expires(fake):
    seed_cluster(fake)
    a_clock, b_clock = Clock(), Clock()
    a, b = make(fake, "r1", a_clock), make(fake, "r2", b_clock)
    assert a.pass_once() is not None
    assert b.pass_once() is None
    lease = fake.get("leases", names.REPLACER_LEASE, NS)
    assert lease["spec"]["holderIdentity"] == "r1" and lease["spec"]["leaseTransitions"] == 0
    duration = lease["spec"]["leaseDurationSeconds"]
    assert duration == 15

    # The leader renews; the other sees the lease change and keeps waiting from that moment.
    a_clock.now += 10
    assert a.pass_once() is not None
    b_clock.now += 10
    assert b.pass_once() is None
    b_clock.now += duration - 1
    assert b.pass_once() is None

    # r1 stops renewing (it died): once r2 has seen the same lease for its duration, r2 takes over.
    b_clock.now += 2
    assert b.pass_once() is not None
    lease = fake.get("leases", names.REPLACER_LEASE, NS)
    assert lease["spec"]["holderIdentity"] == "r2" and lease["spec"]["leaseTransitions"] == 1
    a_clock.now += 1
    assert a.pass_once() is None  # the old leader comes back and stands by

    # A leader that stops gives the lease up: the other takes it at once.
    b.elector.release()
    assert fake.get("leases", names.REPLACER_LEASE, NS)["spec"].get("holderIdentity") is None
    assert a.pass_once() is not None
    assert fake.get("leases", names.REPLACER_LEASE, NS)["spec"]["holderIdentity"] == "r1"


def test_the_loop_runs_passes_until_stopped_then_releases(fake):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    replacer = make(fake)
    stop = threading.Event()
    thread = threading.Thread(target=replacer.run, args=(stop,))
    thread.start()
    o.wait_for(lambda: "web-x1" not in pods(fake), what="the first pass")
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert fake.get("leases", names.REPLACER_LEASE, NS)["spec"].get("holderIdentity") is None


@pytest.mark.parametrize("interval,took,wait", [(5, 0.1, 5), (5, 1.25, 5), (5, 4, 16), (15, 30, 120)])
def test_a_slow_pass_stretches_the_wait(interval, took, wait):
    assert controller.pause(interval, took) == pytest.approx(wait)


def test_a_long_wait_keeps_the_lease(fake):
    seed_cluster(fake)
    now = [1000.0]
    replacer = make(fake, clock=lambda: now[0])  # interval 5 s: a 15 s Lease
    renewals = []
    real_lead, real_pass = replacer.elector.lead, replacer.pass_once

    def lead() -> bool:
        renewals.append(now[0])
        return real_lead()

    def slow_pass():  # a large cluster's lists: 100 s, so the next pass waits 400 s
        outcome = real_pass()
        now[0] += 100
        return outcome

    replacer.elector.lead, replacer.pass_once = lead, slow_pass
    stop = threading.Event()
    original_wait = stop.wait

    def wait(timeout=None):  # time passes as the loop waits; the test ends it after a while
        now[0] += timeout or 0
        if now[0] > 2000:
            stop.set()
        return original_wait(0)

    stop.wait = wait
    replacer.run(stop)
    # The first pass ends at 1100 and the next begins at 1500: the Lease renewed every 5 s between.
    between = [t for t in renewals if 1100 < t < 1500]
    assert len(between) >= 70
    assert max(b - a for a, b in zip(between, between[1:], strict=False)) <= replacer.elector.duration / 3
    assert 1500 in renewals  # and the next pass waited the 400 s, not the 5 s interval


def test_the_loop_stops_its_watches_as_soon_as_a_renewal_finds_the_lease_lost(fake):
    seed_cluster(fake)
    now = [1000.0]
    replacer = make(fake, clock=lambda: now[0])
    real_lead = replacer.elector.lead
    leads = iter([True])  # the first pass leads; every renewal after it finds the Lease taken
    replacer.elector.lead = lambda: next(leads, False) and real_lead()
    real_pass, passes = replacer.pass_once, []

    def slow_pass():  # 100 s: the loop then waits 400 s, renewing the Lease every 5 s on the way
        passes.append(real_pass())
        now[0] += 100
        return passes[-1]

    replacer.pass_once = slow_pass
    stop = threading.Event()
    original_wait = stop.wait
    followed = []

    def wait(timeout=None):
        followed.append(replacer.cache is not None and replacer.cache.current())
        now[0] += timeout or 0
        if len(followed) >= 3:
            stop.set()
        return original_wait(0)

    stop.wait = wait
    replacer.run(stop)
    # Followed after the pass; not once the first renewal in the wait found the Lease lost.
    assert len(passes) == 1 and passes[0].synced
    assert followed[0] and not any(followed[1:])


def test_each_owner_kind_is_handled_as_its_controller_counts_an_eviction(fake):
    seed_cluster(fake, free_card1=100)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("statefulsets", workload("StatefulSet", "db"))
    fake.put("jobs", workload("Job", "train-safe", spec=IGNORE_DISRUPTION))
    fake.put("jobs", workload("Job", "train-counted", spec={"backoffLimit": 6}))
    fake.put("pods", waiting_pod("web-x1", 0, 20, ("ReplicaSet", "web"), age=900))
    fake.put("pods", waiting_pod("db-0", 0, 15, ("StatefulSet", "db"), age=800))
    fake.put("pods", waiting_pod("db-1", 0, 15, ("StatefulSet", "db"), age=700))
    fake.put("pods", waiting_pod("train-safe-a", 0, 15, ("Job", "train-safe"), age=600))
    fake.put("pods", waiting_pod("train-counted-a", 0, 15, ("Job", "train-counted"), age=500))
    fake.put("pods", waiting_pod("bare-1", 0, 15, None, age=400))
    fake.put("pods", waiting_pod("orphan-1", 0, 15, ("ReplicaSet", "gone"), age=300))

    outcome = make(fake).pass_once()
    evicted = [m.pod.name for m in outcome.evicted]
    assert evicted == ["web-x1", "db-0", "train-safe-a"]  # oldest first; one pod of db this pass
    assert not {"web-x1", "db-0", "train-safe-a"} & pods(fake)
    stuck = {s.pod.name: s.why for s in outcome.plan.stuck}
    assert set(stuck) == {"train-counted-a", "bare-1", "orphan-1"}
    assert "backoffLimit" in stuck["train-counted-a"] and "DisruptionTarget" in stuck["train-counted-a"]
    assert "bare pod" in stuck["bare-1"]
    assert "gone" in stuck["orphan-1"]
    assert {"db-1", "train-counted-a", "bare-1", "orphan-1"} <= pods(fake)

    # The evicted pods got the DisruptionTarget condition before they were deleted.
    deleted = {e[3]["metadata"]["name"]: e[3] for e in fake.events if e[1] == "pods" and e[2] == "DELETED"}
    for name in evicted:
        conditions = deleted[name]["status"]["conditions"]
        assert {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}.items() <= \
            conditions[-1].items()

    # The next pass takes db-1 (its StatefulSet's turn has come).
    outcome = make(fake).pass_once()
    assert [m.pod.name for m in outcome.evicted] == ["db-1"]


def test_an_event_on_the_pod_says_why(fake):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    outcome = make(fake).pass_once()
    assert [m.pod.name for m in outcome.evicted] == ["web-x1"]
    (event,) = events(fake)
    assert event["metadata"]["namespace"] == "team"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "web-x1", "namespace": "team",
                                       "uid": "uid-team-web-x1"}
    assert event["reason"] == names.REPLACED_REASON and event["type"] == "Normal"
    assert event["source"] == {"component": names.REPLACER_COMPONENT}
    message = event["message"]
    assert message.startswith("gpushard: evicted after 600s Pending: card 0 has no room for 25 shares")
    assert "card 1 of node gpu-b" in message and "ReplicaSet web" in message


def test_a_disruption_budget_429_means_skip(fake):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    fake.put("poddisruptionbudgets", {"metadata": {"name": "web", "namespace": "team"},
                                      "spec": {"selector": {"matchLabels": {"app": "web"}}},
                                      "status": {"disruptionsAllowed": 0, "currentHealthy": 1, "desiredHealthy": 1}})

    def bound_and_started(namespace, name):  # room freed up after all, between list and eviction
        pod = fake.objects["pods"][(namespace, name)]
        pod["spec"]["nodeName"] = "gpu-a"
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}

    fake.before_eviction.append(bound_and_started)
    outcome = make(fake).pass_once()
    assert outcome.evicted == [] and [why for _m, why in outcome.refused] == [
        "a disruption budget allows no eviction now"]
    assert "web-x1" in pods(fake) and events(fake) == []


def test_a_pod_that_changed_since_the_list_is_not_evicted(fake):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))

    def bound(namespace, name):  # bound, not yet running: no budget involved, the precondition holds
        pod = fake.get("pods", name, namespace)
        pod["spec"]["nodeName"] = "gpu-a"
        fake.put("pods", pod)

    fake.before_eviction.append(bound)
    outcome = make(fake).pass_once()
    assert [why for _m, why in outcome.refused] == ["the pod changed since it was listed"]
    assert "web-x1" in pods(fake) and events(fake) == []


def test_nothing_is_evicted_when_no_other_card_has_room(fake):
    seed_cluster(fake, free_card1=20)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    outcome = make(fake).pass_once()
    assert outcome.evicted == [] and outcome.plan.stuck == [] and outcome.plan.waiting_for_room == 1
    assert "web-x1" in pods(fake) and events(fake) == []


def test_nothing_is_evicted_while_a_terminating_pod_on_its_card_makes_room(fake):
    seed_cluster(fake)  # card 0: 10 free on each node; card 1 of gpu-b: 60 free
    ending = fake.get("pods", "full-b0", "default")
    ending["metadata"]["deletionTimestamp"] = stamp(5)
    fake.put("pods", ending)  # still bound and counted, but its 90 shares come free once it is gone
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    outcome = make(fake, pending_seconds=0).pass_once()
    assert outcome.evicted == [] and outcome.plan.stuck == [] and "web-x1" in pods(fake)
    fake.delete("pods", "full-b0", "default")
    fake.put("pods", o.pod("full-b0-again", 0, 90, "gpu-b"))  # the room went to another pod
    assert [m.pod.name for m in make(fake, pending_seconds=0).pass_once().evicted] == ["web-x1"]


def test_only_as_many_as_the_free_cards_take_oldest_first_and_not_too_soon(fake):
    seed_cluster(fake, free_card1=60)  # room for two pods of 25 on card 1 of gpu-b
    fake.put("replicasets", workload("ReplicaSet", "web"))
    for i, age in enumerate((300, 900, 600, 700, 60)):
        fake.put("pods", waiting_pod(f"web-x{i}", 0, 25, ("ReplicaSet", "web"), age=age))
    # A pod waiting on card 1 (which has room) will be scheduled there: its room is not handed out.
    fake.put("pods", waiting_pod("other-1", 1, 10, None, preferred="gpu-b"))
    outcome = make(fake).pass_once()
    assert [m.pod.name for m in outcome.evicted] == ["web-x1", "web-x3"]
    assert {m.to_node for m in outcome.evicted} == {"gpu-b"}
    assert {"web-x0", "web-x2", "web-x4", "other-1"} <= pods(fake)


def test_the_off_switch_and_dry_run_evict_nothing(fake, capsys):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    settings = settings_mod.Settings(replacement=settings_mod.Replacement(enabled=False))
    args = type("Args", (), {"once": True, "kubeconfig": None, "context": None, "namespace": NS,
                             "identity": "r1", "dry_run": False})()
    assert controller.run(args, settings) == 0
    assert "re-placement is off" in capsys.readouterr().out
    assert not fake.requests
    dry = controller.Replacer(fake.api_client(), settings_mod.Settings(), "r1", NS, wall=lambda: NOW, dry_run=True)
    STARTED.append(dry)
    outcome = dry.pass_once()
    assert [m.pod.name for m in outcome.plan.moves] == ["web-x1"] and outcome.evicted == []
    assert "web-x1" in pods(fake) and events(fake) == []


def test_lists_are_read_page_by_page(fake):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    for i in range(controller.PAGE + 20):
        fake.put("pods", o.pod(f"p{i}", 0, 0 if i else 1, "gpu-a"))
    view, waiting = make(fake).read()
    assert waiting == [] and view.nodes[0].cards[0].used == 1
    lists = [path for method, path, _ in fake.requests if method == "GET" and "/pods?" in path]
    assert len(lists) == 2 and "continue=" in lists[1]


@pytest.fixture(autouse=True)
def _no_kubeconfig(monkeypatch, fake):
    """`controller.run` builds its client from a kubeconfig: point it at the fake."""
    monkeypatch.setattr(controller, "api_client", lambda *_a, **_k: fake.api_client())


def test_objects_of_odd_shapes_are_skipped(fake):
    seed_cluster(fake)
    shared = {names.SHARED_LABEL: names.SHARED_LABEL_VALUE}
    fake.put("pods", {"metadata": {"name": "odd-1", "namespace": "team", "labels": shared}, "spec": [], "status": "x"})
    fake.put("pods", {"metadata": {"name": "odd-2", "namespace": "team", "labels": shared,
                                   "ownerReferences": {"kind": "ReplicaSet"}},
                      "spec": {"containers": "none", "affinity": []}, "status": {"phase": "Pending"}})
    bad_affinity = waiting_pod("odd-3", 0, 25, ("ReplicaSet", "web"))
    bad_affinity["spec"]["affinity"] = {"nodeAffinity": []}
    fake.put("pods", bad_affinity)
    outcome = make(fake).pass_once()
    assert outcome.evicted == [] and outcome.plan.moves == []


def lists(fake, resource: str) -> int:
    """How many list requests (not watches) for ``resource`` the server answered."""
    return sum(1 for method, path, _ in fake.requests
               if method == "GET" and path.startswith(f"/api/v1/{resource}?") and "watch=" not in path)


def silently(fake, change) -> None:
    """Change the store with no watch event, then expire history and drop watches: only a relist shows it."""
    with fake.lock:
        change(fake.objects["pods"])
    compact(fake)
    fake.drop_watches()


def compact(fake) -> None:
    """History compacted: watches from before now and continue tokens get 410 Gone."""
    fake.expire_history()
    # The cluster moves on (the fake's list carries its last resourceVersion, which must be watchable).
    fake.put("namespaces", {"metadata": {"name": f"moved-on-{fake.rv}"}})


def in_cache(replacer, name: str, namespace: str = "default") -> bool:
    return f"uid-{namespace}-{name}" in replacer.cache.contents()[2]


@pytest.mark.parametrize("event", ["a pod ends", "a card is offered again"])
def test_a_pass_after_a_watch_event_acts_on_the_new_state_with_no_list(fake, event):
    seed_cluster(fake, free_card1=20 if event == "a pod ends" else 100)
    if event == "a card is offered again":
        fake.put("nodes", o.node("gpu-b", {0: 100, 1: 0}))  # card 1 unhealthy: the agent offers none of it
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    replacer = make(fake)
    outcome = replacer.pass_once()
    assert outcome.synced and outcome.evicted == [] and outcome.plan.waiting_for_room == 1
    before = (lists(fake, "nodes"), lists(fake, "pods"))
    assert before == (1, 1)

    if event == "a pod ends":
        fake.delete("pods", "part-b1", "default")
        o.wait_for(lambda: not in_cache(replacer, "part-b1"), what="the deletion in the cache")
    else:
        fake.put("nodes", o.node("gpu-b", {0: 100, 1: 100}))
        o.wait_for(lambda: any(c.capacity == 100 for n in replacer.cache.contents()[0] if n.name == "gpu-b"
                               for c in n.cards if c.index == 1), what="the node in the cache")
    outcome = replacer.pass_once()
    assert [(m.pod.name, m.to_node, m.to_card) for m in outcome.evicted] == [("web-x1", "gpu-b", 1)]
    assert "web-x1" not in pods(fake)
    assert (lists(fake, "nodes"), lists(fake, "pods")) == before  # no list: the watch told it

    # The evicted pod leaves the cache by watch; until it does, no pass moves it again.
    o.wait_for(lambda: not in_cache(replacer, "web-x1", "team"), what="the eviction in the cache")
    assert replacer.pass_once().evicted == []


def test_a_410_gone_relists_and_the_pass_sees_what_the_watch_missed(fake):
    seed_cluster(fake, free_card1=20)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    replacer = make(fake)
    assert replacer.pass_once().plan.waiting_for_room == 1

    # The pod that filled card 1 of gpu-b goes while no watch is open, and history is compacted.
    silently(fake, lambda store: store.pop(("default", "part-b1")))
    o.wait_for(lambda: replacer.cache.lists[kube.PODS] == 2 and replacer.cache.current(), what="the relist")
    assert not in_cache(replacer, "part-b1")
    outcome = replacer.pass_once()
    assert [m.pod.name for m in outcome.evicted] == ["web-x1"]
    assert lists(fake, "pods") == 2 and lists(fake, "nodes") == 2  # the first list and the relist


def test_nothing_is_evicted_before_the_first_list_nor_during_a_relist(fake):
    seed_cluster(fake)  # card 1 of gpu-b has 60 free
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))

    def never_done(resource, page):  # each pod list loses its continue token after the first page
        if resource == "pods" and page == 0:
            compact(fake)

    fake.on_page = never_done
    replacer = make(fake, page=1, sync_wait=0.3)
    outcome = replacer.pass_once()
    assert not outcome.synced and outcome.plan.moves == [] and outcome.evicted == []
    assert "web-x1" in pods(fake)
    assert not [path for method, path, _ in fake.requests if method == "POST" and path.endswith("/eviction")]

    fake.on_page = None  # the list goes through: the leader syncs, then plans
    o.wait_for(replacer.cache.current, what="the first sync")
    assert [m.pod.name for m in replacer.pass_once().evicted] == ["web-x1"]

    # A new waiting pod the cache knows; then card 1 of gpu-b fills while the watches are down and
    # the relist cannot finish. The stale cache still shows room: a pass over it would evict web-x2
    # onto a full card. No pass plans until the relist is in.
    fake.put("pods", waiting_pod("web-x2", 0, 25, ("ReplicaSet", "web")))
    o.wait_for(lambda: in_cache(replacer, "web-x2", "team"), what="web-x2 in the cache")
    filler = o.pod("fill-b1", 1, 60, "gpu-b")
    fake.on_page = never_done
    silently(fake, lambda store: store.__setitem__(("default", "fill-b1"), filler))
    o.wait_for(lambda: not replacer.cache.current(), what="the relist to begin")
    outcome = replacer.pass_once()
    assert not outcome.synced and outcome.evicted == [] and "web-x2" in pods(fake)

    fake.on_page = None
    o.wait_for(replacer.cache.current, what="the relist")
    outcome = replacer.pass_once()
    assert outcome.evicted == [] and outcome.plan.waiting_for_room == 1 and "web-x2" in pods(fake)


def test_a_pod_the_cache_shows_but_that_is_gone_is_skipped(fake):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    fake.before_eviction.append(lambda namespace, name: fake.objects["pods"].pop((namespace, name)))
    outcome = make(fake).pass_once()
    assert outcome.evicted == [] and [why for _m, why in outcome.refused] == ["the pod is gone"]
    assert events(fake) == []


def watches(fake) -> int:
    return sum(1 for method, path, _ in fake.requests if method == "GET" and "watch=" in path)


def test_a_standby_holds_no_watch_and_a_leader_that_loses_the_lease_stops_its_watches(fake):
    seed_cluster(fake)
    a_clock, b_clock = Clock(), Clock()
    a, b = make(fake, "r1", a_clock), make(fake, "r2", b_clock)
    assert a.pass_once().synced
    o.wait_for(lambda: watches(fake) == 2, what="the leader's two watches")

    seen = len(fake.requests)
    assert b.pass_once() is None and b.cache is None
    assert {path.split("?")[0].rsplit("/", 2)[-2] for _m, path, _ in fake.requests[seen:]} == {"leases"}

    # r1 stops renewing; r2 takes the Lease (its election only). r1's next pass finds it lost and stands by.
    b_clock.now += a.elector.duration + 1
    assert b.elector.lead() and b.cache is None  # r2 only holds the Lease: every watch left would be r1's
    followed = a.cache
    assert a.pass_once() is None and a.cache is None
    seen = watches(fake)
    fake.drop_watches()  # a thread still following would reconnect at once
    fake.put("pods", o.pod("late", 0, 1, "gpu-a"))
    # r1's watch threads have ended: none is left to watch again.
    o.wait_for(lambda: not any(t.is_alive() for t in followed.informer.threads), what="r1's watch threads ended")
    assert watches(fake) == seen


# --- failures, liveness and a changed config -------------------------------------------------------

def test_a_lease_the_api_refuses_is_an_error_not_another_leader(fake):
    seed_cluster(fake)
    fake.tokens = {}  # every request: 401
    target = controller.connecting.Target(fake.url, "ctx", "kubeconfig")
    replacer = make(fake, target=target)
    with pytest.raises(controller.connecting.ApiError, match=r"\(context ctx\) refused the credentials \(401 "
                                                             r"Unauthorized\) while trying to get Lease "):
        replacer.pass_once()
    fake.tokens = None
    fake.fail_next = [500]
    with pytest.raises(controller.kubernetes.client.ApiException):
        replacer.pass_once()
    assert replacer.pass_once() is not None  # and once it answers, this one leads


def test_the_loop_outlives_a_refusing_api_and_stands_by_then_leads_again(fake, caplog):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    fake.tokens = {}  # 401 for everything, for a while
    replacer = make(fake, clock=time.monotonic, interval=1,
                    target=controller.connecting.Target(fake.url, "ctx", "kubeconfig"))
    stop = threading.Event()
    thread = threading.Thread(target=replacer.run, args=(stop,))
    with caplog.at_level("WARNING"):
        thread.start()
        o.wait_for(lambda: any("401 Unauthorized" in r.getMessage() for r in caplog.records), what="a failed pass")
        assert "web-x1" in pods(fake)
        fake.tokens = None
        o.wait_for(lambda: "web-x1" not in pods(fake), what="a pass once the API answers")
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    # One plain line per failed pass, naming the server and the context; no traceback.
    failed = [r for r in caplog.records if "re-placement pass failed" in r.getMessage()]
    assert failed and all(r.exc_info is None and "(context ctx)" in r.getMessage() for r in failed)


def test_a_changed_config_is_read_before_the_next_pass(fake, tmp_path):
    seed_cluster(fake)
    fake.put("replicasets", workload("ReplicaSet", "web"))
    config = tmp_path / "config.yaml"
    config.write_text("replacement: {enabled: false, interval: 1}\n")
    reload = controller.Reloader(str(config))
    assert reload() is None  # unchanged since it was made
    replacer = make(fake, clock=time.monotonic, interval=1, enabled=False, pending_seconds=0)
    stop = threading.Event()
    thread = threading.Thread(target=replacer.run, args=(stop, reload))
    thread.start()
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    began = replacer.beat
    o.wait_for(lambda: replacer.beat >= began + 2, what="two turns with re-placement off")
    config.write_text("replacement: {enabled: nope}\n")  # does not validate: the settings in use stay
    began = replacer.beat
    o.wait_for(lambda: replacer.beat >= began + 2, what="two turns with a bad config")
    assert "web-x1" in pods(fake) and not fake.objects["leases"]
    config.write_text("replacement: {enabled: true, interval: 1, pendingSeconds: 0}\n")
    o.wait_for(lambda: "web-x1" not in pods(fake), what="the pass after the switch")
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_health_endpoint_fails_once_the_loop_stalls(fake):
    import urllib.error
    import urllib.request

    replacer = make(fake, clock=time.monotonic)
    server = controller.serve_health(0, replacer, stall_s=30)
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200 and response.read().startswith(b"ok")
        replacer.beat -= 31  # the loop last came round 31 s ago
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(url, timeout=5)
        assert failed.value.code == 503 and failed.value.read().startswith(b"stalled")
    finally:
        server.shutdown()
        server.server_close()
