"""What the scheduler reads of a pod and a node, and the terms gpushard adds for it.

The view types (``Node``, its ``Card``s, cordoned or not, and ``Taint``s), what placement knows of a pod (``Ask``,
from its spec), the scheduling predicates (``eligible``: node name, selector, required node
affinity, taints against tolerations, readiness and cordon), and the node-affinity terms that
carry a choice to the scheduler (the preferred hint, the required node, a card's memory size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from webhook.core import findings as f
from webhook.core import names

# The preferred node-affinity term gpushard may add for the node that placement chose.
PREFERRED_WEIGHT = 100
NODE_NAME_FIELD = "metadata.name"


_new = object.__new__
_set = object.__setattr__


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
    # An operator cordoned it (gpushard cordon): no room for new pods, while the pods on it still count.
    cordoned: bool = False

    @property
    def free(self) -> int:
        """Shares a new pod may take: none on a cordoned card (its capacity still shows what it has)."""
        free = self.capacity - self.used
        return min(free, 0) if self.cordoned else free

    def with_used(self, used: int) -> Card:
        """This card with ``used`` shares held. A remembered choice makes one per review: its fields
        are set as one dict, where the frozen ``__init__`` sets each through object.__setattr__."""
        card = _new(Card)
        _set(card, "__dict__", {"index": self.index, "capacity": self.capacity, "used": used, "uuid": self.uuid,
                                "model": self.model, "memory_mib": self.memory_mib, "cordoned": self.cordoned})
        return card


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

    def with_card(self, j: int, card: Card) -> Node:
        """This node with ``card`` in place of its ``j``-th card, made as ``Card.with_used`` is."""
        cards = self.cards
        node = _new(Node)
        _set(node, "__dict__", {"name": self.name, "labels": self.labels, "taints": self.taints, "ready": self.ready,
                                "unschedulable": self.unschedulable, "cards": (*cards[:j], card, *cards[j + 1:])})
        return node


def same_scheduling(a: Node, b: Node) -> bool:
    """Whether two node states admit exactly the same pods (shares aside)."""
    # A node rebuilt for its shares keeps its labels and taints objects: no need to compare them.
    return (a.name == b.name and a.ready == b.ready and a.unschedulable == b.unschedulable
            and (a.taints is b.taints or a.taints == b.taints) and (a.labels is b.labels or a.labels == b.labels))


# Ask is made once or twice per admission: slots, not frozen, since a frozen dataclass sets each
# field through object.__setattr__ (a microsecond per object). Nothing changes it after it is made.
@dataclass(slots=True)
class Ask:
    """What placement needs to know of a pod."""

    shares: int
    pin: int | None = None
    node_name: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    required_terms: tuple[dict, ...] = ()  # nodeSelectorTerms, ORed
    tolerations: tuple[dict, ...] = ()
    priority: int = 0  # spec.priority: what the scheduler may preempt for it



def _mapping(value: object, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise f.ObjectError(field, f"expected a mapping, got {type(value).__name__}")
    return value


def _dicts(value: object, field: str) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise f.ObjectError(field, "expected a list of mappings")
    return tuple(value)


def ask_from_spec(spec: dict, shares: int, pin: int | None) -> Ask:
    """Placement's view of a pod spec; scheduling fields of the wrong shape are an ObjectError."""
    affinity = _mapping(spec.get("affinity"), "spec.affinity")
    node_aff = _mapping(affinity.get("nodeAffinity"), "spec.affinity.nodeAffinity")
    required = _mapping(node_aff.get("requiredDuringSchedulingIgnoredDuringExecution"),
                        "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution")
    terms = _dicts(required.get("nodeSelectorTerms"), "nodeSelectorTerms")
    for i, term in enumerate(terms):
        for part in ("matchExpressions", "matchFields"):
            for expr in _dicts(term.get(part), f"nodeSelectorTerms[{i}].{part}"):
                values = expr.get("values")
                if values is not None and (not isinstance(values, list)
                                           or not all(isinstance(v, str) for v in values)):
                    raise f.ObjectError(f"nodeSelectorTerms[{i}].{part}.values", "expected a list of strings")
    selector = _mapping(spec.get("nodeSelector"), "spec.nodeSelector")
    node_name = spec.get("nodeName") or None
    if node_name is not None and not isinstance(node_name, str):
        raise f.ObjectError("spec.nodeName", f"expected a string, got {type(node_name).__name__}")
    return Ask(
        shares=shares,
        pin=pin,
        node_name=node_name,
        node_selector={str(k): str(v) for k, v in selector.items()},
        required_terms=terms,
        tolerations=_dicts(spec.get("tolerations"), "spec.tolerations"),
        priority=_priority(spec.get("priority")),
    )


def _priority(value: object) -> int:
    """spec.priority as the API server's Priority admission set it (an int32); 0 when absent or of another type
    (the API server refuses such a pod anyway)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


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
        _expression_matches(e, {NODE_NAME_FIELD: node.name}) for e in fields if isinstance(e, dict)
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


# --- the soft hint for the scheduler -----------------------------------------------------------


def preferred_affinity_term(node_name: str) -> dict:
    """A preferred node-affinity term for the node whose card placement chose.

    Soft by design: the scheduler may still pick any node whose card k has room. It goes at the
    end of ``spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution``.
    ``matchFields`` on ``metadata.name`` names the node itself, where the hostname label may not.
    """
    return {"weight": PREFERRED_WEIGHT, "preference": {"matchFields": [
        {"key": NODE_NAME_FIELD, "operator": "In", "values": [node_name]}]}}


def required_node_expression(node_name: str) -> dict:
    """The ``matchFields`` expression that requires the node placement chose (policy.nodeAffinity: required)."""
    return {"key": NODE_NAME_FIELD, "operator": "In", "values": [node_name]}


def without_required_node(ask: Ask, node_name: str | None) -> Ask:
    """``ask`` without the expression ``required_node_expression(node_name)`` in its required terms, as
    a pod made again from the same template would ask (gpushard's choice for it is made afresh)."""
    if node_name is None or not ask.required_terms:
        return ask
    expression = required_node_expression(node_name)
    return _without(ask, "matchFields", lambda e: e == expression)


def _without(ask: Ask, part: str, gpushards: Callable[[object], bool]) -> Ask:
    """``ask`` without the requirements under ``part`` (matchFields or matchExpressions) of its
    required terms that ``gpushards`` says gpushard wrote; a term left with none of the author's
    requirements goes too, since gpushard made it whole."""
    terms, changed = [], False
    for term in ask.required_terms:
        found = term.get(part)
        if isinstance(found, list) and any(gpushards(e) for e in found):
            changed = True
            kept = [e for e in found if not gpushards(e)]
            term = {k: v for k, v in term.items() if k != part} | ({part: kept} if kept else {})
            if not term.get("matchExpressions") and not term.get("matchFields"):
                continue  # the term gpushard made: nothing of the author's is left in it
        terms.append(term)
    if not changed:
        return ask
    return Ask(ask.shares, ask.pin, ask.node_name, ask.node_selector, tuple(terms), ask.tolerations)


def preferred_node(spec: dict) -> str | None:
    """The node a pod spec's preferred term names, when the term is one preferred_affinity_term wrote."""
    affinity = spec.get("affinity") if isinstance(spec, dict) else None
    node_aff = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    terms = node_aff.get("preferredDuringSchedulingIgnoredDuringExecution") if isinstance(node_aff, dict) else None
    for term in terms if isinstance(terms, list) else ():
        if not isinstance(term, dict) or term.get("weight") != PREFERRED_WEIGHT:
            continue
        pref = term.get("preference")
        if not isinstance(pref, dict) or pref.get("matchExpressions"):
            continue
        fields = pref.get("matchFields")
        if (isinstance(fields, list) and len(fields) == 1 and isinstance(fields[0], dict)
                and fields[0].get("key") == NODE_NAME_FIELD and fields[0].get("operator") == "In"
                and isinstance(fields[0].get("values"), list) and len(fields[0]["values"]) == 1
                and isinstance(fields[0]["values"][0], str)):
            return fields[0]["values"][0]
    return None


# --- memory asks: the card memory a node's labels publish, and the term that keeps a pod on it ------


def card_memory_mib(node: Node, index: int) -> int | None:
    """Card ``index``'s memory in MiB as the node's label says it (what a required affinity matches)."""
    text = node.labels.get(names.card_memory_label(index))
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 9:
        return None
    value = int(text)
    return value or None


def card_memory_expression(index: int, size_mib: int) -> dict:
    """The required node-affinity expression that keeps a memory ask on card ``index`` of ``size_mib``."""
    return {"key": names.card_memory_label(index), "operator": "In", "values": [str(size_mib)]}


def without_card_memory(ask: Ask, index: int) -> Ask:
    """``ask`` without the expressions on card ``index``'s memory label in its required terms, as a pod
    made again from the same template would ask (a memory ask is sized afresh when it is created)."""
    key = names.card_memory_label(index)
    return _without(ask, "matchExpressions", lambda e: isinstance(e, dict) and e.get("key") == key)
