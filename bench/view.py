"""What the live cluster view costs one worker at scale: memory, sync time, and admission stalls during a relist.

A local HTTP server (its own process) speaks the Kubernetes list/watch API with realistic objects:
Nodes with managedFields, images, conditions, addresses and the agent's inventory; gpushard pods
with a GPU container and a sidecar, managedFields, owner references, volumes and statuses. It
serves lists in pages (limit/continue) as the API server does. A worker process (as a gunicorn
worker would) starts the live view against it and, from a thread that makes card choices in a
loop as admissions do (snapshot, choose, remember), records the longest gap between two choices:
while the view syncs, and while it relists after the server ends the pod watch with 410 Gone.

Prints, per size: the worker's resident memory after sync and its peak, next to an idle
interpreter and one that only imported what `gpushard serve` imports; sync time; longest stall.

    python bench/view.py [--nodes 2000] [--pods 10000,50000] [--page 500] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CARDS = 8
SHARES = (10, 20, 25)  # per pod; at 50,000 pods over 2,000 x 8 cards a card holds at most 4 of them


# --- realistic objects -----------------------------------------------------------------------------

def _managed(manager: str, operation: str, fields: dict, sub: str | None = None) -> dict:
    entry = {"manager": manager, "operation": operation, "apiVersion": "v1", "time": "2026-11-30T09:12:44Z",
             "fieldsType": "FieldsV1", "fieldsV1": fields}
    if sub:
        entry["subresource"] = sub
    return entry


def node_object(i: int) -> dict:
    name = f"gpu-node-{i:05d}"
    labels = {"beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
              "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
              "node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/region": "us-east-1",
              "topology.kubernetes.io/zone": f"us-east-1{'abc'[i % 3]}", "nvidia.com/gpu.present": "true",
              "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
              "gpushard.io/cards": str(CARDS), "pool": f"train-{i % 4}"}
    inventory = [{"index": k, "uuid": f"GPU-{i:05d}-{k}-4b1c-9f2e-0c3a5d7e8f90", "model": "NVIDIA H100 80GB HBM3",
                  "memoryMiB": 81559} for k in range(CARDS)]
    allocatable = {"cpu": "191500m", "ephemeral-storage": "1846677737574", "hugepages-1Gi": "0",
                   "hugepages-2Mi": "0", "memory": "2097151996Ki", "pods": "110", "gpushard.io/shares": "800"}
    allocatable.update({f"gpushard.io/card-{k}": "100" for k in range(CARDS)})
    images = [{"names": [f"registry.example.com/ml/image-{j}@sha256:{(i * 31 + j):064x}",
                         f"registry.example.com/ml/image-{j}:v{j}.{i % 7}"], "sizeBytes": 1_000_000_000 + j}
              for j in range(25)]
    fields_labels = {f"f:{k}": {} for k in labels}
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {
            "name": name, "uid": f"6f1c{i:08d}-3a2b-4c5d-8e9f-0a1b2c3d4e5f", "resourceVersion": str(1000 + i),
            "creationTimestamp": "2026-11-01T00:00:00Z", "labels": labels,
            "annotations": {"gpushard.io/inventory": json.dumps(inventory, separators=(",", ":")),
                            "node.alpha.kubernetes.io/ttl": "0",
                            "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                            "csi.volume.kubernetes.io/nodeid": json.dumps({"ebs.csi.aws.com": f"i-{i:017x}"})},
            "managedFields": [
                _managed("kubelet", "Update", {"f:metadata": {"f:labels": fields_labels}}),
                _managed("gpushard-agent", "Update", {"f:metadata": {"f:annotations": {"f:gpushard.io/inventory": {}},
                                                                     "f:labels": {"f:gpushard.io/cards": {}}}}),
                _managed("kube-controller-manager", "Update", {"f:spec": {"f:podCIDR": {}, "f:podCIDRs": {}}}),
                _managed("kubelet", "Update", {"f:status": {"f:allocatable": {f"f:{k}": {} for k in allocatable},
                                                            "f:conditions": {}, "f:images": {}, "f:nodeInfo": {}}},
                         "status"),
            ],
        },
        "spec": {"podCIDR": f"10.{i // 256}.{i % 256}.0/24", "podCIDRs": [f"10.{i // 256}.{i % 256}.0/24"],
                 "providerID": f"aws:///us-east-1a/i-{i:017x}",
                 "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {
            "capacity": dict(allocatable), "allocatable": allocatable,
            "conditions": [{"type": t, "status": "True" if t == "Ready" else "False",
                            "lastHeartbeatTime": "2026-11-30T09:12:44Z", "lastTransitionTime": "2026-11-01T00:00:00Z",
                            "reason": f"Kubelet{t}", "message": f"kubelet reports {t} as expected"}
                           for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")],
            "addresses": [{"type": "InternalIP", "address": f"10.200.{i // 256}.{i % 256}"},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": f"{i:032x}", "systemUUID": f"ec2{i:029x}", "bootID": f"{i:032x}",
                         "kernelVersion": "6.1.0-27-cloud-amd64", "osImage": "Debian GNU/Linux 12 (bookworm)",
                         "containerRuntimeVersion": "containerd://1.7.22", "kubeletVersion": "v1.31.2",
                         "kubeProxyVersion": "v1.31.2", "operatingSystem": "linux", "architecture": "amd64"},
            "images": images,
        },
    }


def pod_object(i: int, nodes: int) -> dict:
    node = f"gpu-node-{i % nodes:05d}"
    card = (i // nodes) % CARDS
    shares = SHARES[i % len(SHARES)]
    name = f"train-{i // 8:06d}-{i % 8}"
    gpu = {"gpushard.io/shares": str(shares), f"gpushard.io/card-{card}": str(shares), "cpu": "4", "memory": "16Gi"}
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}, {"name": "EPOCHS", "value": "10"},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}}]
    mounts = [{"name": "data", "mountPath": "/data"},
              {"name": "kube-api-access-x7k2p", "readOnly": True,
               "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]
    pending = i % 100 == 99  # a few pods waiting for the scheduler
    spec = {
        "containers": [
            {"name": "train", "image": "nvcr.io/nvidia/pytorch:24.05-py3", "command": ["python", "train.py"],
             "env": env, "resources": {"limits": dict(gpu), "requests": dict(gpu)}, "volumeMounts": mounts,
             "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
             "imagePullPolicy": "IfNotPresent"},
            {"name": "metrics-sidecar", "image": "registry.example.com/obs/exporter:1.4.2", "ports": [
                {"containerPort": 9400, "name": "metrics", "protocol": "TCP"}],
             "resources": {"limits": {"cpu": "200m", "memory": "128Mi"}, "requests": {"cpu": "50m", "memory": "64Mi"}},
             "readinessProbe": {"httpGet": {"path": "/healthz", "port": 9400, "scheme": "HTTP"}, "periodSeconds": 10},
             "volumeMounts": mounts[1:], "terminationMessagePath": "/dev/termination-log",
             "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}],
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "trainer", "serviceAccount": "trainer", "schedulerName": "default-scheduler",
        "securityContext": {}, "priority": 0, "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority",
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": 300},
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}}]}},
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
                    {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                            "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}],
    }
    if not pending:
        spec["nodeName"] = node
    status = {"phase": "Pending"} if pending else {
        "phase": "Running", "hostIP": f"10.200.{(i % nodes) // 256}.{i % 256}", "podIP": f"10.{i % 250}.{i % 199}.7",
        "startTime": "2026-11-30T08:00:00Z", "qosClass": "Burstable",
        "conditions": [{"type": t, "status": "True", "lastProbeTime": None,
                        "lastTransitionTime": "2026-11-30T08:00:05Z"}
                       for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
                                 "PodScheduled")],
        "containerStatuses": [{"name": c, "ready": True, "restartCount": 0, "started": True,
                               "image": "nvcr.io/nvidia/pytorch:24.05-py3", "imageID": f"sha256:{i:064x}",
                               "containerID": f"containerd://{i:064x}",
                               "state": {"running": {"startedAt": "2026-11-30T08:00:04Z"}}}
                              for c in ("train", "metrics-sidecar")]}
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": name, "generateName": f"train-{i // 8:06d}-", "namespace": f"team-{i % 40}",
            "uid": f"{i:08x}-7d3e-4f5a-9b8c-1d2e3f4a5b6c", "resourceVersion": str(5000 + i),
            "creationTimestamp": "2026-11-30T08:00:00Z",
            "labels": {"gpushard.io/shared": "true", "app": "train", "batch.kubernetes.io/job-name": f"train-{i // 8}",
                       "batch.kubernetes.io/controller-uid": f"{i // 8:08x}-aaaa-bbbb-cccc-dddddddddddd"},
            "annotations": {"gpushard.io/card": str(card), "gpushard.io/shares": str(shares),
                            "batch.kubernetes.io/job-completion-index": str(i % 8)},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": f"train-{i // 8}",
                                 "uid": f"{i // 8:08x}-aaaa-bbbb-cccc-dddddddddddd", "controller": True,
                                 "blockOwnerDeletion": True}],
            "managedFields": [
                _managed("kube-controller-manager", "Update", {
                    "f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {}},
                                   "f:ownerReferences": {".": {}, f'k:{{"uid":"{i // 8:08x}"}}': {}}},
                    "f:spec": {"f:containers": {'k:{"name":"train"}': {".": {}, "f:command": {}, "f:env": {},
                                                                       "f:image": {}, "f:resources": {}},
                                                'k:{"name":"metrics-sidecar"}': {".": {}, "f:image": {},
                                                                                 "f:ports": {}}},
                               "f:restartPolicy": {}, "f:tolerations": {}, "f:volumes": {}}}),
                _managed("kubelet", "Update", {"f:status": {"f:conditions": {}, "f:containerStatuses": {},
                                                            "f:hostIP": {}, "f:phase": {}, "f:podIP": {},
                                                            "f:startTime": {}}}, "status"),
            ],
        },
        "spec": spec, "status": status,
    }


# --- the API server ----------------------------------------------------------------------------------

class Api:
    """Nodes and pods rendered on demand (nothing is held but the counts), lists in pages, idle watches."""

    def __init__(self, nodes: int, pods: int):
        self.nodes, self.pods = nodes, pods
        self.rv = 100_000
        self.gone = 0  # bumped to end open pod watches with 410 Gone
        self.lists = 0  # completed pod lists
        self.dropped: set[int] = set()  # pods deleted since the first list (a relist shows it)
        self.cond = threading.Condition()

    def items(self, resource: str, start: int, end: int) -> list[bytes]:
        if resource == "nodes":
            return [json.dumps(node_object(i), separators=(",", ":")).encode() for i in range(start, end)]
        return [json.dumps(pod_object(i, self.nodes), separators=(",", ":")).encode() for i in range(start, end)
                if i not in self.dropped]

    def serve(self) -> ThreadingHTTPServer:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):  # the bench's own control: drop a pod, then end the pod watch with 410
                with api.cond:
                    api.dropped.add(api.pods - 2)  # a bound pod (every 100th is pending)
                    api.gone += 1
                    api.cond.notify_all()
                self._send(b"{}")

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                resource = "nodes" if url.path.endswith("/nodes") else "pods"
                if query.get("watch") == "true":
                    return self._watch(resource)
                total = api.nodes if resource == "nodes" else api.pods
                start = int(query.get("continue") or 0)
                limit = int(query.get("limit") or total)
                end = min(total, start + limit)
                meta = {"resourceVersion": str(api.rv)}
                if end < total:
                    meta["continue"] = str(end)
                elif resource == "pods":
                    with api.cond:
                        api.lists += 1
                body = (b'{"kind":"' + (b"NodeList" if resource == "nodes" else b"PodList")
                        + b'","apiVersion":"v1","metadata":' + json.dumps(meta).encode() + b',"items":['
                        + b",".join(api.items(resource, start, end)) + b"]}")
                self._send(body)

            def _watch(self, resource: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                with api.cond:
                    gone = api.gone
                    while api.gone == gone or resource != "pods":
                        if not api.cond.wait(30):
                            return
                event = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                     "reason": "Expired", "code": 410,
                                                     "message": "too old resource version"}}
                self.wfile.write(json.dumps(event).encode() + b"\n")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        return server


def run_server(nodes: int, pods: int) -> int:
    server = Api(nodes, pods).serve()
    print(server.server_address[1], flush=True)
    server.serve_forever()
    return 0


# --- the worker -------------------------------------------------------------------------------------

def rss() -> tuple[float, float]:
    """(resident, peak resident) MiB of this process."""
    values = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def run_baseline(kind: str) -> int:
    if kind == "imports":
        import flask  # noqa: F401
        import gunicorn.app.base  # noqa: F401
        import kubernetes  # noqa: F401

        from webhook.admission import app  # noqa: F401
        from webhook.cluster import kube  # noqa: F401
    now, peak = rss()
    print(json.dumps({"rss": now, "peak": peak}))
    return 0


def run_worker(port: int, page: int, pods: int, nodes: int) -> int:
    import kubernetes

    from webhook import settings as settings_mod
    from webhook.cluster import kube
    from webhook.core import placement

    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{port}"
    gaps: list[float] = []
    phase = ["sync"]
    stop = threading.Event()
    worst = {"sync": 0.0, "steady": 0.0, "relist": 0.0}
    choices = {"sync": 0, "steady": 0, "relist": 0}
    ask = placement.Ask(shares=5, tolerations=({"key": "nvidia.com/gpu", "operator": "Exists"},))

    view_box: list = []
    gc_pauses = {"max": 0.0, "gen": -1, "count": 0}
    gc_started = [0.0]

    def on_gc(stage: str, info: dict) -> None:
        if stage == "start":
            gc_started[0] = time.perf_counter()
            return
        pause = time.perf_counter() - gc_started[0]
        gc_pauses["count"] += 1
        if pause > gc_pauses["max"]:
            gc_pauses.update(max=pause, gen=info["generation"])

    import gc

    gc.callbacks.append(on_gc)

    def chooser() -> None:
        # What an admission does with the view, back to back with a short pause (the next review).
        last = time.perf_counter()
        while not stop.is_set():
            view = view_box[0]
            snap = view.snapshot()
            choice = placement.choose(snap, ask)
            if choice.fits:
                view.remember(choice.node, choice.card, ask.shares)
            now = time.perf_counter()
            gap = now - last
            last = now
            worst[phase[0]] = max(worst[phase[0]], gap)
            choices[phase[0]] += 1
            gaps.append(gap)
            time.sleep(0.001)

    started = time.perf_counter()
    view = kube.KubeView.start(settings_mod.Settings(), api_client=kubernetes.client.ApiClient(config),
                               page_size=page, remember_ttl=1.0)
    view_box.append(view)
    thread = threading.Thread(target=chooser, daemon=True)
    thread.start()
    while not view.synced():
        time.sleep(0.01)
    sync_s = time.perf_counter() - started
    phase[0] = "steady"
    time.sleep(1.0)
    after_sync, peak_sync = rss()
    tracked = len(gc.get_objects())

    # Relist: the server drops one pod and ends the pod watch with 410 Gone.
    victim = pods - 2
    target = f"gpu-node-{victim % nodes:05d}"
    card = (victim // nodes) % CARDS
    shares = SHARES[victim % len(SHARES)]

    def used() -> int:
        for node in view.snapshot().nodes:
            if node.name == target:
                return sum(c.used for c in node.cards if c.index == card)
        return -1

    time.sleep(1.2)  # remembered choices expire (ttl 1 s) so the target card's count is steady
    before = used()
    phase[0] = "relist"
    relist_started = time.perf_counter()
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("POST", "/bench/gone")
    conn.getresponse().read()
    while used() != before - shares and time.perf_counter() - relist_started < 600:
        time.sleep(0.02)
    relist_s = time.perf_counter() - relist_started
    phase[0] = "after"
    worst["after"] = 0.0
    choices["after"] = 0
    stop.set()
    thread.join()
    now, peak = rss()
    view.close()
    print(json.dumps({"sync_s": sync_s, "relist_s": relist_s, "rss_synced": after_sync, "peak_synced": peak_sync,
                      "rss_end": now, "peak_end": peak, "stall_sync": worst["sync"], "stall_steady": worst["steady"],
                      "stall_relist": worst["relist"], "choices": choices,
                      "gc_max": gc_pauses["max"], "gc_gen": gc_pauses["gen"], "gc_count": gc_pauses["count"],
                      "tracked": tracked}))
    return 0


# --- the driver --------------------------------------------------------------------------------------

def _python(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE, text=True, **kwargs)


def _one(args: list[str]) -> dict:
    proc = _python(*args)
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench/view.py {' '.join(args)} failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--pods", default="10000,50000", help="comma-separated pod counts (default 10000,50000)")
    parser.add_argument("--page", type=int, default=500, help="list page size (0: one unpaginated list)")
    parser.add_argument("--quick", action="store_true", help="200 nodes x 2,000 pods only")
    parser.add_argument("--serve", nargs=2, type=int, metavar=("NODES", "PODS"), help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=4, type=int, metavar=("PORT", "PAGE", "PODS", "NODES"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--baseline", choices=("idle", "imports"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return run_server(*args.serve)
    if args.worker:
        return run_worker(*args.worker)
    if args.baseline:
        return run_baseline(args.baseline)

    sizes = [2000] if args.quick else [int(p) for p in args.pods.split(",")]
    nodes = 200 if args.quick else args.nodes
    idle = _one(["--baseline", "idle"])
    imports = _one(["--baseline", "imports"])
    print(f"baseline: idle interpreter {idle['rss']:.0f} MiB; after the imports of `gpushard serve` "
          f"{imports['rss']:.0f} MiB")
    print(f"page size {args.page or 'unpaginated'}; {nodes} nodes x {CARDS} cards; a chooser thread makes a "
          "choice every ~1 ms and records the longest gap")
    print("| pods | sync s | RSS after sync MiB | (view: RSS - imports) | peak MiB | relist s | "
          "longest stall: sync | steady | relist |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pods in sizes:
        server = _python("--serve", str(nodes), str(pods))
        try:
            port = int(server.stdout.readline())
            result = _one(["--worker", str(port), str(args.page or 10**9), str(pods), str(nodes)])
        finally:
            server.terminate()
            server.wait()
        print(f"| {pods:,} | {result['sync_s']:.1f} | {result['rss_synced']:.0f} | "
              f"{result['rss_synced'] - imports['rss']:.0f} | {result['peak_end']:.0f} | {result['relist_s']:.1f} | "
              f"{result['stall_sync'] * 1000:.0f} ms | {result['stall_steady'] * 1000:.0f} ms | "
              f"{result['stall_relist'] * 1000:.0f} ms |", flush=True)
        print(f"  longest garbage collection: {result['gc_max'] * 1000:.0f} ms (generation {result['gc_gen']}, "
              f"{result['gc_count']} collections); objects the collector tracks after sync: {result['tracked']:,}; "
              f"choices made: {result['choices']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
