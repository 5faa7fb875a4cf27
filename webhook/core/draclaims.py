"""The pod as gpushard admits it with backend dra: its shares become one pod-level claim; no card is chosen.

The pod's shares (max of the largest init container and the sum of the others, as Kubernetes
counts them) become a claim from the namespace's template ``gpushard-shares-<n>``, which asks one
device of gpushard's DeviceClass consuming ``n`` of its ``shares`` capacity. The scheduler picks
the card when it places the pod, among cards with room. Every GPU container names that claim
in ``resources.claims`` and keeps its own ``gpushard.io/gpu`` count, which the agent writes into
its Node's status, so ResourceQuota keeps counting shares. Every container gets
``NVIDIA_VISIBLE_DEVICES=void``: the card reaches the GPU containers by CDI, never by that env,
so an image's ``all`` cannot widen what a container sees. Only gpushard names its claim, its
templates and its class in a pod (``claim_findings``); the policy gpushard-dra-claims of the dra
overlay keeps everyone else from making claims or templates of the class.

A memory ask is sized at admission, as with the device plugin: placement picks a card size with
room, the asks become that size's shares, and the claim's template asks one card of that size (a
selector on the slice's ``memoryMiB``), so the scheduler never gives the pod a card its shares were
not computed for.
"""

from __future__ import annotations

from typing import cast

from webhook.core import asks as req
from webhook.core import draobjects, names, quantities, rewrite
from webhook.core import findings as f
from webhook.core.policy import Policy

# The rule id of a card an author pins while the scheduler chooses cards.
PIN_WITH_DRA = "pin-with-dra"


def pin_findings(asks: list[req.ContainerAsk], policy: Policy) -> list[f.Finding]:
    """Containers whose ask the DRA backend cannot keep: a card pin (the scheduler chooses the card)."""
    found = []
    for ask in asks:
        if ask.holds_share and ask.pin is not None:
            found.append(f.Finding(PIN_WITH_DRA, f.DENY, (
                f"gpushard: container \"{ask.name}\" names {policy.resources.card(ask.pin)}; with backend dra the "
                f"scheduler chooses the card: ask {policy.resources.fraction} or {policy.resources.shares}"),
                ask.name))
    return found


# The rule id of a claim, or an extended resource, that would reach gpushard's class around the webhook.
NOT_GPUSHARDS = "dra-claim-not-gpushards"


def _extended_name() -> str:
    """The extended resource every DeviceClass answers to when DRAExtendedResource is on."""
    return f"{names.DRA_EXTENDED_PREFIX}{names.DRA_DEVICE_CLASS}"


def claim_findings(spec: dict, asks: list[req.ContainerAsk], pod_shares: int) -> list[f.Finding]:
    """What only gpushard may name in a pod: its claim, its templates and its class.

    The claim gpushard-gpu comes from the template of the pod's own shares, and only the containers
    that hold them name it: a pod asking no GPU carrying it, another pod claim naming a template
    gpushard-shares-<n>, or a container without shares naming the claim would take a card's shares
    that no ``gpushard.io/gpu`` quota counts (or that the pod's count does not say). The webhook writes
    the pod's own entry itself, so an author's entry named gpushard-gpu in a GPU pod is replaced.
    """
    found = []
    listed = spec.get("resourceClaims")
    for entry in listed if isinstance(listed, list) else []:
        if not isinstance(entry, dict):
            continue
        name, template = entry.get("name"), entry.get("resourceClaimTemplateName")
        if name == names.DRA_POD_CLAIM and pod_shares <= 0:
            found.append(f.Finding(NOT_GPUSHARDS, f.DENY, (
                f"gpushard: pod claim \"{name}\" (spec.resourceClaims) is gpushard's own and this pod asks no GPU: "
                "remove it, or ask nvidia.com/gpu and gpushard writes it")))
        elif name != names.DRA_POD_CLAIM and isinstance(template, str) and \
                template.startswith(names.DRA_TEMPLATE_PREFIX):
            found.append(f.Finding(NOT_GPUSHARDS, f.DENY, (
                f"gpushard: pod claim \"{name}\" names template {template}, which only gpushard's own claim "
                f"\"{names.DRA_POD_CLAIM}\" names: ask nvidia.com/gpu and gpushard writes it")))
    extended = _extended_name()
    for ask in asks:
        container = spec[ask.list_key][ask.position]
        resources = container.get("resources") if isinstance(container.get("resources"), dict) else {}
        if any(isinstance(resources.get(part), dict) and extended in resources[part]
               for part in ("limits", "requests")):
            found.append(f.Finding(NOT_GPUSHARDS, f.DENY, (
                f"gpushard: container \"{ask.name}\" asks {extended}, the whole card around gpushard's "
                "shares: ask nvidia.com/gpu or gpushard.io/gpu"), ask.name))
        elif not ask.holds_share and any(isinstance(c, dict) and c.get("name") == names.DRA_POD_CLAIM
                                         for c in _claims_of(container)):
            found.append(f.Finding(NOT_GPUSHARDS, f.DENY, (
                f"gpushard: container \"{ask.name}\" names claim \"{names.DRA_POD_CLAIM}\" (resources.claims) but "
                "asks no GPU: remove it there, or ask nvidia.com/gpu in that container"), ask.name))
    return found


def waiting_findings(placed: tuple[f.Finding, ...], pod_shares: int) -> list[f.Finding]:
    """Placement's word on a pod that fits nowhere now, said as it is with the scheduler choosing the card."""
    found = []
    for finding in placed:
        if finding.rule == f.NO_ROOM:
            found.append(f.Finding(f.NO_ROOM, f.WARN, (
                f"gpushard: no card has {pod_shares} free shares now; the pod stays Pending until the "
                "scheduler finds one with room")))
        elif finding.rule == f.NO_MATCHING_NODE:
            found.append(f.Finding(f.NO_MATCHING_NODE, f.WARN, (
                "gpushard: no shared node matches this pod's scheduling rules; the pod may stay Pending")))
    return found


def _claims_of(container: dict) -> list:
    resources = container.get("resources")
    claims = resources.get("claims") if isinstance(resources, dict) else None
    return list(claims) if isinstance(claims, list) else []


def _set_shares(container: dict, policy: Policy, count: str) -> None:
    res = policy.resources
    resources = dict(container["resources"]) if isinstance(container.get("resources"), dict) else {}
    for part in ("limits", "requests"):
        current = dict(resources[part]) if isinstance(resources.get(part), dict) else {}
        for key in list(current):
            if key in (res.fraction, res.shares, res.memory) or res.card_index(key) is not None:
                del current[key]
        current[res.shares] = count
        resources[part] = current
    claims = _claims_of(container)
    if not any(isinstance(c, dict) and c.get("name") == names.DRA_POD_CLAIM for c in claims):
        claims.append({"name": names.DRA_POD_CLAIM})
    resources["claims"] = claims
    container["resources"] = resources


def _set_pod_claim(spec: dict, pod_shares: int, size_mib: int = 0) -> None:
    wanted = {"name": names.DRA_POD_CLAIM,
              "resourceClaimTemplateName": draobjects.template_name(pod_shares, size_mib)}
    listed = spec.get("resourceClaims")
    claims = [c for c in listed if not (isinstance(c, dict) and c.get("name") == names.DRA_POD_CLAIM)] \
        if isinstance(listed, list) else []
    spec["resourceClaims"] = claims + [wanted]


def pod(obj: dict, asks: list[req.ContainerAsk], pod_shares: int, policy: Policy,
        sized: tuple[int, int] | None = None) -> dict:
    """The pod with its shares as a claim (when it holds any) and GPU env owned; the input is not touched.

    ``sized`` (card MiB, asked MiB), for a pod that asked GPU memory: its asks carry the shares of a
    card of that size, its claim comes from the template that asks one card of that size
    (``gpushard-shares-<n>-mib-<size>``), and annotations record what it asked and the size.
    """
    new = dict(obj)
    spec = new["spec"] = dict(obj["spec"])
    for key, _group in req.CONTAINER_LISTS:
        if isinstance(spec.get(key), list):
            spec[key] = list(spec[key])
    for ask in asks:
        container = spec[ask.list_key][ask.position] = dict(spec[ask.list_key][ask.position])
        if ask.holds_share:
            _set_shares(container, policy, str(ask.shares))
            rewrite.set_env(container, names.VISIBLE_DEVICES_ENV, names.VISIBLE_NONE)
            rewrite.set_env(container, names.FRACTION_ENV,
                            quantities.fraction_text(ask.shares, policy.shares_per_card))
        elif ask.passthrough:
            if rewrite.env_value(container, names.VISIBLE_DEVICES_ENV):
                rewrite.remove_env(container, names.VISIBLE_DEVICES_ENV)
        elif policy.hide_unrequested_gpus:
            rewrite.set_env(container, names.VISIBLE_DEVICES_ENV, names.VISIBLE_NONE)
    if pod_shares <= 0:
        return new
    _set_pod_claim(spec, pod_shares, sized[0] if sized else 0)
    if policy.runtime_class_name and not spec.get("runtimeClassName"):
        spec["runtimeClassName"] = policy.runtime_class_name
    meta = new["metadata"] = dict(new["metadata"]) if isinstance(new.get("metadata"), dict) else {}
    annotations = cast(dict, meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {})
    labels = cast(dict, meta.get("labels") if isinstance(meta.get("labels"), dict) else {})
    ours = {names.SHARES_ANNOTATION: str(pod_shares)}
    if sized:
        ours[names.MEMORY_ANNOTATION] = str(sized[1])
        ours[names.CARD_MEMORY_ANNOTATION] = str(sized[0])
    meta["annotations"] = {**annotations, **ours}
    meta["labels"] = {**labels, names.SHARED_LABEL: names.SHARED_LABEL_VALUE}
    return new
