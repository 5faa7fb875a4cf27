"""We test the webhook's metrics beyond admissions, built afresh on every scrape:
- the live view's sync state, the age of the API server's last word, relists and watch restarts,
  against the local Kubernetes API server (a dropped watch is a restart, expired history a relist);
- free shares per node and card as the view sees them, and the cap on those series with totals kept;
- the serving certificate's expiry in seconds, from a really generated certificate, following a
  rotated file; an unreadable file gives no series and no error;
- a static view: synced, with free shares; no view: no view series.
"""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import kubeobjects as o
from webhook import certificates
from webhook.admission import metrics
from webhook.cluster import static


def samples(collector) -> dict[tuple[str, tuple], float]:
    reg = metrics.prometheus_client.CollectorRegistry(auto_describe=False)
    reg.register(collector)
    text = metrics.prometheus_client.generate_latest(reg).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_live_view_state(fake, start_view):
    fake.put("nodes", o.node("gpu-a", {0: 100, 1: 100}))
    fake.put("nodes", o.node("gpu-b", {0: 100}))
    fake.put("pods", o.pod("p1", 1, 30, "gpu-a"))
    view = start_view()
    o.wait_for(view.snapshot, what="the first sync")
    o.wait_for(lambda: o.used(view.snapshot(), "gpu-a", 1) == 30, what="the pod")
    collector = metrics.StateCollector(view)
    s = samples(collector)
    assert s[("gpushard_view_synced", ())] == 1
    assert s[("gpushard_view_free_shares", (("gpu", "1"), ("node", "gpu-a")))] == 70
    assert s[("gpushard_view_free_shares", (("gpu", "0"), ("node", "gpu-b")))] == 100
    assert s[("gpushard_view_shares", (("state", "capacity"),))] == 300
    assert s[("gpushard_view_shares", (("state", "used"),))] == 30
    assert s[("gpushard_view_relists_total", (("resource", "pods"),))] == 0
    assert 0 <= s[("gpushard_view_age_seconds", (("resource", "nodes"),))] < 30

    o.wait_for(lambda: view.watches["pods"] >= 1, what="the pod watch")
    fake.drop_watches()
    o.wait_for(lambda: samples(collector)[("gpushard_view_watch_restarts_total", (("resource", "pods"),))] >= 1,
               what="a watch restart")
    fake.expire_history()
    fake.drop_watches()
    o.wait_for(lambda: samples(collector)[("gpushard_view_relists_total", (("resource", "pods"),))] >= 1,
               what="a relist")


def test_free_share_series_are_capped_and_totals_kept(fake, start_view):
    for i in range(3):
        fake.put("nodes", o.node(f"gpu-{i}", {0: 100, 1: 100}))
    view = start_view()
    o.wait_for(lambda: view.snapshot() is not None and len(view.snapshot().nodes) == 3, what="the sync")
    s = samples(metrics.StateCollector(view, max_cards=4))
    assert sum(1 for name, _ in s if name == "gpushard_view_free_shares") == 4
    assert s[("gpushard_view_cards", (("series", "omitted"),))] == 2
    assert s[("gpushard_view_shares", (("state", "free"),))] == 600


def test_certificate_expiry(tmp_path):
    certificates.write_bundle(tmp_path, service="gpushard", namespace="gpushard-system", days=10)
    now = time.time()
    collector = metrics.StateCollector(None, str(tmp_path / "tls.crt"), clock=lambda: now)
    expiry = samples(collector)[("gpushard_certificate_expiry_seconds", ())]
    assert 9.9 * 86400 < expiry <= 10 * 86400 + 60
    # A rotated certificate is read again.
    time.sleep(0.01)  # the stimulus, not a wait: the rotated file's modification time differs from the first's
    certificates.write_bundle(tmp_path, service="gpushard", namespace="gpushard-system", days=30)
    assert samples(collector)[("gpushard_certificate_expiry_seconds", ())] > 29 * 86400
    (tmp_path / "tls.crt").write_text("not a certificate")
    assert ("gpushard_certificate_expiry_seconds", ()) not in samples(collector)


def test_static_view_and_no_view(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n- name: n1\n  cards:\n  - {index: 0, usedShares: 40}\n")
    s = samples(metrics.StateCollector(static.StaticView(static.load(path, 100))))
    assert s[("gpushard_view_synced", ())] == 1
    assert s[("gpushard_view_free_shares", (("gpu", "0"), ("node", "n1")))] == 60
    assert not any(name.startswith("gpushard_view_relists") for name, _ in s)
    assert samples(metrics.StateCollector(None)) == {}
