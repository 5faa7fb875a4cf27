"""Which pods to re-place: pinned, waiting on a full card while another card has room, and recreated by their owner.

gpushard fixes card k when a pod is created; the scheduler can then only use card k. A pod can
wait for ever on card k while another card index has room on a node it may run on. Deleting it
lets its controller create a new pod, which gpushard places again. This module decides, over a
view of the bound pods' usage, which waiting pods to evict and how many: only as many as the
free cards can take together, oldest first, after the room that the other waiting pods will get
anyway, and none whose card is about to have room when its terminating pods are gone. The
adapter (``webhook.replacement``) lists, evicts and records; it decides nothing.

How each owner counts an eviction (see docs/notes/placement.md for the sources):

- ReplicaSet (and the Deployment above it): the pod is gone, the ReplicaSet makes a new one
  with a new name. Nothing is counted.
- StatefulSet: the controller recreates the pod with the same name and ordinal, and the same
  claims; a pod that never ran loses nothing. One pod per StatefulSet per pass, so a set whose
  pods are created in order is not emptied at once.
- Job: a pod deleted before it ends counts as failed against ``backoffLimit`` (and
  ``backoffLimitPerIndex``) unless the Job's ``podFailurePolicy`` has an ``Ignore`` rule for the
  ``DisruptionTarget`` condition, which the Eviction API sets on the pod. Only such Jobs are
  re-placed; others are reported, with the rule to add.
- Anything else (a bare pod, a DaemonSet, a custom controller): not evicted, only reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from webhook.core import placement

REPLICA_SET, STATEFUL_SET, JOB = "ReplicaSet", "StatefulSet", "Job"
RECREATING = (REPLICA_SET, STATEFUL_SET, JOB)
DISRUPTION_TARGET = "DisruptionTarget"


@dataclass(frozen=True)
class Owner:
    """The controller of a pod, as the adapter found it."""

    kind: str
    name: str
    found: bool = True  # False: the owner is gone (its pods will be garbage collected)
    deleting: bool = False
    ignores_disruption: bool = False  # Job: podFailurePolicy ignores DisruptionTarget
    finished: bool = False  # Job: Complete or Failed, or suspended


@dataclass(frozen=True)
class Waiting:
    """A pod gpushard pinned to ``card`` that no node has taken yet."""

    uid: str
    namespace: str
    name: str
    card: int
    shares: int
    age: float  # seconds since it was created
    ask: placement.Ask = field(default_factory=lambda: placement.Ask(shares=0))
    preferred: str | None = None  # the node gpushard's preferred term names
    owner_kind: str | None = None  # from the pod's controller ownerReference; None: a bare pod
    owner_name: str = ""
    gated: bool = False  # spec.schedulingGates: the scheduler does not look at it yet
    version: str = ""  # resourceVersion when listed: the eviction is refused if the pod changed since
    sized: bool = False  # placed by a memory ask: its card-size requirement is gpushard's, made afresh

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


@dataclass(frozen=True)
class Move:
    """Evict ``pod``: card ``to_card`` of ``to_node`` can take it (room reserved there in this plan)."""

    pod: Waiting
    to_node: str
    to_card: int


@dataclass(frozen=True)
class Stuck:
    """A pod waiting on a full card while another has room that gpushard does not evict, and why."""

    pod: Waiting
    to_node: str
    to_card: int
    why: str


@dataclass
class Plan:
    moves: list[Move] = field(default_factory=list)
    stuck: list[Stuck] = field(default_factory=list)
    unjudged: list[Waiting] = field(default_factory=list)  # owners to look up, then plan again
    waiting_for_room: int = 0  # stranded pods with no room on any other card either


def judge(pod: Waiting, owner: Owner | None) -> str | None:
    """None when the pod's owner recreates it safely after an eviction; else why not, for the user."""
    if pod.owner_kind is None:
        return ("gpushard: a bare pod: nothing would recreate it; delete it and create it again, "
                "and gpushard places it on a card with room")
    if pod.owner_kind not in RECREATING:
        return (f"gpushard: owned by a {pod.owner_kind}, which gpushard does not re-place; delete the pod "
                "if its controller recreates it")
    if owner is None or not owner.found or owner.deleting:
        return f"gpushard: its {pod.owner_kind} {pod.owner_name} is gone or being deleted"
    if pod.owner_kind == JOB:
        if owner.finished:
            return f"gpushard: its Job {pod.owner_name} is finished or suspended"
        if not owner.ignores_disruption:
            return (f"gpushard: an eviction would count against Job {pod.owner_name}'s backoffLimit; add a "
                    "podFailurePolicy rule {action: Ignore, onPodConditions: [{type: DisruptionTarget}]} "
                    "to let gpushard re-place its pods")
    return None


def job_ignores_disruption(spec: Mapping) -> bool:
    """Whether a Job spec's podFailurePolicy ignores pods with the DisruptionTarget condition.

    Rules apply in order and the first match wins, so an earlier rule that matches the same
    condition with another action (FailJob, Count, FailIndex) decides instead.
    """
    policy = spec.get("podFailurePolicy") if isinstance(spec, Mapping) else None
    rules = policy.get("rules") if isinstance(policy, Mapping) else None
    for rule in rules if isinstance(rules, list) else ():
        if not isinstance(rule, Mapping):
            continue
        conditions = rule.get("onPodConditions")
        for condition in conditions if isinstance(conditions, list) else ():
            if (isinstance(condition, Mapping) and condition.get("type") == DISRUPTION_TARGET
                    and condition.get("status", "True") in ("True", None)):
                return rule.get("action") == "Ignore"
    return False


def _reserve(view: placement.View, node_name: str, card: int, shares: int) -> placement.View:
    node = next(n for n in view.nodes if n.name == node_name)
    cards = tuple(replace(c, used=c.used + shares) if c.index == card else c for c in node.cards)
    return placement.replace_nodes(view, {node_name: replace(node, cards=cards)})


def _fits_on(view: placement.View, node_name: str | None, ask: placement.Ask) -> bool:
    for node in view.nodes if node_name else ():
        if node.name == node_name:
            return placement.eligible(node, ask) and any(
                c.index == ask.pin and c.free >= ask.shares for c in node.cards)
    return False


def _room_when_ending(view: placement.View, ask: placement.Ask, ending: Mapping[tuple[str, int], int]) -> bool:
    """Whether card ``ask.pin`` has room on a node the pod may run on once the terminating pods there are gone."""
    assert ask.pin is not None  # the pod's own card
    return any(placement.eligible(node, ask) and any(
        c.index == ask.pin and c.free + ending.get((node.name, c.index), 0) >= ask.shares for c in node.cards)
        for node in view.nodes if ending.get((node.name, ask.pin)))


def plan(view: placement.View, waiting: Iterable[Waiting], pending_seconds: float,
         owners: Mapping[str, Owner | None] | None = None,
         ending: Mapping[tuple[str, int], int] | None = None, required_node: bool = False) -> Plan:
    """Which waiting pods to evict, over ``view`` (the cards' usage by bound pods only).

    Waiting pods whose card has room somewhere will be scheduled: their room is set aside first
    (on their preferred node when it fits there, as the scheduler prefers it). Then, oldest first,
    each pod waiting at least ``pending_seconds`` whose card has no room on any node it may run
    on is moved where another card has room, and that room is set aside too, as long as its owner
    recreates it (``owners``, by pod uid; a pod whose owner is not in it yet is ``unjudged``).
    ``ending``: shares that terminating pods still hold, by (node, card); a pod whose card has room
    once they are gone is about to be scheduled, not stranded, and waits. ``required_node``: gpushard
    requires the node it chose (policy.nodeAffinity: required), so that requirement is left out
    where the pod made again may go; otherwise every required term is the author's and holds.
    """
    owners, ending = owners or {}, ending or {}
    out = Plan()
    pods = sorted(waiting, key=lambda p: (-p.age, p.namespace, p.name))
    stranded = []
    for pod in pods:
        ask = replace(pod.ask, shares=pod.shares, pin=pod.card)
        if _fits_on(view, pod.preferred, ask):
            assert pod.preferred is not None  # _fits_on found that node
            view = _reserve(view, pod.preferred, pod.card, pod.shares)
            continue
        choice = placement.choose(view, ask)
        if choice.fits:
            assert choice.node is not None  # a choice that fits names its node
            view = _reserve(view, choice.node, choice.card, pod.shares)
        else:
            stranded.append(pod)
    sets_moved: set[tuple[str, str]] = set()
    for pod in stranded:
        if pod.age < pending_seconds or pod.gated:
            continue
        if ending and _room_when_ending(view, replace(pod.ask, shares=pod.shares, pin=pod.card), ending):
            continue  # a pod on its card is about to end: the scheduler will place it there
        # Where the pod made again could go: gpushard requires no node of it until it chooses anew.
        ask = placement.without_required_node(pod.ask, pod.preferred) if required_node else pod.ask
        if pod.sized:  # the pod made again is sized afresh, for any card size that holds it
            ask = placement.without_card_memory(ask, pod.card)
        choice = placement.choose(view, replace(ask, shares=pod.shares, pin=None))
        if not choice.fits:
            out.waiting_for_room += 1
            continue
        assert choice.node is not None  # a choice that fits names its node
        if pod.owner_kind in RECREATING and pod.uid not in owners:
            out.unjudged.append(pod)
            continue
        why = judge(pod, owners.get(pod.uid))
        if why is None and pod.owner_kind == STATEFUL_SET:
            if (pod.namespace, pod.owner_name) in sets_moved:
                continue  # its turn comes in a later pass
            sets_moved.add((pod.namespace, pod.owner_name))
        if why is not None:
            out.stuck.append(Stuck(pod, choice.node, choice.card, why))
            continue
        view = _reserve(view, choice.node, choice.card, pod.shares)
        out.moves.append(Move(pod, choice.node, choice.card))
    return out


def event_message(move: Move) -> str:
    """What the Event on an evicted pod says (the API server keeps at most 1 kB of it)."""
    pod = move.pod
    return (f"gpushard: evicted after {int(pod.age)}s Pending: card {pod.card} has no room for {pod.shares} "
            f"shares on any node this pod may run on, while card {move.to_card} of node {move.to_node} has; "
            f"its {pod.owner_kind} {pod.owner_name} creates it again and gpushard places it on a card with room")
