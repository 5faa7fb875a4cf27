"""Claims as the scheduler writes them, for the DRA tests: allocated on a card with consumed shares and a shareID."""

from __future__ import annotations

import uuid

from webhook.core import draobjects, names


def claim(namespace: str, name: str, uid: str, node: str, device: str | None, shares: int | None = None,
          driver: str = names.DRA_DRIVER, request: str = names.DRA_REQUEST) -> dict:
    """A ResourceClaim from gpushard's template, with status.allocation as the scheduler's allocator writes it."""
    template = draobjects.claim_template(namespace, shares or 1)
    result = {"request": request, "driver": driver, "pool": node, "device": device}
    if shares is not None:
        # Only devices with allowMultipleAllocations get a shareID and consumedCapacity.
        result["shareID"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{uid}/{device}"))
        result["consumedCapacity"] = {names.DRA_SHARES_CAPACITY: str(shares)}
    return {
        "apiVersion": names.DRA_API_VERSION, "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid,
                     "annotations": {"resource.kubernetes.io/pod-claim-name": names.DRA_POD_CLAIM}},
        "spec": template["spec"]["spec"],
        "status": {"allocation": {
            "devices": {"results": [result] if device else []},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        }},
    }


def reserved(claim: dict, pod: str, pod_uid: str) -> dict:
    """The claim owned by, and reserved for, one pod, as the controller and the scheduler leave it."""
    claim["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": pod_uid,
                                             "controller": True, "blockOwnerDeletion": True}]
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": pod_uid}]
    return claim


def holder(namespace: str, pod: str, pod_uid: str, *container_shares: int, node: str | None = None) -> dict:
    """A pod as gpushard's webhook (backend dra) leaves it: each GPU container's gpushard.io/gpu and the claim;
    with ``node``, as the scheduler bound it there."""
    containers = [{"name": f"c{i}", "image": "cuda:12", "resources": {
        "limits": {names.SHARES_RESOURCE: str(n)}, "requests": {names.SHARES_RESOURCE: str(n)},
        "claims": [{"name": names.DRA_POD_CLAIM}]}} for i, n in enumerate(container_shares)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": namespace, "name": pod, "uid": pod_uid},
            "spec": {"containers": containers or [{"name": "c", "image": "busybox"}],
                     "resourceClaims": [{"name": names.DRA_POD_CLAIM,
                                         "resourceClaimTemplateName": draobjects.template_name(
                                             sum(container_shares) or 1)}],
                     **({"nodeName": node} if node else {})}}
