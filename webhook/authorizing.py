"""Who may read gpushard's metrics: the caller's token reviewed and authorized by the API server.

The agent's per-container usage (namespaces, pods, memory) and the webhook's per-card free shares and
certificate expiry are not for every pod on the network. A scrape from the network must carry a
bearer token: the server asks the API server who it is (``TokenReview``) and whether that user holds
the right its metrics need (``SubjectAccessReview``): for the agent, ``get`` on the ``nodes/metrics``
subresource of its node, the right the kubelet itself asks for its own ``/metrics``, which already
shows every container of the node; for the webhook, ``get`` on the non-resource URL ``/metrics``, as
kube-apiserver's own metrics. This is how kube-rbac-proxy and controller-runtime's metrics filter
guard metrics. Answers are cached briefly, so a scrape every 15 s costs the API server two reviews a
minute at most.

A connection from the pod's own loopback is a port-forward: the container runtime dials
``localhost:<port>`` inside the pod's network namespace, after the API server authorized the
caller for ``pods/portforward`` on this pod (`gpushard top`'s Role). No pod on the network can
appear as the pod's loopback.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import kubernetes

log = logging.getLogger(__name__)

ALLOWED_TTL_S = 60.0
DENIED_TTL_S = 10.0
TIMEOUT_S = 5.0
MAX_CACHED = 1024


@dataclass(frozen=True)
class Verdict:
    """The answer to one request: HTTP status (200, 401, 403, 503), why, and who asked."""

    status: int
    reason: str
    user: str | None = None

    @property
    def allowed(self) -> bool:
        return self.status == 200


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@dataclass(frozen=True)
class Right:
    """What a caller must be allowed, as a SubjectAccessReview's spec says it, and in words."""

    attributes: dict  # {"resourceAttributes": {...}} or {"nonResourceAttributes": {...}}
    words: str


def node_metrics(node: str) -> Right:
    """``get`` on ``nodes/metrics`` of ``node``: the agent's metrics."""
    return Right({"resourceAttributes": {"verb": "get", "group": "", "resource": "nodes", "subresource": "metrics",
                                         "name": node}}, f'get nodes/metrics of node "{node}"')


# ``get`` on the non-resource URL /metrics: the webhook's metrics.
METRICS_URL = Right({"nonResourceAttributes": {"verb": "get", "path": "/metrics"}}, "get /metrics")


class Reviewer:
    """Authenticates tokens and authorizes users through the API server, with a short cache."""

    def __init__(self, api: kubernetes.client.ApiClient, right: Right, allowed_ttl: float = ALLOWED_TTL_S,
                 denied_ttl: float = DENIED_TTL_S, timeout: float = TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.authentication = kubernetes.client.AuthenticationV1Api(api)
        self.authorization = kubernetes.client.AuthorizationV1Api(api)
        self.right = right
        self.allowed_ttl = allowed_ttl
        self.denied_ttl = denied_ttl
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Verdict]] = {}
        self.reviews = 0  # TokenReviews sent, for tests and logs

    def review(self, token: str) -> Verdict:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                return cached[1]
        verdict = self._review(token)
        if verdict.status in (200, 401, 403):  # the API being away is not remembered
            ttl = self.allowed_ttl if verdict.allowed else self.denied_ttl
            with self._lock:
                if len(self._cache) >= MAX_CACHED:
                    self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                    if len(self._cache) >= MAX_CACHED:
                        self._cache.clear()
                self._cache[key] = (now + ttl, verdict)
        return verdict

    def _post(self, call, body: dict) -> dict:
        response = call(body, _preload_content=False, _request_timeout=self.timeout)
        return json.loads(response.data)

    def _review(self, token: str) -> Verdict:
        self.reviews += 1
        try:
            answer = self._post(self.authentication.create_token_review,
                                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                 "spec": {"token": token}})
            status = answer.get("status") or {}
            if not status.get("authenticated"):
                return Verdict(401, "gpushard: the token is not valid")
            user = status.get("user") or {}
            name = str(user.get("username") or "")
            spec = {"user": name, "groups": list(user.get("groups") or []), **self.right.attributes}
            if user.get("uid"):
                spec["uid"] = user["uid"]
            if user.get("extra"):
                spec["extra"] = user["extra"]
            answer = self._post(self.authorization.create_subject_access_review,
                                {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                                 "spec": spec})
        except Exception as exc:  # the API server away or refusing us: nobody from the network gets in
            status = getattr(exc, "status", None)
            why = f"HTTP {status} {getattr(exc, 'reason', '')}".strip() if status else type(exc).__name__
            log.warning("gpushard: cannot review a metrics scrape's token with the API server (%s)", why)
            return Verdict(503, f"gpushard: cannot review the token with the API server ({why})")
        if (answer.get("status") or {}).get("allowed"):
            return Verdict(200, "allowed", name)
        return Verdict(403, f'gpushard: user "{name}" may not {self.right.words}', name)


def check(peer: str, authorization: str | None, reviewer: Reviewer | None) -> Verdict:
    """Whether a request from ``peer`` with this Authorization header may read the metrics."""
    if is_loopback(peer):
        return Verdict(200, "a port-forward into the pod")
    token = bearer_token(authorization)
    if token is None:
        return Verdict(401, "gpushard: a bearer token is required (Authorization: Bearer <token>)")
    if reviewer is None:
        return Verdict(503, "gpushard: no Kubernetes API credentials to review the token with")
    return reviewer.review(token)
