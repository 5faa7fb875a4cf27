"""We test, on the real API server with deploy/base installed, how a webhook replica finds its rank:
- with the webhook ServiceAccount's token (its Role gpushard-webhook-peers, nothing more), it lists and watches
  the EndpointSlices of the Service gpushard in gpushard-system, and its rank among the ready pods follows
  them: a pod becoming ready, or going, changes it;
- the same token may not read EndpointSlices of another namespace.
"""

from __future__ import annotations

import json

import kubernetes
import pytest

from tests.e2e import components, gpushard
from webhook.cluster import peers

NAME = "gpushard-e2e-peers"  # beside the controller's own slices of the Service, which list no ready pod here


def endpoint_slice(pods: dict[str, bool]) -> str:
    return json.dumps({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": NAME, "namespace": gpushard.SYSTEM, "labels": {"kubernetes.io/service-name": "gpushard"}},
        "ports": [{"name": "https", "port": 8443, "protocol": "TCP"}],
        "endpoints": [{"addresses": [f"10.9.0.{i + 1}"], "conditions": {"ready": ready},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": gpushard.SYSTEM}}
                      for i, (pod, ready) in enumerate(pods.items())]})


@pytest.fixture
def webhook_client(plane, kubectl, installed):
    token = kubectl.token("gpushard-webhook", gpushard.SYSTEM)
    return kubernetes.config.new_client_from_config(str(plane.token_config("webhook-peers", token)))


def test_a_replica_finds_its_rank_among_the_services_ready_pods(kubectl, webhook_client):
    kubectl.apply(endpoint_slice({"gpushard-webhook-a": True, "gpushard-webhook-b": True, "gpushard-webhook-c": False}))
    found = peers.Peers(webhook_client, gpushard.SYSTEM, "gpushard", "gpushard-webhook-b", watch_timeout=30,
                        backoff=(0.1, 1.0))
    found.informer.start()
    try:
        components.wait_for("rank 1 of 2", lambda: found.share() == (1, 2), timeout=30,
                            explain=lambda: f"{found.partition()}, errors {dict(found.informer.watch_errors)}")
        kubectl.apply(endpoint_slice({"gpushard-webhook-a": True, "gpushard-webhook-b": True,
                                      "gpushard-webhook-c": True}))
        components.wait_for("rank 1 of 3", lambda: found.share() == (1, 3), timeout=30)
        kubectl.apply(endpoint_slice({"gpushard-webhook-b": True}))
        components.wait_for("alone", lambda: found.partition() == peers.Partition(0, 1), timeout=30)
        assert found.share() is None
        assert not found.informer.watch_errors  # the Role allowed every list and watch
    finally:
        found.close()
        kubectl.run("delete", "endpointslice", NAME, "-n", gpushard.SYSTEM, "--ignore-not-found", check=False)


def test_the_webhook_reads_no_other_namespaces_endpoint_slices(webhook_client):
    api = kubernetes.client.DiscoveryV1Api(webhook_client)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        api.list_namespaced_endpoint_slice("default")
    assert refused.value.status == 403
