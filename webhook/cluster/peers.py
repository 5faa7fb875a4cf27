"""Which of the webhook's replicas this process is, so that replicas fill different cards first.

Replicas choose over views that lag each other by the pods in flight (admitted by one, not yet seen
by the other). In a burst they then pick the same nearly full card, and one of the two pods finds
no room on its card index anywhere: stranded while other cards have room. Measured on the real
scheduler (bench/e2e_scale.py) and reproduced by bench/stranding.py --partition, a burst filling
100 nodes x 8 cards to 95 % strands about 9 % of its pods with two replicas and 12-15 % with three;
with each replica trying first its own share of the cards (its rank ``r`` among ``N`` replicas: card
``k`` of a node whose name hashes to ``h`` is replica ``(h + k) mod N``'s, ``View.share_of``), the
replicas fill different cards and collide only once their own are full.

The partition comes from:
- ``--replica I/N`` (``gpushard serve``; ``$GPUSHARD_REPLICA`` in the workers): fixed, for webhooks
  that no Service fronts;
- in a cluster (``$POD_NAME`` and ``$POD_NAMESPACE`` from the downward API), the ready endpoints of
  the webhook's Service (``$GPUSHARD_SERVICE``, default ``gpushard``), listed and watched through
  their EndpointSlices: the rank is this pod's among the ready pods' names, sorted. A replica that
  is not among them (not ready yet) tries every card alike; so does one alone.

A replica's gunicorn workers (``serve --workers W``) are processes with views of their own, which lag
each other as replicas' do: each worker ``j`` tries first its part of its replica's share (``Workers``:
part ``r * W + j`` of ``N * W``), so that more workers neither strand pods nor lose packing. The master
hands each worker the lowest index no live worker holds (``$GPUSHARD_WORKER``, ``J/W``), so a worker
started again after one died takes that one's part.

A partition never refuses a pod anything: a pod that fits none of its replica's cards is placed over
all of them, as before.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import kubernetes

from webhook import settings as settings_mod
from webhook.kubeapi import connecting, informing

log = logging.getLogger(__name__)

RESOURCE = "endpointslices"
REPLICA_ENV = "GPUSHARD_REPLICA"
WORKER_ENV = "GPUSHARD_WORKER"
SERVICE_ENV = "GPUSHARD_SERVICE"
POD_NAME_ENV, POD_NAMESPACE_ENV = "POD_NAME", "POD_NAMESPACE"
DEFAULT_SERVICE = "gpushard"
SERVICE_LABEL = "kubernetes.io/service-name"


class ReplicaError(ValueError):
    """A replica setting gpushard cannot run with; the message names it and quotes the value."""


@dataclass(frozen=True)
class Partition:
    rank: int
    count: int

    def share(self) -> tuple[int, int] | None:
        """(rank, count) for placement's ``share``; None (every card alike) when it is alone."""
        return (self.rank, self.count) if self.count > 1 else None


def parse(text: str, where: str = "--replica") -> Partition:
    """``I/N``: replica I (from 0) of N."""
    rank, slash, count = text.partition("/")
    if not slash or not rank.isdigit() or not count.isdigit() or int(count) < 1 or int(rank) >= int(count):
        raise ReplicaError(f"{where}: expected I/N with 0 <= I < N (replica I of N), got {text!r}")
    return Partition(int(rank), int(count))


class Workers:
    """Worker ``index`` of a replica's ``count`` workers: its part of the replica's share (the replica's own
    partition as it stands, fixed or kept by ``Peers``), so that the workers fill different cards first."""

    def __init__(self, replica: Fixed | Peers, index: int, count: int):
        self.replica, self.index, self.count = replica, index, count

    def share(self) -> tuple[int, int] | None:
        rank, count = self.replica.share() or (0, 1)
        return (rank * self.count + self.index, count * self.count)

    def close(self) -> None:
        self.replica.close()


def for_worker(replica: Fixed | Peers, environ: dict | None = None) -> Fixed | Peers | Workers:
    """The partition of this worker: the replica's, split among its workers when ``$GPUSHARD_WORKER`` names
    more than one."""
    text = (os.environ if environ is None else environ).get(WORKER_ENV)
    if not text:
        return replica
    worker = parse(text, f"${WORKER_ENV}")
    if worker.count < 2:
        return replica
    # Each worker is its own process with its own view and memory of choices (docs/placement.md, "One view
    # per replica"): its own part of the cards first, so that the workers collide only once theirs are full.
    log.info("gpushard: worker %d of %d of this replica, with its own cluster view: its part of the cards first",
             worker.rank, worker.count)
    return Workers(replica, worker.rank, worker.count)


def next_worker_index(held: set[int | None]) -> int:
    """The lowest worker index that no live worker holds."""
    index = 0
    while index in held:
        index += 1
    return index


class Fixed:
    """A partition given on the command line."""

    def __init__(self, partition: Partition | None):
        self._partition = partition

    def share(self) -> tuple[int, int] | None:
        return self._partition.share() if self._partition is not None else None

    def close(self) -> None:
        pass


def ready_pods(slice_obj: dict) -> frozenset[str]:
    """The names of the pods an EndpointSlice lists as ready (a missing ``ready`` counts as ready)."""
    names = set()
    for endpoint in slice_obj.get("endpoints") or ():
        if not isinstance(endpoint, dict):
            continue
        conditions = cast(dict, endpoint.get("conditions") if isinstance(endpoint.get("conditions"), dict) else {})
        ref = cast(dict, endpoint.get("targetRef") if isinstance(endpoint.get("targetRef"), dict) else {})
        if conditions.get("ready") is False or ref.get("kind") != "Pod" or not isinstance(ref.get("name"), str):
            continue
        names.add(ref["name"])
    return frozenset(names)


class Peers(informing.ByName[frozenset[str]]):
    """This pod's rank among the webhook Service's ready pods, kept by list and watch of its EndpointSlices."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None, namespace: str, service: str, pod: str, *,
                 watch_timeout: int = informing.WATCH_TIMEOUT_S, backoff: tuple[float, float] = informing.BACKOFF_S,
                 connect_timeout: float = informing.CONNECT_TIMEOUT_S, list_timeout: float = informing.LIST_TIMEOUT_S):
        self.pod = pod
        calls = {RESOURCE: functools.partial(
            kubernetes.client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice, namespace,
            label_selector=f"{SERVICE_LABEL}={service}")} if api_client is not None else {}
        self.informer = informing.Informer(api_client, self, watch_timeout=watch_timeout, backoff=backoff,
                                           resources=(RESOURCE,), connect_timeout=connect_timeout,
                                           list_timeout=list_timeout, calls=calls)
        super().__init__()  # slice name -> its ready pods
        self._partition: Partition | None = None

    @classmethod
    def start(cls, settings: settings_mod.Settings | None = None, environ: Mapping[str, str] | None = None,
              api_client: kubernetes.client.ApiClient | None = None, **options) -> Peers | Fixed:
        """The partition the environment says: fixed (``$GPUSHARD_REPLICA``), found through the Service's
        EndpointSlices (in a pod: ``$POD_NAME``, ``$POD_NAMESPACE``), or none."""
        environ = os.environ if environ is None else environ
        fixed = environ.get(REPLICA_ENV)
        if fixed:
            return Fixed(parse(fixed, f"${REPLICA_ENV}"))
        pod, namespace = environ.get(POD_NAME_ENV), environ.get(POD_NAMESPACE_ENV)
        if not pod or not namespace:
            return Fixed(None)
        settings = settings or settings_mod.Settings()
        options = {"connect_timeout": settings.view.connect_timeout, "list_timeout": settings.view.list_timeout,
                   "watch_timeout": settings.view.watch_timeout, **options}
        if api_client is None:
            try:
                api_client = connecting.client().api
            except connecting.ConfigError as exc:
                log.error("%s; this replica tries every card alike", exc)
                return Fixed(None)
        peers = cls(api_client, namespace, environ.get(SERVICE_ENV) or DEFAULT_SERVICE, pod, **options)
        peers.informer.start()
        return peers

    def partition(self) -> Partition | None:
        return self._partition

    def share(self) -> tuple[int, int] | None:
        """(rank, count) of this replica; None while alone or not among the ready."""
        partition = self._partition
        return partition.share() if partition is not None else None

    def close(self) -> None:
        self.informer.close()

    # --- the sink (informing.ByName): each EndpointSlice as its ready pods ------------------------

    def read(self, obj: dict) -> frozenset[str]:
        return ready_pods(obj)

    def rebuild(self) -> None:
        ready = sorted(set().union(*self._by_name.values())) if self._by_name else []
        partition = Partition(ready.index(self.pod), len(ready)) if self.pod in ready else None
        if partition != self._partition:
            if partition is None or partition.count < 2:
                log.info("gpushard: %s; it tries every card alike", "this replica is alone" if partition else
                         f"this replica ({self.pod}) is not among the Service's ready endpoints yet")
            else:
                log.info("gpushard: replica %d of %d (%s): its share of the cards first", partition.rank,
                         partition.count, ", ".join(ready))
        self._partition = partition
