"""The live cluster view: shared nodes and gpushard pods, listed then watched from the Kubernetes API.

Two daemon threads (nodes, pods) each list, then watch from the list's resourceVersion, relist
on 410 Gone, and reconnect with backoff when the API fails or drops the connection. They keep
an immutable ``placement.View`` up to date node by node (``placement.replace_nodes``), so an
admission takes ``snapshot()`` without waiting on anything. Lists come in pages, each reduced to
what placement reads before the next; nodes are those the agent labelled with its cards.

Shares a pod holds count on its node and card from the moment the watch shows it bound. A pod
gpushard pinned that the watch shows unbound counts on the node its preferred affinity term
names (where it was chosen) until it binds or goes away, however long that takes. Between a
choice and the watch showing its pod the view would not know of the pod, so a burst of pods
would all pick the same nearly full card; ``remember`` therefore counts each choice on its node
until the watch shows a pod that accounts for it, or for at most ``remember_ttl`` seconds (a
pod the API server refused never shows). Choices expire oldest first, each in constant time.

The time to live is short (seconds): once the watch shows the pod, unbound or bound, the pod
itself counts, so a choice only has to bridge the API server storing the pod and its watch
event arriving. A choice nobody's pod takes over (a review the API server never sent: anyone
who reaches the webhook's port can post one) then stops counting in seconds, and forged
reviews cannot fill the view. While the pods watch is down (between a failure and the next
list) no pod can take a choice over, so choices are kept up to ``remember_held_ttl``.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import kubernetes

from webhook import connecting
from webhook import settings as settings_mod
from webhook.cluster import static
from webhook.core import names, objects, placement
from webhook.core.policy import Policy

log = logging.getLogger(__name__)

# How long a remembered choice counts before a watch event accounts for it, while the pods watch
# streams. It bridges admission to the pod's watch event: the rest of admission (later webhooks,
# whose timeouts the operator sets), the write, and the event's delivery, well under a second
# in a healthy cluster. Scheduling does not count here: an unbound pod counts once it shows.
REMEMBER_TTL_S = 5.0
# ... and while the pods watch is down, when no pod can show and take its choice over.
REMEMBER_HELD_TTL_S = static.REMEMBER_TTL_S
# Server-side watch length; the API server ends watches itself too, and we resume from the last
# resourceVersion. The read timeout above it catches connections that died silently.
WATCH_TIMEOUT_S = 300
LIST_TIMEOUT_S = 120
# Lists come in pages: each is read and parsed on its own, and only the fields placement needs
# are kept, so neither memory nor the interpreter lock held by one json.loads grows with the
# cluster. 500 realistic pods are a few MiB of JSON, parsed in tens of milliseconds.
LIST_PAGE = 500
# A continue token the API server no longer honours (410 Gone) restarts the list; a list that
# keeps losing its token (history compacted faster than we read) is an error that backs off.
LIST_RESTARTS = 3
CONNECT_TIMEOUT_S = 10
BACKOFF_S = (0.5, 30.0)
REMEMBER_WAIT_S = 0.05
NODES, PODS = "nodes", "pods"


class _Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class _ContinueGone(Exception):
    """A list's continue token expired between two pages (410 Gone): start the list over."""


@dataclass(slots=True)
class _Pod:
    node: str | None
    shares: dict[int, int]  # card index -> shares held, counted as Kubernetes counts a pod
    active: bool
    preferred: str | None  # the node gpushard's preferred affinity term names, if any


@dataclass(slots=True)
class _Entry:
    """A choice counted on its node until a pod accounts for it or it expires."""

    node: str
    card: int
    shares: int
    deadline: float
    held_deadline: float = math.inf  # how long it counts while the pods watch is down
    number: int = 0  # its place among the remembered choices, oldest first


# --- reading API objects (raw JSON: the typed models are too slow for thousands of pods) --------


def read_node(obj: dict, policy: Policy) -> placement.Node | None:
    """A node's cards, labels, taints, readiness and cordon; None for a node without gpushard cards."""
    cards_of = objects.node_cards(obj, policy)
    indexes = cards_of.indexes
    if not indexes:
        return None
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    cards = []
    for k in indexes:
        info = cards_of.inventory.get(k, {})
        # A card in the inventory but not in allocatable is known but not (yet) offered: room 0.
        cards.append(placement.Card(k, cards_of.cards.get(k, 0), 0, str(info.get("uuid") or ""),
                                    str(info.get("model") or ""), objects.card_memory(info)))
    taints = tuple(placement.Taint(str(t.get("key")), str(t.get("value") or ""), str(t.get("effect") or ""))
                   for t in spec.get("taints") or () if isinstance(t, dict) and t.get("key"))
    ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or ())
    labels = meta.get("labels") or {}
    return placement.Node(str(meta.get("name")), {str(k): str(v) for k, v in labels.items()}, taints, ready,
                          bool(spec.get("unschedulable")), tuple(cards))


def read_pod(obj: dict, policy: Policy) -> _Pod | None:
    """What a gpushard pod holds and where; None for a pod that holds no card."""
    spec = obj.get("spec") or {}
    shares = objects.card_shares(spec, policy) if isinstance(spec, dict) else {}
    if not shares:
        return None
    phase = (obj.get("status") or {}).get("phase")
    return _Pod(spec.get("nodeName") or None, shares, phase not in objects.TERMINAL_PHASES,
                placement.preferred_node(spec))


def _api_client() -> kubernetes.client.ApiClient | None:
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

    ``webhook.relocation.cache.Cache`` follows the same resources with this list/watch machinery and keeps
    its own state: it overrides ``_reduce``, ``_apply_list`` and ``_apply_event`` (what a page or
    an event leaves behind) and wraps ``_call`` and ``_watch`` (to know when it has a gap).
    """

    def __init__(self, api_client: kubernetes.client.ApiClient | None, policy: Policy, *,
                 remember_ttl: float = REMEMBER_TTL_S, remember_held_ttl: float = REMEMBER_HELD_TTL_S,
                 watch_timeout: int = WATCH_TIMEOUT_S,
                 backoff: tuple[float, float] = BACKOFF_S, clock: Callable[[], float] = time.monotonic,
                 page_size: int = LIST_PAGE):
        self._api = kubernetes.client.CoreV1Api(api_client) if api_client is not None else None
        self._policy = policy
        self._ttl = remember_ttl
        self._held_ttl = max(remember_ttl, remember_held_ttl)
        self._watch_timeout = watch_timeout
        self._backoff = backoff
        self._clock = clock
        self._page_size = page_size
        self._lock = threading.Lock()  # guards everything below but _view and _inbox
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._responses: dict[str, object] = {}  # open watch responses, to cut on close()
        self._streaming: set[str] = set()  # resources whose watch is connected now
        self._listed: set[str] = set()
        self._base: dict[str, placement.Node] = {}  # nodes as listed, no shares used
        self._pods: dict[str, _Pod] = {}
        self._used: collections.Counter = collections.Counter()  # (node, card) -> shares of bound pods
        # Remembered choices, oldest first (so soonest to expire: one time to live for all), and
        # the same by (card, shares) and by (node, card, shares), for a pod to find its own.
        # OrderedDicts: their first item is found in constant time however many went before it,
        # where a plain dict scans the slots of the items deleted from its front.
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._by_ask: dict[tuple, collections.OrderedDict[int, _Entry]] = {}
        self._by_place: dict[tuple, collections.OrderedDict[int, _Entry]] = {}
        self._numbers = 0
        self._waiting: dict[str, str] = {}  # uid of an unbound pod -> the node it counts on
        # (node, card) -> shares of remembered choices and of unbound pods counted on the node.
        self._tentative: collections.Counter = collections.Counter()
        self._next_deadline = math.inf
        self._inbox: collections.deque = collections.deque()  # remember() calls not applied yet
        self._current: dict[str, placement.Node] = {}  # the nodes of _view, by name
        self._built_from: dict[str, placement.Node] = {}  # the listed node each of _current was built from
        self._view: placement.View | None = None
        # For the webhook's metrics, by resource: lists and watches made, watches that failed, and
        # the wall-clock time the API server last said anything (a list, an event, a bookmark).
        self.lists: collections.Counter = collections.Counter()
        self.watches: collections.Counter = collections.Counter()
        self.watch_errors: collections.Counter = collections.Counter()
        self.heard_at: dict[str, float] = {}

    @classmethod
    def start(cls, settings: settings_mod.Settings | None = None,
              api_client: kubernetes.client.ApiClient | None = None, **options) -> KubeView:
        """A view of the API server (in-cluster, else kubeconfig) with its watch threads running."""
        settings = settings or settings_mod.Settings()
        view = cls(api_client if api_client is not None else _api_client(), settings.policy, **options)
        if view._api is not None:
            for resource in (NODES, PODS):
                thread = threading.Thread(target=view._run, args=(resource,), daemon=True,
                                          name=f"gpushard-watch-{resource}")
                view._threads.append(thread)
                thread.start()
        return view

    # --- the surface the admission server uses --------------------------------------------------

    def synced(self) -> bool:
        """True once nodes and pods have both been listed (it stays True through reconnects)."""
        return self._view is not None

    def snapshot(self) -> placement.View | None:
        """The latest view, or None before the first sync; never waits on the watch threads."""
        if (self._inbox or self._next_deadline <= self._clock()) and self._lock.acquire(blocking=False):
            try:
                self._refresh(self._catch_up())
            finally:
                self._lock.release()
        return self._view

    def remember(self, node: str | None, card: int, shares: int) -> None:
        """Count a choice on its node until the watch shows the pod (never called for dry runs)."""
        if node is None or shares <= 0:
            return
        now = self._clock()
        self._inbox.append(_Entry(node, card, shares, now + self._ttl, now + self._held_ttl))
        # The watch thread holds the lock for well under a millisecond per event; a relist can
        # take longer, and then the thread applies the entry itself when it is done.
        if self._lock.acquire(timeout=REMEMBER_WAIT_S):
            try:
                if len(self._inbox) == 1 and self._next_deadline > self._clock():
                    # The usual call: one choice to count and nothing due to expire, so one card changes.
                    entry = self._inbox.popleft()
                    self._add_entry(entry)
                    self._refresh_card(entry.node, entry.card)
                else:
                    self._refresh(self._catch_up())
            finally:
                self._lock.release()

    def close(self) -> None:
        """Stop the watch threads."""
        self._stop.set()
        for response in list(self._responses.values()):
            try:
                response.shutdown()  # wakes a thread blocked reading the stream
            except Exception:  # already closed or never connected: nothing to wake
                pass
        for thread in self._threads:
            thread.join(timeout=5)

    # --- keeping the view current (call with the lock held) -------------------------------------

    def _catch_up(self) -> set[str]:
        touched: set[str] = set()
        while self._inbox:
            entry = self._inbox.popleft()
            self._add_entry(entry)
            touched.add(entry.node)
        now = self._clock()
        held = PODS not in self._streaming
        while self._next_deadline <= now:
            entry = next(iter(self._entries.values()))
            if held and entry.held_deadline > now:
                break  # no pod can show while the watch is down: the choice still stands for one
            self._drop_entry(entry)
            touched.add(entry.node)
        return touched

    def _count(self, node: str, card: int, shares: int) -> None:
        key = (node, card)
        self._tentative[key] += shares
        if self._tentative[key] <= 0:
            del self._tentative[key]

    def _add_entry(self, entry: _Entry) -> None:
        self._numbers += 1
        entry.number = self._numbers
        self._entries[entry.number] = entry
        for table, key in ((self._by_ask, (entry.card, entry.shares)),
                           (self._by_place, (entry.node, entry.card, entry.shares))):
            group = table.get(key)
            if group is None:  # not setdefault: that would build an OrderedDict on every call
                group = table[key] = collections.OrderedDict()
            group[entry.number] = entry
        self._count(entry.node, entry.card, entry.shares)
        self._next_deadline = min(self._next_deadline, entry.deadline)

    def _drop_entry(self, entry: _Entry) -> None:
        del self._entries[entry.number]
        for table, key in ((self._by_ask, (entry.card, entry.shares)),
                           (self._by_place, (entry.node, entry.card, entry.shares))):
            group = table[key]
            del group[entry.number]
            if not group:
                del table[key]
        self._count(entry.node, entry.card, -entry.shares)
        # Entries are kept in the order they expire: the oldest left is the next due.
        self._next_deadline = next(iter(self._entries.values())).deadline if self._entries else math.inf

    def _entry_for(self, pod: _Pod) -> _Entry | None:
        """The oldest remembered choice that ``pod`` accounts for, if any.

        A pod with gpushard's preferred term was chosen on that node: only an entry there can be
        its own (another replica's pod of the same size must not take this process's entry). A
        pod without one takes the oldest entry of its card and shares, preferring its node.
        """
        card, shares = min(pod.shares.items())
        if pod.preferred:
            group = self._by_place.get((pod.preferred, card, shares))
        else:
            group = self._by_place.get((pod.node, card, shares)) if pod.node else None
            group = group or self._by_ask.get((card, shares))
        return next(iter(group.values())) if group else None

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
                placement.Card(c.index, c.capacity, self._used.get((name, c.index), 0)
                               + self._tentative.get((name, c.index), 0), c.uuid, c.model, c.memory_mib)
                for c in base.cards))
            self._built_from[name] = base
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
                changed[j] = placement.Card(c.index, c.capacity, used, c.uuid, c.model, c.memory_mib)
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
        cards = current.cards
        at = [j for j, c in enumerate(cards) if c.index == index]
        if len(at) != 1:  # no such card, or the index twice: the general path decides
            self._refresh({name})
            return
        j = at[0]
        c = cards[j]
        key = (name, index)
        used = self._used.get(key, 0) + self._tentative.get(key, 0)
        if used == c.used:
            return
        card = placement.Card(c.index, c.capacity, used, c.uuid, c.model, c.memory_mib)
        node = placement.Node(current.name, current.labels, current.taints, current.ready, current.unschedulable,
                              (*cards[:j], card, *cards[j + 1:]))
        self._current[name] = node
        self._view = placement.replace_card(self._view, node, j)

    def _refresh(self, touched) -> None:
        if len(self._listed) < 2:
            return  # no view before both lists; the first full build happens at sync
        if self._view is None:
            self._current = {name: self._node(name) for name in self._base}
            view = placement.View(nodes=tuple(self._current.values()))
            placement.choose(view, placement.Ask(shares=1))  # builds the indexes here, not in an admission
            self._view = view
            return
        changes = {}
        for name in touched:
            node = self._node(name)
            current = self._current.get(name)
            if node is not current and node != current:  # node heartbeats change nothing we read
                changes[name] = node
                if node is None:
                    self._current.pop(name, None)
                    self._built_from.pop(name, None)
                else:
                    self._current[name] = node
        if changes:
            self._view = placement.replace_nodes(self._view, changes)

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
        it keeps counting there until it binds or goes away.
        """
        touched: set[str] = set()
        old = self._pods.get(uid)
        if old is not None and old.active and old.node:
            for k, shares in old.shares.items():
                self._used[(old.node, k)] -= shares
                if self._used[(old.node, k)] <= 0:
                    del self._used[(old.node, k)]
            touched.add(old.node)
        standing = self._waiting.pop(uid, None)
        if standing is not None:
            for k, shares in old.shares.items():
                self._count(standing, k, -shares)
            touched.add(standing)
        if pod is None or not pod.active:
            self._pods.pop(uid, None)
            return touched
        self._pods[uid] = pod
        # A pod new to the view accounts for the choice made for it, bound or not.
        entry = self._entry_for(pod) if old is None else None
        if entry is not None:
            self._drop_entry(entry)
            touched.add(entry.node)
        if pod.node:
            for k, held in pod.shares.items():
                self._used[(pod.node, k)] += held
            touched.add(pod.node)
            return touched
        standing = pod.preferred or (entry.node if entry is not None else standing)
        if standing is not None:
            self._waiting[uid] = standing
            for k, held in pod.shares.items():
                self._count(standing, k, held)
            touched.add(standing)
        return touched

    def _reduce(self, resource: str, items, into: dict) -> dict:
        """Read listed objects into what placement keeps: nodes by name, pods by uid."""
        if resource == NODES:
            for obj in items:
                node = _tolerant(read_node, obj, self._policy)
                if node is not None:
                    into[node.name] = node
        else:
            for obj in items:
                into[objects.key(obj)] = _tolerant(read_pod, obj, self._policy)
        return into

    def _apply_list(self, resource: str, fresh: dict | list) -> None:
        """Replace the listed state of ``resource`` with ``fresh``: as ``_reduce`` reads it, or the raw objects."""
        if isinstance(fresh, list):
            fresh = self._reduce(resource, fresh, {})
        with self._lock:
            touched = self._catch_up()  # a remembered choice must be in place before its pod shows
            if resource == NODES:
                touched |= set(self._base) | set(fresh)
                self._base = fresh
            else:
                for uid in [u for u in self._pods if u not in fresh]:
                    touched |= self._set_pod(uid, None)
                for uid, pod in fresh.items():
                    touched |= self._set_pod(uid, pod)
            self._listed.add(resource)
            self._refresh(touched | self._catch_up())

    def _apply_event(self, resource: str, kind: str, obj: dict) -> None:
        with self._lock:
            touched = self._catch_up()
            if resource == NODES:
                name = str((obj.get("metadata") or {}).get("name"))
                touched |= self._set_node(name, None if kind == "DELETED" else read_node(obj, self._policy))
            else:
                touched |= self._set_pod(objects.key(obj), None if kind == "DELETED" else read_pod(obj, self._policy))
            self._refresh(touched | self._catch_up())

    # --- talking to the API server --------------------------------------------------------------

    def _call(self, resource: str, **kwargs):
        if resource == NODES:
            # Only nodes the agent has published on offer cards; the rest of a large cluster
            # would cost every worker memory and watch traffic for nothing.
            return self._api.list_node(label_selector=names.CARDS_LABEL, _preload_content=False, **kwargs)
        selector = f"{names.SHARED_LABEL}={names.SHARED_LABEL_VALUE}"
        return self._api.list_pod_for_all_namespaces(label_selector=selector, _preload_content=False, **kwargs)

    def _list(self, resource: str) -> str:
        """List ``resource`` page by page and apply it; the resourceVersion to watch from."""
        for _attempt in range(LIST_RESTARTS):
            try:
                fresh, version = self._read_pages(resource)
            except _ContinueGone:
                log.info("gpushard: the %s list's continue token expired; listing again", resource)
                continue
            self._apply_list(resource, fresh)
            self.lists[resource] += 1
            self.heard_at[resource] = time.time()
            # What the list built lives until the next list: moved out of the collector's sight,
            # later full collections (set off by admissions' garbage) walk only newer objects.
            gc.freeze()
            return version
        raise RuntimeError(f"the {resource} list lost its continue token {LIST_RESTARTS} times in a row")

    def _read_pages(self, resource: str) -> tuple[dict, str]:
        """Every page of a list, each parsed and reduced to what placement reads before the next is fetched.

        The view in use stays as it is meanwhile: admissions keep choosing over the last good
        snapshot until the whole list is in.
        """
        fresh: dict = {}
        token = None
        version = ""
        while True:
            kwargs = {"limit": self._page_size, "_request_timeout": (CONNECT_TIMEOUT_S, LIST_TIMEOUT_S)}
            if token:
                kwargs["_continue"] = token
            try:
                response = self._call(resource, **kwargs)
            except kubernetes.client.ApiException as exc:
                if exc.status == 410 and token:
                    raise _ContinueGone() from exc
                raise
            with _collector_paused():
                try:
                    body = json.loads(response.data)
                finally:
                    response.release_conn()
                self._reduce(resource, body.get("items") or (), fresh)
                meta = body.get("metadata") or {}
                del body  # the page's objects go before the next page arrives
            # Every page of one list carries the resourceVersion of the list's snapshot.
            version = str(meta.get("resourceVersion") or version)
            token = meta.get("continue")
            if not token:
                return fresh, version

    def _watch(self, resource: str, version: str) -> str:
        """Apply a watch's events until it ends; the last resourceVersion seen."""
        response = self._call(resource, watch=True, resource_version=version, allow_watch_bookmarks=True,
                              timeout_seconds=self._watch_timeout,
                              _request_timeout=(CONNECT_TIMEOUT_S, self._watch_timeout + 30))
        self._responses[resource] = response
        self._streaming.add(resource)
        self.watches[resource] += 1
        try:
            for line in _lines(response, self._stop):
                self.heard_at[resource] = time.time()
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    try:
                        self._apply_event(resource, kind, obj)
                    except Exception:  # noqa: BLE001
                        # One object the view cannot read must not stop the watch: resuming from
                        # the same version would replay it for ever and freeze the view.
                        log.exception("gpushard: skipped a %s event the view could not read", resource)
        finally:
            self._streaming.discard(resource)
            self._responses.pop(resource, None)
            response.release_conn()
        return version

    def _run(self, resource: str) -> None:
        version: str | None = None
        delay = self._backoff[0]
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list(resource)
                started = time.monotonic()
                version = self._watch(resource, version)
                delay = self._backoff[0]
                if time.monotonic() - started < 1:  # a watch that ends at once: do not spin
                    self._stop.wait(self._backoff[0])
            except _Gone:
                version = None  # history expired: list again right away
            except Exception as exc:  # noqa: BLE001 - any failure: back off and start over
                if self._stop.is_set():
                    break
                self.watch_errors[resource] += 1
                status = getattr(exc, "status", None)
                if status == 410:
                    version = None
                    continue
                # What failed, in words an operator can act on (the API server's own message, or
                # what went wrong on the wire); a failure that is no API's is a bug: its traceback.
                api_side = status is not None or connecting.is_transport_failure(exc)
                log.warning("gpushard: listing or watching %s failed: %s; retrying in %.1fs (until then card "
                            "choice uses what the view last saw)", resource, connecting.failure_text(exc), delay,
                            exc_info=not api_side)
                self._stop.wait(delay)
                delay = min(delay * 2, self._backoff[1])


_collector_lock = threading.Lock()
_collector_holders = [0, False]  # threads inside _collector_paused(); whether the collector was on


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while one page is parsed and reduced.

    A page is a few hundred thousand short-lived containers, freed by reference counting the
    moment the page is done. With the collector running they outlive a few young collections,
    reach the oldest generation, and set off full collections over everything the process
    holds, each a pause of every thread of a few hundred milliseconds at 50,000 pods. Paused
    for the page (tens of milliseconds), none of them is ever promoted.
    """
    with _collector_lock:
        if _collector_holders[0] == 0:
            _collector_holders[1] = gc.isenabled()
            gc.disable()
        _collector_holders[0] += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_holders[0] -= 1
            if _collector_holders[0] == 0 and _collector_holders[1]:
                gc.enable()


def _tolerant(reader, obj: dict, policy: Policy):
    """``reader(obj, policy)``, or None (logged) for an object it cannot read: one odd object
    must not make every list fail and the view never sync."""
    try:
        return reader(obj, policy)
    except Exception:  # noqa: BLE001
        log.exception("gpushard: the view skipped an object it could not read")
        return None


def _lines(response, stop: threading.Event) -> Iterator[bytes]:
    """The newline-separated events of a watch response, each as soon as it arrives."""
    buffer = b""
    while not stop.is_set():
        chunk = response.read1(65536)
        if not chunk:
            return
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
