"""Choosing card index k for a pod over a snapshot of the cluster: binpack or spread.

The packing policy, over the view's queries (``webhook.core.snapshot``): the cards that fit, best
first (binpack: the fullest that holds the pod; spread: the emptiest), one drawn among the best
few; where nothing fits, the index the pod waits on; for a memory ask, the card size first, then
a card of that size. The scheduling predicates and hint terms are ``webhook.core.scheduling``'s;
their names are offered here too, as every caller of placement uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from webhook.core import findings as f
from webhook.core import names
from webhook.core.scheduling import (  # noqa: F401 - the names placement's callers use
    NODE_NAME_FIELD,
    PREFERRED_WEIGHT,
    Ask,
    Card,
    Node,
    Taint,
    ask_from_spec,
    card_memory_expression,
    card_memory_mib,
    eligible,
    preferred_affinity_term,
    preferred_node,
    required_node_expression,
    same_scheduling,
    tolerates,
    without_card_memory,
    without_required_node,
)
from webhook.core.snapshot import (  # noqa: F401 - the names placement's callers use
    CHUNK,
    FEW_CHANGES,
    MASK_CACHE_SIZE,
    View,
    lowest_node,
    replace_card,
    replace_nodes,
)


class Rng(Protocol):
    """What a choice draws from: ``random.Random``, or admission's ``draws.Draw`` keyed by the request."""

    def randrange(self, stop: int, /) -> int: ...


# Choice is made once or twice per admission: slots, not frozen (see scheduling.Ask).
@dataclass(slots=True)
class Choice:
    card: int
    node: str | None = None  # the node whose card was chosen, when one fits
    fits: bool = False
    findings: tuple[f.Finding, ...] = ()



# --- the choice --------------------------------------------------------------------------------


def _warn(rule: str, message: str) -> f.Finding:
    return f.Finding(rule, f.WARN, f"gpushard: {message}")


# A choice draws uniformly among the best-fitting cards: up to CHOICE_CANDIDATES of them whose
# free shares are within CHOICE_SLACK of the best one's. Choosers whose views lag each other
# (webhook replicas, a burst of pods) then rarely pick the same card, where all of them would
# pick the one best card, and the slack keeps packing where the best card alone would (the
# figures behind these values are in docs/notes/placement.md). 64 rather than 16: with the scheduler
# behind a burst (every pod admitted before one binds), two replicas 20 changes apart put 12 % of
# the pods on a card the other had just filled with 16 candidates, 8.9 % with 64, at the same
# packing (bench/stranding.py --behind).
CHOICE_CANDIDATES = 64
CHOICE_SLACK = 5


def _new_cards(fills: Sequence[int], size: int, capacity: int) -> tuple[int, int, int]:
    """(cards before, cards with a pod of ``size`` too, the least room it leaves on the card it joins) of one
    index over new nodes, when first-fit puts the pods of ``fills`` shares on them, one such card per node."""
    cards: list[int] = []
    for shares in fills:
        for i, used in enumerate(cards):
            if used + shares <= capacity:
                cards[i] = used + shares
                break
        else:
            cards.append(shares)
    left = [capacity - used - size for used in cards if used + size <= capacity]
    return (len(cards), len(cards), min(left)) if left else (len(cards), len(cards) + 1, capacity - size)


def _waiting_index(view: View, ks: Sequence[int], size: int, capacity: int, rng: Rng | None) -> int:
    """The card index among ``ks`` a pod of ``size`` shares that fits nowhere waits on.

    The pods that wait (``view.waiting``) are what new nodes would take, one card ``k`` of each node per
    index, each index filled first-fit: the index chosen keeps the new nodes they and this pod need fewest
    (the most cards any index needs), then the cards of its own index fewest, then leaves the least room on
    the card it joins (best fit, so that larger pods find room on the others); among the indexes that still
    tie, one drawn with ``rng`` (else the lowest). With no pod waiting every index ties, so waiting pods
    still spread over the indexes, and a burst that fits nowhere asks an autoscaler for the nodes a packing
    of it needs."""
    waiting = view.waiting
    counts = {k: _new_cards(waiting.get(k, ()), size, capacity) for k in ks}
    most = max((before for before, _after, _left in counts.values()), default=0)
    keys = {k: (max(most, after), after, left) for k, (_before, after, left) in counts.items()}
    best = min(keys.values())
    tied = [k for k in ks if keys[k] == best]
    return tied[rng.randrange(len(tied))] if rng is not None and len(tied) > 1 else tied[0]


def _waiting_indexes(view: View, mask: int, new_cards: int) -> list[int]:
    """The card indexes a pod that fits nowhere may wait on when an autoscaler adds nodes of ``new_cards``
    cards: those every node it may run on has (a node the autoscaler adds is one of them) and a new node has,
    not cordoned on all of them; else any index some of them has open."""
    common = [k for k in view.common_indexes(mask) if k < new_cards]
    open_ = set(view.open_indexes(mask))
    return [k for k in common if k in open_] or common or view.open_indexes(mask) or view.card_indexes(mask)


def _preempting_index(view: View, mask: int, ask: Ask) -> int | None:
    """The card index where the scheduler may preempt for a pod that fits nowhere, or None.

    Used only where some bound pods have a priority other than 0 (``View.priorities``); where every pod has
    priority 0 no pod can preempt another, and the pod waits as any other. A card of one of ``mask``'s nodes
    qualifies when its free shares and those of the pods of a lower priority than ``ask``'s hold the pod (the
    scheduler preempts only such pods). Among them, the index of the first card (in node order) that needs the
    fewest shares preempted. Cordoned cards do not qualify: the scheduler would preempt, and the pod still would
    not fit. Where no pod has a lower priority than the pod's (``View.priority_floor``: one PriorityClass for
    every pod), it returns at once.
    """
    priorities = view.priorities
    if not priorities:
        return None
    floor = view.priority_floor
    if floor is None or ask.priority <= floor:
        return None  # no pod of a lower priority anywhere: the common case of one default PriorityClass
    most = view.most_free(mask, None)
    assert most is not None  # the caller found none with room among these nodes, which have cards
    fewest = ask.shares - next(c.free for c in view.node(most[0]).cards if c.index == most[1])
    best: tuple[int, int] | None = None
    bits = mask
    while bits:
        pos = lowest_node(bits)
        bits &= bits - 1
        node = view.node(pos)
        for card in node.cards:
            if card.cordoned or card.capacity < ask.shares:
                continue
            ranked = priorities.get((node.name, card.index), ())
            lower = sum(shares for priority, shares in ranked if priority < ask.priority)
            if ask.priority > 0:  # the pods of priority 0: what the ranked pairs leave of the card's use
                lower += card.used - sum(shares for _priority, shares in ranked)
            need = ask.shares - card.free
            if need <= lower and (best is None or need < best[0]):
                if need <= fewest:
                    return card.index  # no card needs fewer preempted: the first such one
                best = (need, card.index)
    return best[1] if best is not None else None


def _drawn_index(view: View, mask: int, rng: Rng) -> int:
    """The card index a pod that fits nowhere waits on, drawn uniformly among the indexes of the nodes
    it may run on: waiting pods then spread over the indexes, and room freed on any index finds a pod
    waiting for it, where all of them waiting on the most free card's index leave room freed on the
    others to pods that come later (the churn figures in docs/notes/placement.md)."""
    ks = view.open_indexes(mask) or view.card_indexes(mask)  # not an index cordoned on all of them
    return ks[rng.randrange(len(ks))]


def choose(view: View | None, ask: Ask, strategy: str = "binpack", rng: Rng | None = None,
           share: tuple[int, int] | None = None, new_cards: int = 0, capacity: int = 100) -> Choice:
    """Pick card k for the pod. Never fails: a poor view only costs packing, not correctness.

    With ``share`` (rank, count), one of several webhook replicas: its own cards first
    (``View.share_of``), then any. Without ``rng`` the best card (ties to the lower index, then the
    earlier node); with it, one of
    the best few (CHOICE_CANDIDATES, CHOICE_SLACK), drawn uniformly. When nothing fits, without
    ``rng`` the most free card's index; with it, an index drawn among those of the nodes the pod may
    run on (``_drawn_index``), one not cordoned on all of them. A card an operator cordoned has no
    room (``Card.free``), so it is never chosen; a pod pinned to a card cordoned on every node it may
    run on gets a warning that says so. With ``new_cards`` (the cards of a node an autoscaler adds, of
    ``capacity`` shares each), a pod that no node it may run on has room for, or that no shared node matches
    yet, waits on the index that packs the waiting pods onto the fewest new nodes (``_waiting_index``);
    without it, on an index drawn among the nodes' (``_drawn_index``). Before either, where bound pods have
    priorities, a pod that fits nowhere waits where the scheduler may preempt pods of a lower priority for it
    (``_preempting_index``). The draw uses only ``rng``, so a
    caller that seeds it per request (as admission does, with the request's uid) leaves no trace
    on later choices.
    """
    if view is None:
        k = ask.pin if ask.pin is not None else 0
        return Choice(k, findings=(_warn(f.NO_VIEW, f"no cluster view yet; card {k} chosen without "
                                         "looking, the scheduler still enforces capacity"),))
    mask = view.candidates(ask, ask.pin)
    if not mask and new_cards and ask.pin is None:
        k = _waiting_index(view, range(new_cards), ask.shares, capacity, rng)
        return Choice(k, findings=(_warn(f.NO_MATCHING_NODE, (
            f"no shared node matches this pod's scheduling rules yet; card {k} chosen of the {new_cards} cards "
            "of a node the autoscaler adds, the pod stays Pending until one joins")),))
    if not mask:
        k = ask.pin if ask.pin is not None else 0
        why = (f"no shared node with card {k} matches this pod's scheduling rules" if ask.pin is not None
               else "no shared node matches this pod's scheduling rules")
        return Choice(k, findings=(_warn(f.NO_MATCHING_NODE, f"{why}; card {k} chosen, the pod may stay Pending"),))
    hit = None
    if share is not None and share[1] > 1 and ask.pin is None:
        # This replica's own cards first (``share``: its rank among ``count`` webhook replicas): replicas
        # whose views lag each other then fill different cards, and only collide once their own are full.
        hit = view.draw(0, None, ask.shares, strategy, CHOICE_SLACK if rng is not None else 0, CHOICE_CANDIDATES,
                        rng, view.share_of(mask, *share))
    if hit is not None:
        pass
    elif rng is not None:
        # The candidates start with search's answer, and there are none exactly when it has none.
        hit = view.draw(mask, ask.pin, ask.shares, strategy, CHOICE_SLACK, CHOICE_CANDIDATES, rng)
    else:
        hit = view.best(mask, ask.pin, ask.shares, strategy)
    if hit is None:
        if ask.pin is not None and view.cordoned_on(mask, ask.pin):
            # Admitted, as a pod that fits nowhere is: cordons come and go, and the pod starts once
            # an operator uncordons the card (or re-placement moves it, when its owner recreates it).
            return Choice(ask.pin, findings=(_warn(f.NO_ROOM, (
                f"card {ask.pin} is cordoned on every node the pod may run on; it stays Pending until "
                "uncordoned, or pin another card")),))
        most = view.most_free(mask, ask.pin)
        assert most is not None  # mask holds only nodes with the card (or any card): one is the most free
        _pos, k = most
        preempting = _preempting_index(view, mask, ask) if ask.pin is None else None
        if preempting is not None:
            return Choice(preempting, findings=(_warn(
                f.NO_ROOM, f"no card has {ask.shares} free shares now; card {preempting} chosen, where the "
                "scheduler may preempt pods of a lower priority"),))
        if new_cards and ask.pin is None:
            k = _waiting_index(view, _waiting_indexes(view, mask, new_cards), ask.shares, capacity, rng)
        elif rng is not None and ask.pin is None:
            k = _drawn_index(view, mask, rng)
        elif ask.pin is None and view.cordoned_on(mask, k):
            k = next(iter(view.open_indexes(mask)), k)  # wait where an operator has not cordoned the card
        return Choice(k, findings=(_warn(
            f.NO_ROOM, f"no card has {ask.shares} free shares now; card {k} chosen, "
            "the pod stays Pending until one frees up"),))
    pos, k = hit
    return Choice(k, node=view.node(pos).name, fits=True)


@dataclass(slots=True)
class SizedChoice:
    """A card for a memory ask: ``size_mib`` is the size the shares were computed for (0: denied)."""

    card: int
    size_mib: int
    shares: int
    node: str | None = None
    fits: bool = False
    findings: tuple[f.Finding, ...] = ()
    denied: bool = False


def largest_card(view: View) -> tuple[int, str]:
    """(MiB, model) of the largest card any node's labels publish; (0, "") when none does."""
    best, model = 0, ""
    for node in view.nodes:
        for card in node.cards:
            mib = card_memory_mib(node, card.index) or 0
            if mib > best:
                best, model = mib, card.model
    return best, model


def choose_sized(view: View, ask: Ask, shares_for: Callable[[int], int], shares_per_card: int,
                 size_policy: str = "smallest", strategy: str = "binpack",
                 rng: Rng | None = None, asked_mib: int = 0, new_cards: int = 0, new_mib: int = 0) -> SizedChoice:
    """Pick a card size and a card of that size for a memory ask.

    ``shares_for(size_mib)`` is the pod's shares on a card of that size. Sizes that hold the pod
    (at most ``shares_per_card`` shares) are tried in ``size_policy`` order; the first with a card
    that has room on a node the pod may run on wins, the card chosen among those of that size as
    ``choose`` does (binpack or spread, drawn among the best few with ``rng``). When none has room:
    with ``new_cards`` and ``new_mib`` (the cards of a node an autoscaler adds and their MiB) that hold the
    pod, it waits for a card of ``new_mib`` on the index that packs the waiting pods onto the fewest new
    nodes, as ``choose`` does; else on the first size the pod's nodes offer, on an index drawn among them.
    """
    sizes = view.sizes()
    held = sorted((mib for mib in sizes if shares_for(mib) <= shares_per_card),
                  reverse=size_policy == "largest")
    new = new_mib if new_cards and new_mib and shares_for(new_mib) <= shares_per_card else 0
    if not held and not new:
        mib, model = largest_card(view)
        if new_cards and new_mib > mib:
            mib, model = new_mib, "a card of the nodes the autoscaler adds"
        return SizedChoice(0, 0, 0, denied=True, findings=(f.Finding(f.MEMORY_ABOVE_CARD, f.DENY, (
            f"gpushard: the pod asks {asked_mib} MiB of GPU memory, more than the largest card holds "
            f"({model or 'a card'}, {mib} MiB); ask at most {mib}Mi") if mib else (
            "gpushard: the pod asks GPU memory, but no shared node publishes its cards' memory "
            f"(label {names.card_memory_label(0)}); ask a fraction instead, or check the agents")),),)
    mask = view.candidates(ask, None)
    waiting: tuple[int, dict[int, int]] | None = None
    for mib in held:
        masks = {k: bits & mask for k, bits in sizes[mib].items() if bits & mask}
        if not masks:
            continue
        shares = shares_for(mib)
        hit = view.draw(0, None, shares, strategy, CHOICE_SLACK if rng is not None else 0, CHOICE_CANDIDATES,
                        rng, masks)
        if hit is not None:
            pos, k = hit
            return SizedChoice(k, mib, shares, node=view.node(pos).name, fits=True)
        if waiting is None:
            waiting = (mib, masks)
    if new:
        shares = shares_for(new)
        ks = [k for k in _waiting_indexes(view, mask, new_cards) if k < new_cards] if mask else []
        k = _waiting_index(view, ks or range(new_cards), shares, shares_per_card, rng)
        return SizedChoice(k, new, shares, findings=(_warn(f.NO_ROOM if mask else f.NO_MATCHING_NODE, (
            f"no card of {new} MiB has {shares} free shares now; card {k} chosen of the {new_cards} cards of a "
            "node the autoscaler adds, the pod stays Pending until one joins or frees up")),))
    if waiting is None:
        mib = held[0]
        k = min(sizes[mib])
        return SizedChoice(k, mib, shares_for(mib), findings=(_warn(f.NO_MATCHING_NODE, (
            f"no shared node this pod may run on has a card of {mib} MiB; card {k} of that size chosen, "
            "the pod may stay Pending")),))
    mib, masks = waiting
    ks = [k for k in sorted(masks) if not view.cordoned_on(masks[k], k)] or sorted(masks)
    k = ks[rng.randrange(len(ks))] if rng is not None else ks[0]
    shares = shares_for(mib)
    return SizedChoice(k, mib, shares, findings=(_warn(f.NO_ROOM, (
        f"no card of {mib} MiB has {shares} free shares now; card {k} chosen, the pod stays Pending "
        "until one frees up")),))


