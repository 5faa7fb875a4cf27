"""Which replica a webhook is, and what it does with it.

We test:
- ``I/N`` is read, and anything else gets one line naming the setting and quoting the value; `gpushard serve
  --replica` refuses a bad one with exit status 2 before anything starts;
- over tests/fakekube.py as the API server, a pod's rank among its Service's ready endpoints (EndpointSlices
  labelled with the Service's name; another Service's are not read; an endpoint not ready does not count), kept
  by watch: a replica going away or becoming ready changes the rank; a replica not among the ready, or alone,
  tries every card alike; the environment chooses the source ($GPUSHARD_REPLICA, else $POD_NAME and
  $POD_NAMESPACE, else none);
- placement: each replica's share of the cards (card k of a node whose name hashes to h is replica (h + k) mod
  N's) is even over the cards whatever N, and every card is exactly one replica's; replicas with the same view
  choose cards of their own share while those have room, and any card once they have none; a pinned pod keeps
  its pin; the share survives the view's updates;
- admission: the app hands the replica's indexes to every choice;
- a replica's workers (`serve --workers W`): worker j of W tries part r * W + j of N * W, of a fixed partition,
  of one kept by watch (following its changes) and of none; the parts of all workers of all replicas are every
  card exactly once; the gunicorn master hands each new worker the lowest index no live worker holds (a worker
  started again takes the part of the one it replaces), and the worker reads it from $GPUSHARD_WORKER; one
  worker alone keeps the replica's share.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from tests.admission import objects
from tests.cluster import kubeobjects as o
from webhook import cli
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.cluster import peers, static
from webhook.core import placement


def endpoint_slice(name: str, pods: dict[str, bool | None], service: str = "gpushard") -> dict:
    endpoints = []
    for pod, ready in pods.items():
        endpoint = {"addresses": ["10.0.0.1"],
                    "targetRef": {"kind": "Pod", "name": pod, "namespace": "gpushard-system"}}
        if ready is not None:
            endpoint["conditions"] = {"ready": ready}
        endpoints.append(endpoint)
    return {"metadata": {"name": name, "namespace": "gpushard-system", "labels": {peers.SERVICE_LABEL: service}},
            "addressType": "IPv4", "endpoints": endpoints}


@pytest.mark.parametrize("text", ["2", "1/1", "3/2", "-1/2", "a/b", "1/0", "", "1/2/3"])
def test_a_bad_replica_setting_names_itself_and_the_value(text):
    with pytest.raises(peers.ReplicaError) as caught:
        peers.parse(text, "--replica")
    assert str(caught.value) == f"--replica: expected I/N with 0 <= I < N (replica I of N), got {text!r}"


def test_serve_refuses_a_bad_replica_with_exit_2(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--cert", "c", "--key", "k", "--replica", "2/2"])
    assert caught.value.code == 2
    assert "--replica: I/N: expected I/N with 0 <= I < N (replica I of N), got '2/2'" in capsys.readouterr().err


def test_partitions_name_their_share():
    assert peers.parse("1/3").share() == (1, 3)
    assert peers.parse("0/1").share() is None  # alone: every card alike


def test_the_rank_among_the_services_ready_pods_is_kept_by_watch(fake):
    fake.put("endpointslices", endpoint_slice("gpushard-a", {"webhook-c": True, "webhook-a": None}))
    fake.put("endpointslices", endpoint_slice("gpushard-b", {"webhook-b": True, "webhook-d": False}))
    fake.put("endpointslices", endpoint_slice("other", {"webhook-0": True}, service="elsewhere"))
    found = peers.Peers.start(environ={"POD_NAME": "webhook-b", "POD_NAMESPACE": "gpushard-system"},
                              api_client=fake.api_client(), watch_timeout=5, backoff=(0.05, 0.3))
    try:
        # Ready: a (no condition counts as ready), b, c; d is not ready, and webhook-0 is another Service's.
        o.wait_for(lambda: found.partition() == peers.Partition(1, 3), what="rank 1 of 3")
        assert found.share() == (1, 3)
        fake.put("endpointslices", endpoint_slice("gpushard-a", {"webhook-c": False, "webhook-a": True}))
        o.wait_for(lambda: found.partition() == peers.Partition(1, 2), what="rank 1 of 2")
        fake.put("endpointslices", endpoint_slice("gpushard-b", {"webhook-d": True}))  # b itself not ready
        o.wait_for(lambda: found.partition() is None, what="not among the ready")
        assert found.share() is None
        fake.delete("endpointslices", "gpushard-a", "gpushard-system")
        fake.put("endpointslices", endpoint_slice("gpushard-b", {"webhook-b": True}))
        o.wait_for(lambda: found.partition() == peers.Partition(0, 1), what="alone")
        assert found.share() is None
    finally:
        found.close()


def test_the_environment_chooses_the_source():
    assert peers.Peers.start(environ={"GPUSHARD_REPLICA": "2/3"}).share() == (2, 3)
    assert peers.Peers.start(environ={}).share() is None  # not in a pod: every card alike
    with pytest.raises(peers.ReplicaError, match=r"\$GPUSHARD_REPLICA: expected I/N"):
        peers.Peers.start(environ={"GPUSHARD_REPLICA": "three"})


def empty_view(nodes: int = 4, cards: int = 4, used=lambda i, k: 0) -> placement.View:
    return placement.View(tuple(placement.Node(f"n{i}", cards=tuple(placement.Card(k, 100, used(i, k))
                                                                    for k in range(cards))) for i in range(nodes)))


def owner(view: placement.View, node: str, k: int, count: int) -> int:
    every = (1 << view.size) - 1
    i = next(i for i, n in enumerate(view.nodes) if n.name == node)
    return next(r for r in range(count) if view.share_of(every, r, count).get(k, 0) >> i & 1)


@pytest.mark.parametrize("count", [2, 3, 5])
def test_every_card_is_one_replicas_and_the_shares_are_even(count):
    view = empty_view(nodes=300, cards=8)
    every = (1 << view.size) - 1
    shares = [sum(bin(bits).count("1") for bits in view.share_of(every, r, count).values()) for r in range(count)]
    assert sum(shares) == 300 * 8  # every card is someone's, and no card is two replicas'
    for r in range(count):
        for s in range(r + 1, count):
            mine, theirs = view.share_of(every, r, count), view.share_of(every, s, count)
            assert not any(mine[k] & theirs[k] for k in mine)
    assert max(shares) - min(shares) <= 0.12 * 300 * 8 / count, shares  # within a hash's spread of even
    # Each replica has cards of every index (with three replicas and eight cards, index-only shares would give
    # one replica two indexes for three's traffic).
    assert all(all(view.share_of(every, r, count)[k] for k in range(8)) for r in range(count))


def test_replicas_with_one_view_fill_their_own_share_then_any():
    view = empty_view(nodes=8)
    for rank in (0, 1):
        for seed in range(20):
            choice = placement.choose(view, placement.Ask(shares=25), "binpack", random.Random(seed), (rank, 2))
            assert choice.fits and owner(view, choice.node, choice.card, 2) == rank
    # Replica 1's cards full: any card with room.
    full = empty_view(nodes=8, used=lambda i, k: 100 if owner(view, f"n{i}", k, 2) == 1 else 0)
    choice = placement.choose(full, placement.Ask(shares=25), "binpack", None, (1, 2))
    assert choice.fits and owner(view, choice.node, choice.card, 2) == 0
    # A pinned pod keeps its pin.
    choice = placement.choose(view, placement.Ask(shares=25, pin=3), "binpack", None, (1, 2))
    assert choice.card == 3


def test_the_share_follows_the_views_updates():
    view = empty_view(nodes=8)
    every = (1 << view.size) - 1
    before = view.share_of(every, 0, 2)
    # A remembered choice (one card's shares) and a watch event (a node's shares) keep every node where it was.
    node = view.nodes[3]
    fuller = placement.Node(node.name, cards=tuple(placement.Card(c.index, 100, 50) for c in node.cards))
    after = placement.replace_nodes(view, {node.name: fuller})
    assert after.share_of(every, 0, 2) == before
    # A node removed shifts the positions: its share is built again from the names.
    fewer = placement.replace_nodes(view, {view.nodes[0].name: None})
    assert owner(fewer, "n5", 2, 2) == owner(view, "n5", 2, 2)


def test_admission_hands_the_replicas_share_to_the_choice(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(json.dumps({"nodes": [{"name": f"n{i}", "cards": [{"index": k} for k in range(4)]}
                                             for i in range(4)]}))
    view = static.StaticView(static.load(cluster, 100))
    for rank in (0, 1):
        client = app_mod.create_app(settings_mod.Settings(), view,
                                    peers=peers.Fixed(peers.Partition(rank, 2))).test_client()
        for _ in range(3):
            obj = objects.pod(objects.container("train", "0.25"))
            review = objects.review(obj)
            resp = client.post("/mutate", data=json.dumps(review), content_type="application/json")
            new = objects.patched(obj, objects.response_of(resp.get_json(), review["request"]["uid"]))
            k = int(new["metadata"]["annotations"]["gpushard.io/card"])
            node = placement.preferred_node(new["spec"])
            assert owner(view.snapshot(), node, k, 2) == rank


@pytest.mark.parametrize("replica, expected", [
    (peers.Fixed(peers.Partition(1, 3)), [(2, 6), (3, 6)]),
    (peers.Fixed(None), [(0, 2), (1, 2)]),
])
def test_each_worker_takes_its_part_of_the_replicas_share(replica, expected):
    assert [peers.Workers(replica, j, 2).share() for j in range(2)] == expected


def test_the_workers_parts_follow_a_rank_kept_by_watch(fake):
    fake.put("endpointslices", endpoint_slice("gpushard-a", {"web-a": True, "web-b": True}))
    replica = peers.Peers.start(environ={"POD_NAME": "web-b", "POD_NAMESPACE": "gpushard-system"},
                                api_client=fake.api_client(), watch_timeout=5, backoff=(0.05, 0.3))
    try:
        worker = peers.for_worker(replica, {peers.WORKER_ENV: "2/4"})
        o.wait_for(lambda: worker.share() == (1 * 4 + 2, 2 * 4), what="the rank of web-b, split")
        fake.put("endpointslices", endpoint_slice("gpushard-a", {"web-b": True}))
        o.wait_for(lambda: worker.share() == (2, 4), what="web-b alone: the workers split every card")
    finally:
        worker.close()


def test_every_workers_part_of_every_replica_is_every_card_once():
    view = empty_view(nodes=50, cards=8)
    every = (1 << view.size) - 1
    parts = [peers.Workers(peers.Fixed(peers.Partition(r, 3)), j, 2).share() for r in range(3) for j in range(2)]
    assert sorted(parts) == [(i, 6) for i in range(6)]
    seen = {(i, k): 0 for i in range(view.size) for k in range(8)}
    for rank, count in parts:
        for k, bits in view.share_of(every, rank, count).items():
            for i in range(view.size):
                seen[(i, k)] += bits >> i & 1
    assert set(seen.values()) == {1}  # every card of every node is one worker's part


class Arbiter:
    """What gpushard's gunicorn hooks read of gunicorn's master: its live workers and how many it keeps."""

    def __init__(self, workers: int):
        self.WORKERS: dict[int, object] = {}
        self.num_workers = workers


class Worker:
    pass


def test_the_master_hands_each_worker_the_lowest_free_index(monkeypatch):
    from webhook.admission import serving

    master = Arbiter(3)
    started = []
    for pid in (10, 11, 12):
        worker = Worker()
        serving._pre_fork(master, worker)
        master.WORKERS[pid] = worker
        started.append(worker.gpushard_index)
    assert started == [0, 1, 2]
    del master.WORKERS[11]  # worker 1 died: the one started in its place takes its part
    again = Worker()
    serving._pre_fork(master, again)
    assert again.gpushard_index == 1
    monkeypatch.delenv(peers.WORKER_ENV, raising=False)
    serving._post_fork(master, again)
    assert os.environ[peers.WORKER_ENV] == "1/3"
    assert peers.for_worker(peers.Fixed(None)).share() == (1, 3)


def test_one_worker_keeps_the_replicas_share(monkeypatch):
    from webhook.admission import serving

    monkeypatch.delenv(peers.WORKER_ENV, raising=False)
    master, worker = Arbiter(1), Worker()
    serving._pre_fork(master, worker)
    serving._post_fork(master, worker)
    assert peers.WORKER_ENV not in os.environ
    replica = peers.Fixed(peers.Partition(1, 2))
    assert peers.for_worker(replica, {}) is replica
    assert peers.for_worker(replica, {peers.WORKER_ENV: "0/1"}) is replica
    with pytest.raises(peers.ReplicaError, match=r"\$GPUSHARD_WORKER: expected I/N"):
        peers.for_worker(replica, {peers.WORKER_ENV: "one"})
