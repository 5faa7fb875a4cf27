"""The re-placement cache's own surface: synced() turns true once both lists are in and stays so."""

from __future__ import annotations

from tests.cluster import kubeobjects as o
from webhook import settings as settings_mod
from webhook.replacement.cache import Cache


def compact(fake) -> None:
    """History compacted: watches from before now and continue tokens get 410 Gone."""
    fake.expire_history()
    fake.put("namespaces", {"metadata": {"name": f"moved-on-{fake.rv}"}})


def test_synced_turns_true_once_both_are_listed_and_stays_true_through_a_relist(fake):
    fake.put("nodes", o.node("gpu-a", {0: 100, 1: 100}))
    fake.put("pods", o.pod("p1", 0, 10, "gpu-a"))
    fake.put("pods", o.pod("p2", 1, 10, "gpu-a"))

    def never_done(resource, page):  # each pod list loses its continue token after the first page
        if resource == "pods" and page == 0:
            compact(fake)

    fake.on_page = never_done
    cache = Cache.start(settings_mod.Settings(), api_client=fake.api_client(), page_size=1, watch_timeout=5,
                        backoff=(0.05, 0.3))
    try:
        # Each failed pods list compacts the fake's history, so the nodes watch may lose its place and
        # list the nodes again: at least one nodes list, not exactly one.
        o.wait_for(lambda: cache.lists["nodes"] >= 1, what="the nodes list")
        o.wait_for(lambda: cache.informer.watch_errors["pods"] >= 1, what="a pods list that failed")
        assert not cache.synced() and not cache.current()  # the nodes alone are no sync

        fake.on_page = None
        o.wait_for(cache.synced, what="the first sync")
        assert cache.current() and len(cache.contents()[1]) == 2

        # A gap the watch cannot replay, and a relist that cannot finish: not current, still synced.
        fake.on_page = never_done
        compact(fake)
        fake.drop_watches()
        o.wait_for(lambda: not cache.current(), what="the gap")
        assert cache.synced()
        fake.on_page = None
        o.wait_for(cache.current, what="the relist")
        assert cache.synced() and cache.lists["pods"] == 2
    finally:
        cache.close()


def test_a_cache_without_a_client_starts_no_thread_and_is_never_synced():
    cache = Cache(None, settings_mod.Settings().policy)
    cache.informer.start()
    assert cache.informer.threads == []
    assert not cache.synced() and not cache.current()
    cache.close()
