"""The agent's Prometheus metrics: per card, and per container that holds shares of it.

Every scrape is built from the state of that moment (a custom collector, no long-lived labelled
gauges), so a container that is gone has no series any more, and only containers holding shares
on this node get one: the label sets stay bounded by the node's pods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import core as prom
from prometheus_client import exposition, registry

from webhook.agent import attributing, health, nvml, podlisting, podresources, publishing
from webhook.core import isolation as isolation_mod
from webhook.core import policy as policy_mod

log = logging.getLogger(__name__)

DEFAULT_PORT = 9401
CARD_LABELS = ("node", "gpu", "UUID", "modelName")
CONTAINER_LABELS = ("node", "namespace", "pod", "container", "gpu", "UUID", "modelName")


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


@dataclass
class Observation:
    """What one scrape saw."""

    node: str
    shares_per_card: int
    cards: list[CardRow]
    pod_resources_up: bool
    seconds: float = 0.0


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
                 memory_cap: Callable[[nvml.Card, int], int | None] = no_cap) -> None:
        self.node = node
        self.cards = sorted(cards, key=lambda c: c.index)
        self.devices = devices
        self.board = board
        self.policy = policy
        self.holdings = holdings
        self.procs = procs
        self.pods = pods
        self.memory_cap = memory_cap

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
        per_card: dict[int, list[podresources.Holding]] = {}
        for h in held:
            per_card.setdefault(h.card, []).append(h)
        rows = []
        for card in self.cards:
            row = CardRow(card, healthy=snapshot.healthy.get(card.index, True) if snapshot else True,
                          present=snapshot.present.get(card.index, True) if snapshot else True,
                          usage=usage.get(card.uuid))
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
        return Observation(self.node, self.policy.shares_per_card, rows, up, time.perf_counter() - started)


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
    for row in obs.cards:
        labels = [obs.node, str(row.card.index), row.card.uuid, row.card.model]
        g_cap.add_metric(labels, obs.shares_per_card)
        # Without the kubelet's PodResources the shares held are unknown, not 0: no series (and
        # no unattributed figures, since nothing could be attributed); podresources_up says why.
        if obs.pod_resources_up:
            g_alloc.add_metric(labels, row.shares_allocated)
        g_health.add_metric(labels, 1 if row.healthy and row.present else 0)
        if row.usage is not None:
            g_total.add_metric(labels, row.usage.memory_total_bytes)
            g_used.add_metric(labels, row.usage.memory_used_bytes)
            if row.usage.utilization_percent is not None:
                g_util.add_metric(labels, row.usage.utilization_percent / 100)
            c_xid.add_metric(labels, row.usage.xid_errors)
            if obs.pod_resources_up:
                g_unattr.add_metric(labels, row.unattributed_bytes)
                g_unproc.add_metric(labels, row.unattributed_processes)
        for c in row.containers:
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
    up = gauge("gpushard_agent_podresources_up", "1 when the kubelet's PodResources API answered this scrape; "
               "at 0 the shares held are unknown and have no series", ["node"])
    up.add_metric([obs.node], 1 if obs.pod_resources_up else 0)
    took = gauge("gpushard_agent_scrape_duration_seconds", "Time to gather this scrape", ["node"])
    took.add_metric([obs.node], obs.seconds)
    yield from (g_total, g_used, g_util, g_cap, g_alloc, g_health, c_xid, g_unattr, g_unproc,
                k_shares, k_used, k_share, k_cap, k_procs, k_util, k_over, up, took)


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


class Server:
    """The metrics endpoint (``/metrics``) on a port of the agent's own."""

    def __init__(self, reg: registry.CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        self._server, self._thread = exposition.start_http_server(port, addr=addr, registry=reg)
        self.port = self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(args, settings, cards: list[nvml.Card], devices: nvml.Devices, board: health.Board, api,
          node_name: str | None) -> Server | None:
    """`gpushard agent`'s metrics on ``--metrics-port`` (0: none), from its flags and its parts."""
    if not args.metrics_port:
        return None
    policy = settings.policy
    pods = None
    if api is None:
        try:
            api = publishing.api_client()
        except Exception as exc:  # kubernetes.config raises several unrelated types
            log.warning("gpushard: no Kubernetes API credentials (%s); GPU processes are not tied to pods", exc)
    if api is not None and node_name:
        pods = podlisting.NodePods(api, node_name)
    client = podresources.Client(args.pod_resources_socket)
    # Isolation, where configured, caps each container's memory; without it there is no cap to report.
    observer = Observer(node_name or "", cards, devices, board, policy, lambda: client.holdings(policy),
                        attributing.ProcReader(args.proc_root), pods,
                        memory_cap_for(policy.isolation, policy.shares_per_card))
    server = Server(new_registry(observer), args.metrics_port)
    log.info("gpushard: metrics on port %d (processes read from %s, shares from %s)", server.port,
             args.proc_root, args.pod_resources_socket)
    return server
