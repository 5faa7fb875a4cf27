"""A real local HTTP server that speaks enough of the Kubernetes API JSON for gpushard's tests.

We fake the API server on the wire, never by patching the client library: the code under
test talks HTTP to this server through the real kubernetes client.

It keeps namespaces, nodes, pods and the pod-template workloads (core, apps/v1 and batch/v1)
in memory, with admission policies, their bindings and ConfigMaps, answers list (with labelSelector and
fieldSelector on metadata.name, and pages with limit/continue), get, merge and JSON patch of nodes, GETs through
the pod proxy, and watch streams with resourceVersions (an object that stops matching a watch's label selector is
sent as DELETED, as the API server does); it can expire history (watches from older versions,
and continue tokens issued before, get 410 Gone) and drop every open watch connection; with
``tokens`` set it authenticates bearer tokens (401) and lets each read only its namespaces (403),
as RBAC would, less the resources and subresources ``refused`` names for it; ``unserved`` API groups
answer 404, as on an older API server. It answers TokenReviews (``users``: token -> user and groups),
SelfSubjectReviews (``whoami``) and
SubjectAccessReviews (``grants``: who may do what, by user or ``group:<name>``), and port-forwards
to a pod (``forwards``: to a real local TCP address) over the WebSocket protocol the API server
speaks (``v4.channel.k8s.io``: per port a data and an error channel, each opened by a frame
naming the port). For the replacer it also stores Leases and Events (create, replace with a
resourceVersion check), and answers pod evictions as the API server does: preconditions,
PodDisruptionBudgets checked only for pods that are not Pending or ended (429 when one allows no
disruption), the DisruptionTarget condition set, then the pod deleted. For the DRA backend it stores
resource.k8s.io/v1 ResourceSlices, DeviceClasses and ResourceClaimTemplates (create, replace) and
ResourceClaims (tests put them allocated, as the scheduler writes them). ``SilentServer`` accepts
connections and never answers, as a hung API server or a dead proxy does.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import jsonpatch
import jsonpointer
import kubernetes

KINDS = {"nodes": "Node", "pods": "Pod", "namespaces": "Namespace",
         "replicationcontrollers": "ReplicationController", "podtemplates": "PodTemplate",
         "deployments": "Deployment", "statefulsets": "StatefulSet", "daemonsets": "DaemonSet",
         "replicasets": "ReplicaSet", "jobs": "Job", "cronjobs": "CronJob"}
# The API group of each resource outside the core group ("v1").
GROUPS = {"deployments": "apps/v1", "statefulsets": "apps/v1", "daemonsets": "apps/v1",
          "replicasets": "apps/v1", "jobs": "batch/v1", "cronjobs": "batch/v1"}
CLUSTER_SCOPED = ("nodes", "namespaces")
# What `gpushard certs --install` writes: the webhook's TLS Secret and the webhook
# configuration's caBundle. These kinds also take create (POST), replace (PUT, with a
# resourceVersion check) and JSON patch (RFC 6902, with "test" operations).
KINDS.update({"secrets": "Secret", "mutatingwebhookconfigurations": "MutatingWebhookConfiguration"})
GROUPS["mutatingwebhookconfigurations"] = "admissionregistration.k8s.io/v1"
CLUSTER_SCOPED += ("mutatingwebhookconfigurations",)
WRITABLE = ("secrets", "mutatingwebhookconfigurations")
# What `gpushard replace` uses: its Lease, Events on evicted pods, and the budgets evictions honour.
KINDS.update({"leases": "Lease", "events": "Event", "poddisruptionbudgets": "PodDisruptionBudget"})
GROUPS.update({"leases": "coordination.k8s.io/v1", "poddisruptionbudgets": "policy/v1"})
WRITABLE += ("leases", "events")
# What the DRA backend uses (resource.k8s.io/v1): the agent's ResourceSlices, the claims it reads, the
# templates and DeviceClass gpushard writes; also what the agent lists to find another DRA driver offering
# its node's GPUs. Tests allocate claims themselves, as the scheduler would.
KINDS.update({"resourceslices": "ResourceSlice", "resourceclaims": "ResourceClaim",
              "resourceclaimtemplates": "ResourceClaimTemplate", "deviceclasses": "DeviceClass"})
GROUPS.update({k: "resource.k8s.io/v1" for k in ("resourceslices", "resourceclaims", "resourceclaimtemplates",
                                                 "deviceclasses")})
CLUSTER_SCOPED += ("resourceslices", "deviceclasses")
# Which replica a webhook is: the EndpointSlices of its Service (webhook/cluster/peers.py).
KINDS["endpointslices"] = "EndpointSlice"
GROUPS["endpointslices"] = "discovery.k8s.io/v1"
# The install's own objects, which `gpushard status` and `gpushard audit` check (webhook/core/installation.py):
# the admission policies and their bindings, and ConfigMaps (an earlier version's device-policy lists).
KINDS.update({"validatingadmissionpolicies": "ValidatingAdmissionPolicy",
              "validatingadmissionpolicybindings": "ValidatingAdmissionPolicyBinding", "configmaps": "ConfigMap"})
GROUPS.update({"validatingadmissionpolicies": "admissionregistration.k8s.io/v1",
               "validatingadmissionpolicybindings": "admissionregistration.k8s.io/v1"})
CLUSTER_SCOPED += ("validatingadmissionpolicies", "validatingadmissionpolicybindings")
WRITABLE += ("resourceslices", "resourceclaimtemplates", "deviceclasses")


def _matches_selector(labels: dict, selector: str) -> bool:
    for part in filter(None, (p.strip() for p in selector.split(","))):
        if "!=" in part:
            key, value = part.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif part.startswith("!"):
            if part[1:] in labels:
                return False
        elif part not in labels:
            return False
    return True


# A string value standing for raw JSON text (FakeKube.raw): sent in its place, as an API server sends what
# it stored (a ResourceClaim's opaque parameters, nested deeper than Python's json writes or reads).
_RAW = re.compile(rb'"fakekube-raw-(\d+)"')
_RAWS: dict[int, bytes] = {}


def dumps(body: object) -> bytes:
    """The JSON an answer carries, with each FakeKube.raw stand-in replaced by its text."""
    data = json.dumps(body).encode()
    return _RAW.sub(lambda m: _RAWS[int(m.group(1))], data) if _RAWS else data


class FakeKube:
    """The server and its store; use as a context manager or call start()/stop()."""

    @staticmethod
    def raw(text: bytes) -> str:
        """A value to store in an object that is sent as the JSON ``text`` itself."""
        _RAWS[len(_RAWS)] = text
        return f"fakekube-raw-{len(_RAWS) - 1}"

    def __init__(self):
        self.lock = threading.Condition()
        self.rv = 100
        self.objects: dict[str, dict[tuple[str, str], dict]] = {k: {} for k in KINDS}
        self.events: list[tuple[int, str, str, dict]] = []  # (rv, resource, type, object)
        self.oldest_rv = 0  # watches from before this get 410 Gone
        self.requests: list[tuple[str, str, bytes]] = []  # (method, path with query, body)
        self.fail_next: list[int] = []  # HTTP status codes to answer the next requests with
        # Bearer tokens and the namespaces each may read (None: everything), as RBAC would allow;
        # None here means no authentication at all. A namespace's own object counts as inside it.
        self.tokens: dict[str, tuple[str, ...] | None] | None = None
        # What a token may not touch even where its namespaces allow it (403), as a role without that
        # rule: resources ("deployments") or subresources ("pods/portforward").
        self.refused: dict[str, tuple[str, ...]] = {}
        # API groups ("resource.k8s.io/v1") this server does not serve (404), as an older API server.
        self.unserved: set[str] = set()
        # The pod proxy (GET .../pods/<name>:<port>/proxy/<path>): (namespace, name, port) -> handler(path)
        # giving (status, body); a pod with no handler answers 503 as the API server does for no endpoint.
        self.proxies: dict[tuple[str, str, int], object] = {}
        # Port-forwards (GET .../pods/<name>/portforward?ports=<port>, WebSocket): (namespace, name, port) ->
        # (host, port) of a real local TCP server; a pod port with none gets an error on its error channel.
        self.forwards: dict[tuple[str, str, int], tuple[str, int]] = {}
        # TokenReview: token -> (username, groups); SubjectAccessReview: the grants, each a dict with
        # "subject" (a username, or "group:<name>") and the attributes it allows (verb, group, resource,
        # subresource, name: a missing key matches anything; or "path" for a non-resource URL).
        self.users: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.grants: list[dict] = []
        # SelfSubjectReview (`kubectl auth whoami`): the user a token in ``users`` names, else this one.
        self.whoami = "kubernetes-admin"
        # Called with (namespace, name), the lock held, as an eviction arrives: what changes the pod
        # between a client's list and its eviction (the scheduler binding it, the kubelet starting it).
        self.before_eviction: list = []
        self._generation = 0  # bumped to drop open watches
        self.compactions = 0  # bumped by expire_history: continue tokens issued before it get 410 Gone
        # Watches served as kube-apiserver serves them (chunked, the connection kept) rather than closed at the end.
        self.chunked_watches = False
        self.before: dict[int, dict] = {}  # resourceVersion of a MODIFIED event -> the object before it
        self.on_page = None  # called (resource, page number) after each page of a paginated list is sent
        # Called (method, path with query) as each request arrives, before it is answered, the lock
        # not held: it may block, as an API server that is slow to answer would.
        self.on_request = None
        self.server = _QuietServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeKube:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.drop_watches()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def configuration(self) -> kubernetes.client.Configuration:
        """A client configuration that points the real kubernetes client at this server."""
        config = kubernetes.client.Configuration()
        config.host = self.url
        return config

    def api_client(self) -> kubernetes.client.ApiClient:
        return kubernetes.client.ApiClient(self.configuration())

    # --- the store -------------------------------------------------------------------------

    def _bump(self, resource: str, kind: str, obj: dict, old: dict | None = None) -> dict:
        self.rv += 1
        if old is not None:
            self.before[self.rv] = old
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", GROUPS.get(resource, "v1"))
        obj["kind"] = KINDS[resource]
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("uid", f"uid-{resource}-{meta.get('name')}")
        self.events.append((self.rv, resource, kind, copy.deepcopy(obj)))
        self.lock.notify_all()
        return obj

    def put(self, resource: str, obj: dict) -> dict:
        """Create or replace an object (ADDED or MODIFIED on watches)."""
        meta = obj.get("metadata", {})
        key = ("" if resource in CLUSTER_SCOPED else meta.get("namespace", ""), meta["name"])
        with self.lock:
            old = self.objects[resource].get(key)
            stored = self._bump(resource, "ADDED" if old is None else "MODIFIED", obj, old)
            self.objects[resource][key] = stored
            return copy.deepcopy(stored)

    def delete(self, resource: str, name: str, namespace: str = "") -> None:
        with self.lock:
            obj = self.objects[resource].pop((namespace, name))
            self._bump(resource, "DELETED", obj)

    def get(self, resource: str, name: str, namespace: str = "") -> dict:
        with self.lock:
            return copy.deepcopy(self.objects[resource][(namespace, name)])

    def expire_history(self) -> None:
        """Forget all events so far: a watch resuming from them gets 410 Gone."""
        with self.lock:
            self.oldest_rv = self.rv + 1
            self.compactions += 1
            self.events.clear()
            self.lock.notify_all()

    def drop_watches(self) -> None:
        """Close every open watch connection, as a restarting API server or a proxy would."""
        with self.lock:
            self._generation += 1
            self.lock.notify_all()

    # --- HTTP ------------------------------------------------------------------------------

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, code: int, body: dict) -> None:
                data = dumps(body)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": reason, "message": message, "code": code})

            def _route(self):
                url = urlparse(self.path)
                parts = [p for p in url.path.split("/") if p]
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if parts[:2] == ["api", "v1"]:
                    group, rest = "v1", parts[2:]
                elif parts[:1] == ["apis"] and len(parts) >= 3:
                    group, rest = "/".join(parts[1:3]), parts[3:]
                else:
                    return None, None, None, query
                namespace = ""
                if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in KINDS:
                    namespace, rest = rest[1], rest[2:]
                if not rest or rest[0] not in KINDS or GROUPS.get(rest[0], "v1") != group or group in fake.unserved:
                    return None, None, None, query
                return rest[0], namespace, (rest[1] if len(rest) > 1 else None), query

            def _before(self, body: bytes = b"") -> bool:
                with fake.lock:
                    fake.requests.append((self.command, self.path, body))
                if fake.on_request is not None:
                    fake.on_request(self.command, self.path)
                with fake.lock:
                    code = fake.fail_next.pop(0) if fake.fail_next else None
                if code:
                    self._status(code, "InternalError", "injected failure")
                    return False
                return self._authorized()

            def _authorized(self) -> bool:
                if fake.tokens is None:
                    return True
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                if token not in fake.tokens:
                    self._status(401, "Unauthorized", "Unauthorized")
                    return False
                allowed = fake.tokens[token]
                resource, namespace, name, _query = self._route()
                tail = urlparse(self.path).path.rstrip("/").rsplit("/", 1)[-1]
                asked = f"{resource}/{tail}" if name and tail != name else resource
                refused = asked in fake.refused.get(token, ()) or resource in fake.refused.get(token, ())
                if not refused and (allowed is None or namespace in allowed
                                    or (resource == "namespaces" and name in allowed)):
                    return True
                scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
                group = GROUPS.get(resource or "", "v1").rpartition("/")[0]
                self._status(403, "Forbidden", f'{resource} is forbidden: User "{token}" cannot '
                                               f'{self.command.lower()} resource "{asked}" in API group '
                                               f'"{group}" {scope}')
                return False

            def _proxy(self) -> bool:
                parts = [unquote(p) for p in urlparse(self.path).path.split("/")]
                if len(parts) < 8 or parts[1:4] != ["api", "v1", "namespaces"] or parts[5] != "pods" \
                        or parts[7] != "proxy":
                    return False
                namespace, (name, _, port) = parts[4], parts[6].partition(":")
                handler = fake.proxies.get((namespace, name, int(port or 80)))
                if handler is None:
                    self._status(503, "ServiceUnavailable", f"no endpoints available for pod {name!r}")
                    return True
                code, body = handler("/".join(parts[8:]))
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return True

            def _portforward(self) -> bool:
                url = urlparse(self.path)
                parts = [unquote(p) for p in url.path.split("/")]
                if len(parts) != 8 or parts[1:4] != ["api", "v1", "namespaces"] or parts[5] != "pods" \
                        or parts[7] != "portforward":
                    return False
                namespace, name = parts[4], parts[6]
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                with fake.lock:
                    pod = fake.objects["pods"].get((namespace, name))
                if pod is None:
                    self._status(404, "NotFound", f'pods "{name}" not found')
                    return True
                if (self.headers.get("Upgrade") or "").lower() != "websocket":
                    self._status(400, "BadRequest", "port-forward needs a WebSocket upgrade here")
                    return True
                offered = [p.strip() for p in (self.headers.get("Sec-WebSocket-Protocol") or "").split(",")]
                if "v4.channel.k8s.io" not in offered:
                    self._status(400, "BadRequest", f"no supported WebSocket protocol in {offered}")
                    return True
                port = int(query.get("ports") or 0)
                accept = base64.b64encode(hashlib.sha1(
                    (self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
                self.send_response(101, "Switching Protocols")
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept.decode())
                self.send_header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
                self.end_headers()
                self.close_connection = True
                _Tunnel(self.rfile, self.wfile, port, fake.forwards.get((namespace, name, port)), name).run()
                return True

            def do_GET(self):
                if not self._before():
                    return
                if self._proxy() or self._portforward():
                    return
                resource, namespace, name, query = self._route()
                if resource is None:
                    return self._status(404, "NotFound", f"no route {self.path}")
                if name is not None:
                    key = ("" if resource in CLUSTER_SCOPED else namespace, name)
                    with fake.lock:
                        obj = fake.objects[resource].get(key)
                    if obj is None:
                        return self._status(404, "NotFound", f'{resource} "{name}" not found')
                    return self._send(200, obj)
                if query.get("watch") in ("true", "1"):
                    return self._watch(resource, namespace, query)
                limit = int(query.get("limit") or 0)
                start, rv, page, compactions = 0, None, 0, None
                if query.get("continue"):
                    token = json.loads(base64.b64decode(query["continue"]))
                    start, rv, page, compactions = token["start"], token["rv"], token["page"], token["c"]
                with fake.lock:
                    if compactions is not None and compactions != fake.compactions:
                        return self._status(410, "Expired", "The provided continue parameter is too old "
                                            "to display a consistent list result.")
                    keys = [k for k, o in fake.objects[resource].items()
                            if self._selected(o, resource, namespace, query)]
                    end = start + limit if limit else len(keys)
                    items = [copy.deepcopy(fake.objects[resource][k]) for k in keys[start:end]]
                    rv = fake.rv if rv is None else rv
                    compactions = fake.compactions
                meta = {"resourceVersion": str(rv)}
                if end < len(keys):
                    meta["continue"] = base64.b64encode(json.dumps(
                        {"start": end, "rv": rv, "page": page + 1, "c": compactions}).encode()).decode()
                self._send(200, {"kind": KINDS[resource] + "List", "apiVersion": GROUPS.get(resource, "v1"),
                                 "metadata": meta, "items": items})
                if limit and fake.on_page is not None:
                    fake.on_page(resource, page)

            def _selected(self, obj: dict, resource: str, namespace: str, query: dict) -> bool:
                meta = obj.get("metadata", {})
                if namespace and meta.get("namespace") != namespace:
                    return False
                if "labelSelector" in query and not _matches_selector(meta.get("labels") or {},
                                                                      query["labelSelector"]):
                    return False
                field = query.get("fieldSelector", "")
                if field.startswith("metadata.name="):
                    return meta.get("name") == field.split("=", 1)[1]
                if field.startswith("spec.nodeName="):
                    return (obj.get("spec") or {}).get("nodeName") == field.split("=", 1)[1]
                if field.startswith("spec.driver="):
                    return (obj.get("spec") or {}).get("driver") == field.split("=", 1)[1]
                return True

            def _watch(self, resource: str, namespace: str, query: dict) -> None:
                chunked = fake.chunked_watches
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if chunked:
                    # As kube-apiserver serves a watch: chunked, the connection kept for the next request.
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = not chunked

                def send(data: bytes) -> None:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                try:
                    self._watch_events(resource, namespace, query, send)
                    if chunked:
                        # The stream's end as a write of its own, after the last event (a client that stops at
                        # that event has the end still to come on its connection).
                        self.wfile.flush()
                        time.sleep(0.1)  # on purpose, not a wait: the end comes apart from the last event
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _watch_events(self, resource: str, namespace: str, query: dict, send) -> None:
                since = int(query.get("resourceVersion") or 0)
                deadline = time.monotonic() + float(query.get("timeoutSeconds") or 30)
                with fake.lock:
                    generation = fake._generation
                    if since and since < fake.oldest_rv:
                        gone = {"type": "ERROR", "object": {
                            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                            "message": f"too old resource version: {since} ({fake.oldest_rv})", "code": 410}}
                        send(json.dumps(gone).encode() + b"\n")
                        return
                sent = since
                while True:
                    with fake.lock:
                        batch = [e for e in fake.events if e[0] > sent and e[1] == resource]
                        if not batch:
                            remaining = deadline - time.monotonic()
                            if remaining <= 0 or fake._generation != generation:
                                return
                            fake.lock.wait(min(remaining, 0.2))
                            continue
                    for rv, _res, kind, obj in batch:
                        sent = rv
                        if not self._selected(obj, resource, namespace, query):
                            # No longer matching the selector: the watcher is told it is gone.
                            old = fake.before.get(rv)
                            if kind != "MODIFIED" or old is None or not self._selected(
                                    old, resource, namespace, query):
                                continue
                            kind = "DELETED"
                        send(dumps({"type": kind, "object": obj}) + b"\n")
                    self.wfile.flush()

            def do_PATCH(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if not self._before(body):
                    return
                resource, namespace, name, _query = self._route()
                if resource is None or name is None:
                    return self._status(404, "NotFound", f"no route {self.path}")
                key = ("" if resource in CLUSTER_SCOPED else namespace, name)
                with fake.lock:
                    obj = fake.objects[resource].get(key)
                    if obj is None:
                        return self._status(404, "NotFound", f'{resource} "{name}" not found')
                    patch = json.loads(body or b"{}")
                    if isinstance(patch, list) and (resource in WRITABLE or resource == "nodes"):
                        try:
                            merged = jsonpatch.apply_patch(obj, patch)
                        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                            return self._status(422, "Invalid", f"the JSON patch does not apply: {exc}")
                    elif isinstance(patch, list):
                        return self._status(415, "UnsupportedMediaType", "JSON patch is not supported here")
                    else:
                        merged = _merge(copy.deepcopy(obj), patch)
                    stored = fake._bump(resource, "MODIFIED", merged, obj)
                    fake.objects[resource][key] = stored
                self._send(200, stored)

            def _write(self, create: bool) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if not self._before(body):
                    return
                resource, namespace, name, _query = self._route()
                if resource not in WRITABLE or (name is None) != create:
                    return self._status(405, "MethodNotAllowed", f"{self.command} {self.path} is not supported here")
                obj = json.loads(body or b"{}")
                meta = obj.setdefault("metadata", {})
                name = meta.get("name") if create else name
                if not name or (not create and meta.get("name", name) != name):
                    return self._status(422, "Invalid", "metadata.name is missing or differs from the URL")
                if resource not in CLUSTER_SCOPED:
                    meta["namespace"] = namespace
                key = ("" if resource in CLUSTER_SCOPED else namespace, name)
                with fake.lock:
                    old = fake.objects[resource].get(key)
                    if create and old is not None:
                        return self._status(409, "AlreadyExists", f'{resource} "{name}" already exists')
                    if not create and old is None:
                        return self._status(404, "NotFound", f'{resource} "{name}" not found')
                    wanted = meta.get("resourceVersion")
                    if not create and wanted and wanted != old["metadata"]["resourceVersion"]:
                        return self._status(409, "Conflict", f'{resource} "{name}": the object has been modified')
                    if not create and resource == "secrets" and obj.get("type", "Opaque") != old.get("type", "Opaque"):
                        return self._status(422, "Invalid", "type: field is immutable")
                    if old is not None:
                        meta["uid"] = old["metadata"]["uid"]
                    stored = fake._bump(resource, "ADDED" if create else "MODIFIED", obj)
                    fake.objects[resource][key] = stored
                self._send(201 if create else 200, stored)

            def _review(self) -> bool:
                path = urlparse(self.path).path.rstrip("/")
                if path not in ("/apis/authentication.k8s.io/v1/tokenreviews",
                                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                                "/apis/authentication.k8s.io/v1/selfsubjectreviews"):
                    return False
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if not self._before(body):
                    return True
                review = json.loads(body or b"{}")
                spec = review.get("spec") or {}
                with fake.lock:
                    if path.endswith("selfsubjectreviews"):
                        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                        user = fake.users.get(token) or (fake.whoami, ("system:authenticated",))
                        status = {"userInfo": {"username": user[0], "groups": list(user[1])}}
                    elif path.endswith("tokenreviews"):
                        user = fake.users.get(str(spec.get("token") or ""))
                        status = {"authenticated": False, "error": "invalid bearer token"} if user is None else {
                            "authenticated": True, "user": {"username": user[0], "groups": list(user[1])}}
                    else:
                        status = {"allowed": _granted(fake.grants, spec)}
                self._send(201, {**review, "status": status})
                return True

            def do_POST(self):
                if self._review():
                    return
                path = urlparse(self.path).path.rstrip("/").split("/")
                if path[-1] == "eviction" and path[-3] == "pods":
                    return self._evict(path[-4], path[-2])
                self._write(create=True)

            def _evict(self, namespace: str, name: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if not self._before(body):
                    return
                wanted = (json.loads(body or b"{}").get("deleteOptions") or {}).get("preconditions") or {}
                with fake.lock:
                    for hook in fake.before_eviction:
                        hook(namespace, name)
                    pod = fake.objects["pods"].get((namespace, name))
                    if pod is None:
                        return self._status(404, "NotFound", f'pods "{name}" not found')
                    meta, status = pod["metadata"], pod.get("status") or {}
                    # As the API server's eviction: budgets do not protect pods that are Pending,
                    # ended, or already being deleted; an unready pod passes while the budget
                    # has its healthy pods. Preconditions are checked at the deletion, after.
                    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                                for c in status.get("conditions") or ())
                    if status.get("phase") not in ("Pending", "Succeeded", "Failed") and not meta.get(
                            "deletionTimestamp"):
                        budgets = [b for b in fake.objects["poddisruptionbudgets"].values()
                                   if b["metadata"].get("namespace") == namespace and _selects(b, pod)]
                        if len(budgets) > 1:
                            return self._status(500, "InternalError",
                                                "This pod has more than one PodDisruptionBudget")
                        health = (budgets[0].get("status") or {}) if budgets else {}
                        if budgets and not ready and 0 < int(health.get("desiredHealthy") or 0) <= int(
                                health.get("currentHealthy") or 0):
                            budgets = []
                        if budgets:
                            budget = budgets[0]
                            if int((budget.get("status") or {}).get("disruptionsAllowed") or 0) <= 0:
                                return self._status(429, "TooManyRequests",
                                                    "Cannot evict pod as it would violate the pod's disruption budget.")
                            budget = copy.deepcopy(budget)
                            budget["status"]["disruptionsAllowed"] -= 1
                            key = (namespace, budget["metadata"]["name"])
                            fake.objects["poddisruptionbudgets"][key] = fake._bump("poddisruptionbudgets",
                                                                                   "MODIFIED", budget)
                    if wanted.get("uid") not in (None, meta["uid"]) or \
                            wanted.get("resourceVersion") not in (None, meta["resourceVersion"]):
                        return self._status(409, "Conflict", "Precondition failed: UID or ResourceVersion")
                    pod = copy.deepcopy(pod)
                    pod.setdefault("status", {}).setdefault("conditions", []).append(
                        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                         "message": "Eviction API: evicting"})
                    fake._bump("pods", "MODIFIED", pod)
                    del fake.objects["pods"][(namespace, name)]
                    fake._bump("pods", "DELETED", pod)
                self._send(201, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201})

            def do_PUT(self):
                self._write(create=False)

        return Handler


def _granted(grants: list[dict], spec: dict) -> bool:
    """Whether a SubjectAccessReview's spec is allowed by one of ``grants``."""
    subjects = {spec.get("user")} | {f"group:{g}" for g in spec.get("groups") or ()}
    attributes = spec.get("resourceAttributes") or {}
    path = (spec.get("nonResourceAttributes") or {}).get("path")
    verb = (spec.get("nonResourceAttributes") or attributes).get("verb")
    for grant in grants:
        if grant["subject"] not in subjects or grant.get("verb", verb) != verb:
            continue
        if path is not None:
            if grant.get("path") == path:
                return True
            continue
        if "path" not in grant and all(grant.get(k, attributes.get(k, "")) == attributes.get(k, "")
                                       for k in ("group", "resource", "subresource", "name", "namespace")):
            return True
    return False


class _Tunnel:
    """One port-forward over a WebSocket: channel 0 carries the data, channel 1 the errors."""

    def __init__(self, rfile, wfile, port: int, target: tuple[str, int] | None, pod: str):
        self.rfile, self.wfile, self.port, self.target, self.pod = rfile, wfile, port, target, pod
        self.lock = threading.Lock()

    def send(self, payload: bytes, opcode: int = 2) -> None:
        size = len(payload)
        head = bytes([0x80 | opcode])
        if size < 126:
            head += bytes([size])
        elif size < 1 << 16:
            head += bytes([126]) + struct.pack("!H", size)
        else:
            head += bytes([127]) + struct.pack("!Q", size)
        with self.lock:
            self.wfile.write(head + payload)
            self.wfile.flush()

    def receive(self) -> tuple[int, bytes] | None:
        head = self.rfile.read(2)
        if len(head) < 2:
            return None
        opcode, size = head[0] & 0x0F, head[1] & 0x7F
        if size == 126:
            size = struct.unpack("!H", self.rfile.read(2))[0]
        elif size == 127:
            size = struct.unpack("!Q", self.rfile.read(8))[0]
        mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
        data = self.rfile.read(size)
        return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))

    def run(self) -> None:
        port = struct.pack("<H", self.port)
        self.send(b"\x00" + port)
        self.send(b"\x01" + port)
        try:
            conn = socket.create_connection(self.target, timeout=10) if self.target else None
        except OSError:
            conn = None
        if conn is None:
            self.send(b"\x01" + f"error forwarding port {self.port} to pod {self.pod}: connection refused".encode())
            self.send(b"", opcode=8)
            return
        conn.settimeout(None)

        def back() -> None:
            try:
                while data := conn.recv(65536):
                    self.send(b"\x00" + data)
            except OSError:
                pass
            try:
                self.send(b"", opcode=8)
            except OSError:
                pass

        replies = threading.Thread(target=back, daemon=True)
        replies.start()
        try:
            while (frame := self.receive()) is not None:
                opcode, data = frame
                if opcode == 8:
                    break
                if opcode == 2 and data[:1] == b"\x00" and len(data) > 1:
                    conn.sendall(data[1:])
        except OSError:
            pass
        finally:
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            replies.join(timeout=10)
            conn.close()


def _selects(budget: dict, pod: dict) -> bool:
    """Whether a PodDisruptionBudget's matchLabels select the pod (the fake knows no expressions)."""
    want = ((budget.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in want.items())


def _merge(target: dict, patch: dict) -> dict:
    """RFC 7386 merge patch (strategic merge behaves the same for the maps gpushard patches)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up (a pooled connection the kubernetes client drops) is no fault of the server's;
    socketserver would print its traceback on the stderr of the process the test runs in."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class SilentServer:
    """A server that accepts connections and never answers: an API server behind a dead proxy, or hung.

    Use as a context manager; ``url`` is where it listens. Every connection it accepted is held
    open until it stops, so a client waits for its read timeout, never for a reset.
    """

    def __init__(self):
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._held: list = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)

    @property
    def connections(self) -> int:
        """How many connections clients opened: one per try of a request."""
        return len(self._held)

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self._held:
            conn.close()
