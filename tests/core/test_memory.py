"""Memory asks (gpushard.io/memory) on a mixed fleet: 24, 48 and 80 GB cards, several per node,
and one node that holds all three sizes.

We test:
- shares are computed for the size of card chosen (ceil(ask x sharesPerCard / card MiB)), the
  smallest size that holds the ask by default and the largest with policy.memorySize: largest;
- the pod gets a required node affinity on the chosen card's memory label, which the scheduler's
  matching (placement.eligible) satisfies exactly on the nodes whose card k has that size, and the
  author's own required terms keep holding (ANDed into each);
- the memory ask leaves the pod's resources (no node advertises it), is recorded in annotations (the MiB
  asked and the card size the shares are for) and an audit annotation, never in a warning, and the
  patched pod is one the API server accepts; a second pass changes nothing;
- a full size moves the ask to the next size; a pod whose nodes have no room waits on a card of
  the smallest size they offer; node selectors keep their meaning;
- denials: an ask above every card (naming the largest), memory mixed with a fraction, shares or a
  pin (in one container or across containers), no view of the cluster, bad quantities;
- a memory ask in requests only reads as in limits; templates keep the ask, with a limit;
- under isolation the cap that the shares give is never below the ask, for every ask and size;
- over generated mixed views, asks and policies (hypothesis): a pod is denied exactly when no card
  size holds it; otherwise its shares hold its ask on the chosen size, the scheduler may bind it
  only where card k has that size, and it takes the first size (in policy order) with room;
- `gpushard status` shows the memory asked and the card size beside the shares and their cap; the replacer reads a
  memory pod as one sized afresh when its owner makes it again.
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import applypatch
from tests.core import podmaker
from webhook import auditing
from webhook import settings as settings_mod
from webhook.core import asks as req
from webhook.core import auditing as audit_rules
from webhook.core import decisions, isolation, names, placement
from webhook.core import findings as f
from webhook.core import policy as policy_mod
from webhook.core.policy import Policy
from webhook.replacement import cache as replacement_cache

L4, L40S, H100 = ("NVIDIA L4", 23034), ("NVIDIA L40S", 46068), ("NVIDIA H100 80GB HBM3", 81559)
MEMORY = names.MEMORY_RESOURCE


def node(name: str, models: list[tuple[str, int]], used: dict[int, int] | None = None,
         labels: dict | None = None) -> placement.Node:
    used = used or {}
    cards = tuple(placement.Card(k, 100, used.get(k, 0), f"GPU-{name}-{k}", model, mib)
                  for k, (model, mib) in enumerate(models))
    all_labels = {names.HOSTNAME_LABEL: name, **{names.card_memory_label(c.index): str(c.memory_mib) for c in cards}}
    return placement.Node(name, {**all_labels, **(labels or {})}, cards=cards)


def fleet(used: dict[str, dict[int, int]] | None = None) -> placement.View:
    used = used or {}
    return placement.View((
        node("small-a", [L4] * 4, used.get("small-a")),
        node("small-b", [L4] * 4, used.get("small-b")),
        node("medium", [L40S] * 4, used.get("medium")),
        node("large", [H100] * 8, used.get("large")),
        node("mixed", [L4, L40S, H100, H100], used.get("mixed"), labels={"pool": "mixed"}),
    ))


def memory_container(name: str = "main", ask: str = "12Gi", where: str = "both") -> dict:
    c = podmaker.container(name)
    if where in ("both", "limits"):
        c["resources"]["limits"][MEMORY] = ask
    if where in ("both", "requests"):
        c["resources"]["requests"][MEMORY] = ask
    return c


def decide(obj: dict, view: placement.View | None, policy: Policy | None = None, seed: str = "") -> decisions.Decision:
    return decisions.decide(decisions.Request(copy.deepcopy(obj), obj["kind"], seed=seed), policy or Policy(), view)


def admitted(obj: dict, decision: decisions.Decision) -> dict:
    assert decision.allowed, decision.message
    return applypatch.admit(obj, applypatch.make_patch(obj, decision.obj))


def required_terms(obj: dict) -> list[dict]:
    return obj["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]


def schedulable_on(obj: dict, view: placement.View) -> set[str]:
    """The nodes the scheduler may bind the admitted pod to, capacity aside."""
    ask = placement.ask_from_spec(obj["spec"], 0, None)
    return {n.name for n in view.nodes if placement.eligible(n, ask)}


def card_size(view: placement.View, node_name: str, k: int) -> int:
    return next(c.memory_mib for n in view.nodes if n.name == node_name for c in n.cards if c.index == k)


@pytest.mark.parametrize(("ask", "size", "shares"), [
    ("12Gi", 23034, 54),  # ceil(12288 x 100 / 23034) = ceil(53.3)
    ("20Gi", 23034, 89),
    ("24Gi", 46068, 54),  # 24576 MiB is more than an L4's 23034: the next size
    ("30Gi", 46068, 67),
    ("60Gi", 81559, 76),
    ("81559Mi", 81559, 100),  # a whole card of the largest size
    ("500M", 23034, 3),  # decimal units: 476.8 MiB, rounded up to 477 MiB
])
def test_shares_are_computed_for_the_smallest_card_that_holds_the_ask(ask, size, shares):
    view = fleet()
    pod = podmaker.pod(memory_container(ask=ask))
    decision = decide(pod, view)
    out = admitted(pod, decision)
    k, node_name = decision.card, decision.node
    assert card_size(view, node_name, k) == size
    limits = out["spec"]["containers"][0]["resources"]["limits"]
    assert {key: v for key, v in limits.items() if key.startswith("gpushard.io/")} == {
        names.SHARES_RESOURCE: str(shares), f"{names.CARD_PREFIX}{k}": str(shares)}
    assert MEMORY not in out["spec"]["containers"][0]["resources"]["requests"]
    assert out["metadata"]["annotations"][names.SHARES_ANNOTATION] == str(shares)
    assert [x.message for x in decision.findings if x.rule == f.MEMORY_SIZED] == [
        f"gpushard: the pod asks {out['metadata']['annotations'][names.MEMORY_ANNOTATION]} MiB of GPU memory: "
        f"{shares} shares of card {k}, which has {size} MiB ({shares * size // 100} MiB held)"]
    assert decision.audit_annotations[f.MEMORY_SIZED] == decision.findings[-1].message
    # The decision is on the pod, for the record; a memory ask that fits is no warning.
    assert decision.warnings == []
    assert out["metadata"]["annotations"][names.CARD_MEMORY_ANNOTATION] == str(size)
    assert required_terms(out) == [{"matchExpressions": [
        {"key": f"gpushard.io/card-{k}.memory-mib", "operator": "In", "values": [str(size)]}]}]
    # The scheduler may bind it only where card k has that size, the mixed node included when its
    # card k does, and never where card k is another size.
    expected = {n.name for n in view.nodes for c in n.cards if c.index == k and c.memory_mib == size}
    assert schedulable_on(out, view) == expected
    assert node_name in expected


def test_the_annotation_records_the_memory_asked_and_a_second_pass_changes_nothing():
    view = fleet()
    pod = podmaker.pod(memory_container("a", "6Gi"), memory_container("b", "2Gi"))
    decision = decide(pod, view, seed="uid-1")
    out = admitted(pod, decision)
    assert out["metadata"]["annotations"][names.MEMORY_ANNOTATION] == str(8 * 1024)
    # Per container: ceil(6144 x 100 / 23034) = 27 and ceil(2048 x 100 / 23034) = 9.
    shares = [c["resources"]["limits"][names.SHARES_RESOURCE] for c in out["spec"]["containers"]]
    assert shares == ["27", "9"]
    assert decision.shares == 36
    again = decide(out, view, seed="uid-1")
    assert again.allowed and applypatch.make_patch(out, again.obj) == []
    assert not [x for x in again.findings if x.severity != f.WARN]


def test_the_largest_size_first_when_the_policy_says_so():
    view = fleet()
    pod = podmaker.pod(memory_container(ask="12Gi"))
    decision = decide(pod, view, Policy(memory_size="largest"))
    assert card_size(view, decision.node, decision.card) == 81559
    assert decision.shares == 16  # ceil(12288 x 100 / 81559) = ceil(15.07)


def test_a_full_size_sends_the_ask_to_the_next_one():
    full = {k: 100 for k in range(4)}
    view = fleet({"small-a": full, "small-b": full, "mixed": {0: 100}})
    decision = decide(podmaker.pod(memory_container(ask="12Gi")), view)
    assert decision.node in ("medium", "mixed")
    assert card_size(view, decision.node, decision.card) == 46068
    assert decision.shares == 27  # ceil(12288 x 100 / 46068) = ceil(26.7)


def test_binpack_takes_the_fullest_card_of_the_size_and_spread_the_emptiest():
    view = fleet({"small-b": {2: 40}, "mixed": {0: 10}})
    pod = podmaker.pod(memory_container(ask="12Gi"))
    binpack = decide(pod, view)
    assert (binpack.node, binpack.card) == ("small-b", 2)
    spread = decide(pod, view, Policy(placement="spread"))
    assert card_size(view, spread.node, spread.card) == 23034
    assert (spread.node, spread.card) not in (("small-b", 2), ("mixed", 0))


def test_a_node_selector_keeps_its_meaning():
    view = fleet()
    pod = podmaker.pod(memory_container(ask="12Gi"), spec={"nodeSelector": {"pool": "mixed"}})
    decision = decide(pod, view)
    out = admitted(pod, decision)
    assert (decision.node, decision.card) == ("mixed", 0)
    assert out["spec"]["nodeSelector"] == {"pool": "mixed"}
    assert schedulable_on(out, view) == {"mixed"}
    # 30Gi on the mixed node: its card 1 (48 GB) is the smallest that holds it there.
    decision = decide(podmaker.pod(memory_container(ask="30Gi"), spec={"nodeSelector": {"pool": "mixed"}}), view)
    assert (decision.node, decision.card, decision.shares) == ("mixed", 1, 67)


def test_the_authors_required_terms_are_kept_and_anded():
    view = fleet()
    terms = [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["mixed"]}]},
             {"matchExpressions": [{"key": names.HOSTNAME_LABEL, "operator": "In", "values": ["large"]}]}]
    spec = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": terms}}}}
    pod = podmaker.pod(memory_container(ask="60Gi"), spec=spec)
    decision = decide(pod, view)
    out = admitted(pod, decision)
    written = required_terms(out)
    assert len(written) == 2
    expression = placement.card_memory_expression(decision.card, 81559)
    for mine, theirs in zip(written, terms, strict=True):
        assert mine["matchExpressions"] == [*theirs["matchExpressions"], expression]
    assert schedulable_on(out, view) <= {"mixed", "large"}
    assert decision.node in schedulable_on(out, view)


def test_no_room_anywhere_waits_on_the_smallest_size_the_pods_nodes_offer():
    full4, full8 = {k: 100 for k in range(4)}, {k: 100 for k in range(8)}
    view = fleet({"small-a": full4, "small-b": full4, "medium": full4, "large": full8, "mixed": full4})
    pod = podmaker.pod(memory_container(ask="12Gi"))
    decision = decide(pod, view, seed="burst-7")
    out = admitted(pod, decision)
    assert [x.rule for x in decision.findings] == [f.NO_ROOM, f.MEMORY_SIZED]
    assert "23034 MiB" in decision.findings[0].message
    assert decision.shares == 54
    assert required_terms(out)[0]["matchExpressions"][0]["values"] == ["23034"]


def test_an_ask_above_every_card_is_denied_naming_the_largest():
    decision = decide(podmaker.pod(memory_container(ask="100Gi")), fleet())
    assert not decision.allowed and decision.code == 403
    assert [x.rule for x in decision.findings] == [f.MEMORY_ABOVE_CARD]
    assert decision.message == ("gpushard: the pod asks 102400 MiB of GPU memory, more than the largest card "
                                "holds (NVIDIA H100 80GB HBM3, 81559 MiB); ask at most 81559Mi")


def test_the_sum_of_a_pods_containers_counts_against_one_card():
    # 50Gi + 40Gi: each fits an H100, both together do not.
    pod = podmaker.pod(memory_container("a", "50Gi"), memory_container("b", "40Gi"))
    decision = decide(pod, fleet())
    assert not decision.allowed
    assert "92160 MiB" in decision.message
    # An init container runs before the app containers: the pod needs the larger of the two.
    pod = podmaker.pod(memory_container("app", "12Gi"), init=(memory_container("load", "20Gi"),))
    decision = decide(pod, fleet())
    assert decision.allowed and decision.shares == 89  # the init container's 20Gi on an L4
    assert decision.obj["metadata"]["annotations"][names.MEMORY_ANNOTATION] == str(20 * 1024)


@pytest.mark.parametrize(("containers", "snippet"), [
    ([memory_container("a", "12Gi"), podmaker.container("b", "0.25")],
     'container "a" asks gpushard.io/memory 12Gi while "b" asks a share of a card'),
    ([memory_container("a", "12Gi"), podmaker.container("b", "20", resource=names.SHARES_RESOURCE)],
     'container "a" asks gpushard.io/memory 12Gi while "b" asks a share of a card'),
    ([podmaker.container("a", "0.5", extra={MEMORY: "12Gi"})],
     'container "a" asks both gpushard.io/memory 12Gi and nvidia.com/gpu 0.5'),
    ([podmaker.container("a", "30", resource=names.SHARES_RESOURCE, extra={MEMORY: "12Gi"})],
     'container "a" asks both gpushard.io/memory 12Gi and gpushard.io/gpu 30'),
    ([podmaker.container("a", "30", resource="gpushard.io/card-1", extra={MEMORY: "12Gi"})],
     'container "a" asks both gpushard.io/memory 12Gi and gpushard.io/card-1'),
])
def test_memory_mixed_with_a_share_ask_is_denied(containers, snippet):
    decision = decide(podmaker.pod(*containers), fleet())
    assert not decision.allowed and decision.code == 403
    assert [x.rule for x in decision.findings if x.severity == f.DENY] == [f.MIXED_MEMORY]
    assert snippet in decision.message
    assert decision.message.startswith("gpushard: ")


@pytest.mark.parametrize(("value", "snippet"), [
    ("12 GiB", "asks gpushard.io/memory '12 GiB' in limits; that is not a quantity (write e.g. 12Gi or 20480Mi)"),
    ("-1Gi", "asks gpushard.io/memory '-1Gi'; a GPU ask cannot be negative"),
])
def test_a_bad_memory_quantity_is_denied_quoting_it(value, snippet):
    decision = decide(podmaker.pod(memory_container(ask=value)), fleet())
    assert not decision.allowed
    assert snippet in decision.message


def test_a_zero_memory_ask_is_no_gpu():
    decision = decide(podmaker.pod(memory_container(ask="0")), fleet())
    assert decision.allowed and decision.card is None
    env = podmaker.env_of(decision.obj["spec"]["containers"][0], names.VISIBLE_DEVICES_ENV)
    assert env == [names.VISIBLE_NONE]


def test_without_a_view_a_memory_ask_is_denied_and_says_why():
    decision = decide(podmaker.pod(memory_container(ask="12Gi")), None)
    assert not decision.allowed and decision.code == 403
    assert [x.rule for x in decision.findings] == [f.NO_VIEW]
    assert "no view of the cluster's cards" in decision.message
    # Fractions still pass without a view (correctness never depends on it).
    assert decide(podmaker.pod(podmaker.container("a", "0.25")), None).allowed


def test_a_view_whose_nodes_publish_no_sizes_denies_and_says_which_label():
    bare = placement.View((placement.Node("old-agent", {}, cards=(placement.Card(0, 100),)),))
    decision = decide(podmaker.pod(memory_container(ask="1Gi")), bare)
    assert not decision.allowed
    assert "gpushard.io/card-0.memory-mib" in decision.message


def test_a_memory_ask_in_requests_alone_reads_as_in_limits():
    view = fleet()
    pod = podmaker.pod(memory_container(ask="12Gi", where="requests"))
    decision = decide(pod, view)
    out = admitted(pod, decision)
    assert decision.shares == 54
    assert MEMORY not in out["spec"]["containers"][0]["resources"]["limits"]


def test_templates_keep_the_memory_ask_with_a_limit():
    deployment = podmaker.deployment(memory_container("a", "12Gi"), memory_container("b", "2Gi", where="requests"))
    decision = decide(deployment, None)
    out = admitted(deployment, decision)
    containers = out["spec"]["template"]["spec"]["containers"]
    assert [c["resources"]["limits"][MEMORY] for c in containers] == ["12Gi", "2Gi"]
    assert [c["resources"]["requests"][MEMORY] for c in containers] == ["12Gi", "2Gi"]
    again = decide(out, None)
    assert applypatch.make_patch(out, again.obj) == []
    # Each pod the workload makes is sized when it is created.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "d-1", "namespace": "team-a"},
           "spec": out["spec"]["template"]["spec"]}
    decision = decide(pod, fleet())
    assert decision.shares == 54 + 9


def test_the_isolation_cap_is_never_below_the_ask():
    for card_mib in (23034, 46068, 81559, 143771):
        for spc in (100, 1000, 7):
            for asked in (*range(1, 4000, 37), card_mib - 1, card_mib):
                ask = req.ContainerAsk("c", req.APP, "containers", 0, memory_mib=asked)
                shares = req.size([ask], card_mib, spc)
                assert shares <= spc
                assert isolation.memory_cap_mib(shares, card_mib, spc) >= asked
                # ... and one share fewer would be below it: the fewest shares that hold the ask.
                assert shares == 1 or isolation.memory_cap_mib(shares - 1, card_mib, spc) < asked


def test_the_memory_resource_name_is_configurable():
    policy = settings_mod.from_mapping({"resources": {"memory": "example.com/gpu-memory"},
                                    "policy": {"memorySize": "largest"}}).policy
    pod = podmaker.pod(podmaker.container("a", "12Gi", resource="example.com/gpu-memory"))
    decision = decide(pod, fleet(), policy)
    assert decision.allowed and card_size(fleet(), decision.node, decision.card) == 81559
    assert "example.com/gpu-memory" not in decision.obj["spec"]["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize(("config", "message"), [
    ({"policy": {"memorySize": "biggest"}}, "policy.memorySize: must be one of smallest, largest, got 'biggest'"),
    ({"resources": {"memory": "gpu-memory"}}, "resources.memory: 'gpu-memory' is not an extended resource name"),
    ({"resources": {"memory": "nvidia.com/gpu"}}, "resources.memory: 'nvidia.com/gpu' must differ"),
])
def test_bad_memory_settings_name_the_key(config, message):
    with pytest.raises(settings_mod.SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_mod.from_mapping(config)


def test_status_shows_the_memory_asked_and_the_card_size_beside_the_shares():
    pod = podmaker.pod(memory_container(ask="12Gi"), name="infer")
    decision = decide(pod, fleet())
    placed = copy.deepcopy(decision.obj)
    placed["spec"]["nodeName"] = decision.node
    k = decision.card
    inventory = [{"index": i, "uuid": f"GPU-{i}", "model": L4[0], "memoryMiB": L4[1]} for i in range(4)]
    cluster_node = {"metadata": {"name": decision.node, "annotations": {names.INVENTORY_ANNOTATION:
                                                                          json.dumps(inventory)}},
                    "status": {"allocatable": {f"{names.CARD_PREFIX}{i}": "100" for i in range(4)}}}
    fraction = podmaker.pod(podmaker.container("a", "0.25"), name="frac")
    fraction = decide(fraction, fleet()).obj
    fraction["spec"]["nodeName"] = "elsewhere"
    use = audit_rules.usage([cluster_node], [placed, fraction], Policy())
    # The cap is shown where isolation gives one (memory or mps); the ask always.
    table = auditing.status_table(use, capped=True)
    # 54 x 23034 / 100 = 12438 >= 12288
    assert "team-a/infer (54, 12438 MiB, asked 12288 MiB of a 23034 MiB card)" in table
    assert "team-a/infer (54, asked 12288 MiB of a 23034 MiB card)" in auditing.status_table(use)
    report = auditing.status_json(use, 100, capped=True)
    card = next(c for c in report["nodes"][0]["cards"] if c["index"] == k)
    assert card["pods"] == [{"namespace": "team-a", "name": "infer", "shares": 54, "memoryMiB": 12438,
                             "memoryAskedMiB": 12288, "sizedForMiB": 23034}]


def test_the_replacer_reads_a_memory_pod_as_sized_afresh_when_made_again():
    decision = decide(podmaker.pod(memory_container(ask="12Gi")), fleet())
    listed = {**decision.obj, "status": {"phase": "Pending"}}
    listed["metadata"] = {**listed["metadata"], "uid": "u1", "creationTimestamp": "2026-01-01T00:00:00Z"}
    waiting = replacement_cache.read_pinned(listed, Policy()).waiting
    assert waiting.sized and (waiting.card, waiting.shares) == (decision.card, 54)
    fraction = decide(podmaker.pod(podmaker.container("a", "0.25")), fleet()).obj
    fraction = {**fraction, "status": {"phase": "Pending"}}
    assert not replacement_cache.read_pinned(fraction, Policy()).waiting.sized


SIZES_MIB = (23034, 46068, 81559, 143771)


@st.composite
def mixed_views(draw):
    nodes = []
    for i in range(draw(st.integers(min_value=1, max_value=6))):
        count = draw(st.integers(min_value=1, max_value=4))
        cards = tuple(placement.Card(k, 100, draw(st.integers(min_value=0, max_value=100)), f"GPU-{i}-{k}",
                                     "model", draw(st.sampled_from(SIZES_MIB))) for k in range(count))
        labels = {names.card_memory_label(c.index): str(c.memory_mib) for c in cards}
        if draw(st.booleans()):
            labels["pool"] = "p"
        nodes.append(placement.Node(f"n{i}", labels, cards=cards))
    return placement.View(tuple(nodes))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=mixed_views(), asks_mib=st.lists(st.integers(min_value=1, max_value=150_000), min_size=1, max_size=3),
       size_policy=st.sampled_from(policy_mod.MEMORY_SIZES), strategy=st.sampled_from(policy_mod.PLACEMENTS),
       selector=st.booleans(), seed=st.text(max_size=8))
def test_every_memory_decision_keeps_the_pod_on_a_card_size_that_holds_its_ask(view, asks_mib, size_policy, strategy,
                                                                             selector, seed):
    pod = podmaker.pod(*(memory_container(f"c{i}", f"{mib}Mi") for i, mib in enumerate(asks_mib)),
                       spec={"nodeSelector": {"pool": "p"}} if selector else None)
    pol = Policy(memory_size=size_policy, placement=strategy)
    decision = decide(pod, view, pol, seed=seed)
    asked = sum(asks_mib)
    holding = sorted({c.memory_mib for n in view.nodes for c in n.cards
                      if sum(-(-m * 100 // c.memory_mib) for m in asks_mib) <= 100})
    if not holding:
        assert not decision.allowed and [x.rule for x in decision.findings] == [f.MEMORY_ABOVE_CARD]
        largest = max(c.memory_mib for n in view.nodes for c in n.cards)
        assert f"{largest} MiB); ask at most {largest}Mi" in decision.message
        return
    out = admitted(pod, decision)
    size = decision.card_memory_mib
    assert size in holding and decision.memory_mib == asked
    shares = [-(-m * 100 // size) for m in asks_mib]
    assert decision.shares == sum(shares) <= 100
    assert isolation.memory_cap_mib(decision.shares, size, 100) >= asked
    written = [c["resources"]["limits"][names.SHARES_RESOURCE] for c in out["spec"]["containers"]]
    assert written == list(map(str, shares))
    k = decision.card
    # The scheduler may bind the pod only where card k has exactly that size (and the selector holds).
    allowed = schedulable_on(out, view)
    assert allowed == {n.name for n in view.nodes for c in n.cards if c.index == k and c.memory_mib == size
                       and (not selector or n.labels.get("pool") == "p")}
    eligible = [n for n in view.nodes if not selector or n.labels.get("pool") == "p"]
    room = sorted({c.memory_mib for n in eligible for c in n.cards
                   if c.memory_mib in holding and c.free >= sum(-(-m * 100 // c.memory_mib) for m in asks_mib)},
                  reverse=size_policy == "largest")
    if decision.node is not None:  # it fits there now: a card of the first size (in policy order) with room
        assert decision.node in allowed
        card = next(c for n in view.nodes if n.name == decision.node for c in n.cards if c.index == k)
        assert card.free >= decision.shares
        assert room and size == room[0]
    else:
        assert not room
        assert {x.rule for x in decision.findings} & {f.NO_ROOM, f.NO_MATCHING_NODE}


@settings(max_examples=100, deadline=None)
@given(view=mixed_views(), changes=st.lists(st.tuples(st.integers(min_value=0, max_value=7),
                                                       st.sampled_from((*SIZES_MIB, None)), st.booleans()),
                                             max_size=6))
def test_the_card_size_index_of_a_derived_view_equals_a_fresh_one(view, changes):
    view.sizes()  # paid for: derived views carry it
    for position, size, add_card in changes:
        if position >= len(view.nodes):  # a new node at the end
            name, cards, labels = f"new{position}", (placement.Card(0, 100),), {}
        else:
            old = view.nodes[position]
            name, labels = old.name, dict(old.labels)
            cards = old.cards + ((placement.Card(len(old.cards), 100),) if add_card else ())
        key = names.card_memory_label(len(cards) - 1)
        if size is None:
            labels.pop(key, None)
        else:
            labels[key] = str(size)
        view = placement.replace_nodes(view, {name: placement.Node(name, labels, cards=cards)})
        assert "_sizes" in view.__dict__  # derived, not built afresh
        assert view.sizes() == placement.View(view.nodes).sizes()
