"""Choosing card index k for a pod over a snapshot of the cluster: binpack or spread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from webhook.core import findings as f
from webhook.core import names


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class Card:
    index: int
    capacity: int  # allocatable shares of gpushard.io/card-<index> (0 while unhealthy)
    used: int = 0  # shares held by non-terminal pods pinned to this card
    uuid: str = ""
    model: str = ""
    memory_mib: int = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(frozen=True)
class Node:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    ready: bool = True
    unschedulable: bool = False
    cards: tuple[Card, ...] = ()

    def effective_taints(self) -> tuple[Taint, ...]:
        """Taints as the scheduler sees them, with cordon and not-ready made explicit."""
        extra = []
        if self.unschedulable:
            extra.append(Taint(names.UNSCHEDULABLE_TAINT, "", "NoSchedule"))
        if not self.ready:
            extra.append(Taint(names.NOT_READY_TAINT, "", "NoSchedule"))
        return self.taints + tuple(extra)


@dataclass(frozen=True)
class View:
    """A read-only snapshot of the shared nodes and the shares held on their cards."""

    nodes: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Ask:
    """What placement needs to know of a pod."""

    shares: int
    pin: int | None = None
    node_name: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    required_terms: tuple[dict, ...] = ()  # nodeSelectorTerms, ORed
    tolerations: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Choice:
    card: int
    node: str | None = None  # the node whose card was chosen, when one fits
    fits: bool = False
    findings: tuple[f.Finding, ...] = ()


def ask_from_spec(spec: dict, shares: int, pin: int | None) -> Ask:
    """Placement's view of a pod spec (tolerant of missing fields)."""
    affinity = spec.get("affinity") or {}
    node_aff = (affinity.get("nodeAffinity") or {}) if isinstance(affinity, dict) else {}
    required = node_aff.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or [] if isinstance(required, dict) else []
    selector = spec.get("nodeSelector") or {}
    tolerations = spec.get("tolerations") or []
    return Ask(
        shares=shares,
        pin=pin,
        node_name=spec.get("nodeName") or None,
        node_selector=selector if isinstance(selector, dict) else {},
        required_terms=tuple(t for t in terms if isinstance(t, dict)),
        tolerations=tuple(t for t in tolerations if isinstance(t, dict)),
    )


def tolerates(tolerations: tuple[dict, ...], taint: Taint) -> bool:
    for tol in tolerations:
        effect = tol.get("effect") or ""
        if effect and effect != taint.effect:
            continue
        key = tol.get("key") or ""
        operator = tol.get("operator") or "Equal"
        if not key:
            if operator == "Exists":
                return True
            continue
        if key != taint.key:
            continue
        if operator == "Exists" or (tol.get("value") or "") == taint.value:
            return True
    return False


def _int(text: object) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None


def _expression_matches(expr: dict, values_by_key: Mapping[str, str]) -> bool:
    key = expr.get("key", "")
    op = expr.get("operator", "")
    values = expr.get("values") or []
    present = key in values_by_key
    value = values_by_key.get(key)
    if op == "In":
        return present and value in values
    if op == "NotIn":
        return not present or value not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt"):
        if not present or len(values) != 1:
            return False
        have, want = _int(value), _int(values[0])
        if have is None or want is None:
            return False
        return have > want if op == "Gt" else have < want
    return False


def _term_matches(term: dict, node: Node) -> bool:
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields:
        return False  # an empty term matches no objects
    return all(_expression_matches(e, node.labels) for e in exprs if isinstance(e, dict)) and all(
        _expression_matches(e, {"metadata.name": node.name}) for e in fields if isinstance(e, dict)
    )


def eligible(node: Node, ask: Ask) -> bool:
    """Whether the scheduler could put the pod on this node, capacity aside."""
    if ask.node_name and node.name != ask.node_name:
        return False
    for key, value in ask.node_selector.items():
        if node.labels.get(key) != value:
            return False
    if ask.required_terms and not any(_term_matches(t, node) for t in ask.required_terms):
        return False
    for taint in node.effective_taints():
        if taint.effect in ("NoSchedule", "NoExecute") and not tolerates(ask.tolerations, taint):
            return False
    return True


def _warn(rule: str, message: str) -> f.Finding:
    return f.Finding(rule, f.WARN, f"gpushard: {message}")


def choose(view: View | None, ask: Ask, strategy: str = "binpack") -> Choice:
    """Pick card k for the pod. Never fails: a poor view only costs packing, not correctness."""
    if view is None:
        k = ask.pin if ask.pin is not None else 0
        return Choice(k, findings=(_warn(f.NO_VIEW, f"no cluster view yet; card {k} chosen without "
                                         "looking, the scheduler still enforces capacity"),))
    candidates = [(node, card) for node in view.nodes if eligible(node, ask) for card in node.cards
                  if ask.pin is None or card.index == ask.pin]
    if not candidates:
        k = ask.pin if ask.pin is not None else 0
        return Choice(k, findings=(_warn(f.NO_MATCHING_NODE, f"no shared node matches this pod's "
                                         f"scheduling rules; card {k} chosen, the pod may stay Pending"),))
    fitting = [(node, card) for node, card in candidates if card.free >= ask.shares]
    if not fitting:
        node, card = max(candidates, key=lambda nc: (nc[1].free, -nc[1].index))
        return Choice(card.index, findings=(_warn(
            f.NO_ROOM, f"no card has {ask.shares} free shares now; card {card.index} chosen, "
            "the pod stays Pending until one frees up"),))
    if strategy == "spread":
        node, card = max(fitting, key=lambda nc: (nc[1].free, -nc[1].index))
    else:
        node, card = min(fitting, key=lambda nc: (nc[1].free, nc[1].index))
    return Choice(card.index, node=node.name, fits=True)
