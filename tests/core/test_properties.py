"""We test, over generated pods (hypothesis), the invariants every admission keeps:
- an allowed pod, once patched, is one the API server accepts (integer extended resources,
  requests equal limits, schema-valid);
- each container ends with exactly one NVIDIA_VISIBLE_DEVICES, and all GPU containers name one card;
- a second pass over gpushard's own output is an empty patch, and the input is never changed;
- a denial is a 403 or 400 whose message starts with "gpushard:", and never an exception;
- placing a stream of pods, each on the card chosen for it, never takes a card past its shares.
"""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import applypatch
from webhook.core import decisions, names, placement, policy

POLICY = policy.Policy()
VIEW = placement.View(nodes=(
    placement.Node("a", cards=(placement.Card(0, 100, 30), placement.Card(1, 100, 95))),
    placement.Node("b", cards=(placement.Card(0, 100, 0), placement.Card(1, 100, 50), placement.Card(2, 100, 70))),
))

FRACTIONS = ["0.1", "0.25", "250m", "0.333", "0.5", "0.75", "1", "0", 0.2, 1, "2", "1.5", "-1", "lots", "1e3"]

ask = st.one_of(
    st.none(),
    st.tuples(st.just("nvidia.com/gpu"), st.sampled_from(FRACTIONS)),
    st.tuples(st.just("gpushard.io/gpu"), st.integers(min_value=-1, max_value=120).map(str)),
    st.tuples(st.sampled_from(["gpushard.io/card-0", "gpushard.io/card-1"]),
              st.integers(min_value=1, max_value=60).map(str)),
)
user_env = st.lists(st.sampled_from([
    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    {"name": "GPUSHARD_FRACTION", "value": "1"},
    {"name": "OTHER", "value": "x"},
]), max_size=3)


@st.composite
def containers(draw, prefix):
    out = []
    for i in range(draw(st.integers(min_value=0 if prefix == "init" else 1, max_value=3))):
        c = {"name": f"{prefix}{i}", "image": "busybox"}
        a = draw(ask)
        if a is not None:
            c["resources"] = {"limits": {a[0]: a[1]}, "requests": {a[0]: a[1]}}
        env = draw(user_env)
        if env:
            c["env"] = env
        if prefix == "init" and draw(st.booleans()):
            c["restartPolicy"] = "Always"
        out.append(c)
    return out


@st.composite
def pods(draw):
    spec = {"containers": draw(containers("app"))}
    init = draw(containers("init"))
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gen", "namespace": "t"}, "spec": spec}


def containers_of(obj):
    spec = obj["spec"]
    return (spec.get("initContainers") or []) + spec["containers"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods())
def test_admitted_pods_are_valid_pinned_and_stable(pod):
    pod = json.loads(json.dumps(pod))  # as the API server sends it: no object shared by two places
    before = json.dumps(pod, sort_keys=True)
    d = decisions.decide(decisions.Request(pod, "Pod"), POLICY, VIEW)
    assert json.dumps(pod, sort_keys=True) == before, "the input is never changed"
    if not d.allowed:
        assert d.code in (400, 403) and d.message.startswith("gpushard: ")
        return
    new = applypatch.admit(pod, applypatch.make_patch(pod, d.obj))
    for c in containers_of(new):
        visible = [e for e in c.get("env") or [] if e["name"] == names.VISIBLE_DEVICES_ENV]
        assert len(visible) == 1, c
        held = [k for k in (c.get("resources") or {}).get("limits") or {} if k.startswith("gpushard.io/card-")]
        expected = str(d.card) if held else "void"
        assert visible[0]["value"] == expected
    assert set(applypatch.card_shares(new)) <= {d.card}
    again = decisions.decide(decisions.Request(new, "Pod"), POLICY, VIEW)
    assert again.allowed and applypatch.make_patch(new, again.obj) == []


def _place(view: placement.View, node: str, card: int, shares: int) -> placement.View:
    return placement.View(nodes=tuple(
        placement.Node(n.name, n.labels, n.taints, n.ready, n.unschedulable, tuple(
            placement.Card(c.index, c.capacity, c.used + (shares if (n.name, c.index) == (node, card) else 0))
            for c in n.cards)) for n in view.nodes))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=40),
       st.sampled_from(["binpack", "spread"]))
def test_placing_on_the_chosen_card_never_oversubscribes(sizes, strategy):
    view = VIEW
    for shares in sizes:
        choice = placement.choose(view, placement.Ask(shares=shares), strategy)
        if choice.fits:
            view = _place(view, choice.node, choice.card, shares)
        else:
            assert choice.findings and choice.findings[0].rule == "no-room"
            assert all(c.free < shares for n in view.nodes for c in n.cards)
    assert all(0 <= c.used <= c.capacity for n in view.nodes for c in n.cards)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.floats(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["spec", "containers", "initContainers", "resources", "limits",
                                         "requests", "name", "env", "nvidia.com/gpu", "gpushard.io/gpu"]),
                        inner, max_size=4), max_leaves=20),
       st.sampled_from(["Pod", "Deployment", "CronJob", "PodTemplate"]),
       st.sampled_from(["enforce", "audit"]))
def test_garbage_objects_get_an_answer_not_an_exception(obj, kind, mode):
    obj = json.loads(json.dumps(obj))
    d = decisions.decide(decisions.Request(obj, kind, mode=mode), POLICY, VIEW)
    assert d.allowed or (d.code in (400, 403) and d.message.startswith("gpushard: "))
