"""A bounded burst of fractional pod creations from several clients, each create timed as its client sees it.

Used by the fault tests: a fault is made while a burst runs, and the burst says how many creates failed, with
which messages, when, and how long the longest admission took. Every burst is bounded in count and in time
and sends traffic only to the run's own API server.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes


@dataclass
class Outcome:
    started: float  # seconds since the burst began
    seconds: float
    error: str = ""


@dataclass
class Burst:
    outcomes: list[Outcome] = field(default_factory=list)
    began: float = 0.0

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    @property
    def longest(self) -> float:
        return max((o.seconds for o in self.outcomes), default=0.0)

    def window(self) -> tuple[float, float] | None:
        """From the first failed create's start to the last one's end, or None."""
        failed = self.failed
        if not failed:
            return None
        return min(o.started for o in failed), max(o.started + o.seconds for o in failed)

    def messages(self) -> dict[str, int]:
        counted: dict[str, int] = {}
        for o in self.failed:
            counted[o.error] = counted.get(o.error, 0) + 1
        return counted

    def summary(self) -> str:
        window = self.window()
        span = f", failing from {window[0]:.1f} s to {window[1]:.1f} s" if window else ""
        return (f"{len(self.outcomes)} creates, {len(self.failed)} failed{span}, longest {self.longest * 1000:.0f} ms; "
                f"{self.messages()}")


def _short(exc: Exception) -> str:
    if not isinstance(exc, kubernetes.client.ApiException) or exc.status == 0:
        return "API server unreachable"  # the client's own connection, not an answer of the API server
    body = getattr(exc, "body", None) or str(exc)
    try:
        text = json.loads(body).get("message", body)
    except (TypeError, ValueError):
        text = str(body)
    # One line per cause, not per pod.
    text = re.sub(r'pods "burst-\d+"', 'pods "burst-*"', str(text))
    # The API server's message names the webhook and the cause; keep the part that says which.
    for marker in ("connection refused", "no endpoints available", "context deadline exceeded", "EOF",
                   "connection reset", "broken pipe", "i/o timeout", "no route to host"):
        if marker in text:
            return marker
    # Another cause: the API server's message ends with it (after the webhook's name and URL).
    return text if len(text) <= 160 else "..." + text[-157:]


def pod(name: str, image: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            # Admission is what a burst measures: its pods wait off every node, so that hundreds of them neither
            # start containers nor fill the cards the other tests use.
            "spec": {"terminationGracePeriodSeconds": 0, "nodeSelector": {"gpushard-e2e/burst": "never"},
                     "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", "exec sleep 100000"],
                                     "resources": {"limits": {"nvidia.com/gpu": "0.1"}}}]}}


def run(kubeconfig: Path, namespace: str, image: str, count: int = 150, clients: int = 3, rate: float = 30.0,
        limit_s: float = 120.0, during=None, at: float = 0.3, stop: threading.Event | None = None,
        make=pod) -> Burst:
    """``count`` creates from ``clients`` threads at about ``rate`` a second in all, stopping after ``limit_s``, or
    once ``stop`` is set; ``during()`` runs once the first ``at`` of them were sent. ``make(name, image)`` is the
    pod each create sends."""
    burst = Burst()
    lock = threading.Lock()
    next_index = [0]
    fired = threading.Event()
    burst.began = time.monotonic()
    deadline = burst.began + limit_s
    interval = clients / rate

    def client() -> None:
        api = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(config_file=str(kubeconfig)))
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            with lock:
                index = next_index[0]
                if index >= count:
                    return
                next_index[0] += 1
            if during is not None and index == int(count * at) and not fired.is_set():
                fired.set()
                threading.Thread(target=during, daemon=True).start()
            began = time.monotonic()
            error = ""
            try:
                api.create_namespaced_pod(namespace, make(f"burst-{index}", image), _request_timeout=60)
            except Exception as exc:  # a refused create is what is counted
                error = _short(exc)
            ended = time.monotonic()
            with lock:
                burst.outcomes.append(Outcome(began - burst.began, ended - began, error))
            time.sleep(max(0.0, interval - (ended - began)))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s + 70)
    burst.outcomes.sort(key=lambda o: o.started)
    return burst
