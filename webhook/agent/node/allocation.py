"""What the agent advertises and hands out, as plain data: resources, share IDs, Allocate's answer.

Nothing here knows gRPC or NVML calls; the device-plugin servicer translates to and from this.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

from webhook.agent.node import nvml
from webhook.core import names
from webhook.core import policy as policy_mod

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_DEVICE_ID = 63  # the kubelet's limit on a device ID

_ID = re.compile(r"^card-(0|[1-9][0-9]*)-(0|[1-9][0-9]*)$")
_POOL_ID = re.compile(r"^share-(0|[1-9][0-9]*)$")


class AllocationError(ValueError):
    """The kubelet asked for something this resource never advertised."""


@dataclass(frozen=True)
class Resource:
    """One advertised resource: its name, its socket file name, and its card (None: all cards)."""

    name: str
    endpoint: str
    card_index: int | None = None


def endpoint_for(resource_name: str) -> str:
    """The socket file name for a resource: the name with every run of odd characters as one '-'."""
    return re.sub(r"[^A-Za-z0-9]+", "-", resource_name).strip("-") + ".sock"


def resources(cards: Iterable[nvml.Card], policy: policy_mod.Policy) -> list[Resource]:
    """The node-wide shares resource first, then one per card, in card order."""
    res = policy.resources
    found = [Resource(res.shares, endpoint_for(res.shares))]
    found += [Resource(res.card(c.index), endpoint_for(res.card(c.index)), c.index)
              for c in sorted(cards, key=lambda c: c.index)]
    endpoints = [r.endpoint for r in found]
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"gpushard: resource names {[r.name for r in found]} give clashing socket names")
    return found


def device_id(card_index: int, share: int) -> str:
    """The ID of one share of card ``card_index``, as ``<cardPrefix><k>`` lists it."""
    return f"card-{card_index}-{share}"


def parse_device_id(device: str) -> tuple[int, int] | None:
    """(card index, share) of a share ID, or None if it is not one."""
    match = _ID.match(device)
    return (int(match[1]), int(match[2])) if match else None


def pool_id(number: int) -> str:
    """The ID of one share of the node-wide shares resource: it names no card.

    The kubelet hands out that resource's IDs without knowing the container's card, so an ID
    that named a card would name the wrong one for most containers, and that card's health
    would reach pods on other cards.
    """
    return f"share-{number}"


def parse_pool_id(device: str) -> int | None:
    """The number of a node-wide share ID, or None if it is not one."""
    match = _POOL_ID.match(device)
    return int(match[1]) if match else None


def device_list(resource: Resource, cards: Iterable[nvml.Card], healthy: Mapping[int, bool],
                shares_per_card: int, held: Mapping[str, int | None] | None = None) -> list[tuple[str, str]]:
    """(ID, health) of every share the resource advertises; a card missing from ``healthy`` is Unhealthy.

    A card's resource lists its shares with the card's health. The node-wide resource lists
    ``shares_per_card`` IDs per card, naming none (:func:`pool_list`); ``held`` maps the IDs
    containers hold to their container's card (None: not known).
    """
    indices = sorted(c.index for c in cards)
    if resource.card_index is None:
        return pool_list(len(indices) * shares_per_card,
                         shares_per_card * sum(1 for k in indices if healthy.get(k, False)), held or {}, healthy)
    indices = [k for k in indices if k == resource.card_index]
    return [(device_id(k, s), HEALTHY if healthy.get(k, False) else UNHEALTHY)
            for k in indices for s in range(shares_per_card)]


def _order(device: str) -> tuple[int, int, int, str]:
    # Numbers as numbers: share-2 before share-10, card-1-9 before card-1-10.
    parsed = parse_device_id(device)
    if parsed is not None:
        return (0, *parsed, "")
    number = parse_pool_id(device)
    return (0, -1, number, "") if number is not None else (1, 0, 0, device)


def pool_list(size: int, target: int, held: Mapping[str, int | None],
              healthy: Mapping[int, bool]) -> list[tuple[str, str]]:
    """(ID, health) of the node-wide resource: ``size`` IDs (and any other ID still held), ``target`` Healthy.

    An ID a container holds has the health of that container's card (Healthy when the card is
    not known), so a card going bad marks exactly the containers on it. The other IDs are
    Healthy, lowest first, until ``target`` IDs are (the node's count: shares per card x
    healthy cards), and Unhealthy after: no pod holds those, and the kubelet does not count
    them as allocatable. No ID ever leaves the list while held: the kubelet reports a held ID
    it no longer sees as Healthy, and refuses to admit again (node reboot) a container whose
    IDs are not all listed Healthy.
    """
    ids = [pool_id(n) for n in range(size)]
    ids += sorted(set(held) - set(ids), key=_order)  # held IDs from outside the pool: an earlier, larger one
    listed = []
    free = target - sum(1 for d in ids if d in held and (held[d] is None or healthy.get(cast(int, held[d]), False)))
    for device in ids:
        if device in held:
            card = held[device]
            listed.append((device, HEALTHY if card is None or healthy.get(card, False) else UNHEALTHY))
        else:
            listed.append((device, HEALTHY if free > 0 else UNHEALTHY))
            free -= 1
    return listed


def _check(resource: Resource, devices: Iterable[str], cards: Mapping[int, nvml.Card],
           shares_per_card: int) -> set[int]:
    touched = set()
    for device in devices:
        number = parse_pool_id(device) if resource.card_index is None else None
        if number is not None and number < shares_per_card * len(cards):
            continue  # one of the node-wide resource's own IDs: it names nothing to check
        parsed = parse_device_id(device)
        if parsed is None or parsed[0] not in cards or parsed[1] >= shares_per_card or (
                resource.card_index is not None and parsed[0] != resource.card_index):
            raise AllocationError(f"gpushard: {resource.name} has no device {device!r}")
        touched.add(parsed[0])
    return touched


@dataclass(frozen=True)
class Mount:
    """A host path the runtime mounts into the container."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class Allocation:
    """What one container gets for its devices of one resource.

    Each part maps to a field of the kubelet's ContainerAllocateResponse; the servicer
    translates it, so new answers (limits, more mounts) are added here and there only.
    """

    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    cdi_devices: tuple[str, ...] = ()  # fully qualified CDI names, vendor.com/class=name


def combined(first: Allocation, second: Allocation) -> Allocation:
    """Both answers for one container, as the kubelet would merge them: env keys of ``second`` win."""
    return Allocation({**first.envs, **second.envs}, first.mounts + second.mounts,
                      first.cdi_devices + second.cdi_devices)


def allocate(resource: Resource, devices: Iterable[str], cards: Iterable[nvml.Card], shares_per_card: int,
             strategy: Iterable[str] = policy_mod.DEFAULT_DEVICE_LIST_STRATEGY) -> Allocation:
    """What one container gets for its devices of one resource.

    A per-card resource names its card by UUID in each strategy of ``strategy``, with the
    meanings of NVIDIA's device plugin: ``envvar`` NVIDIA_VISIBLE_DEVICES; ``volume-mounts``
    /dev/null at <device-list folder>/<uuid>, which NVIDIA's toolkit reads before the env when
    accept-nvidia-visible-devices-as-volume-mounts is on, and which an author cannot write
    around (an env the container sets can); ``cdi-cri`` the CDI device nvidia.com/gpu=<uuid>.

    A list without ``envvar`` still sets NVIDIA_VISIBLE_DEVICES, to a value that names no card:
    the kubelet puts the plugin's env after the image's, so a CUDA image's own ``all`` would
    otherwise stand, and a toolkit that reads the env (its default for unprivileged containers)
    would give every card. With ``volume-mounts`` the value is the device-list folder, as
    NVIDIA's plugin sets it (the mounts carry the list; a toolkit that does not read them fails
    the container rather than give it every card); with ``cdi-cri`` alone, ``void`` (the runtime
    injects the CDI device itself; the toolkit's hook leaves the container alone).

    The node-wide shares resource is a sum for quotas: which share IDs the kubelet picked
    from it says nothing about the card, so it names no device at all. It takes its own IDs
    (``share-<n>``) and, from containers allocated before its IDs named no card, card share IDs. The kubelet merges the
    env of every resource in a container, keeping the first value of a key in an order it does
    not define, so any NVIDIA_VISIBLE_DEVICES from it could override the card's.
    """
    by_index = {c.index: c for c in cards}
    touched = _check(resource, devices, by_index, shares_per_card)
    if resource.card_index is None or not touched:
        return Allocation()
    uuid = by_index[resource.card_index].uuid
    strategy = tuple(strategy)
    envs: dict[str, str] = {}
    mounts: tuple[Mount, ...] = ()
    cdi: tuple[str, ...] = ()
    if policy_mod.ENVVAR in strategy:
        envs[names.VISIBLE_DEVICES_ENV] = uuid
    elif policy_mod.VOLUME_MOUNTS in strategy:
        envs[names.VISIBLE_DEVICES_ENV] = names.DEVICE_LIST_MOUNT_ROOT
    else:
        envs[names.VISIBLE_DEVICES_ENV] = names.VISIBLE_NONE
    if policy_mod.VOLUME_MOUNTS in strategy:
        mounts = (Mount(f"{names.DEVICE_LIST_MOUNT_ROOT}/{uuid}", names.DEVICE_LIST_MOUNT_SOURCE, read_only=True),)
    if policy_mod.CDI_CRI in strategy:
        cdi = (f"{names.NVIDIA_CDI_KIND}={uuid}",)
    return Allocation(envs=envs, mounts=mounts, cdi_devices=cdi)


def preferred(resource: Resource, available: Iterable[str], must_include: Iterable[str], size: int) -> list[str]:
    """The IDs we would like the kubelet to pick: the required ones, then the lowest shares.

    All shares of a card are alike; taking the lowest keeps the choice stable and easy to read,
    and keeps the node-wide resource's held IDs among the low ones its list marks Healthy first.
    """
    chosen: list[str] = []
    for device in must_include:
        if device not in chosen:
            chosen.append(device)
    for device in sorted(set(available) - set(chosen), key=_order):
        if len(chosen) >= size:
            break
        chosen.append(device)
    return chosen
