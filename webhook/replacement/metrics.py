"""The replacer's Prometheus metrics, served on its health port: whether it leads, and the refused pods it found.

Each replica has a registry of its own, and only the leader's figures describe the cluster now (a standby
shows no refused pods; its counter keeps what it deleted while it led): ``gpushard_replacer_leader`` is how a
dashboard picks the leader's.
Every scrape is built from what the last pass saw (a custom collector, no long-lived labelled gauges), so a
node whose refused pods are gone has no series any more.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Iterator

from prometheus_client import core as prom
from prometheus_client import exposition, registry

from webhook.core import refusals

CONTENT_TYPE = exposition.CONTENT_TYPE_LATEST


class Metrics(registry.Collector):
    """What the loop last did, kept for the next scrape; ``registry`` serves it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leader = False
        self._refused: collections.Counter = collections.Counter()  # by node, as the last pass left them
        self._cleaned = 0
        self.registry = registry.CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def lead(self, leads: bool) -> None:
        """This replica leads (it runs passes), or stands by (it then knows of no refused pod)."""
        with self._lock:
            self._leader = leads
            if not leads:
                self._refused.clear()

    def saw_refused(self, present: Iterable[refusals.Refused]) -> None:
        """The refused pods a pass left in the cluster (after its cleanup)."""
        by_node = collections.Counter(pod.node for pod in present)
        with self._lock:
            self._refused = by_node

    def cleaned(self) -> None:
        """One refused pod deleted."""
        with self._lock:
            self._cleaned += 1

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[prom.Metric]:
        with self._lock:
            leader, refused, cleaned = self._leader, dict(self._refused), self._cleaned
        lead = prom.GaugeMetricFamily("gpushard_replacer_leader", "1 while this replacer holds the Lease and runs "
                                      "passes, else 0: only the leader's other figures describe the cluster")
        lead.add_metric([], 1 if leader else 0)
        yield lead
        present = prom.GaugeMetricFamily("gpushard_replacer_refused_pods", "Pods gpushard placed that the kubelet "
                                         "refused at admission (UnexpectedAdmissionError) and that are still there, "
                                         "by node, as the leader's last pass saw them", labels=["node"])
        for node, count in sorted(refused.items()):
            present.add_metric([node], count)
        yield present
        gone = prom.CounterMetricFamily("gpushard_replacer_refused_pods_cleaned", "Refused pods this replacer "
                                        "deleted (replacement.cleanupRefused: true) since it started")
        gone.add_metric([], cleaned)
        yield gone


def text(metrics: Metrics) -> bytes:
    """The exposition text of a scrape."""
    return exposition.generate_latest(metrics.registry)
