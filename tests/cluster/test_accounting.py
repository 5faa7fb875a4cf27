"""Accounting that does not forget: pods gpushard pinned count until they bind or go away.

We test:
- an unbound pod with gpushard's preferred term counts on that node however long it waits (far
  past the time to live of remembered choices), then where it binds, then nowhere once it ends;
- a pod a queue holds with a scheduling gate (Kueue's) counts only through the choice remembered for it, until
  that expires; once the gate is lifted it counts on its node, once, and where it binds;
- an unbound pod without the term that took over a remembered choice keeps counting on its node
  past the time to live, until it binds; deleted unbound, it stops counting at once;
- another replica's pod of the same card and size, chosen on another node, does not take this
  process's remembered choice: both count, each on its own node;
- thousands of remembered choices expire together, and in order: all those due, none other.
"""

from __future__ import annotations

from tests.cluster import kubeobjects as o
from webhook.core import placement


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def preferred(node: str) -> dict:
    return {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        placement.preferred_affinity_term(node)]}}}


def _mark(fake, view, n: int) -> None:
    """A bound pod on the marker node: once the view counts it, every earlier event is applied."""
    fake.put("pods", o.pod(f"mark-{n}", 0, 1, "marker"))
    o.wait_for(lambda: o.used(view.snapshot(), "marker", 0) == n, what=f"marker {n}")


def _start(fake, start_view, clock):
    for name in ("gpu-a", "gpu-b", "marker"):
        fake.put("nodes", o.node(name, {0: 100, 1: 100}))
    view = start_view(clock=clock, remember_ttl=30)
    o.wait_for(view.snapshot, what="the first sync")
    return view


def test_an_unbound_pinned_pod_counts_until_it_binds_or_ends(fake, start_view):
    clock = Clock()
    view = _start(fake, start_view, clock)
    view.remember("gpu-a", 1, 40)  # this process chose it
    fake.put("pods", o.pod("p1", 1, 40, extra=preferred("gpu-a"), phase="Pending"))
    _mark(fake, view, 1)
    assert o.used(view.snapshot(), "gpu-a", 1) == 40  # the pod, not the choice and the pod
    clock.now += 3600  # a scheduler backlog, scheduling gates, waiting for CPU
    assert o.used(view.snapshot(), "gpu-a", 1) == 40
    fake.put("pods", o.pod("p1", 1, 40, "gpu-b", extra=preferred("gpu-a")))
    _mark(fake, view, 2)
    assert (o.used(view.snapshot(), "gpu-a", 1), o.used(view.snapshot(), "gpu-b", 1)) == (0, 40)
    fake.put("pods", o.pod("p1", 1, 40, "gpu-b", extra=preferred("gpu-a"), phase="Succeeded"))
    _mark(fake, view, 3)
    assert o.used(view.snapshot(), "gpu-b", 1) == 0


def test_an_unbound_pod_keeps_the_choice_it_took_over(fake, start_view):
    clock = Clock()
    view = _start(fake, start_view, clock)
    view.remember("gpu-b", 0, 25)
    fake.put("pods", o.pod("p1", 0, 25, phase="Pending"))  # no preferred term
    _mark(fake, view, 1)
    clock.now += 120
    assert o.used(view.snapshot(), "gpu-b", 0) == 25
    fake.delete("pods", "p1", "default")
    _mark(fake, view, 2)
    assert o.used(view.snapshot(), "gpu-b", 0) == 0


def test_another_replicas_pod_does_not_take_this_processs_choice(fake, start_view):
    clock = Clock()
    view = _start(fake, start_view, clock)
    view.remember("gpu-a", 0, 30)
    fake.put("pods", o.pod("theirs", 0, 30, extra=preferred("gpu-b"), phase="Pending"))
    _mark(fake, view, 1)
    assert (o.used(view.snapshot(), "gpu-a", 0), o.used(view.snapshot(), "gpu-b", 0)) == (30, 30)
    fake.put("pods", o.pod("ours", 0, 30, extra=preferred("gpu-a"), phase="Pending"))
    _mark(fake, view, 2)
    assert (o.used(view.snapshot(), "gpu-a", 0), o.used(view.snapshot(), "gpu-b", 0)) == (30, 30)
    clock.now += 31  # the choice is accounted for: nothing left to expire
    assert (o.used(view.snapshot(), "gpu-a", 0), o.used(view.snapshot(), "gpu-b", 0)) == (30, 30)


def test_thousands_of_choices_expire_together_and_in_order(fake, start_view):
    clock = Clock()
    view = _start(fake, start_view, clock)
    for _ in range(3000):
        view.remember("gpu-a", 0, 1)
        view.remember("gpu-b", 1, 1)
    clock.now += 10
    view.remember("gpu-a", 1, 7)
    assert (o.used(view.snapshot(), "gpu-a", 0), o.used(view.snapshot(), "gpu-b", 1)) == (3000, 3000)
    clock.now += 25  # the first 6,000 are due, the last is not
    assert (o.used(view.snapshot(), "gpu-a", 0), o.used(view.snapshot(), "gpu-b", 1),
            o.used(view.snapshot(), "gpu-a", 1)) == (0, 0, 7)
    clock.now += 10
    assert o.used(view.snapshot(), "gpu-a", 1) == 0


def test_a_gated_pod_counts_nowhere_until_its_gate_is_lifted(fake, start_view):
    clock = Clock()
    view = _start(fake, start_view, clock)
    gate = {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}
    view.remember("gpu-a", 1, 40)  # the admission's choice, before the queue's webhook gated it
    fake.put("pods", o.pod("q1", 1, 40, extra={**preferred("gpu-a"), **gate}, phase="Pending"))
    view.remember("gpu-b", 0, 30)
    fake.put("pods", o.pod("q2", 0, 30, extra={**preferred("gpu-b"), **gate}, phase="Pending"))
    _mark(fake, view, 1)
    # Just gated: its remembered choice counts (a burst let through at once must not land on the same room).
    assert (o.used(view.snapshot(), "gpu-a", 1), o.used(view.snapshot(), "gpu-b", 0)) == (40, 30)
    fake.put("pods", o.pod("q2", 0, 30, extra=preferred("gpu-b"), phase="Pending"))  # let through at once
    _mark(fake, view, 2)
    assert o.used(view.snapshot(), "gpu-b", 0) == 30  # once: the pod took its choice over
    clock.now += 31  # the queue holds q1 past the choice's time to live: q1 holds no room
    _mark(fake, view, 3)
    assert o.used(view.snapshot(), "gpu-a", 1) == 0
    fake.put("pods", o.pod("q1", 1, 40, extra=preferred("gpu-a"), phase="Pending"))  # admitted: ungated
    _mark(fake, view, 4)
    assert o.used(view.snapshot(), "gpu-a", 1) == 40
    fake.put("pods", o.pod("q1", 1, 40, "gpu-a", extra=preferred("gpu-a")))
    _mark(fake, view, 5)
    assert (o.used(view.snapshot(), "gpu-a", 1), o.used(view.snapshot(), "gpu-b", 0)) == (40, 30)
