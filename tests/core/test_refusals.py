"""We test the reader of the pods the kubelet refused at admission (core/refusals.py), which `gpushard status` and
the replacer share:
- a Failed pod with reason UnexpectedAdmissionError that asked gpushard's shares (the shares resource, or a
  card-k resource alone, in a container or an init container) is read with its node, message and controller;
- a pod failed for another reason, one that asked no gpushard resource, a running pod and objects of odd shapes
  are not;
- the pods are ordered by node, namespace and name.
"""

from __future__ import annotations

import pytest

from webhook.core import refusals
from webhook.core.policy import Policy


def failed(name: str, limits: dict, node: str = "gpu-a", reason: str = "UnexpectedAdmissionError",
           init: bool = False, owner: dict | None = None, namespace: str = "ml") -> dict:
    containers = [{"name": "main", "resources": {"limits": limits}}]
    spec = {"nodeName": node, "initContainers" if init else "containers": containers}
    meta = {"name": name, "namespace": namespace, "uid": f"u-{name}"}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"metadata": meta, "spec": spec, "status": {"phase": "Failed", "reason": reason, "message": "no devices"}}


def test_a_refused_pod_is_read_with_what_brings_it_back():
    owner = {"kind": "ReplicaSet", "name": "train-7d9", "controller": True}
    pod = refusals.read(failed("train-x", {"gpushard.io/gpu": "50", "gpushard.io/card-1": "50"}, owner=owner),
                        Policy())
    assert pod == refusals.Refused("u-train-x", "ml", "train-x", "gpu-a", "no devices", "ReplicaSet/train-7d9")
    assert refusals.read(failed("card-only", {"gpushard.io/card-0": "1"}, init=True), Policy()).controller is None


@pytest.mark.parametrize("pod", [
    failed("evicted", {"gpushard.io/gpu": "50"}, reason="Evicted"),
    failed("whole", {"nvidia.com/gpu": "1"}),
    {**failed("running", {"gpushard.io/gpu": "50"}), "status": {"phase": "Running"}},
    {"metadata": [], "spec": "x", "status": {"phase": "Failed", "reason": "UnexpectedAdmissionError"}},
    {"metadata": {}, "spec": {"containers": ["main", {"resources": []}]},
     "status": {"phase": "Failed", "reason": "UnexpectedAdmissionError"}},
    "not a pod",
])
def test_other_pods_and_odd_shapes_are_not_refused_pods(pod):
    assert refusals.read(pod, Policy()) is None


def test_the_pods_come_by_node_namespace_and_name():
    pods = [failed("b", {"gpushard.io/gpu": "1"}, node="gpu-b"), failed("z", {"gpushard.io/gpu": "1"}),
            failed("a", {"gpushard.io/gpu": "1"}, namespace="zz"), failed("c", {"gpushard.io/gpu": "1"})]
    assert [(p.node, p.namespace, p.name) for p in refusals.found(pods, Policy())] == [
        ("gpu-a", "ml", "c"), ("gpu-a", "ml", "z"), ("gpu-a", "zz", "a"), ("gpu-b", "ml", "b")]
