"""The live view keeps the priorities of bound pods per card (``View.priorities``), against the fake API server:
each bound pod of a priority other than 0 counts on its card, pending pods and pods of priority 0 do not, and a
pod that ends or goes away no longer counts; a pod that takes its remembered choice over (its card's shares
unchanged) still has its priority published, with the lowest priority holding shares (``priority_floor``). Where
placement uses them: tests/core/test_priorities.py.
"""

from __future__ import annotations

import pytest

from tests.cluster import kubeobjects as o

HIGH = 1000


@pytest.fixture
def live(start_view, fake):
    for name in ("gpu-a", "gpu-b"):
        fake.put("nodes", o.node(name, {0: 100, 1: 100}))
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")
    return view


def test_the_live_view_keeps_the_priorities_of_bound_pods(live, fake):
    fake.put("pods", o.pod("high", 0, 60, "gpu-a", extra={"priority": HIGH}))
    fake.put("pods", o.pod("plain", 1, 30, "gpu-a", extra={"priority": 0}))
    fake.put("pods", o.pod("low", 1, 20, "gpu-a", extra={"priority": -3}))
    fake.put("pods", o.pod("pending", 0, 10, extra={"priority": 7}, phase="Pending"))
    o.wait_for(lambda: o.used(live.snapshot(), "gpu-a", 1) == 50, what="the pods counted")
    assert live.snapshot().priorities == {("gpu-a", 0): ((HIGH, 60),), ("gpu-a", 1): ((-3, 20),)}
    assert live.snapshot().priority_floor == -3
    fake.put("pods", o.pod("high", 0, 60, "gpu-a", extra={"priority": HIGH}, phase="Succeeded"))
    fake.delete("pods", "low", "default")
    o.wait_for(lambda: o.used(live.snapshot(), "gpu-a", 1) == 30, what="the pods gone")
    assert live.snapshot().priorities == {}


def test_a_pod_that_takes_its_remembered_choice_over_counts_its_priority(live, fake):
    # The shares on gpu-b's card do not change when the pod shows (its remembered choice counted them): only its
    # priority does, and the view is published again for it.
    live.remember("gpu-b", 0, 50)
    o.wait_for(lambda: o.used(live.snapshot(), "gpu-b", 0) == 50, what="the remembered choice counted")
    fake.put("pods", o.pod("taken", 0, 50, "gpu-b", extra={"priority": HIGH}))
    o.wait_for(lambda: live.snapshot().priority_floor == HIGH, what="its priority counted")
    assert live.snapshot().priorities == {("gpu-b", 0): ((HIGH, 50),)}
    assert o.used(live.snapshot(), "gpu-b", 0) == 50
