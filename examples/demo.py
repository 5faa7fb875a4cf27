"""The gpushard demo: a real webhook over TLS on an embedded cluster view, fed realistic pods.

It makes certificates with `gpushard certs`, starts `gpushard serve` (gunicorn, TLS) on
loopback with the cluster of examples/cluster.yaml, sends every manifest of examples/demo/
as the API server would (an AdmissionReview over HTTPS, CA and Service name verified), and
prints what happened to each: shares, card, env, or the denial. Then it stops the server.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import pathlib
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid

import jsonpatch
import yaml

from webhook.core import placement

HERE = pathlib.Path(__file__).resolve().parent
SERVICE, NAMESPACE = "gpushard", "gpushard-system"
BOLD, GREEN, RED, YELLOW, DIM, RESET = (("\033[1m", "\033[32m", "\033[31m", "\033[33m", "\033[2m", "\033[0m")
                                        if sys.stdout.isatty() else ("",) * 6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpushard(*args: str, **kw) -> subprocess.Popen:
    exe = pathlib.Path(sys.executable).with_name("gpushard")
    return subprocess.Popen([str(exe), *args], **kw)


class Webhook:
    """An HTTPS client that talks to the webhook as the API server does."""

    def __init__(self, port: int, ca: pathlib.Path):
        self.ctx = ssl.create_default_context(cafile=str(ca))
        self.port = port
        self.conn: http.client.HTTPSConnection | None = None

    def _connection(self) -> http.client.HTTPSConnection:
        if self.conn is None:
            # Connect to loopback, but verify the certificate against the Service's DNS name.
            self.conn = http.client.HTTPSConnection(f"{SERVICE}.{NAMESPACE}.svc", self.port, context=self.ctx,
                                                    timeout=10)
            self.conn.sock = self.ctx.wrap_socket(socket.create_connection(("127.0.0.1", self.port), timeout=10),
                                                  server_hostname=f"{SERVICE}.{NAMESPACE}.svc")
        return self.conn

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        conn = self._connection()
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()

    def review(self, path: str, obj: dict) -> dict:
        kind = obj["kind"]
        group, _, version = obj["apiVersion"].rpartition("/")
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": str(uuid.uuid4()), "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": kind.lower() + "s"},
            "namespace": obj["metadata"].get("namespace", "default"), "operation": "CREATE",
            "userInfo": {"username": "demo"}, "object": obj, "dryRun": False}}
        status, body = self.request("POST", path, review)
        if status != 200:
            raise SystemExit(f"gpushard demo: {path} answered HTTP {status}: {body[:200]!r}")
        answer = json.loads(body)
        assert answer["response"]["uid"] == review["request"]["uid"]
        return answer["response"]


def containers(spec: dict) -> list[dict]:
    return (spec.get("initContainers") or []) + (spec.get("containers") or [])


def show(obj: dict, response: dict) -> None:
    meta = obj["metadata"]
    print(f"{BOLD}{obj['kind']} {meta.get('namespace')}/{meta['name']}{RESET}")
    for line in (obj.get("_comment") or "").splitlines():
        print(f"  {DIM}{line}{RESET}")
    if not response["allowed"]:
        status = response.get("status", {})
        print(f"  {RED}denied ({status.get('code')}){RESET}: {status.get('message')}")
        return
    new = obj
    if response.get("patch"):
        new = jsonpatch.JsonPatch(json.loads(base64.b64decode(response["patch"]))).apply(obj)
    ann = (new.get("metadata") or {}).get("annotations") or {}
    if "gpushard.io/card" in ann:
        node = placement.preferred_node(new["spec"])
        where = f" (node {node} preferred: its card has room)" if node else ""
        print(f"  {GREEN}admitted{RESET}: {ann['gpushard.io/shares']} shares, pinned to card {ann['gpushard.io/card']}"
              f"{where}")
        required = ((new["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution")
        if "gpushard.io/memory-mib" in ann and required:
            expression = required["nodeSelectorTerms"][0]["matchExpressions"][-1]
            print(f"    asked {ann['gpushard.io/memory-mib']} MiB of GPU memory, sized for a "
                  f"{ann.get('gpushard.io/card-memory-mib', '?')} MiB card; required: {expression['key']} "
                  f"in {expression['values']}")
    else:
        print(f"  {GREEN}admitted{RESET}")
    spec = new["spec"] if obj["kind"] == "Pod" else new["spec"]["template"]["spec"]
    for c in containers(spec):
        limits = (c.get("resources") or {}).get("limits") or {}
        gpu = {k: v for k, v in limits.items() if "gpu" in k or "gpushard" in k}
        env = {e["name"]: e.get("value") for e in c.get("env") or [] if e["name"].startswith(("NVIDIA", "GPUSHARD"))}
        print(f"    container {c['name']}: limits {gpu or '{}'}  env {env or '{}'}")
    for warning in response.get("warnings") or []:
        print(f"  {YELLOW}warning{RESET}: {warning}")
    for key, value in (response.get("auditAnnotations") or {}).items():
        print(f"  {YELLOW}audit annotation{RESET} {key}: {value}")


def load(path: pathlib.Path) -> dict:
    text = path.read_text()
    obj = yaml.safe_load(text)
    obj["_comment"] = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    return obj


def main() -> int:
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpushard-demo-"))
    certs = work / "certs"
    subprocess.run([str(pathlib.Path(sys.executable).with_name("gpushard")), "certs", "--out", str(certs),
                    "--service", SERVICE, "--namespace", NAMESPACE], check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    print(f"{BOLD}gpushard demo{RESET}: certificates in {certs}; webhook on https://127.0.0.1:{port} "
          f"with the cluster view of examples/cluster.yaml\n")
    server = gpushard("serve", "--cert", str(certs / "tls.crt"), "--key", str(certs / "tls.key"),
                      "--bind", f"127.0.0.1:{port}", "--cluster", str(HERE / "cluster.yaml"), "--workers", "1",
                      stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "w"), start_new_session=True)
    try:
        hook = Webhook(port, certs / "ca.crt")
        deadline = time.monotonic() + 30
        while True:
            try:
                status, body = hook.request("GET", "/readyz")
                if status == 200:
                    break
            except OSError:
                hook.conn = None
            if server.poll() is not None or time.monotonic() > deadline:
                print((work / "server.log").read_text(), file=sys.stderr)
                raise SystemExit("gpushard demo: the webhook did not start")
            time.sleep(0.2)

        print(f"{BOLD}== Namespaces in enforce mode: POST /mutate{RESET}\n")
        for path in sorted((HERE / "demo").glob("*.yaml")):
            obj = load(path)
            comment = obj.pop("_comment")
            response = hook.review("/mutate", obj)
            obj["_comment"] = comment
            show(obj, response)
            print()

        print(f"{BOLD}== A namespace in audit mode: POST /audit (nothing changed, findings reported){RESET}\n")
        obj = load(HERE / "demo" / "02-inference-with-sidecar.yaml")
        obj.pop("_comment")
        obj["_comment"] = "The same inference pod, in a namespace labelled gpushard.io/mode=audit."
        show(obj, hook.review("/audit", {k: v for k, v in obj.items() if k != "_comment"}))
        print()

        status, body = hook.request("GET", "/metrics")
        counted = [line for line in body.decode().splitlines()
                   if line.startswith("gpushard_admissions_total") and not line.endswith(" 0.0")]
        print(f"{BOLD}== /metrics{RESET} (admissions by outcome)")
        for line in counted:
            print(f"  {line}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    print(f"\n{BOLD}Stopped the webhook.{RESET} Next: `make test`, then docs/install.md for a real cluster.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
