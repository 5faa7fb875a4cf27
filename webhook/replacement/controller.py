"""`gpushard replace`, the re-placement loop: one leader evicts pinned pods that wait on a full card
while another card has room.

The loop runs in its own Deployment, not in `gpushard serve`: the webhook stays read-only and
lean on the admission path (no eviction rights, no full pod list per worker), and a replacer
that is down only delays re-placement, never an admission. Replicas and rollouts may overlap:
a ``coordination.k8s.io/v1`` Lease elects the one that acts (``lease``). The leader lists shared nodes and
pinned pods once, then follows them by watch (``cache.Cache``, a sink of the informer the live view uses,
``cluster.informing``), so a pass reads no list: it asks ``core.replacement`` what to evict over the
cache, looks up the owners it names, evicts through the Eviction API (``policy/v1``; a 429 from
a disruption budget means skip) and records a core/v1 Event on each evicted pod that says why.
A standby holds no watch; a new leader plans only once its cache is in sync.

The same pass finds the pinned pods the kubelet refused at admission (``core.refusals``: after a node reboot,
before the agent registered its cards) in the same cache, records one Warning Event on each and, with
``replacement.cleanupRefused``, deletes those a controller makes again, through the Eviction API too (a
Failed pod is deleted at once, whatever its disruption budget). ``/metrics`` on the health port says how
many there are and whether this replica leads.
"""


from __future__ import annotations

import collections
import contextlib
import dataclasses
import http.server
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import kubernetes

from webhook import kubectlflags
from webhook import settings as settings_mod
from webhook.cluster import kube
from webhook.core import names, placement, refusals, replacement
from webhook.kubeapi import connecting
from webhook.kubeapi.lease import REQUEST_TIMEOUT_S, Elector, json_body, now_text
from webhook.replacement import metrics
from webhook.replacement.cache import Cache, assemble, read_pinned

log = logging.getLogger(__name__)

PAGE = 500  # items per list page: memory stays bounded however many pods the cluster holds
# The leader's watches end after this long and resume from their last resourceVersion; a
# connection that died silently is noticed 30 s after it (the read timeout above it).
WATCH_TIMEOUT_S = 60
DEFAULT_NAMESPACE = "gpushard-system"
# The liveness endpoint fails once the loop has not come round for this long: a pass stuck
# on a call has timed out well before (every call is bounded by --request-timeout).
STALL_S = 300.0
# Why an eviction found no pod to evict.
GONE, CHANGED = "the pod is gone", "the pod changed since it was listed"
# What grants the replacer's calls, told with a 403.
RIGHTS = ("the ServiceAccount gpushard-system/gpushard-replacer has it (deploy/base/rbac-replacer.yaml): run the "
          "replacer as that account, or bind its roles to this one")


@dataclasses.dataclass
class Outcome:
    """What one pass did."""

    plan: replacement.Plan
    evicted: list[replacement.Move] = dataclasses.field(default_factory=list)
    refused: list[tuple[replacement.Move, str]] = dataclasses.field(default_factory=list)  # (move, why)
    synced: bool = True  # False: the cache was not in sync, nothing was planned
    # The pods the kubelet refused at admission: all that the pass found, those it recorded an Event on
    # (the first pass to see each), and those it deleted (replacement.cleanupRefused).
    admission_refused: list[refusals.Refused] = dataclasses.field(default_factory=list)
    reported: list[refusals.Refused] = dataclasses.field(default_factory=list)
    cleaned: list[refusals.Refused] = dataclasses.field(default_factory=list)


class Replacer:
    """The loop; ``pass_once`` is one leader-checked pass."""

    def __init__(self, api_client, settings: settings_mod.Settings, identity: str, namespace: str, *,
                 lease_name: str = names.REPLACER_LEASE, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, dry_run: bool = False, follow: bool = True,
                 page: int = PAGE, watch_timeout: int = WATCH_TIMEOUT_S,
                 backoff: tuple[float, float] = kube.BACKOFF_S, sync_wait: float | None = None,
                 timeout: float | None = REQUEST_TIMEOUT_S, target: connecting.Target | None = None):
        self._api_client = api_client
        self._timeout = timeout
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._apps = kubernetes.client.AppsV1Api(api_client)
        self._batch = kubernetes.client.BatchV1Api(api_client)
        self._settings = settings
        self._clock = clock
        self._wall = wall
        self._dry_run = dry_run
        self.identity = identity
        # Renewed every pass: it outlives a pass or two that run long before another takes over.
        duration = max(15, 3 * settings.replacement.interval)
        self.elector = Elector(api_client, namespace, lease_name, identity, duration, clock=clock, wall=wall,
                               timeout=timeout, target=target)
        self._target = target
        self.beat = clock()  # the loop's last turn, for the liveness endpoint
        # follow: plan over a Cache fed by watches (the loop); else list nodes and pods every pass.
        self._follow = follow
        self._cache_options = {"page_size": page, "watch_timeout": watch_timeout, "backoff": backoff}
        # A new leader waits this long for its first sync within a pass: well inside the Lease it
        # has just renewed; a larger cluster syncs over several passes, renewing in between.
        self._sync_wait = duration / 3 if sync_wait is None else sync_wait
        self.cache: Cache | None = None
        self._evicted: set[str] = set()  # uids evicted that the cache may still show
        # uids of the refused pods an Event was recorded on (or, in a dry run, logged): one each, not one a pass.
        self._reported: set[str] = set()
        self._sync_waited = 0.0
        self.metrics = metrics.Metrics()

    # --- reading the cluster -------------------------------------------------------------------

    def _pages(self, call: Callable, **kwargs):
        token = None
        while True:
            page = json_body(call(limit=self._cache_options["page_size"], _continue=token, _preload_content=False,
                              _request_timeout=self._timeout, **kwargs))
            yield from page.get("items") or ()
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def read(self) -> tuple[placement.View, list[replacement.Waiting]]:
        """The cards' usage by bound pods, and the pinned pods no node has taken yet."""
        view, waiting, _ending, _refused = self.read_all()
        return view, waiting

    def read_all(self) -> tuple[placement.View, list[replacement.Waiting], collections.Counter,
                                list[refusals.Refused]]:
        """As ``read``, the shares that terminating bound pods still hold, by (node, card), and the pinned pods
        the kubelet refused at admission."""
        policy = self._settings.policy
        # Only nodes the agent published cards on, as the webhook's view lists them.
        with self._reaching("list nodes"):
            nodes = [n for n in (kube.read_node(obj, policy)
                                 for obj in self._pages(self._core.list_node, label_selector=names.CARDS_LABEL)) if n]
        now = self._wall()
        selector = f"{names.SHARED_LABEL}={names.SHARED_LABEL_VALUE}"
        pinned, refused = [], []
        with self._reaching("list pods"):
            for obj in self._pages(self._core.list_pod_for_all_namespaces, label_selector=selector):
                pod = read_pinned(obj, policy)
                if pod is not None:
                    pinned.append(pod)
                elif (refusal := refusals.read(obj, policy)) is not None:
                    refused.append(refusal)
        view, waiting, ending = assemble(nodes, pinned, now)
        return view, waiting, ending, sorted(refused, key=lambda r: (r.node, r.namespace, r.name))

    def _reaching(self, what: str):
        if self._target is None:
            return contextlib.nullcontext()
        return connecting.reaching(self._target, what)

    def use(self, settings: settings_mod.Settings) -> None:
        """Settings read again (the config changed): the next pass plans with them."""
        if settings.policy != self._settings.policy:
            self.stand_by()  # the cache read pods with the old policy: list them again
        self._settings = settings
        self.elector.duration = max(15, 3 * settings.replacement.interval)

    def owner(self, pod: replacement.Waiting) -> replacement.Owner:
        """The pod's controller as the API shows it now."""
        assert pod.owner_kind is not None  # asked only of pods whose controller recreates them
        reads = {replacement.REPLICA_SET: self._apps.read_namespaced_replica_set,
                 replacement.STATEFUL_SET: self._apps.read_namespaced_stateful_set,
                 replacement.JOB: self._batch.read_namespaced_job}
        try:
            obj = json_body(reads[pod.owner_kind](pod.owner_name, pod.namespace, _preload_content=False,
                                              _request_timeout=self._timeout))
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return replacement.Owner(pod.owner_kind, pod.owner_name, found=False)
            raise
        meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        finished = bool(spec.get("suspend")) or any(
            isinstance(c, dict) and c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in status.get("conditions") or ())
        return replacement.Owner(pod.owner_kind, pod.owner_name, deleting=bool(meta.get("deletionTimestamp")),
                                 ignores_disruption=replacement.job_ignores_disruption(spec), finished=finished)

    # --- one pass --------------------------------------------------------------------------------

    def follow(self) -> Cache:
        """The cache, started (list, then watch) if this process has none."""
        if self.cache is None:
            self._evicted.clear()
            self.cache = Cache.start(self._settings, api_client=self._api_client, **self._cache_options)
        return self.cache

    def stand_by(self) -> None:
        """Stop following the cluster (a standby or a stopping replacer puts no load on the API server)."""
        cache, self.cache = self.cache, None
        if cache is not None:
            cache.close()

    def _read_cache(self) -> tuple[placement.View, list[replacement.Waiting], collections.Counter,
                                   list[refusals.Refused]] | None:
        """The cache's state as a pass plans over it; None while it is not current."""
        cache = self.follow()
        began = self._clock()
        in_sync = cache.wait_current(self._sync_wait)
        self._sync_waited = self._clock() - began
        if not in_sync:
            log.info("gpushard: the replacer's cache of nodes and pods is not in sync (listing, or a watch is "
                     "down); no re-placement until it is")
            return None
        nodes, pinned, uids = cache.contents()
        # An evicted pod stays in the cache until its deletion arrives by watch: not moved twice.
        self._evicted &= uids
        view, waiting, ending = assemble(nodes, pinned, self._wall())
        if self._evicted:
            waiting = [w for w in waiting if w.uid not in self._evicted]
        return view, waiting, ending, cache.refused()

    def pass_once(self) -> Outcome | None:
        """One pass if this process leads (None if another does, and this one then holds no watch)."""
        self._sync_waited = 0.0
        leads = self.elector.lead()
        self.metrics.lead(leads)
        if not leads:
            self.stand_by()
            return None
        if self._follow:
            read = self._read_cache()
            if read is None:
                return Outcome(replacement.Plan(), synced=False)
            view, waiting, ending, refused = read
        else:
            view, waiting, ending, refused = self.read_all()
        pending = self._settings.replacement.pending_seconds
        required = self._settings.policy.node_affinity == "required"
        plan = replacement.plan(view, waiting, pending, ending=ending, required_node=required)
        owners: dict[str, replacement.Owner | None] = {}
        while plan.unjudged:
            owners.update({pod.uid: self.owner(pod) for pod in plan.unjudged})
            plan = replacement.plan(view, waiting, pending, owners, ending, required_node=required)
        outcome = Outcome(plan)
        for stuck in plan.stuck:
            log.warning("gpushard: pod %s/%s waits on full card %d while card %d of %s has room: %s",
                        stuck.pod.namespace, stuck.pod.name, stuck.pod.card, stuck.to_card, stuck.to_node, stuck.why)
        for move in plan.moves:
            if self._dry_run:
                log.info("gpushard: would evict %s/%s: %s", move.pod.namespace, move.pod.name,
                         replacement.event_message(move))
                continue
            why = self._evict(move)
            if why is None:
                self._evicted.add(move.pod.uid)
                outcome.evicted.append(move)
                self._record(move)
            else:
                outcome.refused.append((move, why))
        self._tend_refused(refused, outcome)
        return outcome

    # --- pods the kubelet refused at admission ---------------------------------------------------

    def _tend_refused(self, refused: list[refusals.Refused], outcome: Outcome) -> None:
        """One Event on each refused pod; with cleanupRefused, those a controller makes again deleted instead.

        A bare pod is never deleted: nothing would make it again, and its Failed object is what is
        left of its spec for the operator to read.
        """
        outcome.admission_refused = list(refused)
        self._reported &= {pod.uid for pod in refused}
        cleanup = self._settings.replacement.cleanup_refused
        left = []
        for pod in refused:
            if cleanup and pod.controller is not None:
                if self._dry_run:
                    if pod.uid not in self._reported:
                        self._reported.add(pod.uid)
                        log.info("gpushard: would delete %s/%s: %s", pod.namespace, pod.name,
                                 refusals.event_message(pod, deleted=True).removeprefix("gpushard: "))
                    left.append(pod)
                    continue
                why = self._delete_refused(pod)
                if why is None:
                    outcome.cleaned.append(pod)
                    self.metrics.cleaned()
                    self._report(pod, deleted=True)
                    continue
                if why in (GONE, CHANGED):
                    continue  # its controller deleted it first (a StatefulSet's, a DaemonSet's)
            left.append(pod)
            if pod.uid in self._reported:
                continue
            if self._dry_run:
                self._reported.add(pod.uid)
                log.info("gpushard: would record an Event on %s/%s: %s", pod.namespace, pod.name,
                         refusals.event_message(pod).removeprefix("gpushard: "))
                continue
            if self._report(pod):
                outcome.reported.append(pod)
        self.metrics.saw_refused(left)

    def _delete_refused(self, pod: refusals.Refused) -> str | None:
        """None once deleted; else why the API refused (the pod is reported instead, or is gone)."""
        try:
            self._post_eviction(pod.namespace, pod.name, {"uid": pod.uid})
        except kubernetes.client.ApiException as exc:
            reason = {404: GONE, 409: CHANGED}.get(exc.status, f"HTTP {exc.status}")
            log.info("gpushard: did not delete %s/%s, refused at admission: %s", pod.namespace, pod.name, reason)
            return reason
        log.info("gpushard: deleted %s/%s: %s", pod.namespace, pod.name,
                 refusals.event_message(pod, deleted=True).removeprefix("gpushard: "))
        return None

    def _report(self, pod: refusals.Refused, deleted: bool = False) -> bool:
        """Record the Event on a refused pod; False where another leader had (409) or the API refused.

        The Event's name is made of the pod's name and uid, so that a replica that takes over and sees the
        same pod gets 409 and records no second one.
        """
        tail = f".{pod.uid}.{'deleted' if deleted else 'refused'}"
        name = pod.name[:253 - len(tail)].rstrip(".-") + tail
        message = refusals.event_message(pod, deleted)
        # Any: a manifest, which the client takes for a CoreV1Event.
        body: Any = self._event(pod.namespace, pod.name, pod.uid, name, reason=names.REFUSED_AT_ADMISSION_REASON,
                                message=message, event_type="Warning", action="Delete" if deleted else "Report")
        try:
            json_body(self._core.create_namespaced_event(pod.namespace, body, _preload_content=False,
                                                     _request_timeout=self._timeout))
        except kubernetes.client.ApiException as exc:
            if exc.status == 409:
                self._reported.add(pod.uid)  # recorded before, by this leader's predecessor
                return False
            log.warning("gpushard: could not record the Event on %s/%s, refused at admission (%s); trying again "
                        "next pass", pod.namespace, pod.name, exc.status)
            return False
        self._reported.add(pod.uid)
        if not deleted:
            log.info("gpushard: recorded an Event on %s/%s: %s", pod.namespace, pod.name,
                     message.removeprefix("gpushard: "))
        return True

    def _post_eviction(self, namespace: str, name: str, preconditions: dict) -> None:
        """Evict one pod through the Eviction API; raises the API's refusal."""
        # Any: a manifest, which the client takes for a V1Eviction.
        body: Any = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
                     "deleteOptions": {"preconditions": preconditions}}
        json_body(self._core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False,
                                                        _request_timeout=self._timeout))

    def _evict(self, move: replacement.Move) -> str | None:
        """None once evicted; else why the API refused (the pod is skipped this pass)."""
        pod = move.pod
        preconditions = {"uid": pod.uid}
        if pod.version:
            preconditions["resourceVersion"] = pod.version  # bound or changed since listed: refused
        try:
            self._post_eviction(pod.namespace, pod.name, preconditions)
        except kubernetes.client.ApiException as exc:
            reason = {429: "a disruption budget allows no eviction now", 404: GONE,
                      409: CHANGED}.get(exc.status, f"HTTP {exc.status}")
            log.info("gpushard: did not evict %s/%s: %s", pod.namespace, pod.name, reason)
            return reason
        log.info("gpushard: evicted %s/%s: %s", pod.namespace, pod.name, replacement.event_message(move))
        return None

    def _event(self, namespace: str, pod: str, uid: str, name: str, *, reason: str, message: str,
               event_type: str, action: str) -> dict:
        """A core/v1 Event on a pod, as the replacer records it (the API server keeps at most 1 kB of message)."""
        stamp = now_text(self._wall)[:19] + "Z"
        return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": namespace},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": namespace, "uid": uid},
                "reason": reason, "message": message[:1024], "type": event_type, "action": action, "count": 1,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "source": {"component": names.REPLACER_COMPONENT},
                "reportingComponent": names.REPLACER_COMPONENT, "reportingInstance": self.identity}

    def _record(self, move: replacement.Move) -> None:
        pod = move.pod
        # Any: a manifest, which the client takes for a CoreV1Event.
        body: Any = self._event(pod.namespace, pod.name, pod.uid, f"{pod.name}.{uuid.uuid4().hex[:16]}",
                                reason=names.REPLACED_REASON, message=replacement.event_message(move),
                                event_type="Normal", action="Evict")
        try:
            json_body(self._core.create_namespaced_event(pod.namespace, body, _preload_content=False,
                                                     _request_timeout=self._timeout))
        except kubernetes.client.ApiException as exc:
            log.warning("gpushard: evicted %s/%s but could not record its Event (%s)", pod.namespace, pod.name,
                        exc.status)

    def since_beat(self) -> float:
        """Seconds since the loop last came round (on this replacer's clock)."""
        return self._clock() - self.beat

    def _still_leads(self) -> None:
        """Renew the Lease between passes; a leader that cannot stops its watches at once."""
        try:
            leads = self.elector.lead()
        except Exception as exc:  # noqa: BLE001 - the loop must go on; the next pass tries again
            log.warning("gpushard: cannot renew Lease %s/%s: %s; standing by until it can", self.elector.namespace,
                        self.elector.name, connecting.failure_text(exc))
            leads = False
        self.metrics.lead(leads)
        if not leads:
            self.stand_by()

    def run(self, stop: threading.Event, reload: Callable[[], settings_mod.Settings | None] | None = None) -> None:
        """Pass after pass until ``stop`` is set, ``interval`` apart or farther (see ``pause``).

        ``reload`` (before each pass) gives settings read again from a changed config, or None.
        With ``replacement.enabled: false`` the loop keeps turning and evicts nothing.
        """
        while not stop.is_set():
            self.beat = self._clock()
            fresh = reload() if reload is not None else None
            if fresh is not None:
                self.use(fresh)
            began = self._clock()
            if not self._settings.replacement.enabled:
                self.stand_by()
                self.elector.release()
                self.metrics.lead(False)
            else:
                try:
                    self.pass_once()
                except Exception as exc:  # noqa: BLE001 - one failed pass must not end the loop
                    if isinstance(exc, (connecting.ApiError, kubernetes.client.ApiException)) or \
                            connecting.is_transport_failure(exc):
                        log.warning("gpushard: a re-placement pass failed: %s; trying again next interval",
                                    connecting.failure_text(exc))
                    else:
                        log.exception("gpushard: a re-placement pass failed; trying again next interval")
            took = self._clock() - began - self._sync_waited  # waiting for a sync is no load
            wait = pause(self._settings.replacement.interval, took)
            # A long wait renews the Lease on the way, so that the leader stays the leader; one
            # that lost it stops its watches at once.
            until = self._clock() + wait
            while not stop.wait(max(0.0, min(until - self._clock(), self.elector.duration / 3))):
                self.beat = self._clock()
                if self._clock() >= until:
                    break
                if self._settings.replacement.enabled:
                    self._still_leads()
        self.stand_by()
        self.elector.release()
        self.metrics.lead(False)


BUSY_SHARE = 0.2  # at most this share of the time spent in passes, however large the cluster


def pause(interval: float, took: float) -> float:
    """How long to wait before the next pass: ``interval``, or longer where a pass is slow.

    A pass over the cache reads no list, but it plans over every pinned pod and then reads owners
    and evicts through the API; where that takes long (a very large cluster, or passes that list:
    ``follow=False``), a short interval would keep the replacer and the API server busy all the
    time: the wait grows so that passes take at most BUSY_SHARE of the time. Waiting for the
    cache's first sync does not count.
    """
    return max(interval, took * (1 - BUSY_SHARE) / BUSY_SHARE)


def api_client(kubeconfig: str | None = None, context: str | None = None, timeout: float | None = None):
    """A client from the one kubeconfig loader (webhook.kubeapi.connecting, kubectl's order); in a pod, with no
    kubeconfig around, the in-cluster service account."""
    return connecting.client(kubeconfig, context, timeout).api


class Reloader:
    """The config file read again when it changes (a ConfigMap update swaps its symlink), before each pass.

    A changed file that does not validate is logged and the settings in use are kept.
    """

    def __init__(self, path: str | None):
        self._path = path
        self._seen = self._stamp()

    def _stamp(self) -> tuple | None:
        if self._path is None:
            return None
        try:
            found = os.stat(self._path)
        except OSError:
            return None
        return found.st_ino, found.st_mtime_ns, found.st_size

    def __call__(self) -> settings_mod.Settings | None:
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:
            fresh = settings_mod.load(self._path)
        except settings_mod.SettingsError as exc:
            log.error("gpushard: the changed config is not used, the one read before is: %s", exc)
            return None
        log.info("gpushard: config %s read again (re-placement %s)", self._path,
                 "on" if fresh.replacement.enabled else "off")
        return fresh


def serve_health(port: int, replacer: Replacer, stall_s: float = STALL_S) -> http.server.ThreadingHTTPServer:
    """``GET /healthz`` on ``port``: 200 while the loop comes round, 503 once it has stalled for ``stall_s``;
    and ``GET /metrics``, the replacer's Prometheus metrics (``replacement.metrics``).

    The Deployment's liveness probe reads /healthz, so a loop stuck for good is restarted.
    """
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the name http.server calls
            path = self.path.split("?")[0]
            if path == "/metrics":
                return self._answer(200, metrics.text(replacer.metrics), metrics.CONTENT_TYPE)
            since = replacer.since_beat()
            ok = path in ("/healthz", "/livez") and since < stall_s
            body = (f"ok: the loop came round {since:.0f}s ago\n" if ok else
                    f"stalled: the loop last came round {since:.0f}s ago (limit {stall_s:.0f}s)\n").encode()
            self._answer(200 if ok else (404 if path not in ("/healthz", "/livez") else 503), body, "text/plain")

        def _answer(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes every few seconds: not worth a log line each
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server


def _once(replacer: Replacer, client: connecting.Client, namespace: str) -> int:
    """One pass with --once: its outcome on stdout, or one gpushard: line and exit 3 (or 2)."""
    try:
        outcome = replacer.pass_once()
    except connecting.ApiError as exc:
        print(exc, file=sys.stderr)
        return kubectlflags.UNREACHABLE
    except kubernetes.client.ApiException as exc:
        print(connecting.answered(client.target.where, "serve the re-placement pass, which stopped there", exc),
              file=sys.stderr)
        return kubectlflags.UNREACHABLE
    except Exception as exc:  # noqa: BLE001 - an error nobody foresaw: one line, still not a traceback
        print(f"gpushard: the re-placement pass stopped by an unexpected error: {connecting.failure_text(exc)}; "
              "run it again, and if it fails again read the replacer's log", file=sys.stderr)
        return kubectlflags.USAGE
    if outcome is None:
        print(f"gpushard: another replacer holds Lease {namespace}/{names.REPLACER_LEASE}; nothing done")
        return 0
    print(f"gpushard: evicted {len(outcome.evicted)}, refused {len(outcome.refused)}, "
          f"not re-placed {len(outcome.plan.stuck)}, waiting for room {outcome.plan.waiting_for_room}; "
          f"refused at admission by the kubelet {len(outcome.admission_refused)} (Events recorded "
          f"{len(outcome.reported)}, deleted {len(outcome.cleaned)})")
    return 0


def run(args, settings: settings_mod.Settings) -> int:
    """`gpushard replace`: the loop, or one pass with --once."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    if not settings.replacement.enabled:
        # Off: never evict. The loop keeps running (idle, reading the config when it changes), so
        # that switching it on again needs no manifest change and no restart.
        print(f"gpushard: re-placement is off (replacement.enabled: false in {settings.source})")
        if args.once:
            return 0
    try:
        timeout = connecting.parse_timeout(getattr(args, "request_timeout", None), default=None)
        client = connecting.client(args.kubeconfig, args.context, timeout)
    except connecting.ConfigError as exc:
        print(exc, file=sys.stderr)
        return kubectlflags.USAGE
    client.target.rights = RIGHTS
    namespace = args.namespace or os.environ.get(names.POD_NAMESPACE_ENV) or DEFAULT_NAMESPACE
    identity = args.identity or os.environ.get(names.POD_NAME_ENV) or f"{socket.gethostname()}-{os.getpid()}"
    # One pass lists; the loop lists once and then follows by watch.
    replacer = Replacer(client.api, settings, identity, namespace, dry_run=args.dry_run, follow=not args.once,
                        timeout=timeout, target=client.target)
    if args.once:
        return _once(replacer, client, namespace)
    health = None
    port = getattr(args, "health_port", 0) or 0
    if port:
        try:
            health = serve_health(port, replacer, getattr(args, "stall_seconds", None) or STALL_S)
        except OSError as exc:
            print(f"gpushard: --health-port {port}: cannot listen: {exc.strerror}; pick a free port", file=sys.stderr)
            return kubectlflags.USAGE
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        replacer.run(stop, Reloader(args.config))
    finally:
        if health is not None:
            health.shutdown()
    return 0
