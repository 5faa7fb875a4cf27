"""Memory asks through /mutate, over a static view of a mixed fleet (24, 48 and 80 GB cards, and a
node with one of each).

We test:
- a burst of 12 GiB pods fills the 24 GB cards first (each pod's choice counts on its card until
  the view sees it), then moves to the 48 GB cards, each pod with shares for its card's size and a
  required affinity on that card's memory label; every patched pod is one the API server accepts;
- a memory ask that fits gets no warning: what it became is on the pod (its card, shares, the MiB it asked and
  the card size they were computed for, in annotations) and in the audit annotation; a pod that must wait
  for room is still warned;
- an ask above every card comes back as a 403 naming the largest card; a pod mixing memory and a
  fraction as a 403 naming both; a Deployment keeps its memory ask, with a limit;
- with the static view's labels drawn from the file's memoryMiB, as the agent publishes them;
- the metrics count memory pods and the MiB they asked, by the card size they were sized for.
"""

from __future__ import annotations

import json

import pytest

from tests.admission import objects
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.cluster import static
from webhook.core import names

MIXED = """\
nodes:
- name: small
  cards:
  - {index: 0, model: NVIDIA L4, memoryMiB: 23034}
  - {index: 1, model: NVIDIA L4, memoryMiB: 23034}
- name: medium
  cards:
  - {index: 0, model: NVIDIA L40S, memoryMiB: 46068}
  - {index: 1, model: NVIDIA L40S, memoryMiB: 46068}
- name: large
  cards:
  - {index: 0, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
  - {index: 1, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
- name: mixed
  cards:
  - {index: 0, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
  - {index: 1, model: NVIDIA L40S, memoryMiB: 46068}
  - {index: 2, model: NVIDIA L4, memoryMiB: 23034}
"""
SIZES = {("small", 0): 23034, ("small", 1): 23034, ("medium", 0): 46068, ("medium", 1): 46068,
         ("large", 0): 81559, ("large", 1): 81559, ("mixed", 0): 81559, ("mixed", 1): 46068, ("mixed", 2): 23034}


@pytest.fixture
def client(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED)
    view = static.StaticView(static.load(path, 100))
    return app_mod.create_app(settings_mod.Settings(), view).test_client()


def post(client, obj: dict) -> dict:
    review = objects.review(obj)
    resp = client.post("/mutate", data=json.dumps(review), content_type="application/json")
    assert resp.status_code == 200
    return objects.response_of(resp.get_json(), review["request"]["uid"])


def memory_pod(name: str, ask: str, *more: tuple[str, str]) -> dict:
    containers = [objects.container("c0", ask, resource=names.MEMORY_RESOURCE)]
    containers += [objects.container(f"c{i + 1}", value, resource=resource) for i, (resource, value) in enumerate(more)]
    return objects.pod(*containers, name=name)


def test_a_burst_fills_the_smallest_cards_first_then_the_next_size(client):
    seen = []
    for i in range(6):
        obj = memory_pod(f"p{i}", "12Gi")
        response = post(client, obj)
        new = objects.patched(obj, response)
        objects.assert_api_server_accepts(new)
        k = int(new["metadata"]["annotations"][names.CARD_ANNOTATION])
        node = new["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0][
            "preference"]["matchFields"][0]["values"][0]
        size = SIZES[(node, k)]
        term = new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert term == [{"matchExpressions": [
            {"key": f"gpushard.io/card-{k}.memory-mib", "operator": "In", "values": [str(size)]}]}]
        shares = -(-12288 * 100 // size)
        assert objects.shares_of(new["spec"]["containers"][0]) == {
            "gpushard.io/gpu": shares, f"gpushard.io/card-{k}": shares}
        assert new["metadata"]["annotations"][names.MEMORY_ANNOTATION] == "12288"
        assert new["metadata"]["annotations"][names.CARD_MEMORY_ANNOTATION] == str(size)
        assert "warnings" not in response
        assert response["auditAnnotations"]["memory-sized"] == (
            f"gpushard: the pod asks 12288 MiB of GPU memory: {shares} shares of card {k}, which has {size} MiB "
            f"({shares * size // 100} MiB held)")
        seen.append(size)
    # Three 24 GB cards hold one 54-share pod each; then the 48 GB cards (27 shares each) take the rest.
    assert seen == [23034] * 3 + [46068] * 3


def test_a_memory_ask_that_must_wait_is_still_warned(client):
    # Three 80 GB-sized asks fill the three 80 GB cards; the fourth waits.
    for i in range(3):
        assert "warnings" not in post(client, memory_pod(f"big{i}", "79Gi"))
    response = post(client, memory_pod("waits", "79Gi"))
    assert response["allowed"]
    assert [w for w in response["warnings"] if "stays Pending" in w], response["warnings"]
    assert not [w for w in response["warnings"] if "GPU memory" in w]
    assert set(response["auditAnnotations"]) == {"no-room", "memory-sized"}


def test_an_ask_above_every_card_is_a_403_naming_the_largest(client):
    response = post(client, memory_pod("huge", "96Gi"))
    assert not response["allowed"] and response["status"]["code"] == 403
    assert response["status"]["message"] == (
        "gpushard: the pod asks 98304 MiB of GPU memory, more than the largest card holds "
        "(NVIDIA H100 80GB HBM3, 81559 MiB); ask at most 81559Mi")


def test_memory_mixed_with_a_fraction_is_a_403(client):
    response = post(client, memory_pod("mixed", "12Gi", ("nvidia.com/gpu", "0.25")))
    assert not response["allowed"] and response["status"]["code"] == 403
    assert 'container "c0" asks gpushard.io/memory 12Gi while "c1" asks a share of a card' in \
        response["status"]["message"]


def test_a_deployment_keeps_its_memory_ask_with_a_limit(client):
    c = {"name": "serve", "image": "vllm", "resources": {"requests": {names.MEMORY_RESOURCE: "20Gi"}}}
    obj = objects.deployment(c)
    response = post(client, obj)
    new = objects.patched(obj, response)
    objects.assert_api_server_accepts(new)
    resources = new["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"limits": {names.MEMORY_RESOURCE: "20Gi"}, "requests": {names.MEMORY_RESOURCE: "20Gi"}}


def test_metrics_count_memory_pods_and_what_they_asked_by_card_size(client):
    for i in range(3):
        post(client, memory_pod(f"p{i}", "12Gi"))
    post(client, memory_pod("big", "60Gi"))
    post(client, objects.pod(objects.container("frac", "0.25"), name="frac"))
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'gpushard_memory_ask_pods_total{card_mib="23034"} 3.0' in metrics
    assert 'gpushard_memory_asked_mebibytes_total{card_mib="23034"} 36864.0' in metrics
    assert 'gpushard_memory_ask_pods_total{card_mib="81559"} 1.0' in metrics
    assert 'gpushard_memory_asked_mebibytes_total{card_mib="81559"} 61440.0' in metrics
    assert 'card_mib="46068"' not in metrics
