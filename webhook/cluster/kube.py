"""The live cluster view: shared nodes and gpushard pods, listed then watched from the Kubernetes API.

An informer (``informing.Informer``: a daemon thread each for nodes and pods) lists, then
watches from the list's resourceVersion, relists on 410 Gone, and reconnects with backoff when
the API fails or drops the connection; the view is its sink. It keeps an immutable
``placement.View`` up to date node by node (``placement.replace_nodes``), so an admission takes
``snapshot()`` without waiting on anything. Lists come in pages, each reduced to
what placement reads before the next; nodes are those the agent labelled with its cards.

Shares a pod holds count on its node and card from the moment the watch shows it bound. A pod
gpushard pinned that the watch shows unbound counts on the node its preferred affinity term
names (where it was chosen) until it binds or goes away, however long that takes. Between a
choice and the watch showing its pod the view would not know of the pod, so a burst of pods
would all pick the same nearly full card; ``remember`` therefore counts each choice on its node
until the watch shows a pod that accounts for it, or for at most ``remember_ttl`` seconds (a
pod the API server refused never shows). Choices expire oldest first, each in constant time
(the ledger of ``remembering``).

The time to live is short (seconds): once the watch shows the pod, unbound or bound, the pod
itself counts, so a choice only has to bridge the API server storing the pod and its watch
event arriving. A choice nobody's pod takes over (a review the API server never sent: anyone
who reaches the webhook's port can post one) then stops counting in seconds, and forged
reviews cannot fill the view. While the pods watch is down (between a failure and the next
list) no pod can take a choice over, so choices are kept up to ``remember_held_ttl``.

With backend dra no pod names its card: the cards are gpushard's ResourceSlices' devices (a card
that turned Unhealthy or was cordoned has left its slice), and the shares held are the allocated
claims' consumed shares, on the device and pool (the node) of each allocation result. A pod the
webhook hinted counts on its hinted node (the preferred term), or the node it is bound to, until
its claim shows allocated: then the claim counts instead.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import kubernetes

from webhook import settings as settings_mod
from webhook.cluster import remembering, static
from webhook.core import draobjects, names, objects, placement
from webhook.core import policy as policy_mod
from webhook.core.policy import Policy
from webhook.kubeapi import connecting, informing

log = logging.getLogger(__name__)

# How long a remembered choice counts before a watch event accounts for it, while the pods watch
# streams. It bridges admission to the pod's watch event: the rest of admission (later webhooks,
# whose timeouts the operator sets), the write, and the event's delivery, well under a second
# in a healthy cluster. Scheduling does not count here: an unbound pod counts once it shows.
REMEMBER_TTL_S = 5.0
# ... and while the pods watch is down, when no pod can show and take its choice over.
REMEMBER_HELD_TTL_S = static.REMEMBER_TTL_S
# The informer's settings, here too for those who configure the view.
WATCH_TIMEOUT_S = informing.WATCH_TIMEOUT_S
LIST_PAGE = informing.LIST_PAGE
BACKOFF_S = informing.BACKOFF_S
REMEMBER_WAIT_S = 0.05
NODES, PODS = informing.NODES, informing.PODS
# The place a pod that fits nowhere stands on (device plugin backend): no node, only its card index. Its
# remembered choice and, once it shows, the pod itself count there until it binds (``View.waiting``).
WAITING = remembering.WAITING
SLICES, CLAIMS = informing.SLICES, informing.CLAIMS


def shared_calls(api_client: kubernetes.client.ApiClient | None) -> dict[str, Callable[..., object]]:
    """How the view and the re-placement cache list and watch nodes and pods: only the nodes the agent has
    published on (the rest of a large cluster would cost every worker memory and watch traffic for nothing),
    and only gpushard's pods."""
    if api_client is None:
        return {}
    core = kubernetes.client.CoreV1Api(api_client)
    pods = f"{names.SHARED_LABEL}={names.SHARED_LABEL_VALUE}"
    return {NODES: lambda **kw: core.list_node(label_selector=names.CARDS_LABEL, **kw),
            PODS: lambda **kw: core.list_pod_for_all_namespaces(label_selector=pods, **kw)}


@dataclass(slots=True)
class _Pod:
    node: str | None
    shares: dict[int, int]  # card index -> shares held, counted as Kubernetes counts a pod
    active: bool
    preferred: str | None  # the node gpushard's preferred affinity term names, if any
    priority: int = 0  # spec.priority, as the API server's Priority admission set it
    gated: bool = False  # spec.schedulingGates not empty: a queue (Kueue) holds it back from the scheduler


@dataclass(slots=True)
class _Slice:
    node: str
    pool: str
    cards: tuple[placement.Card, ...]  # in the slice's device order, the order the allocator tries them


@dataclass(slots=True)
class _Claim:
    pod: str  # the uid of the pod it is reserved for (else its owner): "" when neither says
    held: tuple[tuple[str, int, int], ...]  # (pool, card index, shares consumed) per allocation result


@dataclass(slots=True)
class _DraPod:
    standing: str | None  # the node it is bound to, else the node gpushard's preferred term names
    shares: int  # the pod's shares as Kubernetes counts them (the webhook's annotation)
    active: bool


# --- reading API objects (raw JSON: the typed models are too slow for thousands of pods) --------


def _node_with(obj: dict, cards: tuple[placement.Card, ...]) -> placement.Node:
    """A node's labels, taints, readiness and cordon, with ``cards``."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    taints = tuple(placement.Taint(str(t.get("key")), str(t.get("value") or ""), str(t.get("effect") or ""))
                   for t in spec.get("taints") or () if isinstance(t, dict) and t.get("key"))
    ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or ())
    labels = meta.get("labels") or {}
    return placement.Node(str(meta.get("name")), {str(k): str(v) for k, v in labels.items()}, taints, ready,
                          bool(spec.get("unschedulable")), cards)


def read_node(obj: dict, policy: Policy) -> placement.Node | None:
    """A node's cards (and which an operator cordoned), labels, taints, readiness and cordon; None for a
    node without gpushard cards."""
    cards_of = objects.node_cards(obj, policy)
    indexes = cards_of.indexes
    if not indexes:
        return None
    cards = []
    for k in indexes:
        info = cards_of.inventory.get(k, {})
        # A card in the inventory but not in allocatable is known but not (yet) offered: room 0.
        # A cordoned card keeps its capacity and its pods; it has no room for new ones (Card.free).
        cards.append(placement.Card(k, cards_of.cards.get(k, 0), 0, str(info.get("uuid") or ""),
                                    str(info.get("model") or ""), objects.card_memory(info), k in cards_of.cordoned))
    return _node_with(obj, tuple(cards))


def read_dra_node(obj: dict, policy: Policy) -> placement.Node:
    """Backend dra: what the scheduler reads of a node, without cards (its ResourceSlice has them)."""
    return _node_with(obj, ())


def _attribute(device: dict, name: str) -> object:
    value = (device.get("attributes") or {}).get(name) if isinstance(device.get("attributes"), dict) else None
    return next(iter(value.values()), None) if isinstance(value, dict) and len(value) == 1 else None


def read_slice(obj: dict, policy: Policy) -> _Slice | None:
    """A ResourceSlice of gpushard's driver: its node, pool and cards (each with its ``shares`` capacity);
    None for another driver's, or one without a node."""
    spec = obj.get("spec") or {}
    if spec.get("driver") != names.DRA_DRIVER or not spec.get("nodeName"):
        return None
    cards = []
    for device in spec.get("devices") or ():
        k = draobjects.card_index(device.get("name")) if isinstance(device, dict) else None
        if k is None:
            continue
        value = ((device.get("capacity") or {}).get(names.DRA_SHARES_CAPACITY) or {}).get("value")
        capacity = objects.count(value) if value is not None else 0
        memory = _attribute(device, "memoryMiB")
        cards.append(placement.Card(k, capacity, 0, str(_attribute(device, "uuid") or ""),
                                    str(_attribute(device, "model") or ""),
                                    memory if isinstance(memory, int) and memory > 0 else 0))
    node = str(spec["nodeName"])
    return _Slice(node, str((spec.get("pool") or {}).get("name") or node), tuple(cards))


def _claim_pod(claim: dict) -> str:
    """The uid of the pod a claim is reserved for, else of the pod that owns it; "" when neither says."""
    for entry in (claim.get("status") or {}).get("reservedFor") or ():
        if isinstance(entry, dict) and entry.get("resource") == "pods" and entry.get("uid"):
            return str(entry["uid"])
    for owner in (claim.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(owner, dict) and owner.get("kind") == "Pod" and owner.get("uid"):
            return str(owner["uid"])
    return ""


def read_claim(obj: dict, policy: Policy) -> _Claim | None:
    """What an allocated claim holds of gpushard's cards; None for one not allocated, or not gpushard's."""
    try:
        results = draobjects.our_results(obj, names.DRA_DRIVER, policy.shares_per_card)
    except draobjects.ClaimError:
        return None
    return _Claim(_claim_pod(obj), tuple((r.pool, r.card, r.shares) for r in results))


def read_dra_pod(obj: dict, policy: Policy) -> _DraPod | None:
    """Backend dra: a gpushard pod's shares and the node it stands for; None for one holding none."""
    meta = obj.get("metadata") or {}
    annotations = cast(dict, meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {})
    shares = objects.count(annotations.get(names.SHARES_ANNOTATION, 0))
    if shares <= 0:
        return None
    spec = obj.get("spec") or {}
    phase = (obj.get("status") or {}).get("phase")
    return _DraPod(spec.get("nodeName") or placement.preferred_node(spec), shares,
                   phase not in objects.TERMINAL_PHASES)


def read_pod(obj: dict, policy: Policy) -> _Pod | None:
    """What a gpushard pod holds and where; None for a pod that holds no card."""
    spec = obj.get("spec") or {}
    shares = objects.card_shares(spec, policy) if isinstance(spec, dict) else {}
    if not shares:
        return None
    phase = (obj.get("status") or {}).get("phase")
    priority = spec.get("priority")
    return _Pod(spec.get("nodeName") or None, shares, phase not in objects.TERMINAL_PHASES,
                placement.preferred_node(spec),
                priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
                bool(spec.get("schedulingGates")))


def default_api_client() -> kubernetes.client.ApiClient | None:
    """A client for the API server from the one kubeconfig loader (kubectl's order; in a pod, the
    in-cluster service account); None without any."""
    try:
        return connecting.client().api
    except connecting.ConfigError as exc:
        log.error("%s; card choice runs without a cluster view", exc)
        return None


# --- the view ------------------------------------------------------------------------------------


class KubeView:
    """The cluster as the Kubernetes API shows it, kept current by list and watch.

    A sink of one ``informing.Informer`` (``informer``): it lists and watches; this class keeps
    what placement reads from the pages and events it hands over.
    """

    def __init__(self, api_client: kubernetes.client.ApiClient | None, policy: Policy, *,
                 remember_ttl: float = REMEMBER_TTL_S, remember_held_ttl: float = REMEMBER_HELD_TTL_S,
                 watch_timeout: int = WATCH_TIMEOUT_S,
                 backoff: tuple[float, float] = BACKOFF_S, clock: Callable[[], float] = time.monotonic,
                 page_size: int = LIST_PAGE, connect_timeout: float = informing.CONNECT_TIMEOUT_S,
                 list_timeout: float = informing.LIST_TIMEOUT_S, after_list: Callable[[], None] | None = None):
        self._dra = policy.backend == policy_mod.DRA
        # Backend dra also follows gpushard's slices (the cards) and the claims (the shares held).
        self._required = frozenset((NODES, PODS, SLICES, CLAIMS) if self._dra else (NODES, PODS))
        self.informer = informing.Informer(api_client, self, watch_timeout=watch_timeout, backoff=backoff,
                                           page_size=page_size, connect_timeout=connect_timeout,
                                           list_timeout=list_timeout, after_list=after_list,
                                           calls=shared_calls(api_client),
                                           resources=tuple(r for r in (NODES, PODS, SLICES, CLAIMS)
                                                           if r in self._required))
        self._policy = policy
        self._ttl = remember_ttl
        self._held_ttl = max(remember_ttl, remember_held_ttl)
        self._clock = clock
        self._lock = threading.Lock()  # guards everything below but _view and _inbox
        self._streaming: set[str] = set()  # resources whose watch is connected now
        self._listed: set[str] = set()
        self._base: dict[str, placement.Node] = {}  # nodes as listed, no shares used
        self._pods: dict[str, _Pod] = {}
        self._used: collections.Counter = collections.Counter()  # (node, card) -> shares of bound pods
        self._ledger = remembering.Ledger()  # remembered choices not yet accounted for
        self._waiting: dict[str, str] = {}  # uid of an unbound pod -> the node it counts on
        # (node, card) -> shares of remembered choices and of unbound pods counted on the node.
        self._tentative: collections.Counter = collections.Counter()
        # Card index -> Counter of the shares of each pod standing on WAITING (remembered choices included),
        # kept only when nodes an autoscaler adds have a size (policy.newNodeCards); as View.waiting.
        self._track_waiting = policy.new_node_cards > 0 and not self._dra
        self._queue: dict[int, collections.Counter] = {}
        self._queue_view: dict[int, tuple[int, ...]] | None = {}  # None: _queue changed since it was made
        # (node, card) -> Counter of the shares bound pods of each priority other than 0 hold there, so that a pod
        # that fits nowhere can wait where the scheduler may preempt for it (View.priorities).
        self._ranked: dict[tuple[str, int], collections.Counter] = {}
        # The same as (priority, shares) pairs, for View.priorities: one dict, each key replaced as it changes (a
        # cluster whose PriorityClass is a global default ranks every pod: no copy per change). Views share it:
        # placement reads it with get() as a hint, never as a snapshot of the same moment as the cards.
        self._ranked_view: dict[tuple[str, int], tuple[tuple[int, int], ...]] = {}
        self._by_priority: collections.Counter = collections.Counter()  # priority -> shares bound pods hold
        self._floor: int | None = None  # the lowest of them, as the current view says it
        self._inbox: collections.deque = collections.deque()  # remember() calls not applied yet
        self._current: dict[str, placement.Node] = {}  # the nodes of _view, by name
        self._built_from: dict[str, placement.Node] = {}  # the listed node each of _current was built from
        # Card index -> its place among the cards of each of _current (as of _built_from); None for a
        # node with an index twice. A remembered choice finds its card here instead of scanning.
        self._card_at: dict[str, dict[int, int] | None] = {}
        self._view: placement.View | None = None
        # Backend dra: nodes as listed without cards, slices by uid, each node's slices (by uid),
        # each pool's node, allocated claims by uid, and the pods (by uid) an allocated claim stands for.
        self._bare: dict[str, placement.Node] = {}
        self._slices: dict[str, _Slice] = {}
        self._slices_of: dict[str, set[str]] = {}
        self._pools: dict[str, str] = {}
        self._claims: dict[str, _Claim] = {}
        self._claimed: collections.Counter = collections.Counter()
        # For the webhook's metrics, by resource: the informer's lists and watches made, watches
        # that failed, and the wall-clock time the API server last said anything.
        self.lists = self.informer.lists
        self.watches = self.informer.watches
        self.watch_errors = self.informer.watch_errors
        self.unreadable = self.informer.unreadable
        self.heard_at = self.informer.heard_at

    @classmethod
    def start(cls, settings: settings_mod.Settings | None = None,
              api_client: kubernetes.client.ApiClient | None = None, **options) -> KubeView:
        """A view of the API server (in-cluster, else kubeconfig) with its watch threads running; its
        timeouts from the config's ``view`` (``options`` override them, for tests)."""
        settings = settings or settings_mod.Settings()
        options = {"connect_timeout": settings.view.connect_timeout, "list_timeout": settings.view.list_timeout,
                   "watch_timeout": settings.view.watch_timeout, **options}
        view = cls(api_client if api_client is not None else default_api_client(), settings.policy, **options)
        view.informer.start()
        return view

    # --- the surface the admission server uses --------------------------------------------------

    def synced(self) -> bool:
        """True once nodes and pods have both been listed (it stays True through reconnects)."""
        return self._view is not None

    def snapshot(self) -> placement.View | None:
        """The latest view, or None before the first sync; never waits on the watch threads."""
        if (self._inbox or self._ledger.next_deadline <= self._clock()) and self._lock.acquire(blocking=False):
            try:
                self._refresh(self._catch_up())
            finally:
                self._lock.release()
        return self._view

    def remember(self, node: str | None, card: int, shares: int) -> None:
        """Count a choice on its node until the watch shows the pod (never called for dry runs); a pod that fits
        nowhere (``node`` None) on WAITING, under the device plugin backend."""
        if node is None and self._track_waiting:
            node = WAITING
        if node is None or shares <= 0:
            return
        now = self._clock()
        self._inbox.append(remembering.Entry(node, card, shares, now + self._ttl, now + self._held_ttl))
        # The watch thread holds the lock for well under a millisecond per event; a relist can
        # take longer, and then the thread applies the entry itself when it is done.
        if self._lock.acquire(timeout=REMEMBER_WAIT_S):
            try:
                if len(self._inbox) == 1 and self._ledger.next_deadline > self._clock():
                    # The usual call: one choice to count and nothing due to expire, so one card changes.
                    entry = self._inbox.popleft()
                    self._add_entry(entry)
                    if entry.node == WAITING:
                        self._refresh({WAITING})
                    else:
                        self._refresh_card(entry.node, entry.card)
                else:
                    self._refresh(self._catch_up())
            finally:
                self._lock.release()

    def close(self) -> None:
        """Stop the watch threads."""
        self.informer.close()

    # --- keeping the view current (call with the lock held) -------------------------------------

    def _catch_up(self) -> set[str]:
        touched: set[str] = set()
        while self._inbox:
            entry = self._inbox.popleft()
            self._add_entry(entry)
            touched.add(entry.node)
        now = self._clock()
        held = PODS not in self._streaming
        while self._ledger.next_deadline <= now:
            entry = self._ledger.oldest()
            if held and entry.held_deadline > now:
                break  # no pod can show while the watch is down: the choice still stands for one
            self._drop_entry(entry)
            touched.add(entry.node)
        return touched

    def _count(self, node: str, card: int, shares: int) -> None:
        if node == WAITING:
            self._queue_view = None
            sizes = self._queue.setdefault(card, collections.Counter())
            sizes[abs(shares)] += 1 if shares > 0 else -1
            if sizes[abs(shares)] <= 0:
                del sizes[abs(shares)]
                if not sizes:
                    del self._queue[card]
            return
        key = (node, card)
        self._tentative[key] += shares
        if self._tentative[key] <= 0:
            del self._tentative[key]

    def _add_entry(self, entry: remembering.Entry) -> None:
        self._ledger.add(entry)
        self._count(entry.node, entry.card, entry.shares)

    def _drop_entry(self, entry: remembering.Entry) -> None:
        self._ledger.drop(entry)
        self._count(entry.node, entry.card, -entry.shares)

    def _node(self, name: str) -> placement.Node | None:
        """The node as the view shows it: its listed state with the shares held and remembered.

        While the listed node is the one the current view's node was built from, only shares
        can differ: unchanged cards are the current view's own objects, and a node with no
        change is the current node itself, so a remembered choice builds one card.
        """
        base = self._base.get(name)
        if base is None:
            return None
        current = self._current.get(name)
        if current is None or self._built_from.get(name) is not base:
            node = placement.Node(base.name, base.labels, base.taints, base.ready, base.unschedulable, tuple(
                c.with_used(self._used.get((name, c.index), 0) + self._tentative.get((name, c.index), 0))
                for c in base.cards))
            self._built_from[name] = base
            at = {c.index: j for j, c in enumerate(base.cards)}
            self._card_at[name] = at if len(at) == len(base.cards) else None
            return node
        cards = current.cards
        changed = None
        held, tentative = self._used, self._tentative
        for j, c in enumerate(cards):
            key = (name, c.index)
            used = held.get(key, 0) + tentative.get(key, 0)
            if used != c.used:
                if changed is None:
                    changed = list(cards)
                changed[j] = c.with_used(used)
        if changed is None:
            return current
        return placement.Node(current.name, current.labels, current.taints, current.ready, current.unschedulable,
                              tuple(changed))

    def _refresh_card(self, name: str, index: int) -> None:
        """``_refresh({name})`` when only card ``index`` of node ``name`` can have changed its shares.

        Every other card of the node is as the last refresh left it (each change is refreshed
        under the lock that made it), so only this one is compared and rebuilt.
        """
        current = self._current.get(name)
        base = self._base.get(name)
        if self._view is None or current is None or base is None or self._built_from.get(name) is not base:
            self._refresh({name})
            return
        at = self._card_at.get(name)
        j = at.get(index) if at is not None else None
        if j is None:  # no such card, or the index twice: the general path decides
            self._refresh({name})
            return
        c = current.cards[j]
        key = (name, index)
        used = self._used.get(key, 0) + self._tentative.get(key, 0)
        if used == c.used:
            return
        node = current.with_card(j, c.with_used(used))
        self._current[name] = node
        self._publish(placement.replace_card(self._view, node, j))

    def _rank(self, pod: _Pod, sign: int) -> None:
        """Count (sign 1) or uncount (-1) a bound pod's shares by its priority: the total of each priority, and
        per card those of a priority other than 0."""
        if not pod.node:
            return
        self._by_priority[pod.priority] += sign * sum(pod.shares.values())
        if self._by_priority[pod.priority] <= 0:
            del self._by_priority[pod.priority]
        if not pod.priority:
            return
        for k, shares in pod.shares.items():
            key = (pod.node, k)
            held = self._ranked.setdefault(key, collections.Counter())
            held[pod.priority] += sign * shares
            if held[pod.priority] <= 0:
                del held[pod.priority]
            if held:
                self._ranked_view[key] = tuple(sorted(held.items()))
            else:
                del self._ranked[key]
                self._ranked_view.pop(key, None)

    def _lowest_priority(self) -> int | None:
        """The lowest priority of the bound pods that hold shares (View.priority_floor); None with none."""
        return min(self._by_priority) if self._by_priority else None

    def _publish(self, view: placement.View) -> None:
        """``view`` as the current one, with the pods that stand on WAITING and the priorities of the pods bound
        (none: as it is)."""
        floor = self._lowest_priority()
        if view.priorities is not self._ranked_view or view.priority_floor != floor:
            view = view.with_priorities(self._ranked_view, floor)
        self._floor = floor
        if self._track_waiting:
            if self._queue_view is None:
                self._queue_view = {k: tuple(sorted(sizes.elements(), reverse=True))
                                    for k, sizes in sorted(self._queue.items())}
            if self._queue_view or view.waiting:
                view = view.with_waiting(self._queue_view)
        self._view = view

    def _refresh(self, touched) -> None:
        if not self._required <= self._listed:
            return  # no view before every list; the first full build happens at sync
        if self._view is None:
            # Every listed node is one (_node is None only for a name not in _base).
            self._current = {name: cast(placement.Node, self._node(name)) for name in self._base}
            view = placement.View(nodes=tuple(self._current.values()))
            placement.choose(view, placement.Ask(shares=1))  # builds the indexes here, not in an admission
            self._publish(view)
            return
        changes = {}
        for name in touched:
            if name == WAITING:
                continue
            node = self._node(name)
            current = self._current.get(name)
            if node is not current and node != current:  # node heartbeats change nothing we read
                changes[name] = node
                if node is None:
                    self._current.pop(name, None)
                    self._built_from.pop(name, None)
                    self._card_at.pop(name, None)
                else:
                    self._current[name] = node
        if changes:
            self._publish(placement.replace_nodes(self._view, changes))
        elif WAITING in touched or self._floor != self._lowest_priority():
            # The shares on the nodes are as they were (a remembered choice became its pod), but what waits, or
            # the lowest priority holding shares, changed.
            self._publish(self._view)

    def _set_node(self, name: str, node: placement.Node | None) -> set[str]:
        if node is None:
            self._base.pop(name, None)
        else:
            self._base[name] = node
        return {name}

    def _set_pod(self, uid: str, pod: _Pod | None) -> set[str]:
        """Account for a pod's new state (None: deleted, or holds nothing); the nodes touched.

        A bound pod counts where it runs. An unbound one counts on the node it stands for: the
        one its preferred term names, else the node of the remembered choice it took over, and
        it keeps counting there until it binds or goes away. While it has scheduling gates it counts nowhere
        but through the choice remembered for it, until that expires.
        """
        touched: set[str] = set()
        old = self._pods.get(uid)
        if old is not None and old.active and old.node:
            self._rank(old, -1)
            for k, shares in old.shares.items():
                self._used[(old.node, k)] -= shares
                if self._used[(old.node, k)] <= 0:
                    del self._used[(old.node, k)]
            touched.add(old.node)
        standing = self._waiting.pop(uid, None)
        if standing is not None:
            assert old is not None  # a pod stands on a node only while the view keeps it
            for k, shares in old.shares.items():
                self._count(standing, k, -shares)
            touched.add(standing)
        if pod is None or not pod.active:
            self._pods.pop(uid, None)
            return touched
        self._pods[uid] = pod
        if pod.gated and not pod.node:
            # A queue holds it (Kueue's admission gate) until its quota is there, which may take hours: it holds
            # no room meanwhile. The choice remembered for it still counts until it expires, so that a burst the
            # queue lets through at once is not placed on the same room.
            return touched
        # A pod new to the view (or just let through by its queue) accounts for the choice made for it.
        entry = self._ledger.entry_for(pod.shares, pod.preferred, pod.node) if old is None or old.gated else None
        if entry is not None:
            self._drop_entry(entry)
            touched.add(entry.node)
        if pod.node:
            for k, held in pod.shares.items():
                self._used[(pod.node, k)] += held
            self._rank(pod, 1)
            touched.add(pod.node)
            return touched
        standing = pod.preferred or (entry.node if entry is not None else standing)
        if standing is None and self._track_waiting:
            standing = WAITING  # it fits nowhere, or its choice is not this process's: it waits on its card
        if standing is not None:
            self._waiting[uid] = standing
            for k, held in pod.shares.items():
                self._count(standing, k, held)
            touched.add(standing)
        return touched

    # --- backend dra: nodes from their slices, shares from the claims ---------------------------

    def _compose(self, name: str) -> set[str]:
        """The listed node ``name`` under backend dra: the node as listed with its slices' cards (none
        without a slice or without the node: then it is no shared node)."""
        bare = self._bare.get(name)
        cards = tuple(c for uid in sorted(self._slices_of.get(name, ())) for c in self._slices[uid].cards)
        if bare is None or not cards:
            self._base.pop(name, None)
        else:
            self._base[name] = placement.Node(bare.name, bare.labels, bare.taints, bare.ready, bare.unschedulable,
                                              cards)
        return {name}

    def _set_bare(self, name: str, node: placement.Node | None) -> set[str]:
        if node is None:
            self._bare.pop(name, None)
        else:
            self._bare[name] = node
        return self._compose(name)

    def _set_slice(self, uid: str, found: _Slice | None) -> set[str]:
        touched: set[str] = set()
        old = self._slices.pop(uid, None)
        if old is not None:
            self._slices_of.get(old.node, set()).discard(uid)
            if not self._slices_of.get(old.node):
                self._slices_of.pop(old.node, None)
            touched |= self._compose(old.node)
        if found is not None:
            self._slices[uid] = found
            self._slices_of.setdefault(found.node, set()).add(uid)
            self._pools[found.pool] = found.node
            touched |= self._compose(found.node)
        return touched

    def _set_claim(self, uid: str, claim: _Claim | None) -> set[str]:
        """Count an allocated claim's consumed shares on its cards; the pod it stands for stops counting."""
        touched: set[str] = set()
        old = self._claims.pop(uid, None)
        if old is not None:
            for pool, k, shares in old.held:
                key = (self._pools.get(pool, pool), k)
                self._used[key] -= shares
                if self._used[key] <= 0:
                    del self._used[key]
                touched.add(key[0])
            self._claimed[old.pod] -= 1
            if self._claimed[old.pod] <= 0:
                del self._claimed[old.pod]
        if claim is None:
            return touched
        self._claims[uid] = claim
        for pool, k, shares in claim.held:
            key = (self._pools.get(pool, pool), k)
            self._used[key] += shares
            touched.add(key[0])
        if claim.pod:
            self._claimed[claim.pod] += 1
            if claim.pod in self._pods:
                touched |= self._set_pod(claim.pod, None)
        return touched

    def _set_dra_pod(self, uid: str, pod: _DraPod | None) -> set[str]:
        """A pod under backend dra counts on the node it stands for, on the card the allocator would take
        there (else the remembered choice's), until an allocated claim stands for it."""
        if pod is None or not pod.active or pod.standing is None or uid in self._claimed:
            return self._set_pod(uid, None)
        old = self._pods.get(uid)
        if old is not None and old.preferred == pod.standing:
            return set()  # it counts where it did
        base = self._base.get(pod.standing)
        indexes = [c.index for c in base.cards] if base is not None else []
        entry = self._ledger.entry_on(pod.standing, indexes, pod.shares) if old is None else None
        card = entry.card if entry is not None else self._first_fit(pod.standing, pod.shares)
        if card is None:
            return self._set_pod(uid, None)
        return self._set_pod(uid, _Pod(None, {card: pod.shares}, True, pod.standing))

    def _first_fit(self, name: str, shares: int) -> int | None:
        """The card of node ``name`` the DRA allocator would take for ``shares``: the first with room."""
        base = self._base.get(name)
        for card in base.cards if base is not None else ():
            used = self._used.get((name, card.index), 0) + self._tentative.get((name, card.index), 0)
            if card.capacity - used >= shares:
                return card.index
        return None

    # --- the informer's sink: what a list page or a watch event leaves in the view ---------------

    def reduce(self, resource: str, items, into: dict) -> dict:
        """Read listed objects into what placement keeps: nodes by name, pods (and slices, claims) by uid."""
        if resource == NODES:
            reader = read_dra_node if self._dra else read_node
            for obj in items:
                node = _tolerant(reader, obj, self._policy)
                if node is not None:
                    into[node.name] = node
            return into
        read = {PODS: read_dra_pod if self._dra else read_pod, SLICES: read_slice, CLAIMS: read_claim}[resource]
        for obj in items:
            into[objects.key(obj)] = _tolerant(read, obj, self._policy)
        return into

    def apply_list(self, resource: str, fresh: dict | list) -> None:
        """Replace the listed state of ``resource`` with ``fresh``: as ``reduce`` reads it, or the raw objects."""
        if isinstance(fresh, list):
            fresh = self.reduce(resource, fresh, {})
        with self._lock:
            touched = self._catch_up()  # a remembered choice must be in place before its pod shows
            if resource == NODES and self._dra:
                touched |= set(self._bare) | set(fresh)
                self._bare = fresh
                for name in set(touched):
                    self._compose(name)
            elif resource == NODES:
                touched |= set(self._base) | set(fresh)
                self._base = fresh
            elif resource == SLICES:
                for uid in [u for u in self._slices if u not in fresh]:
                    touched |= self._set_slice(uid, None)
                for uid, found in fresh.items():
                    touched |= self._set_slice(uid, found)
            elif resource == CLAIMS:
                for uid in [u for u in self._claims if u not in fresh]:
                    touched |= self._set_claim(uid, None)
                for uid, claim in fresh.items():
                    touched |= self._set_claim(uid, claim)
            else:
                setter = self._set_dra_pod if self._dra else self._set_pod
                for uid in [u for u in self._pods if u not in fresh]:
                    touched |= self._set_pod(uid, None)
                for uid, pod in fresh.items():
                    touched |= setter(uid, pod)
            self._listed.add(resource)
            self._refresh(touched | self._catch_up())

    def apply_event(self, resource: str, kind: str, obj: dict) -> None:
        gone = kind == "DELETED"
        with self._lock:
            touched = self._catch_up()
            if resource == NODES:
                name = str((obj.get("metadata") or {}).get("name"))
                if self._dra:
                    touched |= self._set_bare(name, None if gone else read_dra_node(obj, self._policy))
                else:
                    touched |= self._set_node(name, None if gone else read_node(obj, self._policy))
            elif resource == SLICES:
                touched |= self._set_slice(objects.key(obj), None if gone else read_slice(obj, self._policy))
            elif resource == CLAIMS:
                touched |= self._set_claim(objects.key(obj), None if gone else read_claim(obj, self._policy))
            elif self._dra:
                touched |= self._set_dra_pod(objects.key(obj), None if gone else read_dra_pod(obj, self._policy))
            else:
                touched |= self._set_pod(objects.key(obj), None if gone else read_pod(obj, self._policy))
            self._refresh(touched | self._catch_up())

    def watch_opened(self, resource: str) -> None:
        self._streaming.add(resource)

    def watch_closed(self, resource: str, gap: bool) -> None:
        # Any end counts: until the next watch opens no pod can show and take a choice over.
        self._streaming.discard(resource)


def _tolerant(reader, obj: dict, policy: Policy):
    """``reader(obj, policy)``, or None (logged) for an object it cannot read: one odd object
    must not make every list fail and the view never sync."""
    try:
        return reader(obj, policy)
    except Exception:  # noqa: BLE001
        log.exception("gpushard: the view skipped an object it could not read")
        return None
