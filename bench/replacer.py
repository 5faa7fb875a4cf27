"""What the re-placement loop costs the API server: requests and bytes, listing every pass or following by watch.

The local API server of the tests (``tests/fakekube.py``, real HTTP, lists in pages, watches with
resourceVersions, Leases and evictions) holds realistic objects (those of ``bench/view.py``:
Nodes of 10.7 kB, gpushard pods of 5.7 kB of JSON) and counts every request and every byte it
sends back, by kind. Between two passes the cluster changes as a busy one does: ``--churn``
pods start (created, then bound) and as many end (deletionTimestamp, then deleted), and
``--node-updates`` Nodes report status. The same passes then run twice against the same cluster:

- list: the replacer as it was, listing shared nodes and pinned pods (pages of 500) every pass;
- watch: the replacer as it runs now, listing once and then following both by watch, each pass
  planning over its cache.

Prints per mode: requests and bytes in all, per kind (lists, watches, Lease and the rest), per
pass after the first, the time a pass took (server and replacer share this process and its
CPUs: a relative figure), and the ratios list / watch.

    python bench/replacer.py [--nodes 2000] [--pods 20000] [--passes 5] [--churn 20] [--node-updates 33] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import view as objects  # noqa: E402
from tests import fakekube  # noqa: E402
from webhook import settings as settings_mod  # noqa: E402
from webhook.replacement import controller  # noqa: E402


def kind_of(method: str, path: str) -> str:
    if "watch=" in path:
        return "watch"
    resource = path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
    if method == "GET" and resource in ("nodes", "pods"):
        return "list"
    if "/leases" in path:
        return "lease"
    return "other"  # owners, evictions, Events


class _Counted:
    """The handler's output stream, counting what it writes."""

    def __init__(self, raw, server: CountingKube, handler):
        self._raw, self._server, self._handler = raw, server, handler

    def write(self, data) -> int:
        kind = kind_of(getattr(self._handler, "command", "") or "", getattr(self._handler, "path", "") or "")
        with self._server.counts_lock:
            self._server.sent[kind] += len(data)
        return self._raw.write(data)

    def flush(self) -> None:
        self._raw.flush()

    def __getattr__(self, name):
        return getattr(self._raw, name)


class CountingKube(fakekube.FakeKube):
    """The tests' API server, counting the bytes it sends, by kind of request."""

    def __init__(self):
        self.counts_lock = threading.Lock()
        self.sent: collections.Counter = collections.Counter()
        super().__init__()

    def _handler(self):
        server = self

        class Handler(super()._handler()):
            def setup(self):
                super().setup()
                self.wfile = _Counted(self.wfile, server, self)

        return Handler

    def tally(self) -> tuple[collections.Counter, collections.Counter]:
        """(requests, bytes) by kind since the last tally."""
        with self.lock:
            requests = collections.Counter(kind_of(method, path) for method, path, _ in self.requests)
            self.requests.clear()
        with self.counts_lock:
            sent, self.sent = self.sent, collections.Counter()
        return requests, sent


def seed(fake: CountingKube, nodes: int, pods: int) -> None:
    """The cluster, stored as it is after a while: no watch history to replay."""
    with fake.lock:
        for i in range(nodes):
            obj = objects.node_object(i)
            fake.objects["nodes"][("", obj["metadata"]["name"])] = obj
        for i in range(pods):
            obj = objects.pod_object(i, nodes)
            fake.objects["pods"][(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        fake.rv = 200_000


class Churn:
    """Pods that start and end, Nodes that report status, between two passes."""

    def __init__(self, fake: CountingKube, nodes: int, pods: int, churn: int, node_updates: int):
        self.fake, self.nodes, self.churn, self.node_updates = fake, nodes, churn, node_updates
        self.next_pod = pods
        self.oldest = 0
        self.next_node = 0

    def step(self) -> tuple[set[str], set[str]]:
        """One interval's changes; (uids that started, uids that ended)."""
        started, ended = set(), set()
        for _ in range(self.churn):
            obj = objects.pod_object(self.next_pod, self.nodes)
            self.next_pod += 1
            bound = obj["spec"].pop("nodeName", None) or f"gpu-node-{self.next_pod % self.nodes:05d}"
            status = obj["status"]
            obj["status"] = {"phase": "Pending"}
            self.fake.put("pods", obj)  # created (the webhook chose its card)
            obj["spec"]["nodeName"] = bound
            obj["status"] = status if status.get("phase") == "Running" else {"phase": "Running"}
            self.fake.put("pods", obj)  # bound and started
            started.add(obj["metadata"]["uid"])
        for _ in range(self.churn):
            while True:
                obj = objects.pod_object(self.oldest, self.nodes)
                self.oldest += 1
                key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                if key in self.fake.objects["pods"]:
                    break
            ending = self.fake.get("pods", key[1], key[0])
            ending["metadata"]["deletionTimestamp"] = "2026-11-30T09:00:00Z"
            self.fake.put("pods", ending)  # terminating
            self.fake.delete("pods", key[1], key[0])
            ended.add(ending["metadata"]["uid"])
        for _ in range(self.node_updates):
            name = f"gpu-node-{self.next_node % self.nodes:05d}"
            self.next_node += 1
            node = self.fake.get("nodes", name)
            for condition in node["status"].get("conditions") or ():
                condition["lastHeartbeatTime"] = f"2026-11-30T09:{self.next_node % 60:02d}:00Z"
            self.fake.put("nodes", node)  # a status report
        return started, ended


def run_mode(fake: CountingKube, churn: Churn, follow: bool, passes: int) -> dict:
    settings = settings_mod.Settings(replacement=settings_mod.Replacement(pending_seconds=0, interval=5))
    replacer = controller.Replacer(fake.api_client(), settings, "bench", "gpushard-system", follow=follow,
                                  sync_wait=600)
    fake.tally()
    times, per_pass = [], []
    try:
        for _ in range(passes):
            started, ended = churn.step()
            if replacer.cache is not None:  # let the watch deliver the interval's changes first
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    uids = replacer.cache.contents()[2]
                    if started <= uids and not ended & uids:
                        break
                    time.sleep(0.01)
            began = time.perf_counter()
            outcome = replacer.pass_once()
            times.append(time.perf_counter() - began)
            assert outcome is not None and outcome.synced
            per_pass.append(fake.tally())
    finally:
        replacer.stand_by()
    requests = sum((r for r, _ in per_pass), collections.Counter())
    sent = sum((b for _, b in per_pass), collections.Counter())
    later_requests = sum(sum(r.values()) for r, _ in per_pass[1:])
    later_bytes = sum(sum(b.values()) for _, b in per_pass[1:])
    return {"requests": requests, "bytes": sent, "times": times,
            "later_requests": later_requests / max(1, passes - 1), "later_bytes": later_bytes / max(1, passes - 1)}


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--pods", type=int, default=20000)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--churn", type=int, default=20, help="pods started and as many ended between two passes")
    parser.add_argument("--node-updates", type=int, default=33, help="Node status reports between two passes")
    parser.add_argument("--quick", action="store_true", help="200 nodes, 2,000 pods, 3 passes")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.pods, args.passes = 200, 2000, 3
    with CountingKube() as fake:
        began = time.perf_counter()
        seed(fake, args.nodes, args.pods)
        print(f"{args.nodes:,} nodes x {objects.CARDS} cards, {args.pods:,} pinned pods (seeded in "
              f"{time.perf_counter() - began:.1f} s); {args.passes} passes; between two passes {args.churn} pods "
              f"start and {args.churn} end, {args.node_updates} nodes report status")
        results = {}
        for name, follow in (("list", False), ("watch", True)):
            churn = Churn(fake, args.nodes, args.pods, args.churn, args.node_updates)
            state = copy.deepcopy(fake.objects) if not follow else None
            results[name] = run_mode(fake, churn, follow, args.passes)
            if state is not None:  # the second mode starts from the same cluster
                with fake.lock:
                    fake.objects = state
                    fake.rv += 1
            r = results[name]
            kinds = ", ".join(f"{k} {r['requests'][k]:,} / {mib(r['bytes'][k])}"
                              for k in ("list", "watch", "lease", "other") if r["requests"][k] or r["bytes"][k])
            times = r["times"]
            print(f"  {name:5}: {sum(r['requests'].values()):,} requests, {mib(sum(r['bytes'].values()))} "
                  f"({kinds}); per pass after the first: {r['later_requests']:.1f} requests, "
                  f"{mib(r['later_bytes'])}; pass time first {times[0] * 1000:,.0f} ms, later median "
                  f"{sorted(times[1:])[len(times[1:]) // 2] * 1000 if times[1:] else 0:,.0f} ms")
        old, new = results["list"], results["watch"]
        total = sum(old["bytes"].values()) / max(1, sum(new["bytes"].values()))
        later = old["later_bytes"] / max(1.0, new["later_bytes"])
        later_requests = old["later_requests"] / max(1.0, new["later_requests"])
        print(f"  list / watch: bytes over {args.passes} passes {total:,.1f}x, requests "
              f"{sum(old['requests'].values()) / max(1, sum(new['requests'].values())):,.1f}x; per pass after "
              f"the first: bytes {later:,.0f}x, requests {later_requests:,.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
