"""The replacer and the pods the kubelet refused at admission (after a node reboot, before the agent registered),
against the local API server.

We test:
- a refused pod of a ReplicaSet gets one Warning Event naming the node, the kubelet's message and its
  controller; with replacement.cleanupRefused it is deleted instead, through the Eviction API with its uid as
  precondition, and its Event says so; without, it stays;
- a bare refused pod gets its Event and is never deleted, cleanup on or off;
- a pod failed for another reason, and a refused pod that asked no gpushard resource, get nothing;
- a second pass records no second Event, and a replica that takes over (a pass that lists) gets 409 for the
  same Event name and records none either; the leader finds the pods in its watch, with no list of its own;
- a refused pod its controller deleted before the replacer could is neither deleted nor reported;
- a dry run only logs;
- /metrics on the health port: the refused pods per node, the pods deleted, and whether this replica leads.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.cluster import kubeobjects as o
from tests.replacement.conftest import STARTED
from webhook import settings as settings_mod
from webhook.core import names
from webhook.replacement import controller

NOW = 1_800_000_000.0
NS = "gpushard-system"
MESSAGE = ("Pod was rejected: Allocate failed due to no healthy devices present; cannot allocate unhealthy devices "
           "gpushard.io/card-0, which is unexpected")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused_pod(name: str, owner: tuple[str, str] | None = None, reason: str = "UnexpectedAdmissionError",
                node: str = "gpu-a", limits: dict | None = None) -> dict:
    obj = o.pod(name, 0, 25, node, phase="Failed", namespace="team")
    obj["status"].update({"reason": reason, "message": MESSAGE})
    if limits is not None:
        obj["spec"]["containers"][0]["resources"] = {"limits": limits, "requests": dict(limits)}
    if owner:
        kind, owner_name = owner
        obj["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": kind, "name": owner_name,
                                               "uid": f"uid-{owner_name}", "controller": True}]
    return obj




def make(fake, identity: str = "r1", cleanup: bool = False, **options) -> controller.Replacer:
    settings = settings_mod.Settings(replacement=settings_mod.Replacement(cleanup_refused=cleanup))
    options.setdefault("backoff", (0.05, 0.3))
    replacer = controller.Replacer(fake.api_client(), settings, identity, NS, clock=options.pop("clock", Clock()),
                                  wall=lambda: NOW, **options)
    STARTED.append(replacer)
    return replacer


@pytest.fixture
def cluster(fake):
    fake.put("nodes", o.node("gpu-a", {0: 100, 1: 100}))
    fake.put("nodes", o.node("gpu-b", {0: 100}))
    return fake


def events(fake) -> list[dict]:
    return list(fake.objects["events"].values())


def evictions(fake) -> list[tuple[str, dict]]:
    return [(path, json.loads(body)) for method, path, body in fake.requests
            if method == "POST" and path.endswith("/eviction")]


def event_posts(fake) -> int:
    return sum(1 for method, path, _ in fake.requests if method == "POST" and path.endswith("/events"))


@pytest.mark.parametrize("cleanup", [False, True])
def test_a_refused_replicaset_pod_gets_one_event_and_is_deleted_only_with_cleanup(cluster, cleanup):
    cluster.put("pods", refused_pod("web-x1", ("ReplicaSet", "web-7d9")))
    replacer = make(cluster, cleanup=cleanup)
    outcome = replacer.pass_once()
    assert [p.name for p in outcome.admission_refused] == ["web-x1"]
    (event,) = events(cluster)
    assert event["reason"] == names.REFUSED_AT_ADMISSION_REASON and event["type"] == "Warning"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "web-x1", "namespace": "team",
                                       "uid": "uid-team-web-x1"}
    assert event["source"] == {"component": names.REPLACER_COMPONENT}
    message = event["message"]
    assert message.startswith("gpushard: the kubelet on node gpu-a refused this pod at admission "
                              f"(UnexpectedAdmissionError: {MESSAGE})")
    if cleanup:
        assert ("team", "web-x1") not in cluster.objects["pods"]
        ((path, body),) = evictions(cluster)
        assert path.endswith("/namespaces/team/pods/web-x1/eviction")
        assert body["deleteOptions"] == {"preconditions": {"uid": "uid-team-web-x1"}}
        assert "deleted (replacement.cleanupRefused: true), so that the new pod its controller ReplicaSet/web-7d9 " \
               "makes is the one that runs" in message
        assert [p.name for p in outcome.cleaned] == ["web-x1"] and event["metadata"]["name"].endswith(".deleted")
    else:
        assert ("team", "web-x1") in cluster.objects["pods"] and evictions(cluster) == []
        assert "its controller ReplicaSet/web-7d9 makes a new pod; this one stays, Failed, until deleted" in message
        assert [p.name for p in outcome.reported] == ["web-x1"] and outcome.cleaned == []

    # The next pass finds nothing new to say: no second Event, no second eviction; nor a list (the watch told it).
    posts = event_posts(cluster)
    assert replacer.pass_once().reported == []
    assert event_posts(cluster) == posts and len(events(cluster)) == 1 and len(evictions(cluster)) == int(cleanup)
    listed = [path for method, path, _ in cluster.requests
              if method == "GET" and path.startswith("/api/v1/pods?") and "watch=" not in path]
    assert len(listed) == 1


@pytest.mark.parametrize("cleanup", [False, True])
def test_a_bare_refused_pod_gets_its_event_and_is_never_deleted(cluster, cleanup):
    cluster.put("pods", refused_pod("notebook"))
    replacer = make(cluster, cleanup=cleanup)
    replacer.pass_once()
    replacer.pass_once()
    (event,) = events(cluster)
    assert event["message"].endswith("a bare pod: nothing makes it again; delete this one, then create it again "
                                     "from its own manifest (not from kubectl get -o yaml: that one is pinned to the "
                                     "old card and node)")
    assert ("team", "notebook") in cluster.objects["pods"] and evictions(cluster) == []


def test_other_failed_pods_and_pods_that_asked_no_shares_are_left_alone(cluster):
    cluster.put("pods", refused_pod("evicted-1", ("ReplicaSet", "web-7d9"), reason="Evicted"))
    cluster.put("pods", refused_pod("whole-1", ("ReplicaSet", "web-7d9"), limits={"nvidia.com/gpu": "1"}))
    cluster.put("pods", o.pod("running-1", 0, 25, "gpu-a", namespace="team"))
    outcome = make(cluster, cleanup=True).pass_once()
    assert outcome.admission_refused == [] and events(cluster) == [] and evictions(cluster) == []
    assert {"evicted-1", "whole-1", "running-1"} <= {name for _ns, name in cluster.objects["pods"]}


def test_a_replica_that_takes_over_records_no_second_event(cluster, caplog):
    cluster.put("pods", refused_pod("web-x1", ("ReplicaSet", "web-7d9")))
    first = make(cluster, follow=False)  # `replace --once`: a pass that lists
    assert [p.name for p in first.pass_once().reported] == ["web-x1"]
    first.elector.release()
    second = make(cluster, "r2", follow=False)
    with caplog.at_level("WARNING"):
        outcome = second.pass_once()
    assert outcome is not None and [p.name for p in outcome.admission_refused] == ["web-x1"]
    assert outcome.reported == [] and len(events(cluster)) == 1  # its create got 409: recorded already
    assert not [r for r in caplog.records if "could not record" in r.getMessage()]
    posts = event_posts(cluster)
    second.pass_once()
    assert event_posts(cluster) == posts  # and it knows it from then on


def test_a_pod_its_controller_deleted_first_is_neither_deleted_nor_reported(cluster):
    cluster.put("pods", refused_pod("db-0", ("StatefulSet", "db")))
    # The StatefulSet controller deletes its failed pod and makes it again, between the watch and the eviction.
    cluster.before_eviction.append(lambda namespace, name: cluster.objects["pods"].pop((namespace, name)))
    outcome = make(cluster, cleanup=True).pass_once()
    assert outcome.cleaned == [] and outcome.reported == [] and events(cluster) == []


def test_a_dry_run_only_logs(cluster, caplog):
    cluster.put("pods", refused_pod("web-x1", ("ReplicaSet", "web-7d9")))
    cluster.put("pods", refused_pod("notebook"))
    replacer = make(cluster, cleanup=True, dry_run=True)
    with caplog.at_level("INFO"):
        replacer.pass_once()
        replacer.pass_once()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpushard: would")]
    assert len(said) == 2  # once each, not once a pass
    assert any(line.startswith("gpushard: would delete team/web-x1: the kubelet on node gpu-a") for line in said)
    assert any(line.startswith("gpushard: would record an Event on team/notebook:") for line in said)
    assert events(cluster) == [] and evictions(cluster) == []


def scrape(server) -> str:
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def test_metrics_show_the_refused_pods_per_node_the_deleted_and_the_leader(cluster):
    cluster.put("pods", refused_pod("web-x1", ("ReplicaSet", "web-7d9")))
    cluster.put("pods", refused_pod("notebook"))
    cluster.put("pods", refused_pod("lab", node="gpu-b"))
    a_clock = Clock()
    leader, standby = make(cluster, cleanup=True, clock=a_clock), make(cluster, "r2", clock=Clock())
    servers = [controller.serve_health(0, r) for r in (leader, standby)]
    try:
        assert "gpushard_replacer_leader 0.0" in scrape(servers[0])  # no pass yet
        leader.pass_once()
        assert standby.pass_once() is None
        text = scrape(servers[0])
        assert "gpushard_replacer_leader 1.0" in text
        # What is left after the cleanup: the two bare pods, one per node; the ReplicaSet's pod deleted.
        assert 'gpushard_replacer_refused_pods{node="gpu-a"} 1.0' in text
        assert 'gpushard_replacer_refused_pods{node="gpu-b"} 1.0' in text
        assert "gpushard_replacer_refused_pods_cleaned_total 1.0" in text
        text = scrape(servers[1])
        assert "gpushard_replacer_leader 0.0" in text and 'gpushard_replacer_refused_pods{' not in text
        assert "gpushard_replacer_refused_pods_cleaned_total 0.0" in text

        cluster.delete("pods", "lab", "team")  # deleted by hand: the node's series goes with it
        o.wait_for(lambda: all(p.name != "lab" for p in leader.cache.refused()), what="the deletion in the cache")
        a_clock.now += 1
        leader.pass_once()
        text = scrape(servers[0])
        assert 'node="gpu-b"' not in text and 'gpushard_replacer_refused_pods{node="gpu-a"} 1.0' in text
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
