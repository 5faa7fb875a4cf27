"""Scrape benchmark: the cost of one agent metrics scrape on a busy node.

A node with 8 cards and 100 pods holding shares (100 containers, 2 GPU processes each, cgroup
files in the three layouts of tests/agent/fakenode.py): NVML's process lists from the fake
backend, a fake /proc tree on disk, the stand-in kubelet PodResources server over a real unix
socket, and the node's pods from the local Kubernetes API server (listed once, then cached, as
in a steady state). Measured in the same run, as baselines:
- an empty scrape: the collector and the exposition with no card and no pod (the fixed cost);
- the PodResources List call alone over the socket (the kubelet round trip every scrape makes);
and the busy scrape split into observing the node and writing the text.
Also: the first scrape (with the pod list from the API server), the size of the text and its series.

Run: python bench/scrape.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.agent import fakenode, fakepodresources  # noqa: E402
from tests.fakekube import FakeKube  # noqa: E402
from webhook.agent.metrics import attributing, exporting, podlisting
from webhook.agent.node import health, nvml, podresources
from webhook.core import policy as policy_mod  # noqa: E402

NODE = "bench-node"
CARDS, PODS, PROCESSES = 8, 100, 2


def _times(action, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        action()
        out.append(time.perf_counter() - started)
    return out


def _line(name: str, times: list[float], base: float | None = None) -> str:
    times = sorted(times)
    p50, p99 = statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]
    ratio = f"{p50 / base:8.1f}x" if base else f"{'':>9}"
    return f"{name:44} {p50 * 1e3:9.2f} {p99 * 1e3:9.2f} {ratio}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="gsb-", dir="/tmp")
    proc_root = os.path.join(work, "proc")
    os.mkdir(proc_root)
    cards = [nvml.Card(k, f"GPU-bench-{k:04d}", "NVIDIA H100 80GB HBM3", 81559) for k in range(CARDS)]
    devices = nvml.FakeDevices(cards)
    node = fakenode.FakeNode(proc_root, devices)
    layouts = list(fakenode.LAYOUTS)
    pid = 10000
    next_share = {k: 0 for k in range(CARDS)}
    for i in range(PODS):
        card = i % CARDS
        shares = 7  # 13 pods on the busiest cards: 91 of 100 shares
        container = fakenode.Container("main", card, shares, next_share[card],
                                       processes=[(pid + j, 500 + 37 * i + j) for j in range(PROCESSES)])
        pid += PROCESSES
        next_share[card] += shares
        node.pods.append(fakenode.Pod(f"team-{i % 7}", f"job-{i}", [container, fakenode.Container("log")],
                                      layout=layouts[i % len(layouts)]))
    node.sync()
    server = fakepodresources.FakePodResources(os.path.join(work, "kubelet.sock")).start()
    server.set(node.pod_resources())
    kube = FakeKube().start()
    for pod in node.pods:
        kube.put("pods", pod.api_object(NODE))
    client = podresources.Client(server.path)
    policy = policy_mod.Policy()
    try:
        pods = podlisting.NodePods(kube.api_client(), NODE, max_age=3600)
        busy = exporting.new_registry(exporting.Observer(
            NODE, cards, devices, health.Board(cards), policy, lambda: client.holdings(policy),
            attributing.ProcReader(proc_root), pods))
        empty_devices = nvml.NullDevices()
        empty = exporting.new_registry(exporting.Observer(
            NODE, [], empty_devices, None, policy, lambda: [], attributing.ProcReader(proc_root), None))

        started = time.perf_counter()
        text = exporting.text(busy)
        first = time.perf_counter() - started
        series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        attributed = sum(1 for line in text.splitlines() if line.startswith("gpushard_container_gpu_processes")
                         and line.endswith(f" {float(PROCESSES)}"))

        observer = exporting.Observer(NODE, cards, devices, health.Board(cards), policy,
                                      lambda: client.holdings(policy), attributing.ProcReader(proc_root), pods)
        frozen = observer.observe()
        text_only = exporting.new_registry(lambda: frozen)
        empty_t = _times(lambda: exporting.text(empty), args.rounds)
        observe_t = _times(observer.observe, args.rounds)
        text_t = _times(lambda: exporting.text(text_only), args.rounds)
        list_t = _times(lambda: client.list(), args.rounds)
        busy_t = _times(lambda: exporting.text(busy), args.rounds)
        base = statistics.median(empty_t)
        print(f"node: {CARDS} cards, {PODS} pods holding shares ({PODS} GPU containers + {PODS} without), "
              f"{PODS * PROCESSES} GPU processes; {args.rounds} scrapes each")
        print(f"metrics text: {len(text) / 1024:.0f} KiB, {series} series; containers with all their processes "
              f"attributed: {attributed}/{PODS}")
        print(f"first scrape (lists the node's pods from the API server): {first * 1e3:.1f} ms")
        print(f"\n{'scrape (milliseconds)':44} {'p50':>9} {'p99':>9} {'vs empty':>9}")
        print(_line("empty collector (baseline)", empty_t))
        print(_line("PodResources List alone (unix socket)", list_t, base))
        print(_line("  of which: observing (NVML, /proc, kubelet)", observe_t, base))
        print(_line("  of which: the text of those series", text_t, base))
        print(_line(f"{CARDS} cards, {PODS} pods (steady state)", busy_t, base))
        busy50, list50 = statistics.median(busy_t), statistics.median(list_t)
        print(f"\nper scrape above the empty one: {(busy50 - base) * 1e3:.2f} ms, of which the kubelet round trip "
              f"{list50 * 1e3:.2f} ms; per GPU process {(busy50 - base) / (PODS * PROCESSES) * 1e6:.0f} us")
    finally:
        client.close()
        server.stop()
        kube.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
