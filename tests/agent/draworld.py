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
