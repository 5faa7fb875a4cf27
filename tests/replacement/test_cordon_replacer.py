"""The re-placement loop and a cordoned card, against the local API server (`gpushard replace`).

We test:
- a pod waiting on a full card is never evicted when the only room is on a cordoned card; once the
  card is uncordoned (the cache follows the Node by watch) the next pass evicts it, and its Event
  names that card;
- a pod waiting on a card cordoned on every node, whose owner recreates it, is evicted to another
  card with room; room on a cordoned card is never counted for it.
"""

from __future__ import annotations

from tests.cluster import kubeobjects as o
from tests.replacement.test_controller import (
    events,
    make,
    pods,
    seed_cluster,
    waiting_pod,
    workload,
)
from webhook.core import names, objects


def cordoned(node: dict, *cards: int) -> dict:
    node["metadata"]["annotations"] = {names.card_cordon_annotation(k): objects.write_cordon(objects.Cordon("fan"))
                                       for k in cards}
    return node


def test_no_pod_is_moved_onto_a_cordoned_card_and_one_is_once_it_is_uncordoned(fake):
    seed_cluster(fake, free_card1=60)  # the only room: card 1 of gpu-b
    fake.put("nodes", cordoned(o.node("gpu-b", {0: 100, 1: 100}), 1))
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    replacer = make(fake, pending_seconds=0)
    for _ in range(3):
        outcome = replacer.pass_once()
        assert outcome is not None and outcome.synced
        assert "web-x1" in pods(fake)
    assert events(fake) == []

    fake.put("nodes", o.node("gpu-b", {0: 100, 1: 100}))  # uncordoned
    o.wait_for(lambda: replacer.pass_once() and "web-x1" not in pods(fake), what="the eviction after the uncordon")
    (event,) = events(fake)
    assert "while card 1 of node gpu-b has" in event["message"]


def test_a_pod_waiting_on_a_card_cordoned_everywhere_is_moved_where_another_has_room(fake):
    fake.put("nodes", cordoned(o.node("gpu-a", {0: 100, 1: 100}), 0))
    fake.put("nodes", cordoned(o.node("gpu-b", {0: 100, 1: 100}), 0, 1))
    fake.put("pods", o.pod("part-a1", 1, 50, "gpu-a"))
    fake.put("replicasets", workload("ReplicaSet", "web"))
    fake.put("pods", waiting_pod("web-x1", 0, 25, ("ReplicaSet", "web")))
    replacer = make(fake, pending_seconds=0)
    o.wait_for(lambda: replacer.pass_once() and "web-x1" not in pods(fake), what="the eviction")
    (event,) = events(fake)
    # Card 1 of gpu-b is empty but cordoned; card 1 of gpu-a has 50 free.
    assert "card 0 has no room for 25 shares" in event["message"]
    assert "while card 1 of node gpu-a has" in event["message"]
