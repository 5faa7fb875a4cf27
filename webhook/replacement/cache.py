"""What the re-placement leader plans over: shared nodes and pinned pods, listed once, then followed by watch;
and the pinned pods the kubelet refused at admission, which the same watch shows."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import threading
from typing import Any

from webhook import settings as settings_mod
from webhook.cluster import kube
from webhook.core import findings as f
from webhook.core import names, objects, placement, refusals, replacement
from webhook.core import policy as policy_mod
from webhook.kubeapi import informing

log = logging.getLogger(__name__)


def _parse_time(text: object) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Pinned:
    """What a pass needs of one pod gpushard pinned: where it holds shares, or what it waits for."""

    node: str | None  # bound: the node its shares count on
    shares: tuple[tuple[int, int], ...]  # (card, shares), counted as Kubernetes counts a pod
    ending: bool  # bound and being deleted: its shares come free once it is gone
    waiting: replacement.Waiting | None  # unbound and Pending on one card (its age filled in per pass)
    created: float | None  # creationTimestamp, for the age


def read_pinned(obj: dict, policy: policy_mod.Policy) -> Pinned | None:
    """A listed or watched pod as a pass reads it; None for one that holds and waits for nothing."""
    spec, meta, status = (obj.get(key) or {} for key in ("spec", "metadata", "status"))
    if not (isinstance(spec, dict) and isinstance(meta, dict) and isinstance(status, dict)) or \
            status.get("phase") in objects.TERMINAL_PHASES:
        return None  # an object of the wrong shape is no pod gpushard placed
    shares = objects.card_shares(spec, policy)
    if spec.get("nodeName"):
        if not shares:
            return None
        return Pinned(str(spec["nodeName"]), tuple(sorted(shares.items())), bool(meta.get("deletionTimestamp")),
                      None, None)
    if len(shares) != 1 or meta.get("deletionTimestamp") or status.get("phase") != "Pending":
        return None
    ((card, count),) = shares.items()
    try:
        ask = placement.ask_from_spec(spec, count, card)
    except f.ObjectError as exc:
        log.warning("gpushard: skipped pod %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)
        return None
    owner = objects.controller(meta)
    waiting = replacement.Waiting(
        uid=str(meta.get("uid") or ""), namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""), card=card, shares=count, age=0.0, ask=ask,
        preferred=placement.preferred_node(spec), owner_kind=owner.get("kind") if owner else None,
        owner_name=str(owner.get("name") or "") if owner else "", gated=bool(spec.get("schedulingGates")),
        version=str(meta.get("resourceVersion") or ""),
        sized=isinstance(meta.get("annotations"), dict) and names.MEMORY_ANNOTATION in meta["annotations"])
    return Pinned(None, (), False, waiting, _parse_time(meta.get("creationTimestamp")))


def assemble(nodes, pinned, now: float) -> tuple[placement.View, list[replacement.Waiting], collections.Counter]:
    """The cards' usage by bound pods, the waiting pods (aged at ``now``), and the shares of terminating pods."""
    used: collections.Counter = collections.Counter()
    ending: collections.Counter = collections.Counter()
    waiting = []
    for pod in pinned:
        if pod.node is not None:
            for k, n in pod.shares:  # a terminating pod holds its shares until it is gone
                used[(pod.node, k)] += n
                if pod.ending:
                    ending[(pod.node, k)] += n
        elif pod.waiting is not None:
            age = max(0.0, now - pod.created) if pod.created is not None else 0.0
            waiting.append(dataclasses.replace(pod.waiting, age=age))
    view = placement.View(nodes=tuple(
        dataclasses.replace(n, cards=tuple(dataclasses.replace(c, used=used[(n.name, c.index)]) for c in n.cards))
        for n in nodes))
    return view, waiting, ending


class Cache:
    """The shared nodes and pinned pods, listed once and then followed by watch: what the leader plans over.

    The pods' watch (gpushard's label) also carries the pods that ended; of those it keeps the ones the
    kubelet refused at admission (as ``refusals.Refused``), so that the leader finds them with no list of its own.

    A sink of one ``informing.Informer`` (``informer``: pages of 500, bookmarks, resume from the
    last resourceVersion, 410 Gone means list again), as the live view is; it keeps only what a
    pass reads (nodes as placement reads them, pods as ``Pinned``). It is *current* while both
    resources have been listed and followed without a gap since: from a 410 Gone until the
    relist is in, and from a failed watch until one is open again from the last
    resourceVersion, it is not, and the leader does not plan over it.
    """

    def __init__(self, api_client, policy: policy_mod.Policy, *, watch_timeout: int = informing.WATCH_TIMEOUT_S,
                 backoff: tuple[float, float] = informing.BACKOFF_S, page_size: int = informing.LIST_PAGE):
        self.informer = informing.Informer(api_client, self, watch_timeout=watch_timeout, backoff=backoff,
                                           page_size=page_size, calls=kube.shared_calls(api_client))
        self._policy = policy
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._listed: set[str] = set()
        self._nodes: dict[str, placement.Node] = {}
        self._pods: dict[str, Pinned | refusals.Refused] = {}  # by uid: each pod is one or the other, or neither
        self._following: set[str] = set()
        self.lists = self.informer.lists  # lists made, by resource

    @classmethod
    def start(cls, settings: settings_mod.Settings | None = None, api_client=None, **options) -> Cache:
        """A cache of the API server (in-cluster, else kubeconfig) with its watch threads running."""
        settings = settings or settings_mod.Settings()
        cache = cls(api_client if api_client is not None else kube.default_api_client(), settings.policy, **options)
        cache.informer.start()
        return cache

    def close(self) -> None:
        """Stop the watch threads."""
        self.informer.close()

    def synced(self) -> bool:
        """True once nodes and pods have both been listed (it stays True through gaps and relists)."""
        with self._lock:
            return self._listed >= {informing.NODES, informing.PODS}

    def current(self) -> bool:
        """Both listed, and every watch since resumed without losing an event."""
        with self._lock:
            return self._following >= {informing.NODES, informing.PODS}

    def wait_current(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._following >= {informing.NODES, informing.PODS}, timeout)

    def contents(self) -> tuple[list[placement.Node], list[Pinned], set[str]]:
        """The nodes, the pinned pods, and the uids of the pods, as the cache holds them now."""
        with self._lock:
            pinned = {k: p for k, p in self._pods.items() if isinstance(p, Pinned)}
            return list(self._nodes.values()), list(pinned.values()), set(pinned)

    def refused(self) -> list[refusals.Refused]:
        """The pinned pods the kubelet refused at admission, as the cache holds them now."""
        with self._lock:
            found = [p for p in self._pods.values() if isinstance(p, refusals.Refused)]
        return sorted(found, key=lambda r: (r.node, r.namespace, r.name))

    # --- the informer's sink: what a list page or a watch event leaves in the cache ------------

    def reduce(self, resource: str, items, into: dict) -> dict:
        if resource == informing.NODES:
            for obj in items:
                try:
                    node = kube.read_node(obj, self._policy)
                except Exception:  # noqa: BLE001 - one odd object must not keep the cache from syncing
                    log.exception("gpushard: the view skipped an object it could not read")
                    continue
                if node is not None:
                    into[node.name] = node
            return into
        for obj in items:
            try:
                pod = self._read_pod(obj)
            except Exception:  # noqa: BLE001 - one odd object must not keep the cache from syncing
                log.exception("gpushard: the replacer skipped a pod it could not read")
                continue
            if pod is not None:
                into[objects.key(obj)] = pod
        return into

    def _read_pod(self, obj: dict) -> Pinned | refusals.Refused | None:
        pinned = read_pinned(obj, self._policy)
        return pinned if pinned is not None else refusals.read(obj, self._policy)

    def apply_list(self, resource: str, fresh: dict | list) -> None:
        """Replace what is held of ``resource`` with ``fresh``: as ``reduce`` reads it, or the raw objects."""
        if isinstance(fresh, list):
            fresh = self.reduce(resource, fresh, {})
        with self._changed:
            if resource == informing.NODES:
                self._nodes = fresh
            else:
                self._pods = fresh
            self._listed.add(resource)
            self._following.add(resource)
            self._changed.notify_all()

    def apply_event(self, resource: str, kind: str, obj: dict) -> None:
        table: dict[str, Any]  # nodes by name, or pods by key
        value: Any  # what that table keeps
        if resource == informing.NODES:
            name = str((obj.get("metadata") or {}).get("name"))
            node = None if kind == "DELETED" else kube.read_node(obj, self._policy)
            table, key, value = self._nodes, name, node
        else:
            key = objects.key(obj)
            table, value = self._pods, None if kind == "DELETED" else self._read_pod(obj)
        with self._lock:
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value

    def watch_opened(self, resource: str) -> None:
        # A watch from the last resourceVersion replays what a gap missed. After a 410 Gone the
        # API server answers this very watch with an error event, or with 410 itself: the
        # resource then waits for its relist (``watch_closed`` with a gap). Between this reply and
        # the replay (or the error event) the cache is taken as current: milliseconds, in which a
        # pass could miss the gap's changes; the evictions' preconditions still hold.
        with self._changed:
            if resource in self._listed:
                self._following.add(resource)
                self._changed.notify_all()

    def watch_closed(self, resource: str, gap: bool) -> None:
        if gap:
            with self._lock:
                self._following.discard(resource)
