"""The live view against a real local HTTP server speaking the Kubernetes API (tests/fakekube.py).

We test:
- the initial sync: cards from allocatable and the inventory annotation, labels, taints,
  readiness and cordon; pods' shares counted as Kubernetes counts them; unbound and finished
  pods hold nothing; nodes without gpushard cards stay out; only nodes labelled
  gpushard.io/cards (published by the agent) are listed and watched;
- node and pod events (added, modified, deleted) reach snapshot(); heartbeats change nothing;
- 410 Gone forces a relist; a dropped watch reconnects; injected API errors are retried;
- an unreachable API: snapshot() stays None, synced() False, and an admission decision still
  answers with the no-view warning;
- synced(): False until both lists complete, then True through reconnects;
- close() stops the watch threads; with no config at all, start() and open_view() give a view
  that never syncs;
- odd nodes (bad quantities, no Ready condition, a broken inventory) are read tolerantly;
- the config's view timeouts reach the view `serve` opens: a list slower than view.listTimeout is given up
  and retried, and each watch asks the API server for view.watchTimeout.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from tests.cluster import kubeobjects as o
from webhook import cluster
from webhook import settings as settings_mod
from webhook.cluster import kube
from webhook.core import decisions, names, objects, placement
from webhook.core import findings as f
from webhook.core.policy import Policy


def _node(view, name):
    return next((n for n in view.nodes if n.name == name), None)


def test_initial_sync_reads_nodes_and_pods(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100, 1: 100}, labels={"pool": "train"},
                             taints=[{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}],
                             inventory=[{"index": 0, "uuid": "GPU-0", "model": "H100", "memoryMiB": 81559},
                                        {"index": 1, "uuid": "GPU-1", "model": "H100", "memoryMiB": 81559},
                                        {"index": 2, "uuid": "GPU-2", "model": "H100", "memoryMiB": 81559}]))
    fake.put("nodes", o.node("gpu-b", {0: 100}, ready=False, unschedulable=True))
    fake.put("nodes", o.node("cpu-only"))
    fake.put("pods", o.pod("p1", 0, 25, "gpu-a"))
    fake.put("pods", o.pod("p2", 0, 30, "gpu-a"))
    fake.put("pods", o.pod("p3", 1, 50, "gpu-a", namespace="other"))
    fake.put("pods", o.pod("done", 1, 40, "gpu-a", phase="Succeeded"))
    fake.put("pods", o.pod("failed", 1, 40, "gpu-a", phase="Failed"))
    fake.put("pods", o.pod("unbound", 0, 60))
    plain = o.pod("plain", 0, 10, "gpu-b")
    plain["metadata"]["labels"] = {}
    fake.put("pods", plain)  # not labelled gpushard.io/shared: not listed

    view = start_view()
    snap = o.wait_for(view.snapshot, what="the first sync")
    assert view.synced()
    assert [n.name for n in snap.nodes] == ["gpu-a", "gpu-b"]
    a, b = _node(snap, "gpu-a"), _node(snap, "gpu-b")
    assert a.cards == (placement.Card(0, 100, 55, "GPU-0", "H100", 81559),
                       placement.Card(1, 100, 50, "GPU-1", "H100", 81559),
                       placement.Card(2, 0, 0, "GPU-2", "H100", 81559))
    assert a.labels["pool"] == "train" and a.ready and not a.unschedulable
    assert a.taints == (placement.Taint("dedicated", "ml", "NoSchedule"),)
    assert not b.ready and b.unschedulable and b.cards == (placement.Card(0, 100, 0),)


def test_pod_shares_count_init_sidecar_and_app_containers():
    policy = Policy()

    def container(name, shares, **extra):
        res = {f"{names.CARD_PREFIX}1": str(shares)}
        return {"name": name, "resources": {"limits": res}, **extra}

    spec = {"initContainers": [container("init", 70), container("side", 20, restartPolicy="Always"),
                               container("init2", 50)],
            "containers": [container("a", 10), container("b", 15)]}
    # init2 runs beside the sidecar (50 + 20); the app containers beside it too (10 + 15 + 20).
    assert objects.card_shares(spec, policy) == {1: 70}
    spec["initContainers"][0] = container("init", 10)
    assert objects.card_shares(spec, policy) == {1: 70}
    spec["initContainers"][2] = container("init2", 5)
    assert objects.card_shares(spec, policy) == {1: 45}
    assert objects.card_shares({"containers": "bad"}, policy) == {}


def test_events_reach_the_snapshot(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")

    fake.put("nodes", o.node("gpu-b", {0: 100, 1: 100}, labels={"zone": "z1"}))
    o.wait_for(lambda: _node(view.snapshot(), "gpu-b"), what="an added node")
    fake.put("pods", o.pod("p1", 1, 40, "gpu-b"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-b", 1) == 40, what="an added pod")

    fake.put("nodes", o.node("gpu-b", {0: 100, 1: 100}, labels={"zone": "z2"},
                             taints=[{"key": "maint", "effect": "NoExecute"}]))
    o.wait_for(lambda: _node(view.snapshot(), "gpu-b").labels.get("zone") == "z2", what="a modified node")
    assert _node(view.snapshot(), "gpu-b").taints == (placement.Taint("maint", "", "NoExecute"),)
    assert o.used(view.snapshot(), "gpu-b", 1) == 40  # a node change keeps the shares held on it

    before = view.snapshot()
    fake.put("nodes", o.node("gpu-b", {0: 100, 1: 100}, labels={"zone": "z2"},
                             taints=[{"key": "maint", "effect": "NoExecute"}]))  # a heartbeat
    fake.put("pods", o.pod("p2", 0, 5, "gpu-a"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 5, what="a pod after the heartbeat")
    assert _node(view.snapshot(), "gpu-b") is _node(before, "gpu-b")

    fake.put("pods", o.pod("p1", 1, 40, "gpu-b", phase="Succeeded"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-b", 1) == 0, what="a finished pod")
    fake.delete("pods", "p2", "default")
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 0, what="a deleted pod")
    fake.put("pods", o.pod("late", 0, 20))
    fake.put("pods", o.pod("late", 0, 20, "gpu-a"))  # bound by the scheduler
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 20, what="a pod bound after creation")

    fake.delete("nodes", "gpu-b")
    o.wait_for(lambda: _node(view.snapshot(), "gpu-b") is None, what="a deleted node")
    fake.put("nodes", o.node("gpu-a", {0: 100}, ready=False))
    o.wait_for(lambda: not _node(view.snapshot(), "gpu-a").ready, what="a node that turns not ready")
    choice = placement.choose(view.snapshot(), placement.Ask(shares=10))
    assert not choice.fits and choice.findings[0].rule == f.NO_MATCHING_NODE


def _requests(fake, path: str, watch: bool) -> int:
    return sum(1 for method, p, _b in fake.requests
               if method == "GET" and p.startswith(path) and ("watch=true" in p.lower()) == watch)


def test_410_gone_forces_a_relist(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")
    o.wait_for(lambda: _requests(fake, "/api/v1/pods", watch=True) >= 1, what="the pod watch")
    lists = _requests(fake, "/api/v1/pods", watch=False)

    fake.expire_history()
    fake.drop_watches()  # the watch resumes from a forgotten version and gets 410 Gone
    o.wait_for(lambda: _requests(fake, "/api/v1/pods", watch=False) > lists, what="a relist")
    fake.put("pods", o.pod("p1", 0, 30, "gpu-a"))
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 30, what="the pod after the relist")

    # A change made while the history is gone is found by the relist itself.
    fake.put("pods", o.pod("p2", 0, 20, "gpu-a"))
    fake.expire_history()
    fake.drop_watches()
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 50, what="the second pod")
    assert view.synced()


def test_a_dropped_watch_reconnects(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")
    o.wait_for(lambda: _requests(fake, "/api/v1/nodes", watch=True) >= 1, what="the node watch")
    watches = _requests(fake, "/api/v1/nodes", watch=True)
    fake.drop_watches()
    o.wait_for(lambda: _requests(fake, "/api/v1/nodes", watch=True) > watches, what="a new watch")
    fake.put("nodes", o.node("gpu-b", {0: 100}))
    o.wait_for(lambda: _node(view.snapshot(), "gpu-b"), what="a node seen on the new watch")
    assert view.synced()


def test_api_errors_are_retried_and_synced_waits_for_both_lists(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    fake.fail_next.extend([500, 503, 500, 503])
    view = start_view(backoff=(0.2, 0.4))
    assert not view.synced() and view.snapshot() is None
    o.wait_for(view.synced, what="a sync after the errors")
    assert [n.name for n in view.snapshot().nodes] == ["gpu-a"]
    fake.drop_watches()
    assert view.synced()  # the last view stays while the watches reconnect


def test_a_failed_list_or_watch_is_logged_in_words_an_operator_can_act_on(fake, start_view, caplog):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    fake.tokens = {}  # the view's token refused: 401 with the API server's message
    with caplog.at_level("WARNING"):
        view = start_view(backoff=(0.2, 0.4))
        o.wait_for(lambda: any("failed: HTTP 401 (Unauthorized)" in r.getMessage() for r in caplog.records),
                   what="the failure's log line")
        fake.tokens = None
        o.wait_for(view.synced, what="a sync once the token is taken")
    line = next(r for r in caplog.records if "HTTP 401" in r.getMessage())
    assert line.getMessage().startswith(("gpushard: listing or watching nodes failed: HTTP 401 (Unauthorized); "
                                         "retrying in", "gpushard: listing or watching pods failed: HTTP 401"))
    assert not line.exc_info  # the API's refusal needs no traceback


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_api_leaves_no_view_and_admission_still_answers(fake):
    config = fake.configuration()
    config.host = f"http://127.0.0.1:{_closed_port()}"
    view = kube.KubeView.start(settings_mod.Settings(), api_client=kube.kubernetes.client.ApiClient(config),
                               watch_timeout=5, backoff=(0.05, 0.2))
    try:
        # Let it try and fail a few times; nothing may appear, and nothing may block.
        o.wait_for(lambda: all(t.is_alive() for t in view.informer.threads), what="the watch threads")
        for _ in range(20):
            assert view.snapshot() is None
            assert not view.synced()
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "c", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "0.25"}}}]}}
        decision = decisions.decide(decisions.Request(pod, "Pod"), Policy(), view.snapshot())
        assert decision.allowed and decision.card == 0 and decision.node is None
        assert any(x.rule == f.NO_VIEW for x in decision.findings)
        assert any(w.startswith("gpushard: no cluster view") for w in decision.warnings)
    finally:
        view.close()
    assert not any(t.is_alive() for t in view.informer.threads)


def test_close_stops_watching_threads(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")
    o.wait_for(lambda: _requests(fake, "/api/v1/nodes", watch=True) >= 1, what="the node watch")
    view.close()
    assert not any(t.is_alive() for t in view.informer.threads)


def test_start_without_any_config_gives_a_view_that_never_syncs(monkeypatch, tmp_path):
    # No service account and no kubeconfig: the admission server still runs, without a view.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    for view in (kube.KubeView.start(), cluster.open_view(None, 100, settings_mod.Settings())):
        try:
            assert isinstance(view, kube.KubeView)
            assert view.snapshot() is None and not view.synced() and view.informer.threads == []
        finally:
            view.close()


def test_odd_nodes_are_read_tolerantly():
    obj = o.node("gpu-a", {0: 100})
    obj["status"]["allocatable"].update({"gpushard.io/card-1": "lots", "gpushard.io/card-01": "5",
                                         "gpushard.io/card-2": "2k"})
    obj["status"]["conditions"] = [{"type": "DiskPressure", "status": "False"}]  # no Ready condition
    obj["metadata"]["annotations"] = {names.INVENTORY_ANNOTATION: "{not json"}
    node = kube.read_node(obj, Policy())
    assert node.cards == (placement.Card(0, 100), placement.Card(1, 0), placement.Card(2, 2000))
    assert not node.ready
    obj["metadata"]["annotations"] = {names.INVENTORY_ANNOTATION: '[{"index": 3, "uuid": "GPU-3"}, 7, {"index": -1}]'}
    assert [c.index for c in kube.read_node(obj, Policy()).cards] == [0, 1, 2, 3]
    assert kube.read_node(o.node("cpu"), Policy()) is None


def test_an_unreadable_object_is_skipped_and_the_watch_goes_on(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    broken = o.node("gpu-bad", {0: 100})
    broken["status"]["allocatable"] = 5  # no mapping: reading it raises
    fake.put("nodes", broken)  # in the first list
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync despite an odd node")
    fake.put("nodes", broken)  # and as a watch event
    fake.put("nodes", o.node("gpu-b", {0: 100}))
    o.wait_for(lambda: _node(view.snapshot(), "gpu-b"), what="events after the odd one")
    assert _node(view.snapshot(), "gpu-a") is not None and _node(view.snapshot(), "gpu-bad") is None


def test_only_nodes_the_agent_published_are_listed_and_watched(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    unpublished = o.node("gpu-quiet", {0: 100})
    del unpublished["metadata"]["labels"][names.CARDS_LABEL]
    fake.put("nodes", unpublished)
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")
    fake.put("nodes", o.node("gpu-b", {0: 100}))
    o.wait_for(lambda: _node(view.snapshot(), "gpu-b"), what="a published node on the watch")
    assert _node(view.snapshot(), "gpu-quiet") is None
    node_calls = [path for _method, path, _body in fake.requests if path.startswith("/api/v1/nodes")]
    assert node_calls and all("labelSelector=gpushard.io/cards" in path for path in node_calls)
    assert any("watch=true" in path for path in node_calls)


def test_the_configs_view_timeouts_reach_the_view(fake, tmp_path, monkeypatch, caplog):
    from tests.audit import world

    fake.put("nodes", o.node("gpu-a", {0: 100}))
    (tmp_path / "kubeconfig").write_text(world.kubeconfig(fake))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    (tmp_path / "config.yaml").write_text("version: v1\nview: {connectTimeout: 3, listTimeout: 0.5, watchTimeout: 7}\n")
    stalled = threading.Event()

    def slow_first_node_list(method, path):
        # The first nodes list answers after the configured list timeout (the default waits 120 s).
        if path.startswith("/api/v1/nodes?") and "watch=" not in path and not stalled.is_set():
            stalled.set()
            time.sleep(2)  # the stimulus, not a wait: this answer comes late on purpose

    fake.on_request = slow_first_node_list
    # As `gpushard serve` opens it: the config file's settings, the kubeconfig's API server.
    view = cluster.open_view(None, 100, settings_mod.load(tmp_path / "config.yaml"))
    try:
        assert (view.informer.connect_timeout, view.informer.list_timeout, view.informer.watch_timeout) == (3, 0.5, 7)
        with caplog.at_level("WARNING"):
            o.wait_for(view.synced, timeout=20, what="a sync after the slow list was given up")
        assert stalled.is_set()
        assert any("listing or watching nodes failed" in r.getMessage() and "timed out" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        o.wait_for(lambda: [p for _m, p, _b in fake.requests if "watch=" in p], what="a watch")
        watches = [path for _m, path, _b in fake.requests if "watch=" in path]
        assert watches and all("timeoutSeconds=7" in path for path in watches), watches
    finally:
        view.close()


def test_a_relist_after_410_is_logged(fake, start_view, caplog):
    """The operator is told when the view rebuilds from a list (etcd compacted past its watch, or a restarted
    API server's watch cache starts later): once, at INFO, naming the resource."""
    caplog.set_level(logging.INFO, logger="webhook.kubeapi.informing")
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")
    o.wait_for(lambda: _requests(fake, "/api/v1/pods", watch=True) >= 1, what="the pod watch")
    fake.expire_history()
    fake.drop_watches()
    o.wait_for(lambda: any("pods watch's history expired" in r.getMessage() and "listing again" in r.getMessage()
                           for r in caplog.records), what="the relist's log line")
