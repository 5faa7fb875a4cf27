"""bench/costs.py: the time-slicing allocation the side-by-side bench counts against, and its readings of the
control plane's metrics."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import costs  # noqa: E402


def test_distributed_takes_a_replica_from_each_card_in_turn():
    # NVIDIA's distributed policy: the card with the fewest replicas allocated first, so a small pod on
    # an empty node already sees as many cards as it has replicas.
    allocated = [0] * 8
    assert costs.allocate(allocated, 100, 3) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert costs.allocate(allocated, 100, 10) == [1, 1, 1, 2, 2, 1, 1, 1]
    assert allocated == [2, 2, 2, 2, 2, 1, 1, 1]


def test_packed_fills_the_fullest_card_first():
    allocated = [0, 30, 0, 0]
    assert costs.allocate(allocated, 100, 75, costs.PACKED) == [5, 70, 0, 0]
    assert allocated == [5, 100, 0, 0]


def test_a_full_card_gives_no_more_replicas_and_a_node_cannot_give_more_than_it_has():
    allocated = [100, 99]
    assert costs.allocate(allocated, 100, 1) == [0, 1]
    with pytest.raises(ValueError, match="1 replicas asked, 0 free"):
        costs.allocate(allocated, 100, 1)
    with pytest.raises(ValueError, match="unknown allocation policy 'spread-thin'"):
        costs.allocate([0], 100, 1, "spread-thin")


def test_timeslice_counts_pods_that_see_several_cards_and_cards_past_one_cards_worth():
    # Two nodes of 2 cards of 100 replicas; pods allocated in bind order, then name.
    bound = [
        ("n1", 2.0, "b", 60),   # after "a": cards hold 50/50, takes 30+30 -> sees both
        ("n1", 1.0, "a", 100),  # first: 50 + 50 -> sees both
        ("n2", 1.0, "c", 1),    # one replica -> one card
    ]
    seen = costs.timeslice(bound, cards=2, replicas=100)
    assert (seen.pods, seen.spanning, seen.widest, seen.cards) == (3, 2, 2, 4)
    # n1's two cards: pods a (100) and b (60) may each use their whole ask on either: 160 > 100.
    assert seen.overcommitted_cards == 2
    packed = costs.timeslice(bound, cards=2, replicas=100, policy=costs.PACKED)
    # Packed: a fills card 0, b goes whole to card 1: nobody spans, nothing past one card.
    assert (packed.spanning, packed.overcommitted_cards, packed.widest) == (0, 0, 1)


def _sample(code: str, scope: str, subresource: str, verb: str, value: int) -> str:
    return (f'apiserver_request_total{{code="{code}",component="apiserver",dry_run="",group="",resource="pods",'
            f'scope="{scope}",subresource="{subresource}",verb="{verb}",version="v1"}} {value}\n')


APISERVER = ("# HELP apiserver_request_total [STABLE] Counter of apiserver requests\n"
             "# TYPE apiserver_request_total counter\n"
             + _sample("201", "resource", "", "POST", 10) + _sample("201", "resource", "binding", "POST", 7)
             + _sample("409", "resource", "", "POST", 1) + _sample("200", "namespace", "", "LIST", 4))
ETCD = "# TYPE etcd_debugging_mvcc_current_revision gauge\netcd_debugging_mvcc_current_revision 1200\n"


def test_requests_are_summed_by_verb_and_resource_across_codes():
    assert costs.requests_by_kind(APISERVER) == {("POST", "pods"): 11.0, ("POST", "pods/binding"): 7.0,
                                                 ("LIST", "pods"): 4.0}


def test_a_delta_is_per_pod_and_leaves_out_the_benchs_own_lists():
    before = costs.Counters.read(APISERVER, ETCD, {})
    after_text = APISERVER.replace("} 10\n", "} 30\n").replace("} 7\n", "} 27\n").replace("} 4\n", "} 14\n")
    after = costs.Counters.read(after_text, ETCD.replace("1200", "1260"), {})
    d = costs.delta(before, after, 20, own={("LIST", "pods"): 10})
    assert d.requests_total == 40
    assert d.per_pod(d.requests_total) == 2.0
    assert d.per_pod(d.etcd_writes) == 3.0
    assert d.top() == [("POST pods/binding", 1.0), ("POST pods", 1.0)]


def test_etcd_metrics_without_the_revision_are_named():
    with pytest.raises(ValueError, match="etcd_debugging_mvcc_current_revision"):
        costs.Counters.read(APISERVER, "etcd_server_has_leader 1\n", {})


def test_cpu_seconds_of_a_live_process_grow_and_of_a_gone_one_are_zero():
    first = costs.cpu_seconds(os.getpid())
    total = 0
    for i in range(3_000_000):
        total += i
    assert costs.cpu_seconds(os.getpid()) > first
    assert costs.cpu_seconds(2 ** 22 + 7) == 0.0


def test_ratio():
    assert costs.ratio(52.3, 52.8) == "0.99"
    assert costs.ratio(1.0, 0) == "n/a"


def _histogram(metric: str, labels: str, total: float, count: float) -> str:
    return f"{metric}_sum{{{labels}}} {total}\n{metric}_count{{{labels}}} {count}\n"


def test_timings_sum_only_the_series_that_match_and_are_per_pod_over_the_burst():
    steps = "apiserver_admission_step_admission_duration_seconds"
    text = (_histogram(steps, 'operation="CREATE",rejected="false",type="admit"', 0.5, 10)
            + _histogram(steps, 'operation="CREATE",rejected="true",type="admit"', 0.25, 2)
            + _histogram(steps, 'operation="UPDATE",rejected="false",type="admit"', 9.0, 9)
            + _histogram("apiserver_request_duration_seconds",
                         'component="apiserver",resource="pods",subresource="",verb="POST"', 1.0, 10)
            + _histogram("apiserver_request_duration_seconds",
                         'component="apiserver",resource="pods",subresource="binding",verb="POST"', 7.0, 10))
    assert costs.histogram_sum(text, steps, {"type": "admit", "operation": "CREATE"}) == (0.75, 12)
    before = costs.Counters.read(text, ETCD, {})
    assert before.timings["create"] == (1.0, 10)  # the binding subresource is not a create of a pod
    after = costs.Counters.read(text.replace("} 0.5\n", "} 2.5\n").replace("} 1.0\n", "} 3.0\n"), ETCD, {})
    d = costs.delta(before, after, 40)
    assert d.ms_per_pod()["mutating admission"] == 50.0
    assert d.ms_per_pod()["create"] == 50.0
    assert d.ms_per_pod()["webhooks"] == 0.0  # no series in the reading: nothing
    assert d.calls_per_pod()["mutating admission"] == 0.0 and d.calls_per_pod()["create"] == 0.0


def test_node_patches_are_setup_noise_not_a_setups_cost():
    patch = 'apiserver_request_total{code="200",resource="nodes",subresource="",verb="PATCH"}'
    before = costs.Counters.read(APISERVER + f"{patch} 5\n", ETCD, {})
    after_text = APISERVER.replace("} 10\n", "} 30\n") + f"{patch} 905\n"
    d = costs.delta(before, costs.Counters.read(after_text, ETCD.replace("1200", "2120"), {}), 20)
    assert d.requests_total == 20
    assert d.top() == [("POST pods", 1.0)]
    assert d.etcd_writes == 20  # 920 revisions, 900 of them the node patches


def test_why_stranded_names_what_took_each_waiting_pods_card():
    # Two nodes of two cards, 100 shares each; card 1 of n2 is empty, so every pending pod fits somewhere.
    # "b" chose n1, but the scheduler bound it on n2's card 0, which gpushard had promised "c": c waits there
    # (card 0 has 10 and 60 free, it asks 70). "d" waits on n1's card 0, filled by two pods that chose it.
    # "e" was admitted with no room in the view (no node chosen); "f" was bound where no node was chosen.
    pods = [("a", 60, 0, "n1", "n1"), ("b", 40, 0, "n1", "n2"), ("c", 70, 0, "n2", None),
            ("a2", 30, 0, "n1", "n1"), ("d", 65, 0, "n1", None), ("e", 20, 1, None, None), ("f", 10, 1, None, "n1")]
    counted = costs.why_stranded([p[1:] for p in pods], cards=4, shares_per_card=100)
    assert counted == {"moved": 1, "bound_without_preferred": 1, "no_room_at_admission": 1, "taken_by_moved": 1,
                       "taken_by_choosers": 1}
    # Once every card has pods, a pod larger than any card's room is not one a card could take: not counted.
    full = [(100, 1, "n2", "n2"), (95, 1, "n1", "n1"), (70, 0, "n2", None)]  # the most room: 60
    assert costs.why_stranded(full + [(60, 0, "n1", "n1"), (40, 0, "n2", "n2")], cards=4,
                              shares_per_card=100)["taken_by_choosers"] == 0
