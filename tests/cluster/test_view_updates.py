"""The live view's incremental updates against a view built from scratch.

We test, over random sequences of node events (shares, labels, cards), pod events (added,
moved, finished, deleted) and remembered choices, fed through the same paths the watch
threads and admissions use:
- every node of the snapshot equals the node built from scratch from the listed node, the
  shares of the pods on it and the remembered choices;
- the snapshot's indexes equal those of a full rebuild, and every choice is the same.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cluster import kubeobjects as o
from webhook import settings as settings_mod
from webhook.cluster import kube
from webhook.core import placement

POLICY = settings_mod.Settings().policy
NODES = ["n0", "n1", "n2", "n3"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _expected(view: kube.KubeView) -> dict[str, placement.Node]:
    out = {}
    for name, base in view._base.items():
        cards = tuple(placement.Card(c.index, c.capacity, view._used[(name, c.index)]
                                     + view._tentative[(name, c.index)], c.uuid, c.model, c.memory_mib)
                      for c in base.cards)
        out[name] = placement.Node(base.name, base.labels, base.taints, base.ready, base.unschedulable, cards)
    return out


steps = st.one_of(
    st.tuples(st.just("node"), st.sampled_from(NODES), st.dictionaries(st.integers(0, 3), st.sampled_from([0, 50, 100]),
                                                                     min_size=0, max_size=3),
              st.sampled_from(["a", "b"])),
    st.tuples(st.just("pod"), st.integers(0, 9), st.integers(0, 3), st.integers(1, 60),
              st.sampled_from(NODES + [None]), st.sampled_from(["Running", "Succeeded"])),
    st.tuples(st.just("delete"), st.integers(0, 9)),
    st.tuples(st.just("remember"), st.sampled_from(NODES), st.integers(0, 3), st.integers(1, 40)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 40.0])),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(steps, min_size=1, max_size=25), st.lists(st.integers(1, 100), min_size=1, max_size=3))
def test_incremental_view_equals_a_rebuild(plan, sizes):
    clock = Clock()
    view = kube.KubeView(None, POLICY, clock=clock)
    view.apply_list(kube.NODES, {n: kube.read_node(o.node(n, {0: 100, 1: 100}), POLICY) for n in NODES[:2]})
    view.apply_list(kube.PODS, {})
    for step in plan:
        kind = step[0]
        if kind == "node":
            _, name, cards, pool = step
            obj = o.node(name, cards, labels={"pool": pool})
            view.apply_event(kube.NODES, "MODIFIED", obj)
        elif kind == "pod":
            _, i, card, shares, node, phase = step
            view.apply_event(kube.PODS, "MODIFIED", o.pod(f"p{i}", card, shares, node, phase=phase))
        elif kind == "delete":
            view.apply_event(kube.PODS, "DELETED", o.pod(f"p{step[1]}", 0, 1))
        elif kind == "remember":
            view.remember(step[1], step[2], step[3])
        else:
            clock.now += step[1]
        snap = view.snapshot()
        expected = _expected(view)
        assert {n.name: n for n in snap.nodes} == expected
        rebuilt = placement.View(nodes=snap.nodes)
        for shares in sizes:
            for strategy in ("binpack", "spread"):
                for ask in (placement.Ask(shares=shares), placement.Ask(shares=shares, pin=1),
                            placement.Ask(shares=shares, node_selector={"pool": "a"})):
                    assert placement.choose(snap, ask, strategy) == placement.choose(rebuilt, ask, strategy)
