"""What gpushard costs the objects that never ask for a GPU, on the real control plane: `make e2e-bench
E2E_BENCH_ARGS=--plain`.

One control plane (the same binaries as `make e2e`: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler), a few nodes with room for every pod and no GPU, and deploy/base applied once. Then rounds,
each with gpushard **off** (its ValidatingAdmissionPolicyBindings and MutatingWebhookConfiguration deleted,
its webhook stopped: nothing of gpushard's runs or is consulted) and **on** (the bindings and the
configuration as shipped, one `gpushard serve` called by the API server, its view synced), in the order
off-on, on-off, off-on, ... so that a drift of the machine over the run falls on both alike. Each state is
checked through the API server before it is measured: a dry-run pod asking `gpushard.io/gpu` outside an
enforce namespace is refused exactly when gpushard is on, and a dry-run plain pod in an enforce namespace
comes back rewritten exactly then.

In each state, four workloads in turn, each ``--objects`` objects created by ``--clients`` threads at
``--rate`` a second, then waited for until every pod they make is bound, then deleted (the deletion is not
measured):

- ``pods outside``: bare pods without a GPU in a namespace that never opted in (what every cluster has most
  of: gpushard's goal is at most 2 % more API server CPU for them);
- ``deployments outside``: Deployments of one such pod (each makes a ReplicaSet and a pod: three objects
  admitted, the controllers' work included);
- ``pods inside`` and ``deployments inside``: the same in an enforce namespace (``gpushard.io/mode=enforce``),
  where gpushard hides the cards from them (the ``hide.gpushard.io`` entry, failurePolicy Ignore).

Printed per workload and state: the API server's CPU per object (user and system time of its process over
the workload, from /proc), the other components' (etcd, scheduler, controllers, webhook), each create's
round trip p50 and p99 as its client timed it, API requests per object (``apiserver_request_total``, the
bench's own lists taken out), the admission steps' time per object as the API server sums it, and how often
the policies' and webhooks' matchConditions were evaluated and left the object out
(``apiserver_admission_match_condition_evaluation_seconds``, ``..._exclusions_total``). Each figure is the
mean of the rounds with its spread (lowest to highest), and on against off per round: the noise is what
the rounds of one state differ by.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import costs  # noqa: E402
import kubernetes  # noqa: E402

from tests.e2e import components, gpushard  # noqa: E402

OUTSIDE, INSIDE = "plain", "plain-enforced"
LABEL = "bench.gpushard.io/plain"
WORKLOADS = (("pods outside", "pod", OUTSIDE), ("deployments outside", "deployment", OUTSIDE),
             ("pods inside", "pod", INSIDE), ("deployments inside", "deployment", INSIDE))
NODES = 10
# The controller manager's client may send this many requests a second: its default (20) makes a burst of
# Deployments wait on the controllers' own rate limit rather than on the API server.
CONTROLLER_FLAGS = ["--kube-api-qps=200", "--kube-api-burst=400"]
# The admission objects gpushard installs that the API server consults for every object: what "off" deletes.
ADMISSION_KINDS = ("validatingadmissionpolicybindings", "mutatingwebhookconfigurations")
PART_OF = "app.kubernetes.io/part-of=gpushard"
MATCH_SECONDS = "apiserver_admission_match_condition_evaluation_seconds"
MATCH_EXCLUDED = "apiserver_admission_match_condition_exclusions_total"


def plain_node(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}


def ready_status() -> dict:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    resources = {"cpu": "512", "memory": "4Ti", "pods": "5000"}
    return {"status": {"capacity": resources, "allocatable": resources, "conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "as the kubelet reports it",
         "lastHeartbeatTime": now, "lastTransitionTime": now}]}}


def pod_spec() -> dict:
    """A pod as most of a cluster's are: one container, a CPU and memory ask, a port, an env var, a probe."""
    return {"terminationGracePeriodSeconds": 0, "containers": [{
        "name": "app", "image": "registry.example/app:1.4", "command": ["/app", "--serve"],
        "ports": [{"containerPort": 8080, "name": "http"}],
        "env": [{"name": "LOG_LEVEL", "value": "info"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}}}]}


def body(kind: str, i: int) -> dict:
    labels = {LABEL: "yes", "app": f"app-{i:05d}"}
    if kind == "pod":
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i:05d}", "labels": labels},
                "spec": pod_spec()}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"app-{i:05d}", "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": f"app-{i:05d}"}},
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec()}}}


def create_all(config: Path, kind: str, namespace: str, count: int, clients: int, rate: float,
               make=body) -> tuple[list, int]:
    """``count`` objects (``make(kind, i)``) from ``clients`` threads, each with its own connection, object
    ``n`` not before ``n / rate`` s; (each create's round trip in seconds, refused)."""
    lock = threading.Lock()
    work = list(range(count))
    took: list[float] = []
    refused = [0]
    issued = [0]
    started = time.monotonic()

    def client() -> None:
        api_client = kubernetes.config.new_client_from_config(str(config))
        core, apps = kubernetes.client.CoreV1Api(api_client), kubernetes.client.AppsV1Api(api_client)
        while True:
            with lock:
                if not work:
                    return
                i = work.pop(0)
                due = started + issued[0] / rate
                issued[0] += 1
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            begun = time.perf_counter()
            try:
                if kind == "pod":
                    core.create_namespaced_pod(namespace, make(kind, i))
                else:
                    apps.create_namespaced_deployment(namespace, make(kind, i))
            except kubernetes.client.ApiException:
                with lock:
                    refused[0] += 1
                continue
            with lock:
                took.append(time.perf_counter() - begun)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took, refused[0]


class Bench:
    def __init__(self, assets: Path, clients: int, leave_out: tuple[str, ...] = ()):
        self.work = Path(tempfile.mkdtemp(prefix="gpushard-plain-"))
        self.plane = components.ControlPlane(assets, self.work, node_lifecycle=False,
                                             controller_flags=CONTROLLER_FLAGS)
        self.clients = clients
        # Diagnosis: admission objects (by name) that "on" does not put back, to tell what each costs.
        self.leave_out = leave_out
        self.left: list[str] = []
        self.webhook: gpushard.Webhook | None = None
        self.saved: list[dict] = []
        self.own: collections.Counter = collections.Counter()

    def start(self) -> None:
        plane = self.plane.start()
        kubectl = plane.kubectl
        kubectl.run("apply", "-k", str(ROOT / "deploy" / "base"), check=False, timeout=180)
        for name, labels in ((OUTSIDE, {}), (INSIDE, {"gpushard.io/mode": "enforce"})):
            kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                      "metadata": {"name": name, "labels": labels}}))
        self.admin = kubernetes.config.new_client_from_config(str(plane.work / "admin.kubeconfig"))
        core = kubernetes.client.CoreV1Api(self.admin)
        for n in range(NODES):
            name = f"node-{n:02d}"
            core.create_node(plain_node(name))
            core.patch_node_status(name, ready_status())
            core.patch_node(name, {"spec": {"taints": []}})
        for namespace in (OUTSIDE, INSIDE):
            components.wait_for(f"the default ServiceAccount of {namespace}", lambda ns=namespace: kubectl.run(
                "get", "serviceaccount", "default", "-n", ns, check=False, timeout=10).returncode == 0, timeout=60)
        # The webhook once, to point the shipped configuration at it; then the admission objects as they
        # stand, which "on" puts back.
        self.webhook = gpushard.Webhook(plane, self.work).start()
        for kind in ADMISSION_KINDS:
            for item in kubectl.json("get", kind, "-l", PART_OF)["items"]:
                meta = item["metadata"]
                item["metadata"] = {k: meta[k] for k in ("name", "labels", "annotations") if k in meta}
                item.pop("status", None)
                if meta["name"] not in self.leave_out:
                    self.saved.append(item)
                else:
                    self.left.append(meta["name"])
        found = {o["metadata"]["name"] for o in self.saved} | set(self.left)
        missing = sorted(set(self.leave_out) - found)
        if missing:
            raise ValueError(f"--leave-out: {missing[0]!r} is none of gpushard's admission objects: "
                             + ", ".join(sorted(found)))
        hooks = [o for o in self.saved if o["kind"] == "MutatingWebhookConfiguration"]
        if "gpushard" not in self.leave_out and not hooks:
            raise RuntimeError("deploy/base applied no MutatingWebhookConfiguration labelled " + PART_OF)
        # "on" without them: taken out now, so that the first state measured is already that.
        for name in self.leave_out:
            for kind in ADMISSION_KINDS:
                kubectl.run("delete", kind, name, "--ignore-not-found", check=False)

    def stop(self) -> None:
        if self.webhook is not None and self.webhook.process is not None:
            self.webhook.process.stop()
        self.plane.stop()

    # gpushard on and off.

    def set_state(self, on: bool) -> None:
        kubectl = self.plane.kubectl
        if on:
            self.webhook.process.start()
            self.webhook.wait_ready()
            kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": self.saved}))
        else:
            for kind in ADMISSION_KINDS:
                kubectl.run("delete", kind, "-l", PART_OF, "--wait=true")
            self.webhook.process.stop()
        expected = (on and "gpushard-opt-in" not in self.leave_out, on and "gpushard" not in self.leave_out)
        components.wait_for(f"gpushard {'on' if on else 'off'} as the API server sees it",
                            lambda: self.state() == expected, timeout=60, interval=1.0)
        # The API server's informers and the webhook's connections settled before anything is counted.
        time.sleep(3)

    def state(self) -> tuple[bool, bool]:
        """(the opt-in policy refuses a gpushard.io ask outside enforce namespaces, a plain pod in an enforce
        namespace comes back hidden from the cards), through dry-run creates."""
        core = kubernetes.client.CoreV1Api(self.admin)
        self.own[("POST", "pods")] += 2
        asking = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"}, "spec": {"containers": [{
            "name": "c", "image": "registry.example/app:1.4",
            "resources": {"limits": {"gpushard.io/gpu": "1"}}}]}}
        try:
            core.create_namespaced_pod(OUTSIDE, asking, dry_run="All")
            refused = False
        except kubernetes.client.ApiException as e:
            refused = e.status in (400, 403, 422) and "gpushard" in (e.body or "")
        plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"}, "spec": pod_spec()}
        try:
            made = core.create_namespaced_pod(INSIDE, plain, dry_run="All")
            hidden = any(e.name == "NVIDIA_VISIBLE_DEVICES" for e in made.spec.containers[0].env or [])
        except kubernetes.client.ApiException:
            hidden = False
        return refused, hidden

    # One workload.

    def counters(self) -> costs.Counters:
        pids = {p.name: (p.proc.pid, False) for p in self.plane.processes if p.alive()}
        if self.webhook.process.alive():
            pids["webhook"] = (self.webhook.process.proc.pid, True)
        metrics = self.plane.kubectl.run("get", "--raw", "/metrics", timeout=60).stdout
        self.own[("GET", "")] += 1
        counters = costs.Counters.read(metrics, costs.fetch(f"{self.plane.etcd_url}/metrics"), pids)
        counters.matching = matching(metrics)
        return counters

    def pods_bound(self, namespace: str) -> tuple[int, int]:
        self.own[("LIST", "pods")] += 1
        pods = kubernetes.client.CoreV1Api(self.admin).list_namespaced_pod(
            namespace, label_selector=f"{LABEL}=yes", _request_timeout=60).items
        return len(pods), sum(1 for p in pods if p.spec.node_name)

    def measure(self, kind: str, namespace: str, count: int, rate: float, make=body) -> dict:
        self.own.clear()
        before = self.counters()
        took, refused = create_all(self.plane.work / "admin.kubeconfig", kind, namespace, count, self.clients, rate,
                                   make)
        wanted = count - refused
        components.wait_for(f"{wanted} {kind}s' pods bound in {namespace}",
                            lambda: self.pods_bound(namespace) == (wanted, wanted), timeout=600, interval=0.5)
        # The scheduler's events and the controllers' last status writes for the last objects.
        time.sleep(2)
        after = self.counters()
        cost = costs.delta(before, after, max(1, wanted), dict(self.own))
        self.clean(kind, namespace)
        return {"refused": refused,
                "cpu_ms": {name: round(1000 * s / max(1, wanted), 2) for name, s in cost.cpu.items()},
                "p50_ms": percentile_ms(took, 0.5), "p99_ms": percentile_ms(took, 0.99),
                "requests": cost.per_pod(cost.requests_total), "top": cost.top(8),
                "server_ms": cost.ms_per_pod(),
                "matching": {k: round(v / max(1, wanted), 4)
                             for k, v in counter_delta(before.matching, after.matching).items()}}

    def clean(self, kind: str, namespace: str) -> None:
        kubectl = self.plane.kubectl
        if kind == "deployment":
            kubectl.run("delete", "deployments", "-n", namespace, "-l", f"{LABEL}=yes", "--wait=false",
                        "--cascade=background")
            components.wait_for("the Deployments' ReplicaSets gone", lambda: not kubectl.json(
                "get", "replicasets", "-n", namespace, "-l", f"{LABEL}=yes")["items"], timeout=300, interval=1.0)
        kubectl.run("delete", "pods", "-n", namespace, "-l", f"{LABEL}=yes", "--grace-period=0", "--force",
                    "--wait=false", timeout=300)
        components.wait_for("the pods gone", lambda: self.pods_bound(namespace)[0] == 0, timeout=300, interval=1.0)
        time.sleep(3)


def matching(metrics: str) -> dict[str, float]:
    """What the API server's admission did so far, by policy or webhook: ``<name> calls`` (a webhook called),
    ``<name> left out`` (its matchConditions left the object out; for a policy, the evaluations the API server
    times: those that left the object out or erred) and ``<name> ms`` (the time those evaluations took)."""
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value
    for labels, value in costs.series(metrics, "apiserver_admission_webhook_admission_duration_seconds_count"):
        add(f"{labels.get('name', '?')} calls", value)
    for labels, value in costs.series(metrics, MATCH_SECONDS + "_count"):
        add(f"{labels.get('name', '?')} left out", value)
    for labels, value in costs.series(metrics, MATCH_SECONDS + "_sum"):
        add(f"{labels.get('name', '?')} ms", 1000 * value)
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else 0.0


def spread(values: list[float]) -> str:
    """Mean (lowest-highest) of a figure over the rounds."""
    if not values:
        return "-"
    mean = statistics.mean(values)
    return f"{mean:.2f} ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{mean:.2f}"


def summarize(results: dict[tuple[str, bool], list[dict]], objects: int, rate: float, rounds: int,
              minor: str) -> list[str]:
    """The table: per workload, off and on, and on against off (the mean of each round's ratio, its spread)."""
    run = f"{objects} objects per workload and state, {rate:g} a second" if objects else "the rows of a run's log"
    lines = [f"\nno GPU, {run}, {rounds} rounds (off-on, on-off, ...), Kubernetes {minor}, {NODES} nodes",
             "workload | gpushard | API server CPU ms/object | x off | x off, per scheduler CPU | "
             "etcd, scheduler, controllers, webhook CPU ms | create p50 ms | p99 ms | p99 - off ms | "
             "API requests/object | validating admission ms/object"]
    for label, _kind, _ns in WORKLOADS:
        off, on = results.get((label, False), []), results.get((label, True), [])
        for state, rows in (("off", off), ("on", on)):
            if not rows:
                continue
            api = [r["cpu_ms"].get("kube-apiserver", 0.0) for r in rows]
            ratio = "1.00 (noise: " + _noise(api) + ")" if state == "off" else _ratios(
                api, [r["cpu_ms"].get("kube-apiserver", 0.0) for r in off])
            # The scheduler does the same work per pod in both states: the API server's CPU over the scheduler's
            # in the same window takes out how fast the shared machine ran meanwhile.
            relative = [_per_scheduler(r) for r in rows]
            normalized = "1.00 (noise: " + _noise(relative) + ")" if state == "off" else _ratios(
                relative, [_per_scheduler(r) for r in off])
            others = ", ".join(spread([r["cpu_ms"].get(n, 0.0) for r in rows]).split(" (")[0]
                               for n in ("etcd", "kube-scheduler", "kube-controller-manager", "webhook"))
            p99 = [r["p99_ms"] for r in rows]
            base_p99 = [r["p99_ms"] for r in off]
            lines.append(" | ".join([
                label, state, spread(api), ratio, normalized, others, spread([r["p50_ms"] for r in rows]), spread(p99),
                "-" if state == "off" else spread([a - b for a, b in zip(p99, base_p99, strict=False)]),
                spread([r["requests"] for r in rows]),
                spread([r["server_ms"].get("validating admission", 0.0) for r in rows])]))
    lines.append("admission per object, gpushard on, by policy or webhook, as the API server counts it (webhook "
                 "calls; left out by matchConditions, and the time those evaluations took):")
    for label, _kind, _ns in WORKLOADS:
        rows = results.get((label, True), [])
        if rows:
            lines.append(f"  {label}: " + (", ".join(f"{k} {v}" for k, v in rows[-1]["matching"].items()) or "none"))
    return lines


def _per_scheduler(row: dict) -> float:
    scheduler = row["cpu_ms"].get("kube-scheduler", 0.0)
    return row["cpu_ms"].get("kube-apiserver", 0.0) / scheduler if scheduler else 0.0


def from_log(path: Path) -> list[str]:
    """The table again from the rows a run printed (its JSON lines), for a run whose table was lost or to
    read one with another summary."""
    results: dict[tuple[str, bool], list[dict]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[(row["workload"], row["gpushard"] == "on")].append(row)
    if not results:
        raise ValueError(f"{path}: no rows of bench/plain.py in it")
    counts = [len(v) for v in results.values()]
    return summarize(results, 0, 0, max(counts), "as the log's run")


def _noise(values: list[float]) -> str:
    if len(values) < 2:
        return "one round"
    mean = statistics.mean(values)
    return f"+-{100 * (max(values) - min(values)) / 2 / mean:.1f} %"


def _ratios(on: list[float], off: list[float]) -> str:
    pairs = [a / b for a, b in zip(on, off, strict=False) if b]
    if not pairs:
        return "n/a"
    return f"{statistics.mean(pairs):.3f} ({min(pairs):.3f}-{max(pairs):.3f})"


def main(assets: Path, objects: int, rate: float, rounds: int, clients: int, only: str = "",
         leave_out: tuple[str, ...] = ()) -> int:
    if objects < 1 or rate <= 0 or rounds < 1:
        raise ValueError(f"--plain needs --objects >= 1 (got {objects}), --rate > 0 (got {rate:g}) and "
                         f"--rounds >= 1 (got {rounds})")
    workloads = [w for w in WORKLOADS if not only or only in w[0]]
    if not workloads:
        raise ValueError(f"--only: {only!r} names none of: " + ", ".join(w[0] for w in WORKLOADS))
    bench = Bench(assets, clients, leave_out)
    results: dict[tuple[str, bool], list[dict]] = collections.defaultdict(list)
    try:
        bench.start()
        minor = bench.plane.kubectl.json("version")["serverVersion"]["gitVersion"]
        on = True  # the webhook started by start(): "on" already
        # One workload not counted: the first objects of a fresh API server cost it more (caches, connections).
        bench.measure(*workloads[0][1:], max(1, objects // 2), rate)
        for r in range(rounds):
            for state in ((False, True) if r % 2 == 0 else (True, False)):
                if state != on:
                    bench.set_state(state)
                    on = state
                for label, kind, namespace in workloads:
                    row = bench.measure(kind, namespace, objects, rate)
                    results[(label, state)].append(row)
                    print(json.dumps({"round": r, "workload": label, "gpushard": "on" if state else "off", **row}),
                          flush=True)
        for line in summarize(results, objects, rate, rounds, minor):
            print(line)
    finally:
        bench.stop()
    return 0


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=300)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--only", default="", help="only the workloads whose name holds this (\"pods outside\")")
    parser.add_argument("--leave-out", default="",
                        help="diagnosis: gpushard's admission objects (ValidatingAdmissionPolicyBindings, the "
                             "MutatingWebhookConfiguration) by name, comma-separated, that \"on\" leaves out")
    parser.add_argument("--summarize", type=Path, metavar="LOG",
                        help="print the table from the rows a run printed to LOG, and run nothing")
    args = parser.parse_args()
    if args.summarize:
        try:
            print("\n".join(from_log(args.summarize)))
        except (OSError, ValueError) as e:
            print(f"gpushard: --summarize: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(0)
    found, why = components.which_assets(os.environ)
    if found is None:
        print(f"gpushard: plain needs the real components: {why}", file=sys.stderr)
        raise SystemExit(2)
    try:
        raise SystemExit(main(found, args.objects, args.rate, args.rounds, args.clients, args.only,
                              tuple(n for n in args.leave_out.split(",") if n)))
    except ValueError as e:
        print(f"gpushard: {e}", file=sys.stderr)
        raise SystemExit(2) from None
