"""We test, on the real kube-apiserver, gpushard's entries beside another mutating webhook that adds a container
after them (a service mesh's sidecar injector, here a real HTTPS admission webhook of the test's own, called after
gpushard's configuration as the API server orders configurations by name). With ``reinvocationPolicy: IfNeeded``
the API server calls the gpushard entry that judged the pod again, and:
- a pod that asks no GPU in an enforce namespace: the injected sidecar is hidden from the cards too
  (``NVIDIA_VISIBLE_DEVICES=void``), as its first container was: the hide entry's own rewrite must not make the
  reinvocation skip it;
- a pod that asks a fraction: its container keeps its card, the sidecar is hidden;
- a plain pod whose injected sidecar is privileged: refused, with gpushard's message (the hide entry is called
  again and judges it by the enforce rules; a condition that sent the changed pod to neither entry once let it
  through unjudged).
Admission only (server-side dry run): nothing is scheduled.
"""

from __future__ import annotations

import base64
import http.server
import json
import ssl
import threading

import pytest

from tests.e2e import components, objects

INJECTOR = "zz-e2e-sidecar-injector"
LABEL = "e2e.gpushard.io/inject"
# A pod annotated so gets a privileged sidecar.
PRIVILEGED = "e2e.gpushard.io/privileged-sidecar"


class Injector(http.server.BaseHTTPRequestHandler):
    """Adds a container named "sidecar" to every pod that lacks one, as a mesh's injector does."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request = review["request"]
        containers = request["object"]["spec"].get("containers") or []
        answer = {"uid": request["uid"], "allowed": True}
        if not any(c.get("name") == "sidecar" for c in containers):
            sidecar = {"name": "sidecar", "image": "registry.example/mesh-proxy:1"}
            if PRIVILEGED in (request["object"]["metadata"].get("annotations") or {}):
                sidecar["securityContext"] = {"privileged": True}
            patch = [{"op": "add", "path": "/spec/containers/-", "value": sidecar}]
            answer.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(patch).encode()).decode())
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": answer}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def injector(plane, kubectl, installed):
    cert, key = plane.pki.issue("injector", "e2e-injector", ips=("127.0.0.1",), server=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Injector)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubectl.apply(json.dumps({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": INJECTOR},
        "webhooks": [{
            "name": "sidecar.e2e.gpushard.io", "failurePolicy": "Fail", "sideEffects": "None",
            "admissionReviewVersions": ["v1"], "timeoutSeconds": 5, "reinvocationPolicy": "Never",
            "namespaceSelector": {"matchLabels": {LABEL: "yes"}},
            "clientConfig": {"url": f"https://127.0.0.1:{server.server_address[1]}/inject",
                             "caBundle": base64.b64encode(plane.pki.ca_path.read_bytes()).decode()},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"],
                       "scope": "Namespaced"}]}]}))
    yield server
    kubectl.run("delete", "mutatingwebhookconfiguration", INJECTOR, check=False)
    server.shutdown()


def admitted(kubectl: components.Kubectl, namespace: str, pod: str) -> dict:
    """The pod as admission leaves it (a server-side dry run: the webhooks run, nothing is stored)."""
    kubectl.run("label", "namespace", namespace, f"{LABEL}=yes", "--overwrite")
    result = {}

    def injected() -> bool:
        done = kubectl.run("create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-", input=pod,
                           check=False)
        if done.returncode != 0:
            result["error"] = done.stderr
            return False
        result["pod"] = json.loads(done.stdout)
        return any(c["name"] == "sidecar" for c in result["pod"]["spec"]["containers"])
    # The configuration reaches the API server's admission through its informer: give it a moment.
    components.wait_for("the sidecar injected", injected, timeout=30, explain=lambda: result.get("error", ""))
    return {c["name"]: objects.env_of(c) for c in result["pod"]["spec"]["containers"]}


def test_a_plain_pods_injected_sidecar_is_hidden_too(kubectl, injector, namespace):
    envs = admitted(kubectl, namespace, objects.pod("plain"))
    assert envs == {"main": {"NVIDIA_VISIBLE_DEVICES": "void"}, "sidecar": {"NVIDIA_VISIBLE_DEVICES": "void"}}


def test_a_gpu_pods_injected_sidecar_is_hidden_and_its_card_kept(kubectl, agent, injector, namespace):
    envs = admitted(kubectl, namespace, objects.pod("quarter", objects.container(gpu="0.25")))
    assert envs["sidecar"] == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert envs["main"]["NVIDIA_VISIBLE_DEVICES"].isdigit(), envs


def test_a_plain_pods_privileged_sidecar_is_judged_and_refused(kubectl, injector, namespace):
    kubectl.run("label", "namespace", namespace, f"{LABEL}=yes", "--overwrite")
    pod = objects.pod("escalated", annotations={PRIVILEGED: "yes"})
    result = {}

    def refused() -> bool:
        done = kubectl.run("create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-", input=pod,
                           check=False)
        result["done"] = done
        return done.returncode != 0 and "gpushard:" in done.stderr
    # The configuration reaches the API server's admission through its informer: give it a moment.
    components.wait_for("the privileged sidecar refused", refused, timeout=30,
                        explain=lambda: result["done"].stdout[-2000:] + result["done"].stderr)
    assert 'admission webhook "hide.gpushard.io" denied the request' in result["done"].stderr
    assert "privileged" in result["done"].stderr
