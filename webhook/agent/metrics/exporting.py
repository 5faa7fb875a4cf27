"""The agent's Prometheus metrics: per card, and per container that holds shares of it.

Every scrape is built from the state of that moment (a custom collector, no long-lived labelled
gauges), so a container that is gone has no series any more, and only containers holding shares
on this node get one: the label sets stay bounded by the node's pods.
"""

from __future__ import annotations

import http.server
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import core as prom
from prometheus_client import exposition, registry

from webhook import authorizing, certificates
from webhook.agent.metrics import attributing, podlisting
from webhook.agent.node import health, nvml, podresources, publishing
from webhook.core import isolation as isolation_mod
from webhook.core import policy as policy_mod
from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

DEFAULT_PORT = 9401
# Connections served at once (a scrape is one; Prometheus keeps one open per target).
CONNECTIONS_MAX = 16
HANDSHAKE_TIMEOUT_S = 10.0
CARD_LABELS = ("node", "gpu", "UUID", "modelName")
CONTAINER_LABELS = ("node", "namespace", "pod", "container", "gpu", "UUID", "modelName")
POD_LABELS = ("node", "namespace", "pod", "gpu", "UUID", "modelName")


@dataclass
class ContainerRow:
    """One container's view of one card."""

    namespace: str
    pod: str
    container: str
    shares: int
    share_bytes: int  # its fraction of the card's memory
    cap_bytes: int | None  # the memory cap isolation gives it, if any
    used_bytes: int = 0
    processes: int = 0
    sm_percent: float = 0.0  # its processes' share of the card's SM time, summed
    # Its pod's memory ask, where the pod was placed by one (gpushard.io/memory-mib): the pod's, not its own.
    memory_asked_bytes: int | None = None

    @property
    def over_share(self) -> bool:
        return self.used_bytes > self.share_bytes


@dataclass
class CardRow:
    card: nvml.Card
    healthy: bool
    present: bool
    usage: nvml.Usage | None  # None: the card did not answer
    shares_allocated: int = 0
    unattributed_bytes: int = 0
    unattributed_processes: int = 0
    containers: list[ContainerRow] = field(default_factory=list)
    cordoned: bool = False  # an operator cordoned it: its shares are not offered to new pods


@dataclass
class Observation:
    """What one scrape saw."""

    node: str
    shares_per_card: int
    cards: list[CardRow]
    pod_resources_up: bool
    seconds: float = 0.0
    # Other DRA drivers offering this node's GPUs (webhook.agent.node.otherdrivers); None: not checked (yet).
    dra_conflicts: list | None = None
    # Whether the node's NVIDIA toolkit ignores an unprivileged container's NVIDIA_VISIBLE_DEVICES (toolkitcheck);
    # None: no config found, or none read yet.
    toolkit_hardened: bool | None = None
    # Cards other device plugins' containers hold, withheld from new pods (foreign.Watcher); None: not watched.
    foreign_held: int | None = None


def memory_cap_for(isolation: str | None, shares_per_card: int) -> Callable[[nvml.Card, int], int | None]:
    """The memory cap that isolation gives a container: shares x card memory / shares per card, or None
    when no isolation caps memory (``none``, or not configured)."""
    def cap(card: nvml.Card, shares: int) -> int | None:
        # The very figure the card-k plugin hands the container at Allocate (whole MiB, floored).
        if isolation in (None, "", isolation_mod.NONE) or card.memory_mib <= 0:
            return None
        return isolation_mod.memory_cap_mib(shares, card.memory_mib, shares_per_card) * nvml.MIB
    return cap


def no_cap(card: nvml.Card, shares: int) -> int | None:
    return None


class Observer:
    """Joins NVML's processes, their cgroups, the node's pods and the kubelet's PodResources."""

    def __init__(self, node: str, cards: list[nvml.Card], devices: nvml.Devices, board: health.Board | None,
                 policy: policy_mod.Policy, holdings: Callable[[], list[podresources.Holding]],
                 procs: attributing.ProcReader, pods: podlisting.NodePods | None,
                 memory_cap: Callable[[nvml.Card, int], int | None] = no_cap, conflicts=None,
                 cordoned: Callable[[], frozenset[int]] = frozenset, toolkit=None, withheld=None) -> None:
        self.node = node
        self.cards = sorted(cards, key=lambda c: c.index)
        self.devices = devices
        self.board = board
        self.policy = policy
        self.holdings = holdings
        self.procs = procs
        self.pods = pods
        self.memory_cap = memory_cap
        self.conflicts = conflicts  # a conflicting.Watcher, or None
        self.cordoned = cordoned
        self.toolkit = toolkit  # a toolkitcheck.Checker, or None
        self.withheld = withheld  # a foreign.Watcher, or None

    def _owner(self, pid: int, holders: dict[tuple[str, str, str], ContainerRow]) -> ContainerRow | None:
        ref = self.procs.container_of(pid)
        if ref is None or self.pods is None:
            return None
        if ref.container_id is not None:
            name = self.pods.container(ref.container_id)
            if name is not None:
                return holders.get((name.namespace, name.pod, name.container))
        # The container is not in the pods' status yet (just started): the pod is enough when only
        # one of its containers holds shares of this card.
        pod = self.pods.pod(ref.pod_uid)
        if pod is None:
            return None
        candidates = [row for key, row in holders.items() if key[:2] == (pod.namespace, pod.pod)]
        return candidates[0] if len(candidates) == 1 else None

    def _memory_asked(self, row: ContainerRow) -> int | None:
        pod = self.pods.named(row.namespace, row.pod) if self.pods is not None else None
        return pod.memory_asked_mib * nvml.MIB if pod is not None and pod.memory_asked_mib else None

    def observe(self) -> Observation:
        started = time.perf_counter()
        snapshot = self.board.snapshot() if self.board is not None else None
        try:
            usage = self.devices.usage()
        except Exception:  # a broken backend must not break the scrape
            log.exception("gpushard: reading GPU usage failed")
            usage = {}
        try:
            held = self.holdings()
            up = True
        except podresources.PodResourcesError as exc:
            log.warning("gpushard: %s", exc)
            held, up = [], False
        cordoned = self.cordoned()
        per_card: dict[int, list[podresources.Holding]] = {}
        for h in held:
            per_card.setdefault(h.card, []).append(h)
        rows = []
        for card in self.cards:
            row = CardRow(card, healthy=snapshot.healthy.get(card.index, True) if snapshot else True,
                          present=snapshot.present.get(card.index, True) if snapshot else True,
                          usage=usage.get(card.uuid), cordoned=card.index in cordoned)
            total = row.usage.memory_total_bytes if row.usage else card.memory_mib * nvml.MIB
            holders: dict[tuple[str, str, str], ContainerRow] = {}
            for h in per_card.get(card.index, []):
                key = (h.namespace, h.pod, h.container)
                if key in holders:  # one container listed twice: add up
                    holders[key].shares += h.shares
                    continue
                holders[key] = ContainerRow(h.namespace, h.pod, h.container, h.shares, 0, None)
            for r in holders.values():
                r.share_bytes = r.shares * total // self.policy.shares_per_card
                r.cap_bytes = self.memory_cap(card, r.shares)
                r.memory_asked_bytes = self._memory_asked(r)
            row.shares_allocated = sum(r.shares for r in holders.values())
            for proc in row.usage.processes if row.usage else ():
                owner = self._owner(proc.pid, holders)
                used = proc.used_bytes or 0
                if owner is None:
                    row.unattributed_bytes += used
                    row.unattributed_processes += 1
                else:
                    owner.used_bytes += used
                    owner.processes += 1
                    owner.sm_percent += proc.sm_percent or 0.0
            row.containers = sorted(holders.values(), key=lambda r: (r.namespace, r.pod, r.container))
            rows.append(row)
        dra = list(self.conflicts.found) if self.conflicts is not None and self.conflicts.checked else None
        verdict = self.toolkit.verdict if self.toolkit is not None else None
        hardened = verdict.hardened if verdict is not None else None
        foreign_held = len(self.withheld.withheld) if self.withheld is not None else None
        return Observation(self.node, self.policy.shares_per_card, rows, up, time.perf_counter() - started, dra,
                           hardened, foreign_held)


def families(obs: Observation) -> Iterator[prom.Metric]:
    """The metric families of one observation."""
    def gauge(name, doc, labels):
        return prom.GaugeMetricFamily(name, doc, labels=labels)

    g_total = gauge("gpushard_card_memory_total_bytes", "The card's memory", CARD_LABELS)
    g_used = gauge("gpushard_card_memory_used_bytes", "Memory in use on the card, by any process", CARD_LABELS)
    g_util = gauge("gpushard_card_utilization_ratio",
                   "Fraction of the last sample period in which a kernel ran on the card", CARD_LABELS)
    g_cap = gauge("gpushard_card_shares_capacity", "Shares the card is cut into", CARD_LABELS)
    g_alloc = gauge("gpushard_card_shares_allocated",
                    "Shares of the card held by containers, as the kubelet's PodResources reports", CARD_LABELS)
    g_health = gauge("gpushard_card_healthy", "1 when the card is healthy and present, else 0", CARD_LABELS)
    g_cordon = gauge("gpushard_card_cordoned", "1 when an operator cordoned the card (gpushard cordon): its shares "
                     "are not offered to new pods, its pods keep running", CARD_LABELS)
    c_xid = prom.CounterMetricFamily("gpushard_card_xid_errors", "Critical Xid errors on the card since the agent "
                                     "started", labels=CARD_LABELS)
    g_unattr = gauge("gpushard_card_unattributed_memory_bytes",
                     "Memory used on the card by processes of no container holding shares of it", CARD_LABELS)
    g_unproc = gauge("gpushard_card_unattributed_processes",
                     "Processes on the card that belong to no container holding shares of it", CARD_LABELS)
    k_shares = gauge("gpushard_container_shares", "Shares of the card the container holds", CONTAINER_LABELS)
    k_used = gauge("gpushard_container_memory_used_bytes", "Card memory used by the container's processes",
                   CONTAINER_LABELS)
    k_share = gauge("gpushard_container_memory_share_bytes",
                    "The container's fraction of the card's memory: shares x memory / shares per card",
                    CONTAINER_LABELS)
    k_cap = gauge("gpushard_container_memory_cap_bytes", "The memory cap isolation gives the container",
                  CONTAINER_LABELS)
    k_procs = gauge("gpushard_container_gpu_processes", "The container's processes on the card", CONTAINER_LABELS)
    k_util = gauge("gpushard_container_utilization_ratio",
                   "Share of the card's SM time the container's processes used since the last scrape (where NVML "
                   "reports it per process)", CONTAINER_LABELS)
    k_over = gauge("gpushard_container_over_share",
                   "1 when the container uses more of the card's memory than its shares give it", CONTAINER_LABELS)
    p_asked = gauge("gpushard_pod_memory_asked_bytes",
                    "The memory a pod placed by its memory ask asked (gpushard.io/memory-mib), on the card it "
                    "holds shares of", POD_LABELS)
    for row in obs.cards:
        labels = [obs.node, str(row.card.index), row.card.uuid, row.card.model]
        g_cap.add_metric(labels, obs.shares_per_card)
        # Without the kubelet's PodResources the shares held are unknown, not 0: no series (and
        # no unattributed figures, since nothing could be attributed); podresources_up says why.
        if obs.pod_resources_up:
            g_alloc.add_metric(labels, row.shares_allocated)
        g_health.add_metric(labels, 1 if row.healthy and row.present else 0)
        g_cordon.add_metric(labels, 1 if row.cordoned else 0)
        if row.usage is not None:
            g_total.add_metric(labels, row.usage.memory_total_bytes)
            g_used.add_metric(labels, row.usage.memory_used_bytes)
            if row.usage.utilization_percent is not None:
                g_util.add_metric(labels, row.usage.utilization_percent / 100)
            c_xid.add_metric(labels, row.usage.xid_errors)
            if obs.pod_resources_up:
                g_unattr.add_metric(labels, row.unattributed_bytes)
                g_unproc.add_metric(labels, row.unattributed_processes)
        asked: dict[tuple[str, str], int] = {}
        for c in row.containers:
            if c.memory_asked_bytes is not None:
                asked[(c.namespace, c.pod)] = c.memory_asked_bytes
            clabels = [obs.node, c.namespace, c.pod, c.container, *labels[1:]]
            k_shares.add_metric(clabels, c.shares)
            k_share.add_metric(clabels, c.share_bytes)
            if c.cap_bytes is not None:
                k_cap.add_metric(clabels, c.cap_bytes)
            if row.usage is not None:
                k_used.add_metric(clabels, c.used_bytes)
                k_procs.add_metric(clabels, c.processes)
                if row.usage.process_utilization:
                    k_util.add_metric(clabels, min(1.0, c.sm_percent / 100))
                k_over.add_metric(clabels, 1 if c.over_share else 0)
        # One series per pod, not per container: the ask is the pod's (counted as Kubernetes counts requests).
        for (namespace, pod), value in sorted(asked.items()):
            p_asked.add_metric([obs.node, namespace, pod, *labels[1:]], value)
    up = gauge("gpushard_agent_podresources_up", "1 when the kubelet's PodResources API answered this scrape; "
               "at 0 the shares held are unknown and have no series", ["node"])
    up.add_metric([obs.node], 1 if obs.pod_resources_up else 0)
    took = gauge("gpushard_agent_scrape_duration_seconds", "Time to gather this scrape", ["node"])
    took.add_metric([obs.node], obs.seconds)
    cordons = gauge("gpushard_agent_cordoned_cards", "Cards of this node an operator cordoned", ["node"])
    cordons.add_metric([obs.node], sum(1 for row in obs.cards if row.cordoned))
    yield from (g_total, g_used, g_util, g_cap, g_alloc, g_health, g_cordon, cordons, c_xid, g_unattr, g_unproc,
                k_shares, k_used, k_share, k_cap, k_procs, k_util, k_over, p_asked, up, took)
    if obs.dra_conflicts is not None:
        count = gauge("gpushard_agent_dra_conflicts",
                      "DRA drivers whose ResourceSlices offer this node's GPUs besides gpushard (should be 0)",
                      ["node"])
        count.add_metric([obs.node], len(obs.dra_conflicts))
        devices = gauge("gpushard_agent_dra_conflict_devices",
                        "Devices a conflicting DRA driver publishes for this node", ["node", "driver"])
        for c in obs.dra_conflicts:
            devices.add_metric([obs.node, c.driver], c.devices)
        yield from (count, devices)
    if obs.toolkit_hardened is not None:
        hardened = gauge("gpushard_agent_toolkit_hardened",
                         "1 when the node's NVIDIA container toolkit ignores NVIDIA_VISIBLE_DEVICES in unprivileged "
                         "containers; 0 when a pod outside gpushard's namespaces can ask every card by it",
                         ["node"])
        hardened.add_metric([obs.node], 1 if obs.toolkit_hardened else 0)
        yield hardened
    if obs.foreign_held is not None:
        held = gauge("gpushard_agent_cards_held_by_other_plugins",
                     "Cards of this node that containers of another device plugin hold (NVIDIA's, on a node moved "
                     "to gpushard): their shares are not offered until those containers end", ["node"])
        held.add_metric([obs.node], obs.foreign_held)
        yield held


class Collector(registry.Collector):
    """A prometheus_client collector that observes the node afresh on every scrape."""

    def __init__(self, observer: Observer | Callable[[], Observation]) -> None:
        self._observe = observer.observe if isinstance(observer, Observer) else observer
        self._lock = threading.Lock()  # scrapes one at a time: NVML and the kubelet need no crowd

    def describe(self) -> list:
        return []  # nothing to observe when registering

    def collect(self) -> Iterator[prom.Metric]:
        with self._lock:
            obs = self._observe()
        return families(obs)


def new_registry(observer: Observer | Callable[[], Observation]) -> registry.CollectorRegistry:
    reg = registry.CollectorRegistry(auto_describe=False)
    reg.register(Collector(observer))
    return reg


def text(reg: registry.CollectorRegistry) -> str:
    """The exposition text of a registry (what a scrape gets)."""
    return exposition.generate_latest(reg).decode()


def self_signed_context(node: str) -> ssl.SSLContext:
    """A TLS context with a certificate made at start, as controller-runtime's metrics server does.

    It protects the tokens scrapes carry on the pod network; the scraper cannot verify it (nothing
    publishes the CA), which a token reviewed by the API server makes up for on the server's side.
    The agent's root filesystem is read-only: the PEM goes through an anonymous in-memory file.
    """
    ca_key, ca_cert = certificates.make_ca("gpushard agent metrics CA", days=3650)
    key, cert = certificates.make_serving(ca_key, ca_cert, [node or "gpushard-agent"], days=3650)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    fd = os.memfd_create("gpushard-metrics-tls")
    try:
        os.write(fd, certificates.cert_pem(cert) + certificates.key_pem(key))
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return context


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPSServer

    def log_message(self, *args):  # scrapes every few seconds: nothing to say each time
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        probe = self.server.probes.get(path)
        if probe is not None:
            # The kubelet's probes carry no token; they learn only whether the agent is whole, and what is not.
            problems = probe()
            if problems:
                return self._answer(503, f"gpushard: {'; '.join(problems)}\n".encode())
            return self._answer(200, b"ok\n")
        if path != "/metrics":
            return self._answer(404, b"gpushard: only /metrics, /healthz and /readyz are served here\n")
        verdict = authorizing.check(self.client_address[0], self.headers.get("Authorization"), self.server.reviewer)
        if not verdict.allowed:
            if verdict.status == 403:
                log.info("%s (from %s)", verdict.reason, self.client_address[0])
            extra = {"WWW-Authenticate": 'Bearer realm="gpushard-agent"'} if verdict.status == 401 else None
            return self._answer(verdict.status, (verdict.reason + "\n").encode(), headers=extra)
        body = exposition.generate_latest(self.server.registry)
        self._answer(200, body, exposition.CONTENT_TYPE_LATEST)

    do_HEAD = do_GET


class _HTTPSServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, registry, context: ssl.SSLContext, reviewer,
                 probes: Mapping[str, Callable[[], list[str]]] | None = None) -> None:
        self.registry = registry
        self.probes = dict(probes or {})
        self.context = context
        self.reviewer = reviewer
        # A thread per connection, but no more than this at once: a connection past it is closed at once,
        # so that clients that open connections and stall cannot grow the agent's threads without bound.
        self._slots = threading.BoundedSemaphore(CONNECTIONS_MAX)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            log.debug("gpushard: closed a metrics connection from %s: %d already open", client_address[0],
                      CONNECTIONS_MAX)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request, client_address):
        # The handshake runs in the request's own thread, so a slow client holds up nobody else.
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        # Headers and body go out as separate TLS records: without this, Nagle's algorithm holds the
        # body for the client's delayed ACK (40 ms a scrape).
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            request = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            request.close()
            return
        super().finish_request(request, client_address)


class Server:
    """The metrics endpoint (``/metrics``) on a port of the agent's own, over TLS, with the kubelet's probes
    (``/healthz``, ``/readyz``) beside it, answered to anyone.

    A request from the network needs a bearer token the API server authenticates and authorizes
    (``webhook.agent.authorizing``); one from the pod's own loopback is a port-forward the API server
    already authorized. Without a reviewer (no API credentials) only port-forwards get in.
    """

    def __init__(self, reg: registry.CollectorRegistry, port: int, addr: str = "0.0.0.0",
                 reviewer: authorizing.Reviewer | None = None, context: ssl.SSLContext | None = None,
                 node: str = "", probes: Mapping[str, Callable[[], list[str]]] | None = None) -> None:
        self.context = context or self_signed_context(node)
        self._server = _HTTPSServer((addr, port), reg, self.context, reviewer, probes)
        self._thread = threading.Thread(target=self._server.serve_forever, name="gpushard-metrics", daemon=True)
        self._thread.start()
        self.port = self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(args, settings, cards: list[nvml.Card], devices: nvml.Devices, board: health.Board, api,
          node_name: str | None, conflicts=None,
          cards_by_pod: Callable[[], Mapping[tuple[str, str], int]] | None = None,
          cordoned: Callable[[], frozenset[int]] = frozenset, toolkit=None, withheld=None,
          probes: Mapping[str, Callable[[], list[str]]] | None = None) -> Server | None:
    """`gpushard agent`'s metrics on ``--metrics-port`` (0: none), from its flags and its parts, with the
    kubelet's ``probes`` (path: what is wrong, nothing when well) beside them.

    ``cards_by_pod`` (backend dra: the DRA plugin's prepared claims) says which card each pod's
    containers use, where PodResources names none."""
    if not args.metrics_port:
        return None
    policy = settings.policy
    pods = None
    if api is None:
        try:
            api = publishing.api_client()
        except Exception as exc:  # kubernetes.config raises several unrelated types
            log.warning("gpushard: no Kubernetes API credentials (%s); GPU processes are not tied to pods",
                        connecting.config_reason(exc))
    if api is not None and node_name:
        # Backend dra: a container's shares are its spec's (PodResources lists no ID of the count).
        pods = podlisting.NodePods(api, node_name, timeout=settings.agent.metrics_request_timeout,
                                   policy=policy if cards_by_pod is not None else None)
    client = podresources.Client(args.pod_resources_socket)
    shares_of = pods.shares if pods is not None and cards_by_pod is not None else None
    # Isolation, where configured, caps each container's memory; without it there is no cap to report.
    observer = Observer(node_name or "", cards, devices, board, policy,
                        lambda: client.holdings(policy, cards_by_pod, shares_of),
                        attributing.ProcReader(args.proc_root), pods,
                        memory_cap_for(policy.isolation, policy.shares_per_card), conflicts, cordoned, toolkit,
                        withheld)
    reviewer = authorizing.Reviewer(api, authorizing.node_metrics(node_name or ""),
                                    timeout=settings.agent.metrics_request_timeout) \
        if api is not None else None
    if reviewer is None:
        log.warning("gpushard: no Kubernetes API credentials: metrics are served to port-forwards only")
    server = Server(new_registry(observer), args.metrics_port, reviewer=reviewer, node=node_name or "",
                    probes=probes)
    log.info("gpushard: metrics on port %d over TLS, to callers allowed get nodes/metrics of this node and to "
             "port-forwards (processes read from %s, shares from %s)", server.port,
             args.proc_root, args.pod_resources_socket)
    return server
