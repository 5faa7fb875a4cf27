"""What gpushard costs the API server against the floor of any mutating webhook: `make e2e-bench
E2E_BENCH_ARGS=--floor`.

One control plane (the same binaries as `make e2e`), ``GPU_NODES`` nodes of 8 cards that advertise both
time-slicing's ``nvidia.com/gpu`` (8 x 100 replicas) and gpushard's ``gpushard.io/card-<k>`` shares (as
the agent publishes them), and deploy/base applied once. Then rounds over four setups, in an order that
turns by one each round so that a drift of the machine falls on every setup alike:

- ``none``: nothing but the API server's own admission; GPU pods ask ``nvidia.com/gpu: 25`` (time-slicing
  replicas), as a cluster without gpushard runs them;
- ``noop``: the same pods, and one mutating webhook that allows every pod of the GPU namespace and changes
  nothing (a small TLS server of this bench, in its own process);
- ``patching``: the same webhook, answering with a patch that adds an env var and an annotation;
- ``gpushard``: deploy/base's admission objects as shipped and one ``gpushard serve`` with the shipped
  worker settings; GPU pods ask ``nvidia.com/gpu: 0.25`` in the enforce namespace.

In the other setups gpushard's ValidatingAdmissionPolicyBindings and MutatingWebhookConfiguration are
deleted and its webhook is stopped; each setup is checked through the API server (a dry-run create) before
it is measured. Workloads: ``GPU pods`` (``--objects`` bare pods created by ``--clients`` threads at
``--rate`` a second in the enforce namespace, waited for until all are bound, then deleted) under every
setup, and ``plain pods outside`` (pods that ask no GPU, in a namespace that never opted in) under ``none``
and ``gpushard`` (the bench's webhooks never see them).

Printed: the API server's CPU per pod (user and system time of its process over the workload, from /proc),
the same over the scheduler's CPU of the same window (the scheduler does the same work per pod in every
setup, so the ratio takes out how fast the shared machine ran), each setup against ``patching`` (GPU pods)
or ``none`` (plain pods) per round, the webhook's CPU per review, and each create's round trip p50/p99 as its
client timed it. Each figure is the mean of the rounds with their spread (lowest to highest). With
``--profile S`` a CPU profile of kube-apiserver is taken over S seconds of each GPU workload and summarized
by where the samples went (``go tool pprof``; needs Go).
"""

from __future__ import annotations

import base64
import collections
import http.server
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import costs  # noqa: E402
import kubernetes  # noqa: E402
import plain  # noqa: E402

from tests.e2e import components, gpushard  # noqa: E402
from webhook.core import names  # noqa: E402

SETUPS = ("none", "noop", "patching", "gpushard")
GPU, OUTSIDE = "GPU pods", "plain pods outside"
WORKLOADS = ((GPU, plain.INSIDE, SETUPS), (OUTSIDE, plain.OUTSIDE, ("none", "gpushard")))
GPU_NODES, CARDS, SHARES, MEMORY_MIB = 50, 8, 100, 81559
ASK = 25  # shares (or time-slicing replicas) of each GPU pod
TRIVIAL = "trivial.bench.gpushard.io"
# Where the samples of a kube-apiserver profile went: (label, a regular expression of the Go function).
PLACES = (
    ("mutating webhooks", r"mutating\.\(\*mutatingDispatcher\)\.Dispatch$"),
    ("webhook calls", r"mutating\.\(\*mutatingDispatcher\)\.callAttrMutatingHook$"),
    ("matchConditions", r"matchconditions\.\(\*matcher\)\.Match$"),
    ("validating policies", r"policy/validating\.\(\*Plugin\)\.Validate$"),
    ("watch encoding", r"watchEncoder\)\.Encode$"),
    ("etcd client", r"etcd3\.\(\*store\)\.(Create|GuaranteedUpdate)$"),
)


def gpu_pod(i: int, setup: str) -> dict:
    ask = f"{ASK / SHARES:g}" if setup == "gpushard" else str(ASK)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i:05d}", "labels": {plain.LABEL: "yes"}},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                "name": "main", "image": "registry.example/cuda:12", "command": ["/app", "--serve"],
                "env": [{"name": "LOG_LEVEL", "value": "info"}],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                              "limits": {"memory": "256Mi", "nvidia.com/gpu": ask}}}]}}


def gpu_node(i: int) -> tuple[dict, dict]:
    """A node of 8 cards as gpushard's agent publishes it, that also advertises time-slicing's replicas."""
    name = f"gpu-{i:03d}"
    inventory = [{"index": k, "uuid": f"GPU-{name}-{k}", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": MEMORY_MIB}
                 for k in range(CARDS)]
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "labels": {"kubernetes.io/hostname": name, names.CARDS_LABEL: str(CARDS),
                                 **{names.card_memory_label(k): str(MEMORY_MIB) for k in range(CARDS)}},
        "annotations": {"gpushard.io/inventory": json.dumps(inventory)}}}
    resources = {"cpu": "512", "memory": "4Ti", "pods": "500", "nvidia.com/gpu": str(CARDS * SHARES),
                 "gpushard.io/gpu": str(CARDS * SHARES),
                 **{f"gpushard.io/card-{k}": str(SHARES) for k in range(CARDS)}}
    status = plain.ready_status()
    status["status"]["capacity"] = status["status"]["allocatable"] = resources
    return node, status


class Trivial(http.server.BaseHTTPRequestHandler):
    """The floor: /noop allows and changes nothing; /patch adds an env var to the first container and an
    annotation."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in two writes

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request = review["request"]
        response: dict = {"uid": request["uid"], "allowed": True}
        if self.path.startswith("/patch"):  # the API server adds ?timeout=
            pod = request["object"]
            container = pod["spec"]["containers"][0]
            ops = [{"op": "add", "path": "/spec/containers/0/env/-" if container.get("env") else
                    "/spec/containers/0/env", "value": {"name": "BENCH", "value": "patched"}
                    if container.get("env") else [{"name": "BENCH", "value": "patched"}]}]
            if pod["metadata"].get("annotations"):
                ops.append({"op": "add", "path": "/metadata/annotations/bench.gpushard.io~1patched", "value": "yes"})
            else:
                ops.append({"op": "add", "path": "/metadata/annotations",
                            "value": {"bench.gpushard.io/patched": "yes"}})
            response.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(ops).encode()).decode())
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": response}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def trivial_server(port: int, cert: str, key: str) -> http.server.ThreadingHTTPServer:
    """The trivial webhook, listening on ``port`` (0: any free one) once this returns."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Trivial)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


class Bench(plain.Bench):
    def __init__(self, assets: Path, clients: int, profile: bool = False):
        super().__init__(assets, clients)
        if profile:
            self.plane.apiserver_flags.append("--profiling=true")
        self.setup = "gpushard"  # what start() leaves on
        self.trivial: components.Process | None = None
        self.trivial_url = ""

    def start(self) -> None:
        super().start()
        core = kubernetes.client.CoreV1Api(self.admin)
        for i in range(GPU_NODES):
            node, status = gpu_node(i)
            core.create_node(node)
            core.patch_node_status(node["metadata"]["name"], status)
            core.patch_node(node["metadata"]["name"], {"spec": {"taints": []}})
        port = components.free_port()
        cert, key = self.plane.pki.issue("trivial", "bench-trivial", dns=("localhost",), ips=("127.0.0.1",),
                                         server=True)
        self.trivial = components.Process("trivial", [
            sys.executable, __file__, "--serve-trivial", str(port), str(cert), str(key)],
            self.work / "trivial.log").start()
        self.trivial_url = f"https://127.0.0.1:{port}"
        context = ssl.create_default_context(cafile=str(self.plane.pki.ca_path))

        def answers() -> bool:
            try:
                urllib_request(self.trivial_url + "/noop", context)
            except OSError:
                return False
            return True
        components.wait_for("the bench's trivial webhook", answers, timeout=30)

    def stop(self) -> None:
        if self.trivial is not None:
            self.trivial.stop()
        super().stop()

    def trivial_configuration(self, path: str) -> dict:
        return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": "bench-trivial"}, "webhooks": [{
                    "name": TRIVIAL, "failurePolicy": "Fail", "sideEffects": "None",
                    "admissionReviewVersions": ["v1"], "timeoutSeconds": 5,
                    "clientConfig": gpushard.client_config(self.plane, self.trivial_url,
                                                           {"clientConfig": {"url": path}}),
                    "namespaceSelector": {"matchLabels": {"gpushard.io/mode": "enforce"}},
                    "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                               "resources": ["pods"], "scope": "Namespaced"}]}]}

    def set_setup(self, setup: str) -> None:
        if setup == self.setup:
            return
        kubectl = self.plane.kubectl
        if self.setup == "gpushard":
            self.set_state(False)
        elif self.setup in ("noop", "patching"):
            kubectl.run("delete", "mutatingwebhookconfiguration", "bench-trivial", "--wait=true")
        if setup == "gpushard":
            self.set_state(True)
        elif setup in ("noop", "patching"):
            kubectl.apply(json.dumps(self.trivial_configuration("/noop" if setup == "noop" else "/patch")))
        self.setup = setup
        components.wait_for(f"setup {setup} as the API server sees it", lambda: self.seen() == setup,
                            timeout=60, interval=1.0, explain=lambda: f"it meets {self.seen()}; "
                            + (self.trivial.tail(10) if self.trivial else ""))
        time.sleep(3)  # the API server's informers and the webhook's connections settled

    def seen(self) -> str:
        """Which setup a dry-run pod asking 25 whole GPUs meets: refused by gpushard (more than one card),
        annotated (patching), sent to the trivial webhook unchanged (noop), or none of these."""
        before = self.trivial_calls()
        self.own[("POST", "pods")] += 1
        try:
            made = kubernetes.client.CoreV1Api(self.admin).create_namespaced_pod(
                plain.INSIDE, gpu_pod(0, "none"), dry_run="All")
        except kubernetes.client.ApiException as e:
            return "gpushard" if "gpushard" in (e.body or "") else "?"
        if "bench.gpushard.io/patched" in (made.metadata.annotations or {}):
            return "patching"
        return "noop" if self.trivial_calls() > before else "none"

    def trivial_calls(self) -> float:
        metrics = self.plane.kubectl.run("get", "--raw", "/metrics", timeout=60).stdout
        self.own[("GET", "")] += 1
        return plain.matching(metrics).get(f"{TRIVIAL} calls", 0.0)

    def counters(self):
        counters = super().counters()
        if self.trivial is not None and self.setup in ("noop", "patching"):
            counters.cpu["webhook"] = costs.cpu_seconds(self.trivial.proc.pid)
        return counters

    def measure_setup(self, workload: str, namespace: str, setup: str, count: int, rate: float,
                      profile: float) -> dict:
        body = (lambda i: gpu_pod(i, setup)) if workload == GPU else (lambda i: plain.body("pod", i))
        profiled: dict = {}
        thread = None
        if profile and workload == GPU:
            thread = threading.Thread(target=self.profile, args=(profile, profiled), daemon=True)
            # Started with the burst: the creates take count / rate seconds.
            thread.start()
        row = self.measure("pod", namespace, count, rate, lambda _kind, i: body(i))
        if thread is not None:
            thread.join(profile + 60)
            row["profile"] = profiled.get("summary", [])
        return row

    def profile(self, seconds: float, out: dict) -> None:
        kubectl = self.plane.kubectl
        path = self.work / f"apiserver-{time.monotonic_ns()}.pprof"
        with open(path, "wb") as f:
            subprocess.run([kubectl.binary, f"--kubeconfig={kubectl.config}", "get", "--raw",
                            f"/debug/pprof/profile?seconds={int(seconds)}"], stdout=f, timeout=seconds + 60,
                           check=True)
        out["summary"] = summarize_profile(self.plane.binary("kube-apiserver"), path)


def urllib_request(url: str, context: ssl.SSLContext) -> None:
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "probe"}}
    request = urllib.request.Request(url, data=json.dumps(review).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, context=context, timeout=3).read()


def summarize_profile(binary: Path, path: Path) -> list[tuple[str, float]]:
    """(place, cumulative % of the samples) for each of PLACES, and the 8 functions with most samples of their
    own, from `go tool pprof -top`."""
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        return [("no go tool to read the profile", 0.0)]
    out = subprocess.run([go, "tool", "pprof", "-top", "-nodecount=100000", str(binary), str(path)],
                         capture_output=True, text=True, timeout=300, check=False).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[1].endswith("%") and fields[4].endswith("%"):
            rows.append((float(fields[1][:-1]), float(fields[4][:-1]), fields[5].split(" ")[0]))
    summary = []
    for label, pattern in PLACES:
        found = [cum for _flat, cum, name in rows if re.search(pattern, name)]
        summary.append((label, max(found) if found else 0.0))
    for flat, _cum, name in sorted(rows, reverse=True)[:8]:
        summary.append(("self " + name.rsplit("/", 1)[-1], flat))
    return summary


def spread(values: list[float]) -> str:
    return plain.spread(values)


def summarize(results: dict[tuple[str, str], list[dict]], objects: int, rate: float, rounds: int,
              minor: str) -> list[str]:
    lines = [f"\nthe API server's cost per pod, {objects} pods per workload and setup, {rate:g} a second, {rounds} "
             f"rounds (the setups' order turning), Kubernetes {minor}, {GPU_NODES} GPU nodes of {CARDS} cards",
             "workload | setup | API server CPU ms/pod | x baseline | API server/scheduler CPU | x baseline | "
             "webhook CPU ms/review | create p50 ms | p99 ms"]
    for workload, _ns, setups in WORKLOADS:
        baseline = "patching" if workload == GPU else "none"
        base = results.get((workload, baseline), [])
        for setup in setups:
            rows = results.get((workload, setup), [])
            if not rows:
                continue
            api = [r["cpu_ms"].get("kube-apiserver", 0.0) for r in rows]
            relative = [plain._per_scheduler(r) for r in rows]
            calls = [sum(v for k, v in r["matching"].items() if k.endswith(" calls")) for r in rows]
            review = [r["cpu_ms"].get("webhook", 0.0) / c for r, c in zip(rows, calls, strict=True) if c]
            lines.append(" | ".join([
                workload, setup, spread(api),
                plain._ratios(api, [r["cpu_ms"].get("kube-apiserver", 0.0) for r in base]),
                spread(relative), plain._ratios(relative, [plain._per_scheduler(r) for r in base]),
                spread(review) if review else "-", spread([r["p50_ms"] for r in rows]),
                spread([r["p99_ms"] for r in rows])]))
    profiled = {setup: [r["profile"] for r in rows if r.get("profile")]
                for (workload, setup), rows in results.items() if workload == GPU}
    if any(profiled.values()):
        lines.append("kube-apiserver CPU profile over GPU pods: % of all samples in each place (cumulative, the mean "
                     "of the rounds), then the functions with most samples of their own (the last round)")
        places = {label for label, _pattern in PLACES}
        for setup in SETUPS:
            summaries = profiled.get(setup)
            if not summaries:
                continue
            mean = [f"{label} {statistics.mean(dict(p).get(label, 0.0) for p in summaries):.1f}%"
                    for label, _pattern in PLACES]
            own = [f"{label} {pct:.1f}%" for label, pct in summaries[-1] if label not in places]
            lines.append(f"  {setup}: " + ", ".join(mean + own))
    lines.append("admission per pod under gpushard, as the API server counts it (webhook calls; policies and "
                 "webhooks left out by matchConditions, and the time those evaluations took):")
    for workload, _ns, _setups in WORKLOADS:
        rows = results.get((workload, "gpushard"), [])
        if rows:
            lines.append(f"  {workload}: " + (", ".join(f"{k} {v}" for k, v in rows[-1]["matching"].items()) or "none"))
    return lines


def main(assets: Path, objects: int, rate: float, rounds: int, clients: int, profile: float = 0.0) -> int:
    if objects < 1 or rate <= 0 or rounds < 1:
        raise ValueError(f"--floor needs --objects >= 1 (got {objects}), --rate > 0 (got {rate:g}) and "
                         f"--rounds >= 1 (got {rounds})")
    bench = Bench(assets, clients, profile > 0)
    results: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    try:
        bench.start()
        minor = bench.plane.kubectl.json("version")["serverVersion"]["gitVersion"]
        # Not counted: the first pods of a fresh API server cost it more (caches, connections).
        bench.measure_setup(GPU, plain.INSIDE, "gpushard", max(1, objects // 2), rate, 0.0)
        for r in range(rounds):
            order = SETUPS[r % len(SETUPS):] + SETUPS[:r % len(SETUPS)]
            for setup in order:
                bench.set_setup(setup)
                for workload, namespace, setups in WORKLOADS:
                    if setup not in setups:
                        continue
                    row = bench.measure_setup(workload, namespace, setup, objects, rate, profile)
                    results[(workload, setup)].append(row)
                    print(json.dumps({"round": r, "workload": workload, "setup": setup, **row}), flush=True)
        for line in summarize(results, objects, rate, rounds, minor):
            print(line)
    finally:
        bench.stop()
    return 0


def from_log(path: Path) -> list[str]:
    """The table again from the rows a run printed (its JSON lines)."""
    results: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        if line.startswith("{") and '"setup"' in line:
            row = json.loads(line)
            results[(row["workload"], row["setup"])].append(row)
    if not results:
        raise ValueError(f"{path}: no rows of bench/floor.py in it")
    return summarize(results, 0, 0, max(len(v) for v in results.values()), "as the log's run")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-trivial":
        trivial_server(int(sys.argv[2]), sys.argv[3], sys.argv[4]).serve_forever()
        raise SystemExit(0)
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=400)
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--profile", type=float, default=0.0, metavar="S",
                        help="a kube-apiserver CPU profile over S seconds of each GPU workload")
    parser.add_argument("--summarize", type=Path, metavar="LOG", help="the table from a run's log; runs nothing")
    args = parser.parse_args()
    if args.summarize:
        print("\n".join(from_log(args.summarize)))
        raise SystemExit(0)
    found, why = components.which_assets(os.environ)
    if found is None:
        print(f"gpushard: floor needs the real components: {why}", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(found, args.objects, args.rate, args.rounds, args.clients, args.profile))
