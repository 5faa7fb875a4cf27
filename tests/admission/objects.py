"""AdmissionReviews, objects and a server process for the admission tests, and the API server's checks."""

from __future__ import annotations

import base64
import contextlib
import copy
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import uuid
from fractions import Fraction
from pathlib import Path

import jsonpatch

from tests import polling
from webhook.core import quantities

SERVICE_HOST = "gpushard.gpushard-system.svc"

CLUSTER_YAML = """\
nodes:
- name: node-a
  labels: {kubernetes.io/hostname: node-a}
  cards:
  - {index: 0, uuid: GPU-a0, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, usedShares: 40}
  - {index: 1, uuid: GPU-a1, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, usedShares: 0}
- name: node-b
  labels: {kubernetes.io/hostname: node-b}
  cards:
  - {index: 0, uuid: GPU-b0, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, usedShares: 90}
"""


def container(name: str = "main", gpu: object = None, resource: str = "nvidia.com/gpu", **extra) -> dict:
    c = {"name": name, "image": "nvcr.io/nvidia/cuda:12.4.0-base-ubuntu22.04", **extra}
    if gpu is not None:
        c["resources"] = {"limits": {resource: gpu}, "requests": {resource: gpu}}
    return c


def pod(*containers: dict, name: str = "p", init: list[dict] | None = None) -> dict:
    spec: dict = {"containers": list(containers) or [container()]}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml"}, "spec": spec}


def deployment(*containers: dict, name: str = "d") -> dict:
    template = {"metadata": {"labels": {"app": name}}, "spec": {"containers": list(containers)}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": name}}, "template": template}}


def review(obj: object, kind: str | None = None, operation: str = "CREATE", dry_run: bool = False,
           uid: str | None = None) -> dict:
    if kind is None:
        kind = obj.get("kind", "Pod") if isinstance(obj, dict) else "Pod"
    group, version = ("apps", "v1") if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet") else ("", "v1")
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid or str(uuid.uuid4()),
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": kind.lower() + "s"},
        "namespace": "ml", "operation": operation, "userInfo": {"username": "alice"},
        "object": obj, "oldObject": None, "dryRun": dry_run, "options": None}}


def response_of(answer: dict, uid: str) -> dict:
    """The response of a well-formed AdmissionReview answer for ``uid``; fails the test otherwise."""
    assert answer["apiVersion"] == "admission.k8s.io/v1", answer
    assert answer["kind"] == "AdmissionReview", answer
    response = answer["response"]
    assert response["uid"] == uid
    assert isinstance(response["allowed"], bool)
    if not response["allowed"]:
        assert response["status"]["code"] in (400, 403, 500), response
        assert response["status"]["message"].startswith("gpushard:"), response
        assert "patch" not in response
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
    for warning in response.get("warnings", []):
        assert isinstance(warning, str) and len(warning) <= 256
    for key in response.get("auditAnnotations", {}):
        assert "/" not in key and len(key) <= 63
    return response


def patched(obj: dict, response: dict) -> dict:
    """The object as the API server stores it after applying the response's patch."""
    if "patch" not in response:
        return copy.deepcopy(obj)
    patch = json.loads(base64.b64decode(response["patch"], validate=True))
    assert patch, "an empty patch must not be sent"
    return jsonpatch.apply_patch(obj, patch)


def pod_spec(obj: dict) -> dict | None:
    if obj.get("kind") == "Pod":
        return obj.get("spec")
    if obj.get("kind") == "Deployment":
        return obj["spec"]["template"]["spec"]
    return None


def assert_api_server_accepts(obj: dict) -> None:
    """What the API server's validation says of extended resources: integers, requests == limits."""
    spec = pod_spec(obj) or {}
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or []:
            resources = c.get("resources") or {}
            limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
            for name in set(limits) | set(requests):
                if "/" not in name or name.split("/")[0].endswith("kubernetes.io"):
                    continue
                assert name in limits and name in requests and \
                    quantities.parse(limits[name]) == quantities.parse(requests[name]), (name, c)
                assert quantities.parse(limits[name]).denominator == 1, (name, limits[name])


def shares_of(c: dict) -> dict[str, Fraction]:
    return {k: quantities.parse(v) for k, v in (c.get("resources", {}).get("limits") or {}).items()}


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env") or []}


# --- a real `gpushard serve` -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def client_context(ca_file: str | Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_file))
    return context


def make_certs(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "webhook.cli", "certs", "--out", str(folder)], check=True,
                   capture_output=True)
    return folder


class Server:
    """`gpushard serve` in its own process group, stopped and reaped by ``stop()``."""

    def __init__(self, certs: Path, cluster: Path, *extra: str, workers: int = 1, threads: int = 4):
        self.certs, self.port = certs, free_port()
        self.log = certs.parent / f"serve-{self.port}.log"
        self.args = [sys.executable, "-m", "webhook.cli", "serve", "--cert", str(certs / "tls.crt"),
                     "--key", str(certs / "tls.key"), "--bind", f"127.0.0.1:{self.port}",
                     "--cluster", str(cluster), "--workers", str(workers), "--threads", str(threads), *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, ready_within: float = 30.0) -> Server:
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

        def healthy() -> bool:
            try:
                return self.request("GET", "/healthz", timeout=2)[0] == 200
            except OSError:
                return False

        try:
            polling.eventually(healthy, "gpushard serve answering /healthz", ready_within, interval=0.1,
                               gone=self.exited)
        except AssertionError as exc:
            self.stop()
            raise AssertionError(f"{exc}:\n{self.output()}") from None
        return self

    def exited(self) -> str | None:
        """Why it can no longer answer, once its master process has exited (``gone`` for polling.eventually)."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"gpushard serve exited {self.proc.returncode}"
        return None

    def connection(self, timeout: float = 10.0, ca: Path | None = None,
                   hostname: str = SERVICE_HOST) -> http.client.HTTPSConnection:
        """A keep-alive HTTPS connection to 127.0.0.1 that checks the certificate names ``hostname``."""
        context = client_context(ca or self.certs / "ca.crt")
        conn = http.client.HTTPSConnection(hostname, self.port, timeout=timeout, context=context)
        # Dial loopback, but verify (SNI and hostname check) the Service's name.
        conn.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", self.port), timeout=timeout),
                                        server_hostname=hostname)
        return conn

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 10.0,
                conn: http.client.HTTPSConnection | None = None) -> tuple[int, dict, bytes]:
        own = conn is None
        conn = conn or self.connection(timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            if own:
                conn.close()

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        """Signal the gunicorn master, as the kubelet signals a container's first process."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        """Stop the server; whatever of its process group outlives the master is killed."""
        if self.proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._out.close()
        return self.proc.returncode
