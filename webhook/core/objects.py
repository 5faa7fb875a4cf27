"""Pure readers of the Kubernetes objects gpushard reads, and the inventory format its agent writes.

One reading for everyone: the live view, the re-placement controller, ``audit`` and ``status``
read a Node's cards and a pod's shares here, so they cannot disagree about the same object.
The objects are raw JSON (dicts): the typed client models are too slow for thousands of pods.
Nothing here raises on odd input: an unreadable value counts as none.

A **shared node** is one where gpushard's agent runs: it advertises per-card capacity,
its inventory annotation lists a card, or it carries the agent's cards label.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from webhook.core import asks as req
from webhook.core import findings as f
from webhook.core import names, quantities
from webhook.core.policy import Policy

# A pod in one of these phases holds nothing any more: the scheduler and kubelet no longer count it.
TERMINAL_PHASES = ("Succeeded", "Failed")


def mapping(value: object) -> dict:
    """``value`` if it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def meta(obj: dict) -> dict:
    return mapping(obj.get("metadata"))


def key(obj: dict) -> str:
    """An object's identity: its uid, or namespace/name for one that has none (a manifest)."""
    m = obj.get("metadata") or {}
    return str(m.get("uid") or f"{m.get('namespace')}/{m.get('name')}")


def terminal(pod: dict) -> bool:
    """A pod that holds nothing any more (Succeeded or Failed)."""
    return mapping(pod.get("status")).get("phase") in TERMINAL_PHASES


def memory_asked_mib(pod: dict) -> int:
    """The MiB a pod placed by its memory ask asked, from gpushard's annotation (0 when none or unreadable)."""
    return _mib_annotation(pod, names.MEMORY_ANNOTATION)


def sized_for_mib(pod: dict) -> int:
    """The card size in MiB a pod placed by its memory ask was sized for (0 when none or unreadable)."""
    return _mib_annotation(pod, names.CARD_MEMORY_ANNOTATION)


def _mib_annotation(pod: dict, key: str) -> int:
    text = mapping(meta(pod).get("annotations")).get(key)
    return int(text) if isinstance(text, str) and text.isascii() and text.isdigit() and len(text) < 10 else 0


def controller(obj_meta: Mapping) -> dict | None:
    """The owner reference marked as the object's controller, if any."""
    refs = obj_meta.get("ownerReferences")
    if not isinstance(refs, list):
        return None
    return next((r for r in refs if isinstance(r, dict) and r.get("controller")), None)


def count(value: object) -> int:
    """A whole count from an allocatable or request value; an unreadable or negative one counts as none."""
    try:
        return max(0, math.floor(quantities.parse(value)))
    except (quantities.QuantityError, TypeError, ValueError):
        return 0


# --- the inventory annotation (written by the agent, read by everyone else) ----------------------

def inventory_entry(index: int, uuid: str, model: str, memory_mib: int, **extra: object) -> dict:
    """One card of the inventory, with the camelCase keys Kubernetes users expect. ``extra`` adds
    keys such as ``isolation``, or ``excluded`` (the reason) for a card the agent left out."""
    return {"index": index, "uuid": uuid, "model": model, "memoryMiB": memory_mib, **extra}


def write_inventory(entries: Iterable[Mapping]) -> str:
    """The annotation's value: the entries as a compact JSON list, by card index."""
    return json.dumps(sorted(entries, key=lambda e: e["index"]), separators=(",", ":"))


def read_inventory(annotation: object) -> dict[int, dict]:
    """Card index -> entry, from the annotation's value. Entries with ``excluded`` (cards the agent
    left out, MIG) and entries without a card index are skipped; unreadable text lists nothing."""
    if not isinstance(annotation, str):
        return {}
    try:
        listed = json.loads(annotation)
    except (ValueError, RecursionError):
        return {}
    out: dict[int, dict] = {}
    for item in listed if isinstance(listed, list) else ():
        index = item.get("index") if isinstance(item, dict) else None
        if isinstance(index, int) and not isinstance(index, bool) and index >= 0 and "excluded" not in item:
            out[index] = item
    return out


def card_memory(entry: Mapping) -> int:
    """An inventory entry's memory in MiB; 0 when it names none (or nothing a card could have)."""
    memory = entry.get("memoryMiB")
    return memory if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0 else 0


# --- cordons (written by an operator with `gpushard cordon`, read by everyone else) ------------------

@dataclass(frozen=True)
class Cordon:
    """An operator's cordon of one card: why, who, when (each may be empty: a hand-written annotation)."""

    reason: str = ""
    by: str = ""
    at: str = ""  # RFC 3339, as Kubernetes writes times

    def said(self) -> str:
        """The cordon in a few words, for tables and messages: ``by alice at 2026-03-01T10:00:00Z: fan``."""
        who = " ".join(part for part in (f"by {self.by}" if self.by else "", f"at {self.at}" if self.at else "")
                       if part)
        return ": ".join(part for part in (who, self.reason) if part) or "no reason given"

    def as_json(self) -> dict:
        return {"reason": self.reason, "by": self.by, "at": self.at}


def write_cordon(cordon: Cordon) -> str:
    """The cordon annotation's value: compact JSON of what is known."""
    return json.dumps({k: v for k, v in cordon.as_json().items() if v}, separators=(",", ":"))


def read_cordon(value: object) -> Cordon:
    """A cordon annotation's value. Any value cordons the card: text that is no JSON object is its reason."""
    text = value if isinstance(value, str) else ""
    try:
        parsed = json.loads(text) if text.lstrip().startswith("{") else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        return Cordon(reason=text.strip())
    return Cordon(*(parsed[k] if isinstance(parsed.get(k), str) else "" for k in ("reason", "by", "at")))


def read_cordons(annotations: object) -> dict[int, Cordon]:
    """Card index -> cordon, from a Node's annotations (``gpushard.io/card-<k>.cordoned``), by index."""
    found = {}
    for key, value in mapping(annotations).items():
        index = names.card_cordon_index(str(key))
        if index is not None:
            found[index] = read_cordon(value)
    return dict(sorted(found.items()))


# --- Nodes -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeCards:
    """What a Node says about its cards."""

    name: str
    shared: bool
    cards: Mapping[int, int]  # card index -> allocatable shares, by index
    fraction_allocatable: int = 0  # allocatable of the fraction resource (NVIDIA's plugin)
    inventory: Mapping[int, Mapping[str, object]] = field(default_factory=dict)
    cordoned: Mapping[int, Cordon] = field(default_factory=dict)  # cards an operator cordoned, by index

    @property
    def indexes(self) -> list[int]:
        """Every card the node offers or its agent lists (a listed card not offered has room 0)."""
        return sorted(set(self.cards) | set(self.inventory))


def node_cards(node: dict, policy: Policy) -> NodeCards:
    """A Node's cards from its allocatable per-card resources and its inventory, the cards an operator
    cordoned, and whether it is shared."""
    res = policy.resources
    m = meta(node)
    allocatable = mapping(mapping(node.get("status")).get("allocatable"))
    cards = {}
    for resource, value in allocatable.items():
        index = res.card_index(str(resource))
        if index is not None:
            cards[index] = count(value)
    annotations = mapping(m.get("annotations"))
    inventory = read_inventory(annotations.get(names.INVENTORY_ANNOTATION))
    return NodeCards(
        name=str(m.get("name") or ""),
        shared=bool(cards) or bool(inventory) or names.CARDS_LABEL in mapping(m.get("labels")),
        cards=dict(sorted(cards.items())),
        fraction_allocatable=count(allocatable.get(res.fraction, 0)),
        inventory=inventory,
        cordoned=read_cordons(annotations),
    )


# --- Pods --------------------------------------------------------------------------------------------

def card_shares(spec: dict, policy: Policy) -> dict[int, int]:
    """Per card index, the shares a pod spec requests, counted as Kubernetes counts a pod's requests."""
    per_card: dict[int, list[req.ContainerAsk]] = {}
    try:
        listed = req.containers(spec)
    except f.ObjectError:
        return {}
    card_index = policy.resources.card_index
    for list_key, position, container in listed:
        resources = container.get("resources")
        if not isinstance(resources, dict):
            continue
        limits = mapping(resources.get("limits"))
        requests = mapping(resources.get("requests"))
        group = req.APP
        if list_key == "initContainers":
            group = req.SIDECAR if container.get("restartPolicy") == "Always" else req.INIT
        for resource in set(limits) | set(requests):
            index = card_index(str(resource))
            if index is None:
                continue
            # Extended resources: requests default to limits and must equal them.
            shares = count(requests.get(resource, limits.get(resource)))
            if shares:
                per_card.setdefault(index, []).append(req.ContainerAsk(
                    name=str(container.get("name") or ""), group=group, list_key=list_key,
                    position=position, shares=shares))
    return {k: req.effective_shares(items) for k, items in sorted(per_card.items())}
