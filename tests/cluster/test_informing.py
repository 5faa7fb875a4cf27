"""The informer on its own: what it hands a sink, and in which order, over a real HTTP API server."""

from __future__ import annotations

import logging
import threading

import kubernetes

from tests.cluster import kubeobjects as o
from webhook.cluster import kube
from webhook.kubeapi import informing


class Recorder:
    """A sink that keeps pods by uid and writes down every call it gets."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def _note(self, *call) -> None:
        with self.lock:
            self.calls.append(call)

    def seen(self) -> list[tuple]:
        with self.lock:
            return list(self.calls)

    def reduce(self, resource, items, into):
        for obj in items:
            into[obj["metadata"]["name"]] = obj["spec"].get("nodeName")
        self._note("page", resource, len(items))
        return into

    def apply_list(self, resource, fresh):
        self._note("list", resource, dict(fresh))

    def apply_event(self, resource, kind, obj):
        self._note("event", resource, kind, obj["metadata"]["name"])

    def watch_opened(self, resource):
        self._note("opened", resource)

    def watch_closed(self, resource, gap):
        self._note("closed", resource, gap)


def test_pages_a_list_then_watches_then_relists_after_410_gone(fake):
    for i in range(3):
        fake.put("pods", o.pod(f"p{i}", 0, 10, "gpu-a"))
    sink = Recorder()
    informer = informing.Informer(fake.api_client(), sink, page_size=2, watch_timeout=5, backoff=(0.05, 0.3),
                                  resources=(informing.PODS,), calls=kube.shared_calls(fake.api_client()),
                                  after_list=lambda: sink._note("after the list"))
    informer.start()
    try:
        o.wait_for(lambda: ("opened", "pods") in sink.seen(), what="the watch")
        calls = sink.seen()
        assert calls[:5] == [("page", "pods", 2), ("page", "pods", 1),
                             ("list", "pods", {"p0": "gpu-a", "p1": "gpu-a", "p2": "gpu-a"}), ("after the list",),
                             ("opened", "pods")]
        assert informer.lists["pods"] == 1 and informer.watches["pods"] == 1

        fake.put("pods", o.pod("p3", 0, 10, "gpu-a"))
        o.wait_for(lambda: ("event", "pods", "ADDED", "p3") in sink.seen(), what="the event")

        # History compacted and the watch dropped: resuming gets 410 Gone, a gap, and a new list.
        fake.expire_history()
        fake.put("namespaces", {"metadata": {"name": "moved-on"}})
        fake.drop_watches()
        o.wait_for(lambda: informer.lists["pods"] == 2, what="the relist")
        calls = sink.seen()
        after = calls[calls.index(("event", "pods", "ADDED", "p3")) + 1:]
        relisted = after.index(("list", "pods", {f"p{i}": "gpu-a" for i in range(4)}))
        assert ("closed", "pods", True) in after[:relisted]  # the sink heard of the gap before the list
    finally:
        informer.close()
    assert not any(t.is_alive() for t in informer.threads)


class Slices(Recorder):
    """A sink that keeps cluster-scoped objects by name."""

    def reduce(self, resource, items, into):
        for obj in items:
            into[obj["metadata"]["name"]] = (obj.get("spec") or {}).get("driver")
        self._note("page", resource, len(items))
        return into


def test_resource_k8s_io_lists_only_gpushards_slices_and_every_claim(fake):
    fake.put("resourceslices", {"metadata": {"name": "a-gpu.gpushard.io"}, "spec": {"driver": "gpu.gpushard.io"}})
    fake.put("resourceslices", {"metadata": {"name": "a-other"}, "spec": {"driver": "gpu.nvidia.com"}})
    fake.put("resourceclaims", {"metadata": {"name": "c1", "namespace": "t"}, "spec": {"driver": "x"}})
    sink = Slices()
    informer = informing.Informer(fake.api_client(), sink, watch_timeout=5, backoff=(0.05, 0.3),
                                  resources=(informing.SLICES, informing.CLAIMS))
    informer.start()
    try:
        o.wait_for(lambda: all(c in sink.seen() for c in (("opened", "resourceslices"), ("opened", "resourceclaims"))),
                   what="both watches")
        assert ("list", "resourceslices", {"a-gpu.gpushard.io": "gpu.gpushard.io"}) in sink.seen()
        assert ("list", "resourceclaims", {"c1": "x"}) in sink.seen()
        fake.put("resourceslices", {"metadata": {"name": "b-other"}, "spec": {"driver": "gpu.nvidia.com"}})
        fake.put("resourceslices", {"metadata": {"name": "b-gpu.gpushard.io"}, "spec": {"driver": "gpu.gpushard.io"}})
        o.wait_for(lambda: ("event", "resourceslices", "ADDED", "b-gpu.gpushard.io") in sink.seen(), what="event")
        assert ("event", "resourceslices", "ADDED", "b-other") not in sink.seen()
    finally:
        informer.close()


def test_an_api_server_without_resource_k8s_io_gives_an_empty_list_and_no_warning(fake, caplog):
    fake.unserved.add("resource.k8s.io/v1")
    sink = Slices()
    informer = informing.Informer(fake.api_client(), sink, watch_timeout=5, backoff=(0.05, 0.2),
                                  resources=(informing.DEVICECLASSES,))
    with caplog.at_level("INFO", logger="webhook.kubeapi.informing"):
        informer.start()
        try:
            o.wait_for(lambda: ("list", "deviceclasses", {}) in sink.seen(), what="the empty list")
            o.wait_for(lambda: informer.watch_errors["deviceclasses"] >= 2, what="a second try")
            assert sink.seen().count(("list", "deviceclasses", {})) == 1  # said once, not on every try
            assert "deviceclasses" in informer.absent
            # The API server serves it later (an upgrade): the informer lists it.
            fake.unserved.clear()
            fake.put("deviceclasses", {"metadata": {"name": "gpu.example.com"}, "spec": {}})
            o.wait_for(lambda: ("list", "deviceclasses", {"gpu.example.com": None}) in sink.seen(), what="the list")
            assert "deviceclasses" not in informer.absent
        finally:
            informer.close()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert sum("serves no resource.k8s.io/v1 deviceclasses" in r.getMessage() for r in caplog.records) == 1


def test_a_resource_can_be_listed_and_watched_with_a_call_of_its_own(fake):
    fake.put("deviceclasses", {"metadata": {"name": "gpu.example.com"}, "spec": {"driver": "x"}})
    typed = kubernetes.client.ResourceV1Api(fake.api_client()).list_device_class
    made = []

    def call(**kwargs):
        made.append(kwargs)
        return typed(**kwargs)

    sink = Slices()
    informer = informing.Informer(fake.api_client(), sink, watch_timeout=5, backoff=(0.05, 0.3),
                                  resources=(informing.DEVICECLASSES,), calls={informing.DEVICECLASSES: call})
    informer.start()
    try:
        o.wait_for(lambda: ("opened", "deviceclasses") in sink.seen(), what="the watch")
        assert ("list", "deviceclasses", {"gpu.example.com": "x"}) in sink.seen()
        fake.put("deviceclasses", {"metadata": {"name": "b"}, "spec": {}})
        o.wait_for(lambda: ("event", "deviceclasses", "ADDED", "b") in sink.seen(), what="the event")
    finally:
        informer.close()
    assert all(kwargs["_preload_content"] is False for kwargs in made)
    assert [bool(kwargs.get("watch")) for kwargs in made][:2] == [False, True]


def test_a_watch_ended_early_leaves_no_unread_bytes_for_the_next_request(fake, caplog):
    """As kube-apiserver serves them, watches are chunked on a connection kept for the next request. A watch the
    informer stops reading early (here at the 410 Gone event, after which the API server ends the stream) must not
    hand its connection back with the stream's end unread: the next request on it reads that as its status line
    (`BadStatusLine('0\\r\\n')`) and fails; urllib3 retries a GET a few times, and once those are spent the
    informer backs off while the view stays stale."""
    caplog.set_level(logging.WARNING, logger="urllib3")
    fake.chunked_watches = True
    fake.put("pods", o.pod("p0", 0, 10, "gpu-a"))
    sink = Recorder()
    informer = informing.Informer(fake.api_client(), sink, watch_timeout=30, backoff=(0.05, 0.3),
                                  resources=(informing.PODS,), calls=kube.shared_calls(fake.api_client()))
    informer.start()
    try:
        o.wait_for(lambda: ("opened", "pods") in sink.seen(), what="the watch")
        for cycle in range(3):
            lists = informer.lists["pods"]
            fake.expire_history()
            fake.put("namespaces", {"metadata": {"name": f"moved-on-{cycle}"}})
            fake.drop_watches()
            o.wait_for(lambda before=lists: informer.lists["pods"] > before, what="the relist")
            o.wait_for(lambda before=lists: informer.watches["pods"] > before, what="the watch again")
        assert informer.watch_errors["pods"] == 0
        assert not [r for r in caplog.records if "BadStatusLine" in r.getMessage()], \
            "a request failed on a connection a watch had left"
    finally:
        informer.close()


def test_an_object_too_deep_to_parse_is_skipped_and_counted_and_the_rest_syncs(fake, caplog):
    deep = fake.raw(b'{"a":' * 5000 + b"1" + b"}" * 5000)
    for i in range(3):
        pod = o.pod(f"p{i}", 0, 10, "gpu-a")
        if i == 1:
            pod["metadata"]["annotations"] = {"deep": "x"}
            pod["spec"]["overhead"] = deep  # a field the API server would store as given, for the sake of the test
        fake.put("pods", pod)
    sink = Recorder()
    informer = informing.Informer(fake.api_client(), sink, page_size=2, watch_timeout=5, backoff=(0.05, 0.3),
                                  resources=(informing.PODS,), calls=kube.shared_calls(fake.api_client()))
    informer.start()
    try:
        o.wait_for(lambda: ("opened", "pods") in sink.seen(), what="the watch")
        assert ("list", "pods", {"p0": "gpu-a", "p2": "gpu-a"}) in sink.seen()
        assert informer.unreadable["pods"] == 1 and informer.watch_errors["pods"] == 0
        # The same in a watch event: skipped, and the next event still comes.
        bad = o.pod("p3", 0, 10, "gpu-a")
        bad["spec"]["overhead"] = deep
        fake.put("pods", bad)
        fake.put("pods", o.pod("p4", 0, 10, "gpu-a"))
        o.wait_for(lambda: ("event", "pods", "ADDED", "p4") in sink.seen(), what="the next event")
        assert ("event", "pods", "ADDED", "p3") not in sink.seen()
        assert informer.unreadable["pods"] == 2 and informer.watch_errors["pods"] == 0
    finally:
        informer.close()
    assert "skipped a pods object that cannot be parsed" in caplog.text
