"""Placement benchmark: how fast one card choice is at scale, and how well the choices pack.

(a) One card choice over 2,000 nodes x 8 cards with 10,000 shared pods in the view: p50/p99
    microseconds for binpack and spread, for a plain pod and for a pod with a nodeSelector and a
    toleration; on one view (indexes warm) and on a view derived after every change (as the live
    view does on each watch event), next to the plain scan over every card.
(b) An online trace of fractional pods arriving and leaving on a smaller cluster: the share of
    capacity in use when the first pod cannot be placed, for gpushard binpack and spread (with a
    scheduler that honours the preferred node, and one that takes any node whose card k has room),
    for the naive scheme of NVIDIA time-slicing replicas (a pod's N replicas from any cards of the
    node, as the device plugin hands them out), and for offline first-fit-decreasing on the same pods;
    binpack both as `gpushard review` chooses (the best card) and as admission does (a draw among
    the best few, seeded by the request).
Stranded pods (several choosers, bursts, churn, re-placement) are bench/stranding.py's.

Run: python bench/placement.py [--seed N] [--seeds K] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import random
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from webhook.core import placement  # noqa: E402

SHARES_PER_CARD = 100
# The mix of pod sizes (fraction of a card, weight): common fractions, whole cards, odd asks.
MIX = ((0.1, 18), (0.2, 8), (0.25, 20), (0.33, 10), (0.5, 18), (0.6, 4), (0.75, 8), (1.0, 14))
TAINT = placement.Taint("gpushard.io/dedicated", "team-a", "NoSchedule")
TEAM_A = {"nodeSelector": {"pool": "team-a"},
          "tolerations": [{"key": TAINT.key, "operator": "Equal", "value": TAINT.value, "effect": "NoSchedule"}]}


def shares_of(fraction: float) -> int:
    return math.ceil(Fraction(str(fraction)) * SHARES_PER_CARD)


def draw_size(rng: random.Random) -> int:
    return shares_of(rng.choices([q for q, _w in MIX], [w for _q, w in MIX])[0])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- (a) speed of one choice ---------------------------------------------------------------------


def big_view(rng: random.Random, nodes: int = 2000, cards: int = 8, pods: int = 10_000) -> placement.View:
    """A cluster with a quarter of its nodes in a tainted pool, a few cordoned or not ready."""
    used = [[0] * cards for _ in range(nodes)]
    placed = 0
    while placed < pods:
        size = draw_size(rng)
        i, k = rng.randrange(nodes), rng.randrange(cards)
        if used[i][k] + size <= SHARES_PER_CARD:
            used[i][k] += size
            placed += 1
    out = []
    for i in range(nodes):
        team = i % 4 == 3
        labels = {"kubernetes.io/hostname": f"gpu-{i:04d}", "pool": "team-a" if team else "general",
                  "topology.kubernetes.io/zone": f"zone-{i % 3}", "gpushard.io/cards": str(cards)}
        out.append(placement.Node(
            f"gpu-{i:04d}", labels, (TAINT,) if team else (), ready=i % 200 != 7, unschedulable=i % 100 == 42,
            cards=tuple(placement.Card(k, SHARES_PER_CARD, used[i][k]) for k in range(cards))))
    return placement.View(nodes=tuple(out))


def plain_scan(view: placement.View, ask: placement.Ask, strategy: str):
    """The choice without indexes: every card of every eligible node."""
    fitting = [(card.free, card.index, pos) for pos, node in enumerate(view.nodes) if placement.eligible(node, ask)
               for card in node.cards if card.free >= ask.shares]
    if not fitting:
        return None
    if strategy == "spread":
        return max(fitting, key=lambda x: (x[0], -x[1], -x[2]))
    return min(fitting)


def changed_node(view: placement.View, rng: random.Random) -> placement.Node:
    """One node whose card shares moved, as after a pod event."""
    node = view.nodes[rng.randrange(len(view.nodes))]
    k = rng.randrange(len(node.cards))
    cards = list(node.cards)
    card = cards[k]
    cards[k] = placement.Card(card.index, card.capacity, rng.randrange(0, card.capacity + 1))
    return placement.Node(node.name, node.labels, node.taints, node.ready, node.unschedulable, tuple(cards))


def bench_speed(seed: int, rounds: int) -> list[dict]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    view = big_view(rng)
    built = time.perf_counter() - t0
    print(f"view: {len(view.nodes)} nodes x 8 cards, 10000 shared pods, built in {built:.1f} s (seed {seed})")
    asks = {"plain pod": placement.ask_from_spec({}, 25, None),
            "nodeSelector+toleration": placement.ask_from_spec(TEAM_A, 25, None)}

    t0 = time.perf_counter()
    placement.choose(view, asks["plain pod"], "binpack")
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    placement.choose(view, asks["nodeSelector+toleration"], "binpack")
    cold_mask = time.perf_counter() - t0
    print(f"first choice on a fresh view (builds both indexes): {cold * 1e3:.1f} ms; "
          f"first with a new constraint set: {cold_mask * 1e3:.1f} ms")

    rows = []
    for strategy in ("binpack", "spread"):
        for label, ask in asks.items():
            for k, a in enumerate((ask, placement.Ask(60, None, None, ask.node_selector, (), ask.tolerations))):
                want = plain_scan(view, a, strategy)
                got = placement.choose(view, a, strategy)
                assert (want is None) == (not got.fits), "index and scan disagree"
                if want is not None:
                    assert (got.card, got.node) == (want[1], view.nodes[want[2]].name), (k, strategy, label)
            # One view, indexes warm.
            steady = []
            for _ in range(rounds):
                t = time.perf_counter()
                placement.choose(view, ask, strategy)
                steady.append(time.perf_counter() - t)
            # A new view after every change: derive it (as the live view does), then choose.
            live_view, derive, choose_live = view, [], []
            for _ in range(rounds):
                node = changed_node(live_view, rng)
                t = time.perf_counter()
                live_view = placement.replace_nodes(live_view, {node.name: node})
                t2 = time.perf_counter()
                placement.choose(live_view, ask, strategy)
                choose_live.append(time.perf_counter() - t2)
                derive.append(t2 - t)
            scan = []
            for _ in range(max(5, rounds // 200)):
                t = time.perf_counter()
                plain_scan(view, ask, strategy)
                scan.append(time.perf_counter() - t)
            rows.append({"strategy": strategy, "pod": label,
                         "p50": percentile(steady, 0.5) * 1e6, "p99": percentile(steady, 0.99) * 1e6,
                         "live_p50": percentile(choose_live, 0.5) * 1e6,
                         "live_p99": percentile(choose_live, 0.99) * 1e6,
                         "derive_p99": percentile(derive, 0.99) * 1e6,
                         "scan_p50": percentile(scan, 0.5) * 1e6})
    print(f"\none card choice, {rounds} choices each (microseconds):")
    print(f"{'strategy':8} {'pod':24} {'p50':>7} {'p99':>7} | {'new view p50':>12} {'p99':>7} "
          f"{'derive p99':>10} | {'plain scan p50':>14}")
    for r in rows:
        print(f"{r['strategy']:8} {r['pod']:24} {r['p50']:7.1f} {r['p99']:7.1f} | {r['live_p50']:12.1f} "
              f"{r['live_p99']:7.1f} {r['derive_p99']:10.1f} | {r['scan_p50']:14.0f}")
    worst = max(max(r["p99"], r["live_p99"]) for r in rows)
    print(f"worst p99: {worst:.1f} us (target < 1000 us): {'met' if worst < 1000 else 'MISSED'}")
    return rows


# --- (b) packing -----------------------------------------------------------------------------------


def make_trace(seed: int, events: int, depart: float) -> list[tuple[str, int, int]]:
    """('arrive', pod, shares) and ('leave', pod, 0) events; pods leave at random among those present."""
    rng = random.Random(seed)
    trace, live, next_id = [], [], 0
    for _ in range(events):
        if live and rng.random() < depart:
            pod = live.pop(rng.randrange(len(live)))
            trace.append(("leave", pod, 0))
        else:
            trace.append(("arrive", next_id, draw_size(rng)))
            live.append(next_id)
            next_id += 1
    return trace


class Result:
    def __init__(self, name: str, used: int, capacity: int, placed: int, spanning: int = 0):
        self.name, self.used, self.capacity, self.placed, self.spanning = name, used, capacity, placed, spanning

    @property
    def utilisation(self) -> float:
        return self.used / self.capacity


def run_gpushard(trace, nodes: int, cards: int, strategy: str, honour: bool, seed: int, behind: int = 0,
                 draw: bool = False) -> Result:
    """Webhook choice (the real placement code over a view kept current node by node) + a scheduler.

    ``behind``: the view catches up only every that many arrivals, as a watch would during a
    burst if choices were not remembered (0: every choice is counted at once, as remember does).
    ``draw``: choose as admission does, among the best few cards, seeded per pod.
    """
    rng = random.Random(seed + 7)
    used = [[0] * cards for _ in range(nodes)]
    names = [f"n{i:03d}" for i in range(nodes)]
    position = {name: i for i, name in enumerate(names)}

    def node(i):
        return placement.Node(names[i], {"kubernetes.io/hostname": names[i]}, cards=tuple(
            placement.Card(k, SHARES_PER_CARD, used[i][k]) for k in range(cards)))

    view = placement.View(nodes=tuple(node(i) for i in range(nodes)))
    where: dict[int, tuple[int, int, int]] = {}
    total, placed = 0, 0
    unseen: set[int] = set()  # nodes whose change the view has not caught up with

    def seen(i: int):
        nonlocal view
        unseen.add(i)
        if not behind or placed % behind == 0:
            view = placement.replace_nodes(view, {names[j]: node(j) for j in unseen})
            unseen.clear()

    for kind, pod, size in trace:
        if kind == "leave":
            i, k, s = where.pop(pod)
            used[i][k] -= s
            total -= s
            seen(i)
            continue
        choice = placement.choose(view, placement.Ask(shares=size), strategy,
                                  random.Random(f"{seed}-{pod}") if draw else None)
        k = choice.card
        room = [i for i in range(nodes) if used[i][k] + size <= SHARES_PER_CARD]
        if not room:
            break  # the first pod that stays Pending
        if honour and choice.node is not None and position[choice.node] in room:
            i = position[choice.node]
        else:
            i = rng.choice(room)  # any node whose card k has room, as far as the GPU is concerned
        used[i][k] += size
        total += size
        placed += 1
        where[pod] = (i, k, size)
        seen(i)
    label = f"gpushard {strategy}" + (" drawn among the best" if draw else "") + (
        "" if honour else " (preference ignored)") + (f" (view {behind} pods behind)" if behind else "")
    return Result(label, total, nodes * cards * SHARES_PER_CARD, placed)


def run_naive(trace, nodes: int, cards: int, seed: int) -> Result:
    """Time-slicing replicas: the node offers cards x 100 replicas; a pod's N come from any cards.

    The device plugin hands out replicas of the least allocated cards first (its distributed
    allocation for shared GPUs), so a pod's replicas often sit on several cards.
    """
    rng = random.Random(seed + 11)
    used = [[0] * cards for _ in range(nodes)]
    where: dict[int, tuple[int, list[int]]] = {}
    total, placed, spanning = 0, 0, 0
    for kind, pod, size in trace:
        if kind == "leave":
            i, taken = where.pop(pod)
            for k, n in enumerate(taken):
                used[i][k] -= n
            total -= sum(taken)
            continue
        room = [i for i in range(nodes) if cards * SHARES_PER_CARD - sum(used[i]) >= size]
        if not room:
            break
        i = rng.choice(room)
        taken = [0] * cards
        for _ in range(size):
            k = min(range(cards), key=lambda c: (used[i][c], c))
            used[i][k] += 1
            taken[k] += 1
        spanning += sum(1 for n in taken if n) > 1
        total += size
        placed += 1
        where[pod] = (i, taken)
    return Result("naive time-slicing", total, nodes * cards * SHARES_PER_CARD, placed, spanning)


def ffd_fits(counts: dict[int, int], bins: int, capacity: int) -> bool:
    """Whether first-fit decreasing packs these items (size -> count) into ``bins`` bins.

    FFD fills bin after bin with the largest items that still fit; a bin's pattern repeats
    while every size it takes has enough items left, so runs of equal bins are counted at once.
    """
    counts = {s: c for s, c in counts.items() if c}
    sizes = sorted(counts, reverse=True)
    used = 0
    while counts:
        room, take = capacity, {}
        for s in sizes:
            c = counts.get(s, 0)
            if c and s <= room:
                n = min(c, room // s)
                take[s] = n
                room -= n * s
        if not take:
            return False
        repeat = min(counts[s] // n for s, n in take.items())
        used += repeat
        if used > bins:
            return False
        for s, n in take.items():
            counts[s] -= repeat * n
            if not counts[s]:
                del counts[s]
    return True


def run_ffd(trace, nodes: int, cards: int) -> Result:
    """Offline bound: at each arrival, could FFD repack every present pod plus the new one?"""
    counts: collections.Counter = collections.Counter()
    sizes: dict[int, int] = {}
    total, placed = 0, 0
    for kind, pod, size in trace:
        if kind == "leave":
            s = sizes.pop(pod)
            counts[s] -= 1
            total -= s
            continue
        counts[size] += 1
        if not ffd_fits(counts, nodes * cards, SHARES_PER_CARD):
            counts[size] -= 1
            break
        sizes[pod] = size
        total += size
        placed += 1
    return Result("offline FFD bound", total, nodes * cards * SHARES_PER_CARD, placed)


def bench_packing(seeds: list[int], nodes: int, cards: int, events: int, depart: float) -> dict:
    mix = ", ".join(f"{q:g} x{w}" for q, w in MIX)
    print(f"\npacking: {nodes} nodes x {cards} cards x {SHARES_PER_CARD} shares; pods leave with p={depart} per "
          f"event; size mix (fraction x weight): {mix}")
    table: dict[str, list[Result]] = collections.defaultdict(list)
    for seed in seeds:
        trace = make_trace(seed, events, depart)
        results = [
            run_gpushard(trace, nodes, cards, "binpack", True, seed),
            run_gpushard(trace, nodes, cards, "binpack", True, seed, draw=True),
            run_gpushard(trace, nodes, cards, "binpack", False, seed),
            run_gpushard(trace, nodes, cards, "binpack", False, seed, draw=True),
            run_gpushard(trace, nodes, cards, "binpack", True, seed, behind=20),
            run_gpushard(trace, nodes, cards, "spread", True, seed),
            run_gpushard(trace, nodes, cards, "spread", False, seed),
            run_naive(trace, nodes, cards, seed),
            run_ffd(trace, nodes, cards),
        ]
        arrivals = sum(1 for e in trace if e[0] == "arrive")
        print(f"\nseed {seed}: {len(trace)} events, {arrivals} arrivals")
        print(f"{'scheme':58} {'in use at first Pending':>24} {'pods placed':>12} {'vs FFD':>7}")
        ffd = results[-1]
        for r in results:
            table[r.name].append(r)
            note = f"  ({r.spanning} pods = {r.spanning / max(1, r.placed):.0%} span several cards)" \
                if r.name.startswith("naive") else ""
            print(f"{r.name:58} {r.utilisation:>23.1%} {r.placed:>12} {r.utilisation / ffd.utilisation:>7.3f}{note}")
    print(f"\nmean over seeds {seeds}:")
    print(f"{'scheme':58} {'in use at first Pending':>24} {'vs FFD':>7}")
    ffd_mean = statistics.mean(r.utilisation for r in table["offline FFD bound"])
    means = {}
    for name, rs in table.items():
        means[name] = statistics.mean(r.utilisation for r in rs)
        extra = ""
        if name.startswith("naive"):
            extra = f"  (pods spanning several cards: {sum(r.spanning for r in rs)} of {sum(r.placed for r in rs)})"
        print(f"{name:58} {means[name]:>23.1%} {means[name] / ffd_mean:>7.3f}{extra}")
    ratio = means["gpushard binpack"] / ffd_mean
    print(f"binpack vs FFD: {ratio:.3f} (target >= 0.95): {'met' if ratio >= 0.95 else 'MISSED'}")
    drawn = means["gpushard binpack drawn among the best"] / ffd_mean
    print(f"binpack drawn among the best (as admitted) vs FFD: {drawn:.3f} (goal >= 0.98): "
          f"{'met' if drawn >= 0.98 else 'MISSED'}")
    gain = means["gpushard binpack"] - means["gpushard binpack (preference ignored)"]
    print(f"preferred node honoured vs ignored (binpack): {gain:+.1%} of capacity at first Pending")
    return means


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--seeds", type=int, default=5, help="packing traces to run (seed, seed+1, ...)")
    parser.add_argument("--rounds", type=int, default=2000, help="timed choices per row")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and one trace")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seeds = 300, 1
    gc.collect()
    started = time.perf_counter()
    bench_speed(args.seed, args.rounds)
    bench_packing([args.seed + i for i in range(args.seeds)], nodes=100, cards=8, events=12000, depart=0.35)
    print(f"\nplacement bench finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
