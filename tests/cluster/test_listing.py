"""The live view's lists against a real local HTTP server speaking the Kubernetes API (tests/fakekube.py).

We test:
- lists come in pages (limit/continue) and every page's objects reach the view;
- a continue token that expires between pages (410 Gone) restarts the list, and the view is
  built from the restarted list only;
- a relist keeps the last good view in use until the whole list is in, and a choice made
  meanwhile counts at once;
- only the fields placement reads are kept: no part of an API object stays in the view;
- nodes are listed and watched by the agent's label: other nodes never arrive, and a node that
  loses the label leaves the view.
"""

from __future__ import annotations

import gc
import threading
from urllib.parse import parse_qs, urlparse

from tests.cluster import kubeobjects as o
from webhook.cluster import kube
from webhook.core import names


def _lists(fake, resource: str) -> list[dict]:
    out = []
    for method, path, _ in fake.requests:
        url = urlparse(path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if method == "GET" and url.path.endswith(f"/{resource}") and query.get("watch") not in ("true", "1"):
            out.append(query)
    return out


def _big_pod(name: str, card: int, shares: int, node: str) -> dict:
    obj = o.pod(name, card, shares, node)
    obj["metadata"]["managedFields"] = [{"manager": "kube-controller-manager", "operation": "Update",
                                         "fieldsV1": {"f:metadata": {"f:labels": {}}}}]
    obj["metadata"]["annotations"] = {"note": "x" * 200}
    obj["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    return obj


def test_lists_come_in_pages_and_every_page_counts(fake, start_view):
    for i in range(7):
        fake.put("nodes", o.node(f"gpu-{i}", {0: 100}))
    for i in range(23):
        fake.put("pods", o.pod(f"p{i}", 0, 1 + i % 3, f"gpu-{i % 7}"))
    view = start_view(page_size=5)
    snap = o.wait_for(view.snapshot, what="the first sync")
    assert len(snap.nodes) == 7
    assert sum(c.used for n in snap.nodes for c in n.cards) == sum(1 + i % 3 for i in range(23))
    pods = _lists(fake, "pods")
    assert [q.get("limit") for q in pods] == ["5"] * 5
    assert "continue" not in pods[0] and all("continue" in q for q in pods[1:])


def test_an_expired_continue_token_restarts_the_list(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    for i in range(6):
        fake.put("pods", o.pod(f"p{i}", 0, 10, "gpu-a"))
    expired = threading.Event()

    def on_page(resource, page):
        # After the first page: p0 finishes and the history it was listed from is compacted.
        if resource == "pods" and page == 0 and not expired.is_set():
            expired.set()
            fake.put("pods", o.pod("p0", 0, 10, "gpu-a", phase="Succeeded"))
            fake.expire_history()

    fake.on_page = on_page
    view = start_view(page_size=4)
    snap = o.wait_for(view.snapshot, what="the first sync")
    assert expired.is_set()
    pods = _lists(fake, "pods")
    # first page, the continue that got 410, then the list from the start again (and the watch
    # from the compacted version may relist once more)
    assert len(pods) >= 4 and "continue" in pods[1] and "continue" not in pods[2] and "continue" in pods[3]
    assert o.used(snap, "gpu-a", 0) == 50  # p0 finished: the restarted list shows it


def test_a_relist_keeps_the_last_good_view_until_it_is_complete(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    for i in range(6):
        fake.put("pods", o.pod(f"p{i}", 0, 10, "gpu-a"))
    view = start_view(page_size=2)
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 60, what="the first sync")
    seen = []
    release = threading.Event()

    def on_page(resource, page):
        if resource == "pods":
            seen.append(o.used(view.snapshot(), "gpu-a", 0))
            if page == 0:
                release.wait(5)

    fake.on_page = on_page
    fake.delete("pods", "p5", "default")
    fake.delete("pods", "p4", "default")
    fake.expire_history()
    fake.drop_watches()  # the watch resumes from a compacted version: 410, relist
    o.wait_for(lambda: seen, what="the relist's first page")
    # Mid-relist: the view in use is the last good one (or one the watch already brought), and an
    # admission's choice counts at once: nothing waits for the list to finish.
    before = o.used(view.snapshot(), "gpu-a", 0)
    assert before in (50, 60, 40)
    view.remember("gpu-a", 0, 5)
    assert o.used(view.snapshot(), "gpu-a", 0) == before + 5
    assert not release.is_set()
    release.set()
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 45, what="the relist to complete")


def test_a_missing_pod_delete_is_seen_by_a_relist(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    fake.put("pods", o.pod("p0", 0, 10, "gpu-a"))
    view = start_view(page_size=1)
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 10, what="the first sync")
    with fake.lock:  # removed without an event, then history compacted: only a relist can know
        fake.objects["pods"].pop(("default", "p0"))
        fake.expire_history()
    fake.drop_watches()
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 0, what="the relist")


def test_only_placement_fields_are_kept(fake, start_view):
    marker = "managedFields"
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    for i in range(5):
        fake.put("pods", _big_pod(f"p{i}", 0, 10, "gpu-a"))
    view = start_view(page_size=2)
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 50, what="the first sync")
    fake.put("pods", _big_pod("p9", 0, 10, "gpu-a"))  # and through the watch
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 0) == 60, what="a watched pod")
    assert all(isinstance(p, kube._Pod) for p in view._pods.values())
    # Walk everything the view's state refers to: no dict of an API object is left in it.
    gc.collect()
    todo = [view._pods, view._base, view._view, view._current, view._ledger]
    seen: set[int] = set()
    while todo:
        item = todo.pop()
        if id(item) in seen or isinstance(item, (str, int, float, bool, type(None), type)):
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            assert marker not in item and "spec" not in item and "metadata" not in item
        todo.extend(gc.get_referents(item))


def test_nodes_are_selected_by_the_agent_label(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    unlabelled = o.node("gpu-b", {0: 100})
    del unlabelled["metadata"]["labels"][names.CARDS_LABEL]
    fake.put("nodes", unlabelled)
    fake.put("nodes", o.node("cpu-only"))
    view = start_view()
    snap = o.wait_for(view.snapshot, what="the first sync")
    assert [n.name for n in snap.nodes] == ["gpu-a"]
    assert all(q.get("labelSelector") == names.CARDS_LABEL for q in _lists(fake, "nodes"))
    watches = [parse_qs(urlparse(p).query) for m, p, _ in fake.requests
               if m == "GET" and "/nodes?" in p and "watch=true" in p]
    assert watches and all(q["labelSelector"] == [names.CARDS_LABEL] for q in watches)

    fake.put("nodes", o.node("gpu-c", {0: 100, 1: 100}))  # the agent publishes a new node
    o.wait_for(lambda: [n.name for n in view.snapshot().nodes] == ["gpu-a", "gpu-c"], what="a labelled node")
    gone = o.node("gpu-a", {0: 100})
    del gone["metadata"]["labels"][names.CARDS_LABEL]
    fake.put("nodes", gone)  # the label is removed: the watch says DELETED
    o.wait_for(lambda: [n.name for n in view.snapshot().nodes] == ["gpu-c"], what="the unlabelled node to leave")
