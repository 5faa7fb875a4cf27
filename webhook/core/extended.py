"""DeviceClasses that serve an extended resource (DRAExtendedResource), and what gpushard does about them.

With ``DRAExtendedResource`` (beta and on by default in Kubernetes 1.36, GA in 1.37) a DeviceClass
whose ``spec.extendedResourceName`` is, say, ``nvidia.com/gpu`` makes kube-scheduler serve a
container's ``nvidia.com/gpu: 1`` from that class's driver: on a node whose allocatable has none of
the resource, the scheduler makes a claim of the class for as many devices as the container asks.

The one safe thing: gpushard never rewrites a pod into a resource another driver serves. A class of
another driver serving gpushard's shares (``gpushard.io/gpu``) or a card name
(``gpushard.io/card-<k>``) would make the scheduler hand out that driver's devices, one per share,
wherever gpushard's agent offers none; every pod that would hold shares is denied until the class
or gpushard's config changes. A class serving the fraction name (``nvidia.com/gpu``) changes
nothing for fractions (the scheduler can never serve a fraction; gpushard keeps rewriting them into
its shares), but a whole card gpushard passes through stays that name and may be served by the
class's driver: both are said as warnings.

Classes are raw JSON here, read tolerantly: a class whose shape cannot be read serves nothing.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from webhook.core import asks as req
from webhook.core import findings as f
from webhook.core import names
from webhook.core import policy as policy_mod
from webhook.core.policy import Policy

KIND = "DeviceClass"
FIELD = "spec.extendedResourceName"
# The driver a class's CEL selector names: device.driver == "gpu.nvidia.com" (either side, either quote).
_DRIVER = re.compile(r"""device\.driver\s*==\s*(["'])([^"']+)\1|(["'])([^"']+)\3\s*==\s*device\.driver""")


@dataclass(frozen=True, slots=True)
class Served:
    """Who serves an extended resource: a DeviceClass, and the driver its selectors name ("" if none)."""

    device_class: str
    driver: str = ""
    created: str = ""  # metadata.creationTimestamp (RFC 3339, UTC): the newer class takes a name served twice

    def said(self) -> str:
        """The class as messages name it: ``DeviceClass gpu.nvidia.com (driver gpu.nvidia.com)``."""
        return f"{KIND} {self.device_class}" + (f" (driver {self.driver})" if self.driver else "")


NONE: Mapping[str, Served] = types.MappingProxyType({})


def driver_of(spec: Mapping) -> str:
    """The driver the first CEL selector of a class names by ``device.driver ==``, or ""."""
    selectors = spec.get("selectors")
    for selector in selectors if isinstance(selectors, list) else ():
        cel = selector.get("cel") if isinstance(selector, dict) else None
        expression = cel.get("expression") if isinstance(cel, dict) else None
        if isinstance(expression, str):
            found = _DRIVER.search(expression)
            if found:
                return found.group(2) or found.group(4)
    return ""


_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def name_problem(resource: object) -> str | None:
    """Why ``resource`` cannot be a DeviceClass's extendedResourceName, or None when it can: the API
    server's rule for an extended resource name (a domain of the operator's, not kubernetes.io, then a
    name; ``requests.`` before it must still be a qualified name, as quota writes it)."""
    if not isinstance(resource, str) or not resource:
        return "must be an extended resource name such as example.com/gpu"
    domain, slash, name = resource.partition("/")
    if not slash or "kubernetes.io/" in resource or resource.startswith("requests."):
        return "must be an extended resource name such as example.com/gpu (a domain, not kubernetes.io, then a name)"
    quota_domain = "requests." + domain
    if len(quota_domain) > 253 or not _SUBDOMAIN.fullmatch(quota_domain) or len(name) > 63 \
            or not _NAME.fullmatch(name):
        return ("must be an extended resource name such as example.com/gpu (a lowercase DNS domain, then a name of "
                "at most 63 letters, digits, '-', '_' or '.')")
    return None


def driver_problem(driver: object) -> str | None:
    """Why ``driver`` cannot be a DRA driver's name (a lowercase DNS subdomain of at most 63 characters)."""
    if isinstance(driver, str) and len(driver) <= 63 and _SUBDOMAIN.fullmatch(driver):
        return None
    return "must be a driver name such as gpu.nvidia.com (a lowercase DNS name of at most 63 characters)"


def read_class(obj: object) -> tuple[str, Served] | None:
    """(the extended resource it serves, who serves it) for a DeviceClass of another driver that names
    one in ``spec.extendedResourceName``; None for gpushard's own class, a class naming none (its
    implicit ``deviceclass.resource.kubernetes.io/<class>`` is no name of gpushard's), and any shape
    that cannot be read."""
    if not isinstance(obj, dict):
        return None
    meta, spec = obj.get("metadata"), obj.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        return None
    name, resource = meta.get("name"), spec.get("extendedResourceName")
    if not isinstance(name, str) or not name or name == names.DRA_DEVICE_CLASS:
        return None
    if not isinstance(resource, str) or not resource or resource.startswith(names.DRA_EXTENDED_PREFIX):
        return None
    created = meta.get("creationTimestamp")
    return resource, Served(name, driver_of(spec), created if isinstance(created, str) else "")


def winners(found: Iterable[tuple[str, Served]]) -> dict[str, Served]:
    """One class per resource name, the one the scheduler uses: the newest, then the first by name
    (the rule of ``DeviceClassSpec.extendedResourceName``)."""
    out: dict[str, Served] = {}
    for resource, by in found:
        held = out.get(resource)
        if held is None or by.created > held.created or (
                by.created == held.created and by.device_class < held.device_class):
            out[resource] = by
    return out


def frozen(served: dict[str, Served]) -> Mapping[str, Served]:
    """``served`` as a mapping nobody can change (the one empty mapping when it is empty)."""
    return types.MappingProxyType(served) if served else NONE


def served_by(classes: Iterable[object]) -> Mapping[str, Served]:
    """The extended resources served by DeviceClasses other than gpushard's own, read from raw objects."""
    return frozen(winners(read for read in map(read_class, classes) if read is not None))


# --- what gpushard makes of them --------------------------------------------------------------------

def writes(resource: str, policy: Policy) -> bool:
    """Whether gpushard writes ``resource`` into pods: its shares name, and with the device-plugin backend
    every card name (the card is chosen at admission, any index may be written)."""
    res = policy.resources
    if resource == res.shares:
        return True
    return policy.backend != policy_mod.DRA and res.card_index(resource) is not None


def taken_message(resource: str, by: Served, verdict: str) -> str:
    driver = f"driver {by.driver}" if by.driver else "that class's driver"
    return (f"gpushard: {KIND} {by.device_class} has {FIELD} {resource}, a resource gpushard writes, so the scheduler "
            f"would serve it with devices of {driver}; {verdict}: remove extendedResourceName from that class, or "
            "give gpushard other resource names in its config (resources)")


def shared_fraction_message(resource: str, by: Served, became: str, shares: str) -> str:
    return f"gpushard: {KIND} {by.device_class} serves {resource} too; the fraction {became} {shares} shares"


def passthrough_message(ask: req.ContainerAsk, resource: str, by: Served) -> str:
    return (f"gpushard: container \"{ask.name}\" keeps {resource} {ask.fraction_text}, which {KIND} "
            f"{by.device_class} serves where no device plugin does")


def pod_findings(asks: list[req.ContainerAsk], served: Mapping[str, Served], policy: Policy,
                 mode: str = names.MODE_ENFORCE) -> list[f.Finding]:
    """What the classes serving extended resources mean for one pod or template, read and checked.

    A pod that would hold shares is denied while another driver's class serves a name gpushard writes;
    a fraction rewritten while a class serves the fraction name, and a whole card passed through under
    it, are warned about.
    """
    if not served:
        return []
    res = policy.resources
    found = []
    holds = any(a.holds_share for a in asks)
    if holds:
        verdict = "the pod is denied" if mode == names.MODE_ENFORCE else "enforce mode denies the pod"
        for resource in sorted(served):
            if writes(resource, policy):
                found.append(f.Finding(f.EXTENDED_RESOURCE_TAKEN, f.DENY, taken_message(resource, served[resource],
                                                                                         verdict)))
        if found:
            return found
    by = served.get(res.fraction)
    if by is None:
        return found
    if any(a.holds_share and a.fraction is not None for a in asks):
        became = "became" if mode == names.MODE_ENFORCE else "would become"
        found.append(f.Finding(f.EXTENDED_RESOURCE_SHARED, f.WARN,
                               shared_fraction_message(res.fraction, by, became, res.shares)))
    for ask in asks:
        if ask.passthrough:
            found.append(f.Finding(f.EXTENDED_RESOURCE_SHARED, f.WARN, passthrough_message(ask, res.fraction, by),
                                   ask.name))
    return found


def class_findings(classes: Iterable[object], policy: Policy) -> list[tuple[str, f.Finding]]:
    """(class name, finding) for each DeviceClass of another driver that serves a name gpushard writes
    (denied pods), or the fraction name users write (warned), for an audit."""
    res = policy.resources
    out = []
    for obj in classes:
        read = read_class(obj)
        if read is None:
            continue
        resource, by = read
        if writes(resource, policy):
            out.append((by.device_class, f.Finding(f.EXTENDED_RESOURCE_TAKEN, f.DENY, taken_message(
                resource, by, "the webhook denies every pod that would hold shares while it does"))))
        elif resource == res.fraction:
            out.append((by.device_class, f.Finding(f.EXTENDED_RESOURCE_SHARED, f.WARN, (
                f"gpushard: {by.said()} serves {resource} ({FIELD}), the name users ask gpushard's fractions by: "
                f"fractions stay gpushard's ({res.shares}), but a whole card passed through may get this driver's "
                "device by DRA on nodes without a device plugin for it; keep this driver off gpushard's nodes"))))
    return out
