"""Scale on the real control plane: a kube-apiserver and kube-scheduler, nodes of 8 cards, bursts of pods, 1-3 webhooks.

The same binaries as `make e2e` (``KUBEBUILDER_ASSETS``: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kubectl); no kubelet: each node is written as the agent and kubelet would report it (8
cards of ``gpushard.io/card-<k>: 100`` allocatable, the inventory annotation, Ready, the not-ready taint
removed, with the node lifecycle controller off so nothing marks them unreachable). deploy/base is installed
as shipped (its admission policies run on every pod), and 1-3 `gpushard serve` processes with the webhook's
own ServiceAccount token, which the shipped MutatingWebhookConfiguration calls (several behind a round-robin
TCP balancer of this bench). Then a burst: pods of the packing benchmark's size mix
(bench/stranding.py ``MIX``) up to ``--load`` of the cluster's shares, bare pods in one enforce namespace,
created by ``--clients`` threads at once. The scheduler binds them (nothing runs them).

Printed per run, with its parameters:
- stranded at first scheduling: pods still Pending once binding stopped, whose shares some card of some
  node still has free (a re-placement could move them there); and Pending pods in all;
- time from the first create until the last bind, and the creation rate the clients reached;
- admission p50/p99 as the API server measures it (``apiserver_admission_webhook_admission_duration_seconds``
  for enforce.gpushard.io: bucket bounds, so "<= 25 ms"), and the webhooks' own (``gpushard_admission_seconds``);
  and each create's round trip as its client timed it (admission, the write and the answer: an upper
  bound on admission, in milliseconds, where the API server's buckets jump from 25 to 100 ms);
- the webhooks' worker RSS and the time from start until their view synced;
- API server requests the webhooks made per admission (list and watch of the view, from the API server's
  audit log, which records the webhooks' ServiceAccount only);
- packing: shares bound against what first-fit-decreasing places from the same trace on empty cards.

Re-placement (`gpushard replace`) moves only pods a controller recreates: with ``--workloads``, once the
burst (bare pods, at the clients' pace) has bound, a ReplicaSet of 1 adopts each pod (its selector matches
that pod alone: pods made by their controllers come at the controller's pace, a few a second, and never
make the burst), then one round runs (`gpushard replace --once`; the pods it evicted are then removed, as
a kubelet would, since none runs here), the ReplicaSets make them again and the webhooks place them, and
the stranded pods are counted again once binding stops. Without it the stranded count is what a round
could rescue.

``--backends`` runs the same trace under each setup, side by side: ``timeslicing`` (the setup gpushard
replaces: no gpushard at all, each node labelled and advertising ``nvidia.com/gpu`` as NVIDIA's device plugin
and GPU feature discovery do with 100 time-slicing replicas per card, pods asking ``nvidia.com/gpu: <replicas>``),
``deviceplugin`` (the webhook pins the card), ``dra`` (deploy/overlays/dra: each node's ResourceSlice written
as the agent writes it, the scheduler's allocator picks the card, the webhook hints the node of its binpack
choice), ``dra-nohint`` (the same with ``policy.nodeAffinity: none``: the scheduler alone) and ``dra-byhand``
(no gpushard: the DeviceClass and a slice per node, and the simplest consumable-capacity claims a user
writes by hand, one ResourceClaimTemplate per size). ``--side-by-side`` runs them all in one go (the device
plugin backend with 1 and 3 webhooks) and prints each against time-slicing's: pods bound a second (from the
pods' PodScheduled times), first create to last bind, each create's round trip p50/p99 as its client timed it,
API requests and etcd writes per pod (``apiserver_request_total`` by verb and resource, less the bench's own
lists; etcd's revision), CPU per pod of each component (from /proc), where a create's time went as the API
server sums it (the create, the mutating and validating admission steps, the webhooks), and for time-slicing
the pods that see more than one card and the cards past one card's worth of asks, under the plugin's
``distributed`` and ``packed`` allocation (bench/costs.py). ``--rate`` paces the creates (a rate the control
plane sustains); ``--without-policies`` deletes gpushard's ValidatingAdmissionPolicyBindings, to tell their
cost from the webhook's. One webhook is called directly; several sit behind the round-robin balancer, which
runs in its own process. Under the device plugin backend each run also says why any pod strands
(``why_stranded``).

``--cordon F`` cordons card 0 on that part of the nodes, as `gpushard cordon` and the agent leave them (the
annotation; allocatable 0 for the device plugin, the device gone from the slice under dra), and reports any
pod bound to a cordoned card. Under dra the card of a bound pod is its claim's allocation result.

``--partition`` (on by default, as in a cluster): each webhook replica tries its share of the cards first
(``serve --replica I/N``); ``off``: every replica chooses over all cards alike.

``--workers 1,2,4`` runs each webhook replica with that many gunicorn workers in turn (each worker tries its part
of its replica's cards first, webhook/cluster/peers.py); with ``--rate 0`` (as fast as the clients go) beside
time-slicing it is the saturation run, each component's CPU per create printed.

``--floor`` measures what gpushard costs the API server against no webhook, a no-op webhook and a small
patching webhook (bench/floor.py: GPU pods and plain pods, the setups in turn on one control plane).

``--plain`` measures what gpushard costs objects that ask no GPU instead (bench/plain.py: pods and Deployments
outside and inside an enforce namespace, gpushard off and on in turn on one control plane).

Run: make e2e-bench (it builds the control plane, e2e/build.py), or
     KUBEBUILDER_ASSETS=... python bench/e2e_scale.py [--nodes 100] [--pods 1000] [--replicas 1,2,3]
     [--clients 16] [--load 0.95] [--seed N] [--backends timeslicing,deviceplugin,dra,dra-nohint,dra-byhand]
     [--side-by-side] [--rate 40] [--without-policies] [--cordon 0.1] [--partition on|off|both] [--workers 1,2,4]
     [--plain [--objects 300] [--rounds 3] [--only "pods outside"]]
     [--floor [--objects 300] [--rounds 4] [--rate 30] [--clients 4] [--profile 15]]
     (as root is not needed: no kubelet runs)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import costs  # noqa: E402
import floor  # noqa: E402
import kubernetes  # noqa: E402
import plain  # noqa: E402
import stranding  # noqa: E402
import yaml  # noqa: E402

from tests.e2e import components, gpushard  # noqa: E402
from webhook.core import draobjects, names, scheduling  # noqa: E402

CARDS = 8
SHARES = 100
MEMORY_MIB = 81559
# The setup gpushard replaces: every card advertised as REPLICAS time-slicing replicas of nvidia.com/gpu, no
# webhook; and under DRA the same claims a user could write without gpushard (no webhook).
BASELINE, BYHAND = "timeslicing", "dra-byhand"
WEBHOOKED = ("deviceplugin", "dra", "dra-nohint")
BACKENDS = (BASELINE, *WEBHOOKED, BYHAND)
# --side-by-side: (setup, webhook replicas) in the order they run.
SIDE_BY_SIDE = ((BASELINE, 0), ("deviceplugin", 1), ("deviceplugin", 3), ("dra", 1), ("dra-nohint", 1), (BYHAND, 0))
NVIDIA_GPU = "nvidia.com/gpu"
REPLICAS = SHARES
POD_LABEL = "bench.gpushard.io/pod"
NAMESPACE = "burst"
WEBHOOK_USER = "system:serviceaccount:gpushard-system:gpushard-webhook"
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  users: ["{WEBHOOK_USER}"]
- level: None
"""


class Balancer:
    """Round-robin TCP: each connection the API server opens goes to the next webhook, as a Service's would. It
    runs in a process of its own, so that copying the webhooks' bytes never waits on the GIL of the bench's
    client threads (which would add its wait to every admission)."""

    def __init__(self, ports: list[int], in_bench: bool = False):
        self.ports, self.port = ports, components.free_port()
        if in_bench:
            # Diagnosis only: in a thread of the bench, as it once ran, waiting on the clients' GIL.
            ready = threading.Event()
            self.process = None
            threading.Thread(target=_balance, args=(ports, self.port, ready), daemon=True).start()
        else:
            ready = multiprocessing.get_context("fork").Event()
            self.process = multiprocessing.get_context("fork").Process(
                target=_balance, args=(ports, self.port, ready), daemon=True)
            self.process.start()
        if not ready.wait(10):
            raise RuntimeError("the bench's balancer did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.join(5)


def _balance(ports: list[int], port: int, ready) -> None:
    turn = [0]

    async def connection(reader, writer):
        upstream = ports[turn[0] % len(ports)]
        turn[0] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def main():
        server = await asyncio.start_server(connection, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()
    asyncio.run(main())


def node_name(i: int) -> str:
    return f"gpu-{i:04d}"


def node_body(name: str, cordoned: tuple[int, ...] = (), backend: str = "deviceplugin") -> dict:
    if backend == BASELINE:
        # As NVIDIA's GPU feature discovery labels a node whose cards are time-sliced.
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "nvidia.com/gpu.count": str(CARDS),
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED", "nvidia.com/gpu.replicas": str(REPLICAS),
            "nvidia.com/gpu.sharing-strategy": "time-slicing"}}}
    if backend == BYHAND:
        # A DRA driver's node: its cards are in its ResourceSlice, nothing of gpushard's on the Node.
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name}}}
    inventory = [{"index": k, "uuid": f"GPU-{name}-{k}", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": MEMORY_MIB}
                 for k in range(CARDS)]
    cordons = {names.card_cordon_annotation(k): json.dumps({"reason": "bench", "by": "bench", "at": ""})
               for k in cordoned}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "labels": {"kubernetes.io/hostname": name, "gpushard.io/shared-node": "true",
                                 "gpushard.io/cards": str(CARDS),
                                 **{names.card_memory_label(k): str(MEMORY_MIB) for k in range(CARDS)}},
        "annotations": {"gpushard.io/inventory": json.dumps(inventory), **cordons}}}


def node_status(backend: str = "deviceplugin", cordoned: tuple[int, ...] = ()) -> dict:
    """The node's status as the kubelet reports it with the device plugins of the setup: time-slicing's
    ``nvidia.com/gpu`` (cards x replicas); under gpushard's dra only the node-wide gpushard.io/gpu (the
    cards are in the slice), under the device plugin also each card's shares (a cordoned card's IDs
    withdrawn); for claims written by hand, nothing (the slice only)."""
    resources = {"cpu": "128", "memory": "1Ti", "pods": "500"}
    healthy = CARDS - len(cordoned)
    if backend == BASELINE:
        resources[NVIDIA_GPU] = str(CARDS * REPLICAS)
    elif backend in WEBHOOKED:
        resources["gpushard.io/gpu"] = str(healthy * SHARES)
    if backend == "deviceplugin":
        resources.update({f"gpushard.io/card-{k}": str(0 if k in cordoned else SHARES) for k in range(CARDS)})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"status": {"capacity": resources, "allocatable": resources, "conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "as the kubelet reports it",
         "lastHeartbeatTime": now, "lastTransitionTime": now}]}}


def cordoned_nodes(nodes: int, part: float) -> set[int]:
    """The nodes whose card 0 is cordoned: spread evenly over the cluster."""
    count = round(nodes * part)
    return {round(j * nodes / count) for j in range(count)} if count else set()


def make_nodes(api: kubernetes.client.CoreV1Api, count: int, workers: int = 16, backend: str = "deviceplugin",
               cordoned: set[int] = frozenset()) -> float:
    started = time.monotonic()
    custom = kubernetes.client.CustomObjectsApi(api.api_client)
    group, version = names.DRA_API_VERSION.split("/")

    def one(i: int) -> None:
        name = node_name(i)
        off = (0,) if i in cordoned else ()
        api.create_node(node_body(name, off, backend))
        api.patch_node_status(name, node_status(backend, off))
        # Admission gives a new Node the not-ready taint; the node lifecycle controller would lift it.
        api.patch_node(name, {"spec": {"taints": []}})
        if backend not in (BASELINE, "deviceplugin"):
            facts = [draobjects.CardFacts(k, f"GPU-{name}-{k}", "NVIDIA H100 80GB HBM3", MEMORY_MIB)
                     for k in range(CARDS) if k not in off]
            custom.create_cluster_custom_object(group, version, "resourceslices",
                                                draobjects.resource_slice(name, facts, SHARES, 1))
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(count)))
    return time.monotonic() - started


def trace(rng: random.Random, nodes: int, load: float, limit: int, cards: int | None = None) -> list[int]:
    """Sizes of the packing mix up to ``load`` of the shares of ``cards`` (every card when None)."""
    capacity = (nodes * CARDS if cards is None else cards) * SHARES
    sizes, total = [], 0
    while total < load * capacity and len(sizes) < limit:
        size = stranding.draw(rng)
        sizes.append(size)
        total += size
    return sizes


def pod_body(i: int, shares: int, backend: str = "deviceplugin") -> dict:
    """Burst pod ``i``: a fraction of a card for gpushard's webhook; ``shares`` replicas of
    ``nvidia.com/gpu`` under time-slicing; a claim from the namespace's template of that size when the
    claims are written by hand."""
    container = {"name": "main", "image": "registry.example/cuda:12", "command": ["sleep", "inf"]}
    spec: dict = {"terminationGracePeriodSeconds": 0, "containers": [container]}
    if backend == BASELINE:
        container["resources"] = {"limits": {NVIDIA_GPU: str(shares)}}
    elif backend == BYHAND:
        container["resources"] = {"claims": [{"name": "gpu"}]}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": draobjects.template_name(shares)}]
    else:
        fraction = f"{shares / SHARES:g}" if shares < SHARES else "1"
        container["resources"] = {"limits": {"nvidia.com/gpu": fraction}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p-{i:05d}", "labels": {POD_LABEL: str(i)}},
            "spec": spec}


def byhand_templates(custom: kubernetes.client.CustomObjectsApi, sizes: list[int]) -> None:
    """The ResourceClaimTemplates a user writes once per size: one device of the class, that many shares of
    its consumable capacity (the simplest such claim; gpushard's webhook writes the same shape)."""
    group, version = names.DRA_API_VERSION.split("/")
    for shares in sorted(set(sizes)):
        template = draobjects.claim_template(NAMESPACE, shares)
        template["metadata"].pop("labels", None)
        custom.create_namespaced_custom_object(group, version, NAMESPACE, "resourceclaimtemplates", template)


def replica_set_body(i: int, shares: int) -> dict:
    """A ReplicaSet of 1 that adopts burst pod ``i`` (its selector matches that pod alone): re-placement may
    then evict the pod, and the ReplicaSet makes it again."""
    pod = pod_body(i, shares)
    labels = {POD_LABEL: str(i)}
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": f"rs-{i:05d}"},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod["spec"]}}}


def in_parallel(config: Path, sizes: list[int], clients: int, one) -> None:
    """``one(api_client, i, shares)`` for every burst pod, from ``clients`` threads, each with its own connection."""
    work = list(enumerate(sizes))
    lock = threading.Lock()

    def client() -> None:
        api_client = kubernetes.config.new_client_from_config(str(config))
        while True:
            with lock:
                if not work:
                    return
                i, shares = work.pop()
            one(api_client, i, shares)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def adopt(config: Path, sizes: list[int], clients: int, api: kubernetes.client.CoreV1Api, timeout: float = 300) -> int:
    """A ReplicaSet for every burst pod, which adopts it (the pods were made first, by the clients, at the burst's
    pace); the pods adopted once adoption stops."""
    in_parallel(config, sizes, clients, lambda api_client, i, shares: kubernetes.client.AppsV1Api(
        api_client).create_namespaced_replica_set(NAMESPACE, replica_set_body(i, shares)))
    deadline, owned, last = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        now_owned = sum(1 for p in api.list_namespaced_pod(NAMESPACE, _request_timeout=60).items
                        if p.metadata.owner_references)
        if now_owned == len(sizes) or (now_owned == owned and time.monotonic() - last > 20):
            return now_owned
        if now_owned != owned:
            owned, last = now_owned, time.monotonic()
        time.sleep(1.0)
    return owned


def create_burst(config: Path, sizes: list[int], clients: int, backend: str = "deviceplugin",
                 rate: float = 0.0) -> tuple[float, int, list[float]]:
    """Create every pod from ``clients`` threads, each with its own connection, as fast as they can or,
    with ``rate``, at that many pods a second in all (pod ``n`` of the burst not before ``n / rate`` s);
    (seconds, refused, each create's round trip in seconds as its client saw it: admission, the write and
    the answer)."""
    lock = threading.Lock()
    refused = [0]
    took: list[float] = []
    issued = [0]
    started = time.monotonic()

    def one(api_client, i: int, shares: int) -> None:
        if rate:
            with lock:
                due = started + issued[0] / rate
                issued[0] += 1
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        begun = time.perf_counter()
        try:
            kubernetes.client.CoreV1Api(api_client).create_namespaced_pod(NAMESPACE, pod_body(i, shares, backend))
        except kubernetes.client.ApiException:
            with lock:
                refused[0] += 1
            return
        with lock:
            took.append(time.perf_counter() - begun)
    in_parallel(config, sizes, clients, one)
    return time.monotonic() - started, refused[0], took


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


def replacement_round(config: Path, settings: Path, api: kubernetes.client.CoreV1Api) -> int:
    """One `gpushard replace --once` pass, then what the kubelet would do for the pods it evicted (no kubelet
    runs on these nodes: a deleted pod stays Terminating until something removes it); those pods."""
    done = subprocess.run([gpushard.GPUSHARD, "replace", "--once", f"--config={settings}", f"--kubeconfig={config}",
                           "--namespace=gpushard-system"], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"gpushard replace --once exited {done.returncode}: {done.stderr[-2000:]}")
    evicted = 0
    for pod in api.list_namespaced_pod(NAMESPACE, _request_timeout=60).items:
        if pod.metadata.deletion_timestamp:
            evicted += 1
            api.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
    return evicted


# The lists this bench makes while it waits, by (verb, resource) as the API server counts them: taken out of
# the requests a setup cost.
OWN_REQUESTS: collections.Counter = collections.Counter()


def pods_state(api: kubernetes.client.CoreV1Api, sizes: list[int] | None = None) -> list[tuple]:
    """(shares, node, card, bound at, name) of every pod in the burst namespace: the shares are the webhook's
    annotation, or the burst's size for the pod (its label) where no webhook wrote one; the card is the
    webhook's pin, or under dra the card of the pod's allocated claim (-1 while it has none, and under
    time-slicing, where the kubelet picks the replicas); bound at: when the scheduler bound it (the
    PodScheduled condition, to the second)."""
    claims = {}
    try:
        OWN_REQUESTS[("LIST", "resourceclaims")] += 1
        listed = kubernetes.client.CustomObjectsApi(api.api_client).list_namespaced_custom_object(
            "resource.k8s.io", "v1", NAMESPACE, "resourceclaims", _request_timeout=60)["items"]
    except kubernetes.client.ApiException:
        listed = []
    for claim in listed:
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
        owners = [o["uid"] for o in claim["metadata"].get("ownerReferences") or [] if o.get("kind") == "Pod"]
        if results and owners:
            claims[owners[0]] = draobjects.card_index(results[0].get("device"))
    out = []
    OWN_REQUESTS[("LIST", "pods")] += 1
    for pod in api.list_namespaced_pod(NAMESPACE, _request_timeout=60).items:
        annotations = pod.metadata.annotations or {}
        card = claims.get(pod.metadata.uid, int(annotations.get("gpushard.io/card", -1)))
        shares = int(annotations.get("gpushard.io/shares", 0))
        label = (pod.metadata.labels or {}).get(POD_LABEL)
        if not shares and sizes is not None and label is not None:
            shares = sizes[int(label)]
        scheduled = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"
                          and c.status == "True"), None)
        at = scheduled.last_transition_time.timestamp() if scheduled and scheduled.last_transition_time else 0.0
        out.append((shares, pod.spec.node_name, card, at, pod.metadata.name))
    return out


def pending_reasons(api: kubernetes.client.CoreV1Api, most: int = 3) -> list[tuple[str, int]]:
    """The scheduler's most common messages on the pods still Pending (numbers of nodes blanked)."""
    seen: collections.Counter = collections.Counter()
    OWN_REQUESTS[("LIST", "pods")] += 1
    for pod in api.list_namespaced_pod(NAMESPACE, _request_timeout=60).items:
        if pod.spec.node_name:
            continue
        condition = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
        message = condition.message if condition and condition.message else "not tried yet"
        seen[re.sub(r"\d+", "N", message)[:160]] += 1
    return seen.most_common(most)


def wait_bound(api, total: int, settle: float, sizes: list[int] | None = None) -> tuple[float, list]:
    """Poll until every pod is bound, or binding stopped for ``settle`` seconds; (time of the last bind, pods)."""
    last_count, last_change = -1, time.monotonic()
    while True:
        state = pods_state(api, sizes)
        bound = sum(1 for p in state if p[1])
        if bound != last_count:
            last_count, last_change = bound, time.monotonic()
        if (len(state) == total and bound == total) or time.monotonic() - last_change > settle:
            return last_change, state
        time.sleep(1.0)


def stranded(state: list, nodes: int, cordoned: set[int] = frozenset()) -> int:
    used = {}
    for shares, node, card, *_ in state:
        if node:
            used[(node, card)] = used.get((node, card), 0) + shares
    free = [SHARES - used.get((node_name(n), k), 0) for n in range(nodes) for k in range(CARDS)
            if not (k == 0 and n in cordoned)]
    return fitting_pending(state, free)


def why_stranded(api: kubernetes.client.CoreV1Api, nodes: int) -> dict:
    """Under the device plugin backend, why pods wait on a full card while another has room. Each pending pod
    that some card could take now falls in one class: ``no_room_at_admission`` (the webhook's view had no card
    with room: it wrote no preferred node and drew an index to wait on), ``taken_by_moved`` (a pod the
    scheduler bound elsewhere than its preferred node holds shares of the card chosen for it) or
    ``taken_by_choosers`` (every pod on that card was chosen for it: choosers whose views lagged each other
    over-filled it). ``moved``: bound pods the scheduler put on another node than gpushard chose."""
    OWN_REQUESTS[("LIST", "pods")] += 1
    listed = api.list_namespaced_pod(NAMESPACE, _request_timeout=60).items
    pods = []
    for pod in listed:
        annotations = pod.metadata.annotations or {}
        preferred = scheduling.preferred_node(api.api_client.sanitize_for_serialization(pod.spec))
        pods.append((int(annotations.get("gpushard.io/shares", 0)), int(annotations.get("gpushard.io/card", -1)),
                     preferred, pod.spec.node_name))
    return costs.why_stranded(pods, nodes * CARDS, SHARES)


def on_cordoned(state: list, cordoned: set[int]) -> int:
    """Pods bound to a cordoned card (none should be: it had no room for new pods)."""
    off = {node_name(n) for n in cordoned}
    return sum(1 for _s, node, card, *_ in state if node in off and card == 0)


HISTOGRAM = re.compile(r'^(\w+)_bucket\{(.*)\} (\S+)$')


def buckets(text: str, metric: str, match: dict[str, str]) -> dict[float, float]:
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = HISTOGRAM.match(line)
        if not m or m.group(1) != metric:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if "le" in labels and all(labels.get(k) == v for k, v in match.items()):
            le = math.inf if labels["le"] == "+Inf" else float(labels["le"])
            out[le] = out.get(le, 0.0) + float(m.group(3))
    return out


def quantile_bound(before: dict, after: dict, q: float) -> str:
    delta = {le: after.get(le, 0) - before.get(le, 0) for le in after}
    total = delta.get(math.inf, 0)
    if not total:
        return "n/a"
    for le in sorted(delta):
        if delta[le] >= q * total:
            return f"<= {le * 1000:g} ms" if le != math.inf else "> last bucket"
    return "?"


def rss_mib(pid: int) -> float:
    """RSS of a gunicorn master's workers (its children), in MiB."""
    total = 0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        for line in Path(f"/proc/{child}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def simulated(nodes: int, sizes: list[int], replicas: int, partition: bool, lag: int, seed: int) -> dict:
    """The same trace through bench/stranding.py's model: ``replicas`` choosers taking the pods in turn (as the
    balancer hands them out), each view ``lag`` changes behind, the scheduler behind the whole burst and
    honouring the preferred node; stranded at the first scheduling pass, and the packing."""
    sim = stranding.Sim([[0] * CARDS for _ in range(nodes)], replicas, lag, True, True, seed)
    sim.partition = partition
    for size in sizes:
        sim.create(size, 0.0)
    sim.schedule()
    placed = sum(p.shares for p in sim.running.values())
    return {"sim_lag": lag, "sim_stranded": sim.stranded(), "sim_pending": len(sim.pending),
            "sim_packing": round(placed / max(1, first_fit_decreasing(nodes, sizes)), 4)}


def first_fit_decreasing(nodes: int, sizes: list[int], cordoned: set[int] = frozenset()) -> int:
    # A cordoned card is full to the packer: it takes nothing.
    return stranding.first_fit_decreasing([[SHARES if (k == 0 and n in cordoned) else 0 for k in range(CARDS)]
                                           for n in range(nodes)], sizes)


def fitting_pending(state: list, free: list[int]) -> int:
    """Pending pods that some place with ``free`` room could still take, counted greedily (each takes its
    room)."""
    count = 0
    for shares in sorted((p[0] for p in state if not p[1]), reverse=True):
        best = max(range(len(free)), key=free.__getitem__)
        if free[best] >= shares:
            free[best] -= shares
            count += 1
    return count


def stranded_on_nodes(state: list, nodes: int) -> int:
    """Under time-slicing the scheduler sees only each node's replicas: pending pods some node still has room
    for, counted greedily."""
    used: dict[str, int] = {}
    for shares, node, *_ in state:
        if node:
            used[node] = used.get(node, 0) + shares
    return fitting_pending(state, [CARDS * REPLICAS - used.get(node_name(n), 0) for n in range(nodes)])


def bind_rate(state: list) -> float:
    """The scheduler's throughput: pods bound per second from its first bind to its last (PodScheduled times,
    to the second)."""
    times = sorted(p[3] for p in state if p[1] and p[3])
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return round((len(times) - 1) / (times[-1] - times[0]), 1)


def bind_span(state: list, since: float) -> list[float]:
    """Seconds from ``since`` (the first create, wall clock) to the first, median and last bind (PodScheduled
    times, to the second)."""
    times = sorted(p[3] for p in state if p[1] and p[3])
    return [round(t - since, 1) for t in (times[0], times[len(times) // 2], times[-1])] if times else []


def component_pids(plane: components.ControlPlane, webhooks: list[components.Process]) -> dict[str, tuple[int, bool]]:
    pids = {p.name: (p.proc.pid, False) for p in plane.processes if p.alive()}
    for w in webhooks:
        pids[w.name] = (w.proc.pid, True)
    return pids


def read_counters(plane: components.ControlPlane, webhooks: list[components.Process]) -> costs.Counters:
    return costs.Counters.read(plane.kubectl.run("get", "--raw", "/metrics", timeout=60).stdout,
                               costs.fetch(f"{plane.etcd_url}/metrics"), component_pids(plane, webhooks))


def run(assets: Path, nodes: int, pods: int, replicas: int, clients: int, load: float, seed: int,
        score_all: bool = True, backend: str = "deviceplugin", cordon: float = 0.0, partition: bool = True,
        sim_lag: int = 0, workloads: bool = False, rate: float = 0.0, policies: bool = True,
        balancer_in_bench: bool = False, workers: int = 1) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpushard-scale-"))
    (work / "audit-policy.yaml").write_text(AUDIT_POLICY)
    plane = components.ControlPlane(assets, work, node_lifecycle=False, score_all_nodes=score_all, apiserver_flags=[
        f"--audit-policy-file={work / 'audit-policy.yaml'}", f"--audit-log-path={work / 'audit.log'}",
        "--audit-log-format=json", "--audit-log-maxsize=0"])
    webhooks: list[components.Process] = []
    balancer: Balancer | None = None
    gpushard_on = backend in WEBHOOKED
    replicas = replicas if gpushard_on else 0
    try:
        plane.start()
        kubectl = plane.kubectl
        admin = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(
            str(plane.work / "admin.kubeconfig")))
        custom = kubernetes.client.CustomObjectsApi(admin.api_client)
        if gpushard_on:
            kustomization = ROOT / "deploy" / ("base" if backend == "deviceplugin" else "overlays/dra")
            kubectl.run("apply", "-k", str(kustomization), check=False, timeout=180)
        elif backend == BYHAND:
            kubectl.apply(json.dumps(draobjects.device_class()))
        off = cordoned_nodes(nodes, cordon) if gpushard_on else set()
        node_seconds = make_nodes(admin, nodes, backend=backend, cordoned=off)
        labels = {"gpushard.io/mode": "enforce"} if gpushard_on else {}
        kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": NAMESPACE, "labels": labels}}))

        rng = random.Random(seed)
        sizes = trace(rng, nodes, load, pods, cards=nodes * CARDS - len(off))
        if backend == BYHAND:
            byhand_templates(custom, sizes)
        synced, config, context, ports = 0.0, None, None, []
        if gpushard_on:
            config = gpushard.shipped_config(kubectl, work)
            if backend == "dra-nohint":
                settings = yaml.safe_load(config.read_text())
                settings.setdefault("policy", {})["nodeAffinity"] = "none"
                config.write_text(yaml.safe_dump(settings))
            token = kubectl.token("gpushard-webhook", gpushard.SYSTEM)
            env = {**os.environ, "KUBECONFIG": str(plane.token_config("webhook", token))}
            cert, key = plane.pki.issue("webhook", "gpushard-webhook", ips=("127.0.0.1",), server=True)
            started = time.monotonic()
            for r in range(replicas):
                port = components.free_port()
                ports.append(port)
                webhooks.append(components.Process(f"webhook-{r}", [
                    gpushard.GPUSHARD, "serve", f"--cert={cert}", f"--key={key}", f"--bind=127.0.0.1:{port}",
                    f"--config={config}", f"--workers={workers}",
                    *([f"--replica={r}/{replicas}"] if partition else [])],
                    work / f"webhook-{r}.log", env=env).start())
            context = components.tls_context(plane.pki.ca_path)
            for port in ports:
                components.wait_for("a webhook's view", lambda p=port: urllib.request.urlopen(
                    f"https://127.0.0.1:{p}/readyz", context=context, timeout=5).status == 200, timeout=300)
            synced = time.monotonic() - started
            if replicas > 1:
                balancer = Balancer(ports, in_bench=balancer_in_bench)
                gpushard.point_configuration(plane, f"https://127.0.0.1:{balancer.port}")
            else:
                # One webhook: the API server calls it itself, as it would its Service's one endpoint.
                gpushard.point_configuration(plane, f"https://127.0.0.1:{ports[0]}")
            if not policies:
                # Diagnosis: gpushard without its ValidatingAdmissionPolicies, to tell their cost apart.
                kubectl.run("delete", "validatingadmissionpolicybinding", "-l", "app.kubernetes.io/part-of=gpushard")
        # Every controller and informer settled (the templates' and configuration's events seen) before the
        # counters are read.
        time.sleep(5)

        metrics_before = kubectl.run("get", "--raw", "/metrics").stdout
        ours_before = [costs.fetch(f"https://127.0.0.1:{p}/metrics", context) for p in ports]
        audit_before = (work / "audit.log").read_text().count("\n") if (work / "audit.log").exists() else 0
        OWN_REQUESTS.clear()
        counters_before = read_counters(plane, webhooks)
        t0, t0_wall = time.monotonic(), time.time()
        create_seconds, refused, took = create_burst(plane.work / "admin.kubeconfig", sizes, clients, backend, rate)
        last_bind, state = wait_bound(admin, len(sizes) - refused, settle=20, sizes=sizes)
        # The bind rate comes from the API server's wall-clock times: a clock stepped meanwhile skews it.
        clock_moved = round((time.time() - time.monotonic()) - (t0_wall - t0), 2)
        own = dict(OWN_REQUESTS)
        counters_after = read_counters(plane, webhooks)
        cost = costs.delta(counters_before, counters_after, len(sizes) - refused, own)
        replaced = {}
        if workloads and gpushard_on:
            first = stranded(state, nodes, off)
            adopted = adopt(plane.work / "admin.kubeconfig", sizes, clients, admin)
            evicted = replacement_round(plane.work / "admin.kubeconfig", config, admin)
            _again, after = wait_bound(admin, len(sizes) - refused, settle=20, sizes=sizes)
            # Every pod the round evicted was made again by its ReplicaSet, under the ReplicaSet's name.
            OWN_REQUESTS[("LIST", "pods")] += 1
            evicted += sum(1 for p in admin.list_namespaced_pod(NAMESPACE, _request_timeout=60).items
                           if p.metadata.name.startswith("rs-"))
            replaced = {"stranded_after_round": stranded(after, nodes, off), "evicted": evicted, "adopted": adopted,
                        "stranded_first": first, "packing_after_round": round(
                            sum(p[0] for p in after if p[1]) / max(1, first_fit_decreasing(nodes, sizes, off)),
                            4)}
        metrics_after = kubectl.run("get", "--raw", "/metrics").stdout
        ours_after = [costs.fetch(f"https://127.0.0.1:{p}/metrics", context) for p in ports]
        audit_total = (work / "audit.log").read_text().count("\n") if (work / "audit.log").exists() else 0
        audit_lines = audit_total - audit_before

        match = {"name": "enforce.gpushard.io", "operation": "CREATE", "type": "admit"}
        api_b = buckets(metrics_before, "apiserver_admission_webhook_admission_duration_seconds", match)
        api_a = buckets(metrics_after, "apiserver_admission_webhook_admission_duration_seconds", match)
        own_b, own_a = {}, {}
        for text, into in [(t, own_b) for t in ours_before] + [(t, own_a) for t in ours_after]:
            for le, v in buckets(text, "gpushard_admission_seconds", {}).items():
                into[le] = into.get(le, 0) + v
        bound_shares = sum(p[0] for p in state if p[1])
        pending = sum(1 for p in state if not p[1])
        spread = {}
        if backend == BASELINE:
            bound = [(p[1], p[3], p[4], p[0]) for p in state if p[1]]
            for policy in (costs.DISTRIBUTED, costs.PACKED):
                seen = costs.timeslice(bound, CARDS, REPLICAS, policy)
                spread[policy] = {"spanning": seen.spanning, "overcommitted_cards": seen.overcommitted_cards,
                                  "widest": seen.widest}
        cpu = {name: round(seconds, 1) for name, seconds in cost.cpu.items()}
        return {
            "backend": backend, "partition": partition and replicas > 1, "cordoned_cards": len(off),
            "workers": workers if gpushard_on else 0,
            "on_cordoned": on_cordoned(state, off),
            "nodes": nodes, "cards": nodes * CARDS, "pods": len(sizes), "load": load, "replicas": replicas,
            "scheduler": "scores every node" if score_all else "kube-scheduler's default sample",
            "policies": policies if gpushard_on else "-",
            "balancer": ("in the bench" if balancer_in_bench else "own process") if replicas > 1 else "-",
            "clients": clients, "rate": rate or "as fast as the clients go", "node_setup_s": round(node_seconds, 1),
            "refused": refused,
            "create_s": round(create_seconds, 1), "create_rate": round(len(sizes) / create_seconds, 1),
            "scheduled_s": round(last_bind - t0, 1), "bound_per_s": bind_rate(state), "pending": pending,
            "binds_s": bind_span(state, t0_wall), "clock_moved_s": clock_moved,
            "stranded": stranded_on_nodes(state, nodes) if backend == BASELINE else stranded(state, nodes, off),
            "api_p50": quantile_bound(api_b, api_a, 0.5) if gpushard_on else "-",
            "api_p99": quantile_bound(api_b, api_a, 0.99) if gpushard_on else "-",
            "own_p50": quantile_bound(own_b, own_a, 0.5) if gpushard_on else "-",
            "own_p99": quantile_bound(own_b, own_a, 0.99) if gpushard_on else "-",
            "create_p50_ms": percentile_ms(took, 0.5), "create_p99_ms": percentile_ms(took, 0.99),
            "requests_per_pod": cost.per_pod(cost.requests_total),
            "etcd_writes_per_pod": cost.per_pod(cost.etcd_writes),
            "top_requests": cost.top(), "own_requests": sum(own.values()),
            "server_ms_per_pod": cost.ms_per_pod(), "server_calls_per_pod": cost.calls_per_pod(),
            "cpu_s": cpu,
            "cpu_ms_per_pod": {name: round(1000 * v / max(1, cost.pods), 1) for name, v in cost.cpu.items()},
            "rss_mib": [round(rss_mib(w.proc.pid), 1) for w in webhooks], "view_synced_s": round(synced, 1),
            "webhook_requests": audit_total, "requests_during_burst": audit_lines,
            "requests_per_admission": round(audit_total / max(1, len(sizes)), 4),
            "load_reached": round(sum(sizes) / ((nodes * CARDS - len(off)) * SHARES), 3),
            "packing": round(bound_shares / max(1, first_fit_decreasing(nodes, sizes, off)), 4),
            "timeslicing": spread,
            "pending_reasons": pending_reasons(admin), "workloads": workloads, **replaced,
            **({"why_stranded": why_stranded(admin, nodes)} if backend == "deviceplugin" else {}),
            **(simulated(nodes, sizes, replicas, partition, sim_lag, seed)
               if sim_lag and backend == "deviceplugin" and not off else {}),
        }
    finally:
        if balancer is not None:
            balancer.stop()
        for w in webhooks:
            w.stop()
        plane.stop()


def side_by_side(rows: list[dict], args) -> None:
    """Each setup against time-slicing's, where the run had it: the issue's three goals (binds a second, a
    create's p99, API requests a pod) and what else each pod cost."""
    base = next((r for r in rows if r["backend"] == BASELINE), None)
    if base is None:
        return
    rate = f"{args.rate:g} pods/s" if args.rate else "as fast as the clients go"
    print(f"\nside by side, {args.nodes} nodes x {CARDS} cards, {base['pods']} pods to {base['load_reached']:.0%} "
          f"of the cards, {args.clients} clients, created {rate}, seed {args.seed}")
    head = ["setup", "replicas", "workers", "bound/s", "x base", "first create to last bind s", "create p50 ms",
            "p99 ms", "p99 - base ms", "API req/pod", "x base", "etcd writes/pod", "x base", "stranded", "packing",
            "CPU ms/pod (apiserver, etcd, scheduler, controllers, webhooks)", "create rate/s"]
    print(" | ".join(head))
    for r in rows:
        webhook_cpu = sum(v for k, v in r["cpu_ms_per_pod"].items() if k.startswith("webhook-"))
        cpu = r["cpu_ms_per_pod"]
        print(" | ".join(str(x) for x in [
            r["backend"], r["replicas"] or "-", r["workers"] or "-", r["bound_per_s"],
            costs.ratio(r["bound_per_s"], base["bound_per_s"]),
            r["scheduled_s"], r["create_p50_ms"], r["create_p99_ms"],
            round(r["create_p99_ms"] - base["create_p99_ms"], 1), r["requests_per_pod"],
            costs.ratio(r["requests_per_pod"], base["requests_per_pod"]), r["etcd_writes_per_pod"],
            costs.ratio(r["etcd_writes_per_pod"], base["etcd_writes_per_pod"]), r["stranded"], r["packing"],
            f"{cpu.get('kube-apiserver', 0)}, {cpu.get('etcd', 0)}, {cpu.get('kube-scheduler', 0)}, "
            f"{cpu.get('kube-controller-manager', 0)}, {round(webhook_cpu, 1)}", r["create_rate"]]))
    for policy, seen in base["timeslicing"].items():
        print(f"time-slicing ({policy} allocation): {seen['spanning']} of {base['pods'] - base['pending']} bound pods "
              f"see more than one card (at most {seen['widest']}), {seen['overcommitted_cards']} cards of "
              f"{base['cards']} past one card's worth of asks; gpushard: 0 and 0 by construction (one card per pod, "
              f"shares counted per card)")
    print("where a create's time went, as the API server sums it (ms per pod: " + ", ".join(costs.TIMINGS) + ")")
    for r in rows:
        print(f"  {r['backend']} x{r['replicas']} ({r['workers']} workers): " + ", ".join(
            f"{r['server_ms_per_pod'].get(name, 0)}" for name in costs.TIMINGS))
    print("what each pod cost the API server, by request (per pod):")
    for r in rows:
        print(f"  {r['backend']} x{r['replicas']} ({r['workers']} workers): " + ", ".join(
            f"{k} {v}" for k, v in r["top_requests"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=1000, help="at most this many pods (fewer if --load is reached)")
    parser.add_argument("--replicas", default="1,2,3", help="webhook replica counts to run, comma-separated")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.95, help="the burst's shares as a part of the cluster's")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--backends", default="deviceplugin",
                        help=f"setups to run the same trace under, comma-separated: {', '.join(BACKENDS)} "
                             f"({BASELINE}: NVIDIA's time-slicing replicas, no gpushard; {BYHAND}: "
                             "consumable-capacity claims written by hand, no gpushard)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="the same trace under each setup in turn, against time-slicing's: "
                             + ", ".join(f"{b}" + (f" x{r}" if r else "") for b, r in SIDE_BY_SIDE)
                             + " (overrides --backends and --replicas)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="create the pods at this many a second in all (0: as fast as the clients go)")
    parser.add_argument("--partition", default="on", choices=("on", "off", "both"),
                        help="webhook replicas each try their share of the cards first (serve --replica I/N, as in a "
                             "cluster they do by their rank among the Service's pods), not, or both in turn")
    parser.add_argument("--workloads", action="store_true",
                        help="after the burst, a ReplicaSet of 1 adopts each pod, then one re-placement round "
                             "(gpushard replace --once) and the stranded pods after it")
    parser.add_argument("--sim-lag", type=int, default=12,
                        help="also run the trace through bench/stranding.py's model, views this many changes "
                             "behind (device plugin, no cordon; 0: not)")
    parser.add_argument("--balancer-in-bench", action="store_true",
                        help="diagnosis: the webhooks' balancer in a thread of the bench, beside its clients (as it "
                             "once ran), not in a process of its own")
    parser.add_argument("--without-policies", action="store_true",
                        help="diagnosis: gpushard's setups without its ValidatingAdmissionPolicies (their bindings "
                             "deleted), to tell what they cost from what the webhook costs")
    parser.add_argument("--cordon", type=float, default=0.0,
                        help="the part of the nodes whose card 0 is cordoned (0.1: one node in ten)")
    parser.add_argument("--default-scheduler", action="store_true",
                        help="kube-scheduler's own percentageOfNodesToScore (a sample past 100 nodes) instead of "
                             "docs/install.md's 100")
    parser.add_argument("--workers", default="1",
                        help="gunicorn workers per webhook replica, comma-separated to run each in turn (1,2,4): "
                             "each worker tries its part of its replica's cards first")
    parser.add_argument("--plain", action="store_true",
                        help="what gpushard costs objects that ask no GPU (bench/plain.py): pods and Deployments "
                             "outside and inside an enforce namespace, gpushard off and on in turn on one control "
                             "plane (--objects, --rate, --rounds, --clients)")
    parser.add_argument("--floor", action="store_true",
                        help="what gpushard costs the API server against no webhook, a no-op webhook and a small "
                             "patching one (bench/floor.py)")
    parser.add_argument("--profile", type=float, default=0.0, metavar="S",
                        help="--floor: a kube-apiserver CPU profile over S seconds of each GPU workload")
    parser.add_argument("--objects", type=int, default=300, help="--plain: objects per workload and state")
    parser.add_argument("--rounds", type=int, default=3, help="--plain: rounds of off and on")
    parser.add_argument("--only", default="", help="--plain: only the workloads whose name holds this")
    args = parser.parse_args(argv)
    assets, why = components.which_assets(os.environ)
    if assets is None:
        print(f"gpushard: e2e_scale needs the real components: {why}", file=sys.stderr)
        return 0 if os.environ.get("GPUSHARD_BENCH_OPTIONAL") else 2
    if args.floor or args.plain:
        try:
            if args.floor:
                return floor.main(assets, args.objects, args.rate or 30.0, args.rounds, args.clients, args.profile)
            return plain.main(assets, args.objects, args.rate or 20.0, args.rounds, args.clients, args.only)
        except ValueError as e:
            print(f"gpushard: {e}", file=sys.stderr)
            return 2
    backends = args.backends.split(",")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        print(f"gpushard: --backends: {unknown[0]!r} is none of {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    if args.rate < 0:
        print(f"gpushard: --rate: {args.rate} must be 0 (as fast as the clients go) or more", file=sys.stderr)
        return 2
    if not 0 <= args.cordon < 1:
        print(f"gpushard: --cordon: {args.cordon} must be from 0 up to (not including) 1", file=sys.stderr)
        return 2
    rows = []
    partitions = {"on": (True,), "off": (False,), "both": (False, True)}[args.partition]
    try:
        worker_counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        worker_counts = [0]
    if min(worker_counts) < 1:
        print(f"gpushard: --workers: {args.workers!r} must be counts of 1 or more, comma-separated", file=sys.stderr)
        return 2
    if args.side_by_side:
        plan = [(b, r, True, w) for b, r in SIDE_BY_SIDE for w in (worker_counts if b in WEBHOOKED else [1])]
    else:
        plan = [(b, int(r), part, w) for b in backends for r in args.replicas.split(",")
                for part in (partitions if int(r) > 1 else partitions[:1]) for w in worker_counts]
        # Setups without gpushard run once, whatever the replica and worker counts.
        plan = [step for i, step in enumerate(plan) if step[0] in WEBHOOKED
                or step[0] not in [s[0] for s in plan[:i]]]
    for backend, replicas, partition, workers in plan:
        row = run(assets, args.nodes, args.pods, replicas, args.clients, args.load, args.seed,
                  score_all=not args.default_scheduler, backend=backend, cordon=args.cordon,
                  partition=partition, sim_lag=args.sim_lag, workloads=args.workloads, rate=args.rate,
                  policies=not args.without_policies, balancer_in_bench=args.balancer_in_bench, workers=workers)
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ["backend", "replicas", "workers", "partition", "cordoned_cards", "on_cordoned", "pods", "load_reached",
            "create_rate", "scheduled_s", "pending", "stranded", "api_p50", "create_p50_ms", "create_p99_ms",
            "api_p99", "own_p50", "own_p99", "rss_mib", "view_synced_s", "requests_per_admission", "packing"]
    print(f"\n{args.nodes} nodes x {CARDS} cards, load {args.load} (of the cards not cordoned), {args.clients} "
          f"clients, seed {args.seed}, "
          f"scheduler: {rows[0]['scheduler']}, card 0 cordoned on {args.cordon:.0%} of the nodes")
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    simulated_rows = [r for r in rows if "sim_stranded" in r]
    if simulated_rows:
        print(f"\nthe same traces through bench/stranding.py (views {args.sim_lag} changes behind, the scheduler "
              "behind the burst): replicas | partition | stranded real / model | packing real / model")
        for r in simulated_rows:
            print(f"{r['replicas']} | {r['partition']} | {r['stranded']} / {r['sim_stranded']} | "
                  f"{r['packing']} / {r['sim_packing']}")
    if args.workloads:
        print("after one re-placement round: " + "; ".join(
            f"{r['replicas']} replicas, partition {r['partition']}: stranded {r['stranded_first']} -> "
            f"{r['stranded_after_round']} ({r['evicted']} evicted), packing {r['packing_after_round']}" for r in rows))
    side_by_side(rows, args)
    print(f"stranded share of the burst: {[round(r['stranded'] / r['pods'], 4) for r in rows]}; "
          f"mean create rate {statistics.mean(r['create_rate'] for r in rows):.1f} pods/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
