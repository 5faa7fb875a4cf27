"""Shares used and free per card with backend dra: from the nodes' ResourceSlices and the allocated claims.

With backend dra no pod names its card; the scheduler's allocation in each claim does. So
`gpushard status` reads the cards from gpushard's ResourceSlices and who holds what from the
claims' allocation results (the device, the consumed shares), and reports them in the same shape
as with the device plugin. Nothing is ever stranded: the scheduler never waits on one card while
another fits.
"""

from __future__ import annotations

from collections.abc import Iterable

from webhook.core import auditing, draobjects, names, objects


def _attribute(device: dict, name: str) -> object:
    value = (device.get("attributes") or {}).get(name)
    return next(iter(value.values()), None) if isinstance(value, dict) and len(value) == 1 else None


def _holder_name(claim: dict) -> str:
    """The pod a claim was made for: its reservation, else its owner, else the claim itself."""
    status = claim.get("status") or {}
    for entry in status.get("reservedFor") or ():
        if isinstance(entry, dict) and entry.get("resource") == "pods" and entry.get("name"):
            return str(entry["name"])
    for owner in (claim.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(owner, dict) and owner.get("kind") == "Pod" and owner.get("name"):
            return str(owner["name"])
    return str((claim.get("metadata") or {}).get("name", ""))


def usage(slices: Iterable[dict], claims: Iterable[dict], shares_per_card: int,
          driver: str = names.DRA_DRIVER, nodes: Iterable[dict] = ()) -> auditing.Usage:
    """Per node and card: the slice's shares, and the claims allocated on it. ``nodes``: the Nodes, for
    the cards an operator cordoned (such a card has left the slice: it shows with capacity 0, as one
    that turned Unhealthy, with its cordon)."""
    cordons = {str(objects.meta(n).get("name") or ""): objects.read_cordons(objects.meta(n).get("annotations"))
               for n in nodes}
    offered: dict[str, dict[int, tuple[int, dict]]] = {}
    for obj in slices:
        spec = obj.get("spec") or {}
        if spec.get("driver") != driver or not spec.get("nodeName"):
            continue
        cards = offered.setdefault(str(spec["nodeName"]), {})
        for device in spec.get("devices") or ():
            k = draobjects.card_index(device.get("name"))
            if k is None:
                continue
            value = ((device.get("capacity") or {}).get(names.DRA_SHARES_CAPACITY) or {}).get("value")
            cards[k] = (int(value) if isinstance(value, str) and value.isdigit() else 0, device)
    held: dict[tuple[str, int], list[auditing.Holder]] = {}
    for claim in claims:
        try:
            results = draobjects.our_results(claim, driver, shares_per_card)
        except draobjects.ClaimError:
            continue  # not allocated yet, or not ours
        namespace = str((claim.get("metadata") or {}).get("namespace", ""))
        for result in results:
            held.setdefault((result.pool, result.card), []).append(
                auditing.Holder(namespace, _holder_name(claim), result.shares))
    out = []
    for node in sorted(set(offered) | {n for n, _k in held} | {n for n, found in cordons.items() if found}):
        uses = []
        cordoned = cordons.get(node, {})
        for k in sorted(set(offered.get(node, {})) | {k for n, k in held if n == node} | set(cordoned)):
            capacity, device = offered.get(node, {}).get(k, (0, {}))
            holders = tuple(sorted(held.get((node, k), ()), key=lambda h: (h.namespace, h.name)))
            memory = _attribute(device, "memoryMiB")
            uses.append(auditing.CardUse(
                index=k, capacity=capacity, used=sum(h.shares for h in holders), holders=holders,
                model=str(_attribute(device, "model") or ""), uuid=str(_attribute(device, "uuid") or ""),
                memory_mib=memory if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0 else 0,
                cordon=cordoned.get(k)))
        out.append(auditing.NodeUse(node, tuple(uses)))
    return auditing.Usage(tuple(out))
