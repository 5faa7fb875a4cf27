"""What the API server would do to an object gpushard patched: apply, then validate.

Tests use this to prove that every patch gpushard answers with yields an object the
API server accepts: the JSONPatch applies, the object is schema-valid, every extended
resource is an integer, and requests equal limits for extended resources.
"""

from __future__ import annotations

import copy
from fractions import Fraction

import jsonpatch
import kubernetes_validate

from webhook.core import names, quantities, rewrite

SCHEMA_VERSION = "1.37"
NATIVE = ("cpu", "memory", "ephemeral-storage", "storage")


def is_extended(resource: str) -> bool:
    return "/" in resource and not resource.startswith("kubernetes.io/") and not resource.startswith(
        "requests.") and not resource.startswith("hugepages-") and resource not in NATIVE


class Rejected(AssertionError):
    """The API server would refuse this object."""


def pod_spec(obj: dict) -> dict:
    kind = obj.get("kind", names.POD_KIND)
    if kind == names.POD_KIND:
        return obj.get("spec") or {}
    return rewrite.pod_template(obj, names.TEMPLATE_PATHS[kind]).get("spec") or {}


def all_containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def validate(obj: dict) -> None:
    """Raise Rejected where the API server's validation would refuse ``obj``."""
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    except kubernetes_validate.utils.ValidationError as exc:
        raise Rejected(f"schema: {exc.message}") from None
    for c in all_containers(pod_spec(obj)):
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for name in set(limits) | set(requests):
            if not is_extended(name):
                continue
            values = {}
            for part, table in (("limits", limits), ("requests", requests)):
                if name in table:
                    value = quantities.parse(table[name])
                    if value.denominator != 1:
                        raise Rejected(f"{c['name']}: {part}.{name} {table[name]!r} must be an integer")
                    values[part] = value
            if "limits" not in values:
                raise Rejected(f"{c['name']}: {name} requested without a limit")
            if values.get("requests", values["limits"]) != values["limits"]:
                raise Rejected(f"{c['name']}: {name} requests must equal limits")


def admit(original: dict, patch: list[dict] | None) -> dict:
    """Apply the webhook's patch as the API server does, then validate the result."""
    obj = copy.deepcopy(original)
    if patch:
        obj = jsonpatch.JsonPatch(patch).apply(obj)
    validate(obj)
    return obj


def make_patch(original: dict, new: dict | None) -> list[dict]:
    if new is None:
        return []
    return jsonpatch.make_patch(original, new).patch


def card_shares(obj: dict, card_prefix: str = names.CARD_PREFIX) -> dict[int, Fraction]:
    """Per-card shares each container of a pod holds, summed naively (for invariants)."""
    out: dict[int, Fraction] = {}
    for c in all_containers(pod_spec(obj)):
        for name, value in ((c.get("resources") or {}).get("limits") or {}).items():
            if name.startswith(card_prefix):
                k = int(name[len(card_prefix):])
                out[k] = out.get(k, 0) + quantities.parse(value)
    return out
