"""We test who may read the agent's metrics, on the wire: the agent's real metrics server (TLS) and the local
Kubernetes API server answering its TokenReviews and SubjectAccessReviews:
- from the network: no token is 401, an unknown token 401, a valid token of a user not allowed `get` on
  nodes/metrics of this node 403, and none of those answers holds a per-container series; Prometheus's
  service account token, allowed that right, gets every series; a user allowed it only on another node is
  refused;
- the answers are cached: a second scrape with the same token sends no new review; an API server that
  fails is 503 and not remembered; an agent with no API credentials serves the network nothing;
- plain HTTP gets no metrics (the tokens would cross the network in clear otherwise);
- from the agent pod's own loopback (where a port-forward arrives) no token is needed;
- connections that stall hold at most CONNECTIONS_MAX of the agent's threads: one past it is closed at once,
  and once they are gone a scrape is answered again;
- the peer and header rules themselves: loopback in IPv4, IPv6 and IPv4-mapped forms, bearer parsing;
- the kubelet's probes (/healthz, /readyz) need no token, from the network too: 200 "ok" while the agent is whole,
  503 naming what is wrong when not, and no metric in either answer.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import ssl
import threading

import pytest

from tests.fakekube import FakeKube
from tests.polling import eventually
from webhook import authorizing
from webhook.agent.metrics import exporting
from webhook.agent.node import nvml

NODE = "gpu-node-1"
PROMETHEUS = "system:serviceaccount:monitoring:prometheus-k8s"
TENANT = "system:serviceaccount:team-a:default"
UNVERIFIED = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
UNVERIFIED.check_hostname = False
UNVERIFIED.verify_mode = ssl.CERT_NONE


def _observation() -> exporting.Observation:
    card = nvml.Card(0, "GPU-aaaa", "NVIDIA L4", 16384)
    row = exporting.CardRow(card, True, True, nvml.Usage(0, 16384 * nvml.MIB, 5), shares_allocated=25,
                            containers=[exporting.ContainerRow("team-b", "train", "main", 25, 4 * nvml.MIB, None)])
    return exporting.Observation(NODE, 100, [row], pod_resources_up=True)


def network_address() -> str | None:
    """An address of this machine other than loopback, as a pod on the network would reach the agent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.fixture
def kube():
    with FakeKube() as fake:
        fake.users = {"prom-token": (PROMETHEUS, ("system:serviceaccounts",)),
                      "tenant-token": (TENANT, ("system:serviceaccounts",)),
                      "other-node-token": ("bob", ())}
        fake.grants = [{"subject": PROMETHEUS, "verb": "get", "group": "", "resource": "nodes",
                        "subresource": "metrics"},
                       {"subject": "bob", "verb": "get", "group": "", "resource": "nodes", "subresource": "metrics",
                        "name": "gpu-node-2"}]
        yield fake


@pytest.fixture
def agent(kube):
    reviewer = authorizing.Reviewer(kube.api_client(), authorizing.node_metrics(NODE))
    server = exporting.Server(exporting.new_registry(_observation), 0, addr="0.0.0.0", reviewer=reviewer, node=NODE)
    server.reviewer = reviewer
    yield server
    server.close()


def scrape(address: str, port: int, token: str | None = None, path: str = "/metrics") -> tuple[int, str]:
    conn = http.client.HTTPSConnection(address, port, timeout=10, context=UNVERIFIED)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def reviews(kube) -> int:
    return sum(1 for m, p, _ in kube.requests if m == "POST" and p.endswith("/tokenreviews"))


def test_only_an_allowed_token_reads_the_metrics_from_the_network(kube, agent):
    address = network_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    for token, status in ((None, 401), ("forged", 401), ("tenant-token", 403), ("other-node-token", 403)):
        got, body = scrape(address, agent.port, token)
        assert got == status, (token, body)
        assert "gpushard_container" not in body and "team-b" not in body
        assert body.startswith("gpushard: ")
    got, body = scrape(address, agent.port, "prom-token")
    assert got == 200
    assert 'gpushard_container_shares{UUID="GPU-aaaa",container="main",gpu="0",modelName="NVIDIA L4",' \
           'namespace="team-b",node="gpu-node-1",pod="train"} 25.0' in body
    # The SubjectAccessReview asked for this node's nodes/metrics, as the user the token is.
    sent = [json.loads(b)["spec"] for m, p, b in kube.requests if p.endswith("/subjectaccessreviews")]
    assert {"user": PROMETHEUS, "groups": ["system:serviceaccounts"], "resourceAttributes": {
        "verb": "get", "group": "", "resource": "nodes", "subresource": "metrics", "name": NODE}} in sent


def test_answers_are_cached_and_an_api_failure_is_not(kube, agent):
    before = reviews(kube)
    assert scrape("127.0.0.1", agent.port, "prom-token")[0] == 200  # loopback: no review at all
    assert reviews(kube) == before
    assert agent.reviewer.review("prom-token").allowed and agent.reviewer.review("prom-token").allowed
    assert agent.reviewer.review("tenant-token").status == 403
    assert agent.reviewer.review("tenant-token").status == 403
    assert reviews(kube) == before + 2
    kube.fail_next = [500]
    assert agent.reviewer.review("other-node-token").status == 503
    assert agent.reviewer.review("other-node-token").status == 403
    assert reviews(kube) == before + 4


def test_no_api_credentials_serve_the_network_nothing():
    assert authorizing.check("10.1.2.3", "Bearer prom-token", None).status == 503
    assert authorizing.check("10.1.2.3", None, None).status == 401
    assert authorizing.check("127.0.0.1", None, None).allowed


def test_plain_http_gets_no_metrics(agent):
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    try:
        with pytest.raises((http.client.HTTPException, OSError)):
            conn.request("GET", "/metrics")
            body = conn.getresponse().read()
            assert b"gpushard_container" not in body
            raise http.client.HTTPException("answered plain HTTP")
    finally:
        conn.close()


def test_a_port_forward_needs_no_token(agent):
    got, body = scrape("127.0.0.1", agent.port)
    assert got == 200 and 'pod="train"' in body
    assert scrape("127.0.0.1", agent.port, "forged")[0] == 200  # the API server checked the port-forward


@pytest.mark.parametrize("peer, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("::ffff:127.0.0.1", True), ("10.244.3.7", False),
                                            ("::ffff:10.244.3.7", False), ("fd00::2", False), ("junk", False)])
def test_loopback_forms(peer, loopback):
    assert authorizing.is_loopback(peer) is loopback


@pytest.mark.parametrize("header, token", [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None),
                                           ("Bearer", None), ("", None), (None, None)])
def test_bearer_tokens(header, token):
    assert authorizing.bearer_token(header) == token


def test_stalled_connections_hold_a_bounded_number_of_threads(agent):
    before = threading.active_count()
    stalled = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(exporting.CONNECTIONS_MAX)]
    try:
        eventually(lambda: threading.active_count() >= before + exporting.CONNECTIONS_MAX,
                   "a thread for each stalled connection", timeout=10, interval=0.05)
        assert threading.active_count() == before + exporting.CONNECTIONS_MAX
        extra = socket.create_connection(("127.0.0.1", agent.port))
        extra.settimeout(10)
        assert extra.recv(1) == b""  # closed at once, no thread started for it
        extra.close()
        assert threading.active_count() == before + exporting.CONNECTIONS_MAX
    finally:
        for sock in stalled:
            sock.close()
    eventually(lambda: threading.active_count() <= before, "the stalled connections' threads gone", timeout=15,
               interval=0.05)
    assert scrape("127.0.0.1", agent.port)[0] == 200


def test_the_kubelets_probes_need_no_token_and_say_what_is_wrong(kube):
    problems = {"/healthz": [], "/readyz": ["the kubelet has not registered gpushard.io/gpu yet"]}
    server = exporting.Server(exporting.new_registry(_observation), 0, addr="0.0.0.0", node=NODE,
                              reviewer=authorizing.Reviewer(kube.api_client(), authorizing.node_metrics(NODE)),
                              probes={path: (lambda path=path: problems[path]) for path in problems})
    try:
        address = network_address() or "127.0.0.1"
        assert scrape(address, server.port, path="/healthz") == (200, "ok\n")
        assert scrape(address, server.port, path="/readyz") == (
            503, "gpushard: the kubelet has not registered gpushard.io/gpu yet\n")
        problems["/healthz"] = ["its gpushard-health loop ended", "its gRPC server on /x.sock does not answer"]
        assert scrape(address, server.port, path="/healthz") == (
            503, "gpushard: its gpushard-health loop ended; its gRPC server on /x.sock does not answer\n")
        assert scrape(address, server.port, path="/metrics")[0] == (401 if address != "127.0.0.1" else 200)
        assert reviews(kube) == 0
    finally:
        server.close()
