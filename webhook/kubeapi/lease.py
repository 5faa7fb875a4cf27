"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that one re-placement replica acts."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import kubernetes

from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0  # each API call, as --request-timeout's default (the cache's lists and watches keep theirs)


def now_text(wall: Callable[[], float]) -> str:
    """A MicroTime (RFC 3339 with microseconds, UTC) as Leases and Events carry."""
    return datetime.datetime.fromtimestamp(wall(), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def json_body(response) -> dict:
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


class Elector:
    """Leader election on a Lease, as client-go's leaderelection does it.

    Whether another holder's lease expired is judged on this process's own clock, from when it
    last saw the lease change, never by comparing its renewTime with our clock (clocks differ).
    Every write carries the resourceVersion read, so two candidates never both win.
    """

    def __init__(self, api_client, namespace: str, name: str, identity: str, duration_s: int, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 timeout: float | None = REQUEST_TIMEOUT_S, target: connecting.Target | None = None):
        self._api = kubernetes.client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity, self.duration = namespace, name, identity, duration_s
        self._clock, self._wall = clock, wall
        self._timeout, self._target = timeout, target
        self._record: tuple | None = None
        self._observed = 0.0

    def _reaching(self, what: str):
        """A transport failure, 401 or 403 in the block becomes a connecting.ApiError in plain words."""
        if self._target is None:
            return contextlib.nullcontext()
        return connecting.reaching(self._target, f"{what} Lease {self.namespace}/{self.name}")

    def lead(self) -> bool:
        """Take or renew the lease; True while this process leads, False while another does.

        A Lease that cannot be read or written (unreachable, 401, 403, a 500) raises: that is not
        "another replacer leads", and the caller says so (``--once``) or stands by and retries.
        """
        now = self._clock()
        try:
            with self._reaching("get"):
                lease = json_body(self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False,
                                                              _request_timeout=self._timeout))
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            return self._write(None, now)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, (lease.get("metadata") or {}).get("resourceVersion"))  # any write changes it
        if record != self._record:
            self._record, self._observed = record, now
        duration = spec.get("leaseDurationSeconds") or self.duration
        if holder and holder != self.identity and now < self._observed + duration:
            return False
        return self._write(lease, now)

    def release(self) -> None:
        """Give the lease up (on shutdown), so that another replacer need not wait for it to expire."""
        if self._record is None or self._record[0] != self.identity:
            return  # not the holder when last seen: nothing to give up
        self._record = None
        try:
            lease = json_body(self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False,
                                                          _request_timeout=self._timeout))
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.identity:
                return
            stamp = now_text(self._wall)
            spec.update(holderIdentity=None, leaseDurationSeconds=1, renewTime=stamp, acquireTime=stamp)
            body: Any = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": spec,  # taken for a V1Lease
                         "metadata": {"name": self.name, "namespace": self.namespace,
                                      "resourceVersion": (lease.get("metadata") or {}).get("resourceVersion")}}
            json_body(self._api.replace_namespaced_lease(self.name, self.namespace, body, _preload_content=False,
                                                     _request_timeout=self._timeout))
        except Exception as exc:  # noqa: BLE001 - it expires anyway; stopping must not fail on it
            log.warning("gpushard: could not release Lease %s/%s (%s); it expires in %ss", self.namespace, self.name,
                        connecting.failure_text(exc), self.duration)

    def _write(self, lease: dict | None, now: float) -> bool:
        spec = dict((lease or {}).get("spec") or {})
        stamp = now_text(self._wall)
        if spec.get("holderIdentity") != self.identity:
            if spec.get("holderIdentity"):
                spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            spec["acquireTime"] = stamp
            spec.setdefault("leaseTransitions", 0)
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=self.duration, renewTime=stamp)
        # Any: a manifest, which the client takes for a V1Lease; and the answer, read raw, is the HTTP response.
        body: Any = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
        written: Any
        try:
            with self._reaching("create" if lease is None else "update"):
                if lease is None:
                    written = self._api.create_namespaced_lease(self.namespace, body, _preload_content=False,
                                                                _request_timeout=self._timeout)
                else:
                    body["metadata"]["resourceVersion"] = (lease.get("metadata") or {}).get("resourceVersion")
                    written = self._api.replace_namespaced_lease(self.name, self.namespace, body,
                                                                 _preload_content=False, _request_timeout=self._timeout)
        except kubernetes.client.ApiException as exc:
            if exc.status == 409:  # another candidate wrote first
                return False
            raise
        written = json_body(written)
        self._record = ((written.get("spec") or {}).get("holderIdentity") or "",
                        (written.get("metadata") or {}).get("resourceVersion"))
        self._observed = now
        return True


