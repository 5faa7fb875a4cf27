"""The admission server's Prometheus metrics, per app, and shared across gunicorn workers."""

from __future__ import annotations

import os

import prometheus_client
from prometheus_client import multiprocess

# Admission answers take around a millisecond; the API server gives up at its
# timeoutSeconds (10 s by default), so buckets span both.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Metrics:
    """The counters of one app. Each app has its own registry, so tests may build many apps."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.admissions = prometheus_client.Counter(
            "gpushard_admissions", "AdmissionReviews answered, by outcome (allowed, patched, denied, "
            "invalid, error), object kind and mode", ["outcome", "kind", "mode"], registry=self.registry)
        self.latency = prometheus_client.Histogram(
            "gpushard_admission_seconds", "Time to read, decide and answer one AdmissionReview",
            ["mode"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics text: this process's, or every worker's when gunicorn runs several."""
        if os.environ.get(MULTIPROC_ENV):
            # Each worker writes its values to files in the folder; any worker can sum them all.
            registry = prometheus_client.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = self.registry
        return prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST


def worker_exited(pid: int) -> None:
    """Forget a dead worker's live gauges (its counters stay counted)."""
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.mark_process_dead(pid)
