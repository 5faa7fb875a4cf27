"""`helm test`: one real AdmissionReview to the webhook's Service, over TLS verified with the webhook's CA.

It runs in the gpushard image (its Python has everything it needs) as a dry run, which leaves no trace
on later card choices. With mode enforce it posts to /mutate a Pod asking half a card and checks that the
answer admits it with the shares of one card; with audit-only it posts to /audit and checks the answer
admits it unchanged. Environment: GPUSHARD_URL (https://gpushard.<namespace>.svc), GPUSHARD_PATH (/mutate
or /audit), GPUSHARD_CA (a PEM file) or GPUSHARD_CA_BUNDLE (base64 PEM), GPUSHARD_FRACTION_RESOURCE,
GPUSHARD_SHARES_RESOURCE, GPUSHARD_SHARES_PER_CARD; GPUSHARD_DIAL (host:port) dials another address
while checking the certificate for the URL's host (used by the chart's own tests).
"""

import base64
import http.client
import json
import math
import os
import socket
import ssl
import sys
import urllib.parse
import uuid

import jsonpatch  # a dependency of gpushard, in its image


def fail(message):
    print(f"gpushard: helm test failed: {message}", file=sys.stderr)
    sys.exit(1)


def tls_context():
    if os.environ.get("GPUSHARD_CA_BUNDLE"):
        return ssl.create_default_context(cadata=base64.b64decode(os.environ["GPUSHARD_CA_BUNDLE"]).decode())
    return ssl.create_default_context(cafile=os.environ["GPUSHARD_CA"])


def post(url, path, body):
    target = urllib.parse.urlsplit(url)
    host, port = target.hostname, target.port or 443
    dial_host, _, dial_port = os.environ.get("GPUSHARD_DIAL", f"{host}:{port}").rpartition(":")
    context = tls_context()
    conn = http.client.HTTPSConnection(host, port, timeout=15, context=context)
    try:
        raw = socket.create_connection((dial_host, int(dial_port)), timeout=15)
        conn.sock = context.wrap_socket(raw, server_hostname=host)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, ssl.SSLError) as exc:
        fail(f"cannot reach {url}{path}: {exc}")
    finally:
        conn.close()


def main():
    url, path = os.environ["GPUSHARD_URL"], os.environ.get("GPUSHARD_PATH", "/mutate")
    fraction = os.environ.get("GPUSHARD_FRACTION_RESOURCE", "nvidia.com/gpu")
    shares = os.environ.get("GPUSHARD_SHARES_RESOURCE", "gpushard.io/gpu")
    per_card = int(os.environ.get("GPUSHARD_SHARES_PER_CARD", "100"))
    namespace = "gpushard-helm-test"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpushard-helm-test", "namespace": namespace},
           "spec": {"containers": [{"name": "main", "image": "gpushard-helm-test",
                                    "resources": {"limits": {fraction: "0.5"}, "requests": {fraction: "0.5"}}}]}}
    uid = str(uuid.uuid4())
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                          "resource": {"group": "", "version": "v1", "resource": "pods"},
                          "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                          "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                          "name": "gpushard-helm-test", "namespace": namespace, "operation": "CREATE",
                          "userInfo": {"username": "gpushard-helm-test"}, "object": pod, "oldObject": None,
                          "dryRun": True, "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}
    status, body = post(url, path, review)
    if status != 200:
        fail(f"{url}{path} answered HTTP {status}: {body[:300]!r}")
    answer = json.loads(body).get("response") or {}
    if answer.get("uid") != uid or not answer.get("allowed"):
        fail(f"{url}{path} did not admit a pod asking {fraction} 0.5: {answer}")
    patch = json.loads(base64.b64decode(answer["patch"])) if answer.get("patch") else []
    if path == "/audit":
        if patch:
            fail(f"{url}{path} changed the pod, which audit never does: {patch}")
        print(f"gpushard: {url}{path} admitted the pod unchanged, with {len(answer.get('warnings') or [])} warnings")
        return
    want = math.ceil(0.5 * per_card)
    try:
        admitted = jsonpatch.apply_patch(pod, patch)
    except jsonpatch.JsonPatchException as exc:
        fail(f"{url}{path} answered a patch that does not apply: {exc}")
    limits = admitted["spec"]["containers"][0]["resources"].get("limits") or {}
    if str(limits.get(shares)) != str(want) or fraction in limits:
        fail(f"{url}{path} did not turn {fraction} 0.5 into {shares} {want}: limits {limits}")
    print(f"gpushard: {url}{path} admitted the pod as {shares} {want} of one card")


main()
