"""What the DRA backend writes to resource.k8s.io/v1, the API's rules for those fields, and reading allocations.

Every object gpushard writes (a node's ResourceSlice, the DeviceClass, a namespace's
ResourceClaimTemplates) is built here and checked here against the rules the API server applies
to the fields gpushard sets (kubernetes/kubernetes staging/src/k8s.io/api/resource/v1/types.go;
see docs/dra.md), so a rule gpushard would break fails a test rather than a node in a cluster.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from webhook.core import names, quantities

# Limits from resource/v1/types.go.
MAX_DEVICES_PER_SLICE = 128  # ResourceSliceMaxDevices (64 once any device has taints or consumes counters)
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_DOMAIN = 63  # DeviceMaxDomainLength
MAX_ID = 32  # DeviceMaxIDLength
MAX_ATTRIBUTE_VALUE = 64  # DeviceAttributeMaxValueLength
MAX_DRIVER_NAME = 63  # DriverNameMaxLength
MAX_POOL_NAME = 253  # PoolNameMaxLength
MAX_REQUESTS = 32  # DeviceRequestsMaxSize
MAX_SELECTORS = 32  # DeviceSelectorsMaxSize

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WHOLE = re.compile(r"^(0|[1-9][0-9]*)$")


def is_dns_label(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 63 and bool(_LABEL.match(value))


def is_dns_subdomain(value: object, limit: int = 253) -> bool:
    return isinstance(value, str) and len(value) <= limit and bool(_SUBDOMAIN.match(value)) and all(
        len(part) <= 63 for part in value.split("."))


def is_qualified_name(value: object) -> bool:
    """A device attribute or capacity name: a C identifier, or domain/C identifier."""
    if not isinstance(value, str):
        return False
    domain, slash, ident = value.rpartition("/")
    if slash and not is_dns_subdomain(domain, MAX_DOMAIN):
        return False
    return len(ident) <= MAX_ID and bool(_C_IDENTIFIER.match(ident))


def _whole(value: object) -> int | None:
    """A quantity gpushard writes: a whole non-negative number as canonical text."""
    return int(value) if isinstance(value, str) and _WHOLE.match(value) else None


# --- names ---------------------------------------------------------------------------------------


def pool_name(node: str) -> str:
    """The node's pool: the name a claim's allocation, and the kubelet's health of its devices, go by."""
    return node


def device_name(index: int) -> str:
    """The device that is card ``index`` in a node's pool."""
    return f"card-{index}"


def card_index(device: object) -> int | None:
    """The card index a device name stands for, or None when it is none of ours."""
    if not isinstance(device, str) or not device.startswith("card-"):
        return None
    number = device[len("card-"):]
    return int(number) if _WHOLE.match(number) else None


def slice_name(node: str, driver: str = names.DRA_DRIVER) -> str:
    """The node's one ResourceSlice: ``<node>-<driver>``, shortened with a digest when too long."""
    name = f"{node}-{driver}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{node[:253 - len(driver) - 12].rstrip('-.')}-{digest}-{driver}"


def template_name(shares: int, size_mib: int = 0) -> str:
    """The ResourceClaimTemplate for a claim of ``shares`` shares of one card (of ``size_mib`` MiB, when
    the shares were computed for that size: a memory ask)."""
    if size_mib:
        return f"{names.DRA_TEMPLATE_PREFIX}{shares}{names.DRA_TEMPLATE_SIZE_INFIX}{size_mib}"
    return f"{names.DRA_TEMPLATE_PREFIX}{shares}"


def memory_selector(size_mib: int, driver: str = names.DRA_DRIVER) -> str:
    """The CEL selector that keeps a claim on cards of ``size_mib`` MiB (the slice's ``memoryMiB``)."""
    return f'device.attributes["{driver}"].memoryMiB == {int(size_mib)}'


# --- objects -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CardFacts:
    """What a node says about one of its cards in its ResourceSlice."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    isolation: str = "none"  # the node's isolation mode: none | memory | mps
    memory_limits: bool = False  # whether the driver caps a container's memory


def _text(value: str) -> dict:
    return {"string": value[:MAX_ATTRIBUTE_VALUE]}


def device(card: CardFacts, shares_per_card: int) -> dict:
    """One card as a DRA device: identity attributes, and ``shares`` a claim consumes in whole shares.

    A claim that names no shares takes the whole card (the policy's default), as a claim for an
    unshared device would.
    """
    whole = str(shares_per_card)
    span = {"min": "1", "max": whole, "step": "1"}
    if shares_per_card == 1:
        span.pop("step")  # the API wants min + step <= value: a card of one share has no step to take
    return {
        "name": device_name(card.index),
        "attributes": {
            "uuid": _text(card.uuid),
            "index": {"int": card.index},
            "model": _text(card.model),
            "memoryMiB": {"int": card.memory_mib},
            "isolation": _text(card.isolation),
            "memoryLimits": {"bool": card.memory_limits},
        },
        "capacity": {
            names.DRA_SHARES_CAPACITY: {
                "value": whole,
                "requestPolicy": {"default": whole, "validRange": span},
            },
        },
        "allowMultipleAllocations": True,
    }


def resource_slice(node: str, cards: Iterable[CardFacts], shares_per_card: int, generation: int,
                   driver: str = names.DRA_DRIVER) -> dict:
    """The node's ResourceSlice: one pool named for the node, one device per card, in card order."""
    return {
        "apiVersion": names.DRA_API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, driver)},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool_name(node), "generation": generation, "resourceSliceCount": 1},
            "devices": [device(c, shares_per_card) for c in sorted(cards, key=lambda c: c.index)],
        },
    }


def device_class(name: str = names.DRA_DEVICE_CLASS, driver: str = names.DRA_DRIVER) -> dict:
    """gpushard's DeviceClass: every device of its driver."""
    return {
        "apiVersion": names.DRA_API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def claim_template(namespace: str, shares: int, device_class_name: str = names.DRA_DEVICE_CLASS,
                   size_mib: int = 0) -> dict:
    """A namespace's template for a claim of ``shares`` shares of one card of gpushard's class; with
    ``size_mib``, of one card of that size (a memory ask's shares hold its memory only on such a card)."""
    exactly: dict = {
        "deviceClassName": device_class_name,
        "allocationMode": "ExactCount",
        "count": 1,
    }
    if size_mib:
        exactly["selectors"] = [{"cel": {"expression": memory_selector(size_mib)}}]
    exactly["capacity"] = {"requests": {names.DRA_SHARES_CAPACITY: str(shares)}}
    return {
        "apiVersion": names.DRA_API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(shares, size_mib), "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "gpushard"}},
        "spec": {"spec": {"devices": {"requests": [{"name": names.DRA_REQUEST, "exactly": exactly}]}}},
    }


# --- the API's rules -----------------------------------------------------------------------------


def _check_name(problems: list[str], obj: dict, namespaced: bool) -> None:
    meta = obj.get("metadata") or {}
    if not is_dns_subdomain(meta.get("name")):
        problems.append(f"metadata.name: {meta.get('name')!r} is not a DNS subdomain")
    if namespaced and not is_dns_label(meta.get("namespace")):
        problems.append(f"metadata.namespace: {meta.get('namespace')!r} is not a namespace name")


def _check_attribute(problems: list[str], where: str, value: object) -> None:
    if not isinstance(value, dict) or len([k for k in ("int", "bool", "string", "version") if k in value]) != 1 \
            or len(value) != 1:
        problems.append(f"{where}: must set exactly one of int, bool, string, version, got {value!r}")
        return
    kind, item = next(iter(value.items()))
    if kind == "int" and (isinstance(item, bool) or not isinstance(item, int)):
        problems.append(f"{where}.int: {item!r} is not an integer")
    elif kind == "bool" and not isinstance(item, bool):
        problems.append(f"{where}.bool: {item!r} is not true or false")
    elif kind in ("string", "version") and (not isinstance(item, str) or len(item) > MAX_ATTRIBUTE_VALUE):
        problems.append(f"{where}.{kind}: must be a string of at most {MAX_ATTRIBUTE_VALUE} characters, "
                        f"got {item!r}")


def _check_capacity(problems: list[str], where: str, capacity: object, shared: bool) -> None:
    if not isinstance(capacity, dict):
        problems.append(f"{where}: must be a mapping, got {capacity!r}")
        return
    value = _whole(capacity.get("value"))
    if value is None:
        problems.append(f"{where}.value: {capacity.get('value')!r} is not a whole quantity")
        return
    policy = capacity.get("requestPolicy")
    if policy is None:
        return
    if not shared:
        problems.append(f"{where}.requestPolicy: needs allowMultipleAllocations: true on the device")
    if not isinstance(policy, dict):
        problems.append(f"{where}.requestPolicy: must be a mapping, got {policy!r}")
        return
    if "validValues" in policy and "validRange" in policy:
        problems.append(f"{where}.requestPolicy: validValues and validRange are exclusive")
    span = policy.get("validRange")
    if span is None:
        return
    default = _whole(policy.get("default"))
    low, high, step = (_whole(span.get(k)) if span.get(k) is not None else None for k in ("min", "max", "step"))
    if default is None:
        problems.append(f"{where}.requestPolicy.default: must be set with validRange, got {policy.get('default')!r}")
        return
    if low is None:
        problems.append(f"{where}.requestPolicy.validRange.min: {span.get('min')!r} is not a whole quantity")
        return
    if low > value:
        problems.append(f"{where}.requestPolicy.validRange.min: {low} exceeds the capacity {value}")
    if high is not None and (high > value or high < low):
        problems.append(f"{where}.requestPolicy.validRange.max: {high} is not between min {low} and the "
                        f"capacity {value}")
    if not low <= default <= (high if high is not None else value):
        problems.append(f"{where}.requestPolicy.default: {default} is outside the valid range")
    if step is not None:
        if step <= 0:
            problems.append(f"{where}.requestPolicy.validRange.step: must be positive, got {step}")
            return
        for key, number in (("default", default), ("validRange.max", high)):
            if number is not None and number % step:
                problems.append(f"{where}.requestPolicy.{key}: {number} is not a multiple of step {step}")
        if low + step > value:
            problems.append(f"{where}.requestPolicy.validRange: min + step ({low + step}) exceeds the "
                            f"capacity {value}")


def check_slice(obj: dict) -> list[str]:
    """The API's rules for every field of a ResourceSlice gpushard sets; empty when it would be taken."""
    problems: list[str] = []
    _check_name(problems, obj, namespaced=False)
    spec = obj.get("spec") or {}
    if not is_dns_subdomain(spec.get("driver"), MAX_DRIVER_NAME) or spec.get("driver") != str(
            spec.get("driver")).lower():
        problems.append(f"spec.driver: {spec.get('driver')!r} is not a lower-case DNS subdomain of at most "
                        f"{MAX_DRIVER_NAME} characters")
    pool = spec.get("pool") or {}
    pool_name = pool.get("name")
    if not isinstance(pool_name, str) or len(pool_name) > MAX_POOL_NAME or not all(
            is_dns_subdomain(part) for part in pool_name.split("/")):
        problems.append(f"spec.pool.name: {pool_name!r} is not DNS subdomains separated by slashes")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        problems.append(f"spec.pool.generation: must be an integer >= 0, got {pool.get('generation')!r}")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        problems.append(f"spec.pool.resourceSliceCount: must be > 0, got {pool.get('resourceSliceCount')!r}")
    chosen = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(chosen) != 1:
        problems.append(f"spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection must be "
                        f"set, got {chosen}")
    elif chosen == ["nodeName"] and not is_dns_subdomain(spec["nodeName"]):
        problems.append(f"spec.nodeName: {spec['nodeName']!r} is not a node name")
    devices = spec.get("devices") or []
    limit = MAX_DEVICES_PER_SLICE
    if any(d.get("taints") or d.get("consumesCounters") for d in devices if isinstance(d, dict)):
        limit = 64
    if len(devices) > limit:
        problems.append(f"spec.devices: {len(devices)} devices; a slice holds at most {limit}")
    seen: set[object] = set()  # names as written, DNS labels or not
    for i, dev in enumerate(devices):
        where = f"spec.devices[{i}]"
        if not isinstance(dev, dict):
            problems.append(f"{where}: must be a mapping")
            continue
        name = dev.get("name")
        if not is_dns_label(name):
            problems.append(f"{where}.name: {name!r} is not a DNS label")
        elif name in seen:
            problems.append(f"{where}.name: {name!r} is listed twice")
        seen.add(name)
        attributes = dev.get("attributes") or {}
        capacity = dev.get("capacity") or {}
        if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
            problems.append(f"{where}: {len(attributes)} attributes and {len(capacity)} capacities; at most "
                            f"{MAX_ATTRIBUTES_AND_CAPACITIES} together")
        for key, value in attributes.items():
            if not is_qualified_name(key):
                problems.append(f"{where}.attributes: {key!r} is not a qualified name")
            _check_attribute(problems, f"{where}.attributes[{key}]", value)
        shared = dev.get("allowMultipleAllocations") is True
        for key, value in capacity.items():
            if not is_qualified_name(key):
                problems.append(f"{where}.capacity: {key!r} is not a qualified name")
            _check_capacity(problems, f"{where}.capacity[{key}]", value, shared)
    return problems


def check_device_class(obj: dict) -> list[str]:
    problems: list[str] = []
    _check_name(problems, obj, namespaced=False)
    selectors = (obj.get("spec") or {}).get("selectors") or []
    if len(selectors) > MAX_SELECTORS:
        problems.append(f"spec.selectors: at most {MAX_SELECTORS}, got {len(selectors)}")
    for i, selector in enumerate(selectors):
        expression = ((selector or {}).get("cel") or {}).get("expression")
        if not isinstance(expression, str) or not expression.strip():
            problems.append(f"spec.selectors[{i}].cel.expression: must be a CEL expression, got {expression!r}")
    return problems


# staging/src/k8s.io/api/resource/v1/types.go: DeviceSelectorsMaxSize, CELSelectorExpressionMaxLength.
MAX_SELECTORS = 32
MAX_SELECTOR_LENGTH = 10 * 1024


def check_claim_template(obj: dict) -> list[str]:
    problems: list[str] = []
    _check_name(problems, obj, namespaced=True)
    requests = (((obj.get("spec") or {}).get("spec") or {}).get("devices") or {}).get("requests") or []
    if not 1 <= len(requests) <= MAX_REQUESTS:
        problems.append(f"spec.spec.devices.requests: 1 to {MAX_REQUESTS} requests, got {len(requests)}")
    for i, request in enumerate(requests):
        where = f"spec.spec.devices.requests[{i}]"
        if not is_dns_label(request.get("name")):
            problems.append(f"{where}.name: {request.get('name')!r} is not a DNS label")
        exactly = request.get("exactly")
        if not isinstance(exactly, dict) or "firstAvailable" in request:
            problems.append(f"{where}: must set exactly one of exactly, firstAvailable")
            continue
        if not is_dns_subdomain(exactly.get("deviceClassName")):
            problems.append(f"{where}.exactly.deviceClassName: {exactly.get('deviceClassName')!r} is not a "
                            "DeviceClass name")
        mode = exactly.get("allocationMode", "ExactCount")
        if mode not in ("ExactCount", "All"):
            problems.append(f"{where}.exactly.allocationMode: {mode!r} is not ExactCount or All")
        count = exactly.get("count", 1)
        if mode == "ExactCount" and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            problems.append(f"{where}.exactly.count: must be > 0, got {count!r}")
        selectors = exactly.get("selectors", [])
        if not isinstance(selectors, list) or len(selectors) > MAX_SELECTORS:
            problems.append(f"{where}.exactly.selectors: at most {MAX_SELECTORS} selectors")
        for j, selector in enumerate(selectors if isinstance(selectors, list) else ()):
            expression = ((selector or {}).get("cel") or {}).get("expression") if isinstance(selector, dict) else None
            if not isinstance(expression, str) or not expression or len(expression) > MAX_SELECTOR_LENGTH:
                problems.append(f"{where}.exactly.selectors[{j}].cel.expression: must be a CEL expression of 1 to "
                                f"{MAX_SELECTOR_LENGTH} characters, got {expression!r}")
        asked = ((exactly.get("capacity") or {}).get("requests")) or {}
        for key, value in asked.items():
            if not is_qualified_name(key):
                problems.append(f"{where}.exactly.capacity.requests: {key!r} is not a qualified name")
            if _whole(value) is None or _whole(value) == 0:
                problems.append(f"{where}.exactly.capacity.requests[{key}]: {value!r} is not a positive quantity")
    return problems


def rounded(asked: int, policy: Mapping) -> int | None:
    """What a request of ``asked`` consumes under a capacity's requestPolicy (None: not allowed), as the
    allocator rounds it: up to min, then up to min + n*step; above max no device fits."""
    span = policy.get("validRange") or {}
    low = _whole(span.get("min")) or 0
    high = _whole(span.get("max")) if span.get("max") is not None else None
    step = _whole(span.get("step")) if span.get("step") is not None else None
    amount = max(asked, low)
    if step:
        amount = low + -(-(amount - low) // step) * step
    if high is not None and amount > high:
        return None
    return amount


# --- reading a claim's allocation ----------------------------------------------------------------


class ClaimError(ValueError):
    """A claim gpushard cannot prepare: the message says why, naming the claim."""


@dataclass(frozen=True)
class Result:
    """One of the claim's allocated devices that belongs to our driver."""

    request: str
    pool: str
    device: str
    card: int
    shares: int
    share_id: str | None


def _consumed_shares(result: dict, driver: str, shares_per_card: int) -> int:
    consumed = result.get("consumedCapacity") or {}
    for key in (names.DRA_SHARES_CAPACITY, f"{driver}/{names.DRA_SHARES_CAPACITY}"):
        if key in consumed:
            try:
                value = quantities.parse(consumed[key])
            except quantities.QuantityError:
                raise ValueError(f"consumed {key} {consumed[key]!r} is not a quantity") from None
            if value != int(value) or not 1 <= value <= shares_per_card:
                raise ValueError(f"consumed {key} {consumed[key]!r} is not 1 to {shares_per_card} whole shares")
            return int(Fraction(value))
    # No consumedCapacity: allocated by a scheduler without consumable capacity, so the whole card.
    return shares_per_card


def our_results(claim: dict, driver: str, shares_per_card: int) -> list[Result]:
    """The claim's allocated devices of ``driver``; ClaimError when it has none or one is none of ours."""
    meta = claim.get("metadata") or {}
    named = f"{meta.get('namespace')}/{meta.get('name')}"
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"gpushard: claim {named} is not allocated")
    results = ((allocation.get("devices") or {}).get("results")) or []
    ours = []
    for result in results:
        if not isinstance(result, dict) or result.get("driver") != driver:
            continue
        card = card_index(result.get("device"))
        if card is None:
            raise ClaimError(f"gpushard: claim {named} was given device {result.get('device')!r}, which is none "
                             f"of {driver}'s cards")
        try:
            shares = _consumed_shares(result, driver, shares_per_card)
        except ValueError as exc:
            raise ClaimError(f"gpushard: claim {named}: {exc}") from None
        ours.append(Result(str(result.get("request", "")), str(result.get("pool", "")), result["device"], card,
                           shares, result.get("shareID")))
    if not ours:
        drivers = sorted({str(r.get("driver")) for r in results if isinstance(r, dict)})
        raise ClaimError(f"gpushard: claim {named} has no device of driver {driver} (its devices are from "
                         f"{', '.join(drivers) or 'no driver'}); it is not gpushard's to prepare")
    return ours
