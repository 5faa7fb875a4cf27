"""The admission server's Prometheus metrics, per app, and shared across gunicorn workers."""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator

import prometheus_client
from cryptography import x509
from prometheus_client import core as prom
from prometheus_client import multiprocess, registry

log = logging.getLogger(__name__)

# Admission answers take around a millisecond; the API server gives up at its
# timeoutSeconds (10 s by default), so buckets span both.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Free shares per node and card: one series per card, up to this many (a 1,000-node cluster of
# 8-card nodes fits); past it only the totals, so a huge cluster cannot blow up the scrape.
MAX_CARD_SERIES = 8192


class Metrics:
    """The counters of one app. Each app has its own registry, so tests may build many apps.

    With several gunicorn workers (multiprocess mode) prometheus_client writes each update to this worker's
    file, and a scrape of any worker sums every worker's files: a review is counted before its answer is sent.
    """

    def __init__(self, view=None, certfile: str | None = None) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.state = StateCollector(view, certfile)
        self.registry.register(self.state)
        self.admissions = prometheus_client.Counter(
            "gpushard_admissions", "AdmissionReviews answered, by outcome (allowed, patched, denied, "
            "invalid, error), object kind and mode", ["outcome", "kind", "mode"], registry=self.registry)
        # Memory asks (gpushard.io/memory), by the card size their shares were computed for.
        self.memory_pods = prometheus_client.Counter(
            "gpushard_memory_ask_pods", "Pods admitted by a GPU memory ask, by the card size (MiB) they were sized "
            "for", ["card_mib"], registry=self.registry)
        self.memory_asked = prometheus_client.Counter(
            "gpushard_memory_asked_mebibytes", "GPU memory those pods asked, in MiB, by card size",
            ["card_mib"], registry=self.registry)
        self.latency = prometheus_client.Histogram(
            "gpushard_admission_seconds", "Time to read, decide and answer one AdmissionReview",
            ["mode"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def admitted(self, outcome: str, kind: str, mode: str) -> None:
        """Count one answered review."""
        self.admissions.labels(outcome, kind, mode).inc()

    def memory_ask(self, card_mib: int, asked_mib: int) -> None:
        """Count one pod admitted by its GPU memory ask, by the card size it was sized for."""
        self.memory_pods.labels(str(card_mib)).inc()
        self.memory_asked.labels(str(card_mib)).inc(asked_mib)

    def observe(self, mode: str, seconds: float) -> None:
        """Record how long one review took to answer."""
        self.latency.labels(mode).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics text: this process's, or every worker's when gunicorn runs several."""
        if os.environ.get(MULTIPROC_ENV):
            # Each worker writes its values to files in the folder; any worker can sum them all.
            registry = prometheus_client.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            # The view and the certificate as the worker that answers sees them.
            registry.register(self.state)
        else:
            registry = self.registry
        return prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST


def worker_exited(pid: int) -> None:
    """Forget a dead worker's live gauges (its counters stay counted)."""
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.mark_process_dead(pid)


def not_after(certfile: str) -> datetime.datetime:
    """When the (first) certificate in a PEM file expires."""
    with open(certfile, "rb") as f:
        return x509.load_pem_x509_certificate(f.read()).not_valid_after_utc


class StateCollector(registry.Collector):
    """The cluster view's state and the serving certificate's expiry, read afresh on every scrape."""

    def __init__(self, view=None, certfile: str | None = None, max_cards: int = MAX_CARD_SERIES,
                 clock: Callable[[], float] = time.time) -> None:
        self.view = view
        self.certfile = certfile
        self.max_cards = max_cards
        self.clock = clock
        self._cert: tuple[tuple[int, int], float] | None = None  # ((mtime, size), notAfter)

    def describe(self) -> list:
        return []

    def _not_after(self) -> float | None:
        assert self.certfile is not None  # collect asks only with a certificate
        try:
            st = os.stat(self.certfile)
            stamp = (st.st_mtime_ns, st.st_size)
            if self._cert is None or self._cert[0] != stamp:
                self._cert = (stamp, not_after(self.certfile).timestamp())
        except (OSError, ValueError) as exc:
            log.warning("gpushard: cannot read the serving certificate %s: %s", self.certfile, exc)
            return None
        return self._cert[1]

    def collect(self) -> Iterator[prom.Metric]:
        now = self.clock()
        if self.certfile:
            expiry = self._not_after()
            if expiry is not None:
                g = prom.GaugeMetricFamily("gpushard_certificate_expiry_seconds",
                                           "Seconds until the serving certificate's notAfter (negative: expired)")
                g.add_metric([], expiry - now)
                yield g
        view = self.view
        if view is None:
            return
        try:
            synced = bool(view.synced())
        except Exception:
            synced = False
        g = prom.GaugeMetricFamily("gpushard_view_synced", "1 once the cluster view has listed nodes and pods")
        g.add_metric([], 1 if synced else 0)
        yield g
        heard = getattr(view, "heard_at", None)
        if heard:
            g = prom.GaugeMetricFamily("gpushard_view_age_seconds", "Seconds since the API server last said "
                                       "anything (list, event or bookmark) to the view, by resource",
                                       labels=["resource"])
            for resource, at in sorted(dict(heard).items()):
                g.add_metric([resource], max(0.0, now - at))
            yield g
        for attr, name, doc, extra in (
                ("lists", "gpushard_view_relists", "Lists after the first one, by resource (a watch that "
                 "lost its place lists again)", 1),
                ("watches", "gpushard_view_watch_restarts", "Watches opened after the first one, by resource "
                 "(the API server ends each after a while; a fast rise means trouble)", 1),
                ("watch_errors", "gpushard_view_watch_errors", "Lists and watches that failed, by resource", 0),
                ("unreadable", "gpushard_view_unreadable_objects", "Objects left out of the view because they "
                 "cannot be parsed (nested too deeply), by resource", 0)):
            counts = getattr(view, attr, None)
            if counts is None:
                continue
            counts = dict(counts)
            c = prom.CounterMetricFamily(name, doc, labels=["resource"])
            # A series from the first list on, 0 until something happens: rate() and increase() of a
            # series that appears only with its first failure have nothing to compare it with.
            listed = dict(getattr(view, "lists", None) or {})
            for resource in sorted(set(counts) | set(listed)):
                c.add_metric([resource], max(0, counts.get(resource, extra) - extra))
            yield c
        snapshot = view.snapshot() if synced else None
        if snapshot is None:
            return
        cards = [(node.name, card) for node in snapshot.nodes for card in node.cards]
        free = prom.GaugeMetricFamily("gpushard_view_free_shares", "Free shares of each card as the view sees "
                                      "them (capacity minus shares held by pods; at most 0 on a cordoned card)",
                                      labels=["node", "gpu"])
        for node_name, card in cards[:self.max_cards]:
            free.add_metric([node_name, str(card.index)], card.free)
        yield free
        total = prom.GaugeMetricFamily("gpushard_view_shares", "Shares of all cards the view sees, by state",
                                       labels=["state"])
        total.add_metric(["capacity"], sum(card.capacity for _, card in cards))
        total.add_metric(["used"], sum(card.used for _, card in cards))
        total.add_metric(["free"], sum(max(0, card.free) for _, card in cards))
        yield total
        cordoned = prom.GaugeMetricFamily("gpushard_view_cordoned_cards", "Cards an operator cordoned, by node, as "
                                          "the view sees them (nodes without one have no series)", labels=["node"])
        for node in snapshot.nodes:
            count = sum(1 for card in node.cards if card.cordoned)
            if count:
                cordoned.add_metric([node.name], count)
        yield cordoned
        g = prom.GaugeMetricFamily("gpushard_view_cards", "Cards the view sees, and whether each has its own "
                                   "free-shares series", labels=["series"])
        g.add_metric(["listed"], min(len(cards), self.max_cards))
        g.add_metric(["omitted"], max(0, len(cards) - self.max_cards))
        yield g
