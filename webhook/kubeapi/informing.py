"""One informer: list a resource in pages, watch it from the list's resourceVersion, list again on
410 Gone, and reconnect with backoff when the API fails or drops the connection.

It only watches; what the objects mean is a sink's business, as in kopf, where watching and
handling are separate. A sink reduces a listed page to what it keeps, takes a whole list in
place of what it held, takes one watch event at a time, and hears when a watch opens and
closes (a closed watch that failed is a gap: events may be missing until the next watch
resumes, or the next list replaces everything). The live view (``kube.KubeView``) and the
re-placement cache (``replacement.cache.Cache``) are two such sinks, each composed with one
informer following shared nodes and gpushard pods.

A daemon thread per resource runs the loop. Lists come in pages, each parsed and reduced
before the next is fetched, with the cyclic garbage collector held off while a page is parsed.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import gc
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import kubernetes

from webhook.core import names, scanning
from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

# Server-side watch length; the API server ends watches itself too, and we resume from the last
# resourceVersion. The read timeout above it catches connections that died silently.
WATCH_TIMEOUT_S = 300
LIST_TIMEOUT_S = 120
# Lists come in pages: each is read and parsed on its own, and only the fields a sink needs are
# kept, so neither memory nor the interpreter lock held by one json.loads grows with the
# cluster. 500 realistic pods are a few MiB of JSON, parsed in tens of milliseconds.
LIST_PAGE = 500
# A continue token the API server no longer honours (410 Gone) restarts the list; a list that
# keeps losing its token (history compacted faster than we read) is an error that backs off.
LIST_RESTARTS = 3
CONNECT_TIMEOUT_S = 10
BACKOFF_S = (0.5, 30.0)
NODES, PODS = "nodes", "pods"
# resource.k8s.io/v1 (Kubernetes 1.34+): gpushard's ResourceSlices and every ResourceClaim (backend
# dra), and the DeviceClasses (any backend: a class may serve an extended resource, 1.36+).
SLICES, CLAIMS, DEVICECLASSES = "resourceslices", "resourceclaims", "deviceclasses"
OPTIONAL = frozenset({SLICES, CLAIMS, DEVICECLASSES})


class Sink(Protocol):
    """What an informer feeds. Called from the informer's threads, one per resource."""

    def reduce(self, resource: str, items, into: dict) -> dict:
        """Read one page of listed objects into ``into`` (what the sink keeps, by key); return it."""

    def apply_list(self, resource: str, fresh: dict) -> None:
        """Replace everything held of ``resource`` with a whole list, as ``reduce`` read it."""

    def apply_event(self, resource: str, kind: str, obj: dict) -> None:
        """One watch event: ADDED, MODIFIED or DELETED, with the object."""

    def watch_opened(self, resource: str) -> None:
        """A watch is open from the last resourceVersion: it replays whatever a gap missed."""

    def watch_closed(self, resource: str, gap: bool) -> None:
        """The watch ended; ``gap``: it failed (or history expired), so events may be missing
        until the next watch opens, or the next list replaces everything."""


_Kept = TypeVar("_Kept")


class ByName(abc.ABC, Generic[_Kept]):
    """A sink that keeps each object it hears of, as ``read`` reduces it, under the object's name, and calls
    ``rebuild`` (with its lock held) after every change; ``listed`` once the first list is in. An object
    ``read`` gives None for is not kept (or no longer). Subclasses say what to keep and what it makes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, _Kept] = {}
        self.listed = False

    @abc.abstractmethod
    def read(self, obj: dict) -> _Kept | None:
        """What to keep of one object; None: nothing."""

    @abc.abstractmethod
    def rebuild(self) -> None:
        """Make what the sink offers from ``self._by_name`` (called with the lock held)."""

    def reduce(self, resource: str, items, into: dict) -> dict:
        for obj in items:
            name, read = _name(obj), self.read(obj)
            if name and read is not None:
                into[name] = read
        return into

    def apply_list(self, resource: str, fresh: dict) -> None:
        with self._lock:
            self._by_name = dict(fresh)
            self.listed = True
            self.rebuild()

    def apply_event(self, resource: str, kind: str, obj: dict) -> None:
        name = _name(obj)
        if not name:
            return
        read = None if kind == "DELETED" else self.read(obj)
        with self._lock:
            if read is None:
                if self._by_name.pop(name, None) is None:
                    return
            else:
                self._by_name[name] = read
            self.rebuild()

    def watch_opened(self, resource: str) -> None:
        """Nothing to do: a by-name sink takes every object afresh, and a list replaces all it held."""
        return None

    def watch_closed(self, resource: str, gap: bool) -> None:
        """Nothing to do: after a gap the next watch replays what was missed (or, on 410, a list replaces it)."""
        return None


def _name(obj: object) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else ""


class _Gone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class _ContinueGone(Exception):
    """A list's continue token expired between two pages (410 Gone): start the list over."""


class Informer:
    """Lists then watches ``resources``, each by its call in ``calls`` (or, for resource.k8s.io's, the generic
    custom-object call), feeding one sink."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None, sink: Sink, *,
                 watch_timeout: int = WATCH_TIMEOUT_S, backoff: tuple[float, float] = BACKOFF_S,
                 page_size: int = LIST_PAGE, resources: tuple[str, ...] = (NODES, PODS),
                 connect_timeout: float = CONNECT_TIMEOUT_S, list_timeout: float = LIST_TIMEOUT_S,
                 calls: Mapping[str, Callable[..., object]] | None = None,
                 after_list: Callable[[], None] | None = None,
                 meanwhile: str = "card choice uses what the view last saw",
                 stop: threading.Event | None = None):
        self._client = api_client
        self.custom = kubernetes.client.CustomObjectsApi(api_client) if api_client is not None else None
        # A resource's own list method of the client (its typed API's list_<kind>, with the reader's selectors),
        # in place of the generic call below; it lists and, with watch=True, watches, as any list method does.
        self._calls = dict(calls or {})
        self._sink = sink
        # Called after each complete list has reached the sink: the process's own business (the webhook's
        # workers move what the list built out of the garbage collector's sight with gc.freeze).
        self._after_list = after_list
        self.watch_timeout = watch_timeout
        self.connect_timeout = connect_timeout
        self.list_timeout = list_timeout
        self._backoff = backoff
        self._page_size = page_size
        self._resources = resources
        # What the reader does while the API fails, for the log; the event that ends the loops (``close`` sets it).
        self._meanwhile = meanwhile
        self._stop = stop if stop is not None else threading.Event()
        self.threads: list[threading.Thread] = []
        self._responses: dict[str, Any] = {}  # open watch responses (raw HTTP), to cut on close()
        # For the webhook's metrics, by resource: lists and watches made, watches that failed, and
        # the wall-clock time the API server last said anything (a list, an event, a bookmark).
        self.lists: collections.Counter = collections.Counter()
        self.watches: collections.Counter = collections.Counter()
        self.watch_errors: collections.Counter = collections.Counter()
        # Objects skipped because they could not be parsed (nested deeper than Python's parser goes).
        self.unreadable: collections.Counter = collections.Counter()
        self.heard_at: dict[str, float] = {}
        self.absent: set[str] = set()  # optional resources the API server answered 404 for

    def start(self) -> None:
        """One daemon thread per resource; none without an API client."""
        if self._client is None:
            return
        for resource in self._resources:
            thread = threading.Thread(target=self.run, args=(resource,), daemon=True,
                                      name=f"gpushard-watch-{resource}")
            self.threads.append(thread)
            thread.start()

    def close(self) -> None:
        """Stop the threads."""
        self._stop.set()
        for response in list(self._responses.values()):
            try:
                response.shutdown()  # wakes a thread blocked reading the stream
            except Exception:  # already closed or never connected: nothing to wake
                pass
        for thread in self.threads:
            thread.join(timeout=5)

    # --- talking to the API server --------------------------------------------------------------

    def _call(self, resource: str, **kwargs):
        call = self._calls.get(resource)
        if call is not None:
            return call(_preload_content=False, **kwargs)
        group, version = names.DRA_API_VERSION.split("/")
        if resource == SLICES:
            # Only gpushard's driver: other drivers' slices say nothing about gpushard's cards.
            kwargs["field_selector"] = f"spec.driver={names.DRA_DRIVER}"
        # Claims cannot be selected by driver: every one is read, and the sink keeps only gpushard's.
        assert self.custom is not None  # without an API client, every resource comes with its call
        return self.custom.list_cluster_custom_object(group, version, resource, _preload_content=False, **kwargs)

    def _list(self, resource: str) -> str:
        """List ``resource`` page by page and hand it to the sink; the resourceVersion to watch from."""
        for _attempt in range(LIST_RESTARTS):
            try:
                fresh, version = self._read_pages(resource)
            except _ContinueGone:
                log.info("gpushard: the %s list's continue token expired; listing again", resource)
                continue
            self._sink.apply_list(resource, fresh)
            self.absent.discard(resource)
            self.lists[resource] += 1
            self.heard_at[resource] = time.time()
            if self._after_list is not None:
                self._after_list()
            return version
        raise RuntimeError(f"the {resource} list lost its continue token {LIST_RESTARTS} times in a row")

    def _read_pages(self, resource: str) -> tuple[dict, str]:
        """Every page of a list, each parsed and reduced by the sink before the next is fetched.

        The sink keeps what it held meanwhile (the live view's admissions keep choosing over
        the last good snapshot) until the whole list is in.
        """
        fresh: dict = {}
        token = None
        version = ""
        while True:
            kwargs = {"limit": self._page_size, "_request_timeout": (self.connect_timeout, self.list_timeout)}
            if token:
                kwargs["_continue"] = token
            try:
                response = self._call(resource, **kwargs)
            except kubernetes.client.ApiException as exc:
                if exc.status == 410 and token:
                    raise _ContinueGone() from exc
                raise
            with collector_paused():
                try:
                    body = self._page(resource, response.data)
                finally:
                    response.release_conn()
                self._sink.reduce(resource, body.get("items") or (), fresh)
                meta = body.get("metadata") or {}
                del body  # the page's objects go before the next page arrives
            # Every page of one list carries the resourceVersion of the list's snapshot.
            version = str(meta.get("resourceVersion") or version)
            token = meta.get("continue")
            if not token:
                return fresh, version

    def _page(self, resource: str, data: bytes) -> dict:
        """A listed page as JSON; one the parser gives up on is cut into its items, each parsed on its own,
        and the items that still cannot be are skipped (logged and counted), so that one object of a
        tenant's, nested deeper than the parser goes, cannot keep the list from ever completing."""
        try:
            return json.loads(data)
        except (RecursionError, ValueError):
            pass
        try:
            metadata, items = scanning.list_items(data)
            body = {"metadata": json.loads(metadata), "items": []}
        except (scanning.Unreadable, RecursionError, ValueError) as exc:
            raise ValueError(f"the API server's {resource} list is not JSON: {exc}") from None
        for index, item in enumerate(items):
            try:
                body["items"].append(json.loads(item))
            except (RecursionError, ValueError):
                self._skipped(resource, f"item {index} of a listed page", item)
        return body

    def _skipped(self, resource: str, where: str, data: bytes) -> None:
        self.unreadable[resource] += 1
        log.warning("gpushard: skipped a %s object that cannot be parsed (%s, %d bytes, nested too deeply or not "
                    "JSON); it is left out of the view", resource, where, len(data))

    def _watch(self, resource: str, version: str) -> str:
        """Hand a watch's events to the sink until it ends; the last resourceVersion seen."""
        try:
            response = self._call(resource, watch=True, resource_version=version, allow_watch_bookmarks=True,
                                  timeout_seconds=self.watch_timeout,
                                  _request_timeout=(self.connect_timeout, self.watch_timeout + 30))
            self._sink.watch_opened(resource)
            self._responses[resource] = response
            self.watches[resource] += 1
            try:
                version = self._stream(resource, response, version)
            finally:
                self._responses.pop(resource, None)
                connecting.finish_watch(response)
        except BaseException:
            self._sink.watch_closed(resource, True)
            raise
        self._sink.watch_closed(resource, False)
        return version

    def _stream(self, resource: str, response, version: str) -> str:
        for line in connecting.watch_lines(response, self._stop):
            self.heard_at[resource] = time.time()
            try:
                event = json.loads(line)
            except (RecursionError, ValueError):
                # The event of one object too deep to parse: skipped, the watch goes on from the next.
                self._skipped(resource, "a watch event", line)
                continue
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _Gone(obj.get("message", ""))
                raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                try:
                    self._sink.apply_event(resource, kind, obj)
                except Exception:  # noqa: BLE001
                    # One object the sink cannot read must not stop the watch: resuming from
                    # the same version would replay it for ever and freeze the sink.
                    log.exception("gpushard: skipped a %s event the view could not read", resource)
        return version

    def run(self, resource: str) -> None:
        """List, then watch, until ``close``: the loop of one resource's thread."""
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
            except _Gone as gone:
                # History expired (etcd compacted past the watch, or a restarted API server's watch cache starts
                # later): list again right away, and say so, since the view is rebuilt from the list.
                log.info("gpushard: the %s watch's history expired (%s); listing again", resource, gone)
                version = None
            except Exception as exc:  # noqa: BLE001 - any failure: back off and start over
                if self._stop.is_set():
                    break
                self.watch_errors[resource] += 1
                status = getattr(exc, "status", None)
                if status == 410:
                    log.info("gpushard: the %s watch's history expired (HTTP 410); listing again", resource)
                    version = None
                    continue
                if status == 404 and resource in OPTIONAL:
                    # A cluster that does not serve resource.k8s.io/v1 (before 1.34) has none of them:
                    # the sink holds an empty list, and the API is asked again now and then (an
                    # upgrade serves it later).
                    if version is None and resource not in self.absent:
                        log.info("gpushard: the API server serves no %s %s; none are counted",
                                 names.DRA_API_VERSION, resource)
                        self._sink.apply_list(resource, {})
                    self.absent.add(resource)
                    version = None
                    self._stop.wait(self._backoff[1])
                    continue
                # What failed, in words an operator can act on (the API server's own message, or
                # what went wrong on the wire); a failure that is no API's is a bug: its traceback.
                api_side = status is not None or connecting.is_transport_failure(exc)
                log.warning("gpushard: listing or watching %s failed: %s; retrying in %.1fs (until then %s)",
                            resource, connecting.failure_text(exc), delay, self._meanwhile, exc_info=not api_side)
                self._stop.wait(delay)
                delay = min(delay * 2, self._backoff[1])


_collector_lock = threading.Lock()
_collector_holders = [0, False]  # threads inside collector_paused(); whether the collector was on


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
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
