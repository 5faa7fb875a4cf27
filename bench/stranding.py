"""Stranded pods: several choosers with lagging views, bursts and churn, with and without re-placement.

A pod is stranded when it waits on its card k, full on every node, while another card has
room for it. This simulation measures how many, with the real placement and re-placement code:

- a cluster of 100 nodes x 8 cards, 70-80 % full, with the packing benchmark's size mix;
- choosers (webhook processes) that each choose over their own view: the cluster as it was
  ``lag`` changes ago, plus their own choices since (as ``remember`` counts them), with the
  live view's accounting: a created pod counts on the node it was chosen for until it binds;
  a pod that fits nowhere waits on a drawn card index (``spread_waiting``) or, as before, on
  the most free card's;
- a scheduler that puts each pod on any node whose card k has room, trying every waiting pod,
  oldest first, whenever room may have freed; with ``honour``, on its preferred node when card k
  has room there, as kube-scheduler's default scoring does (NodeAffinity scores the preferred
  term 100 at weight 2, more than any other default plugin can make up: kubernetes/kubernetes
  ``pkg/scheduler/apis/config/v1/default_plugins.go``). Both are reported: the first is the
  pessimistic bound the figures started from, the second the scheduler gpushard runs with;
- bursts: 330-500 pods created back to back, each scheduled at once; stranded pods counted at
  the end, as many as the free cards can take together (those a re-placement could rescue);
- churn: pods arriving at random and leaving after a random lifetime at 95 % load; stranded
  pods sampled over time; with re-placement, ``core.replacement.plan`` runs every ``interval``
  seconds and its moves are evicted and recreated (their owner makes a new pod at once).

With ``--dra``, the same bursts and churn with backend dra: the webhook picks no card, and the
scheduler binds each claim on a node where some card has room, first fit among its cards; and the
packing figure (shares in use at the first Pending pod) for both backends.

- a burst the scheduler is behind (``--behind``): every pod admitted before the first binds (a Job
  of hundreds of pods, a slow scheduler), 80 % full, the burst asking 0.9 of the free shares, two
  choosers 20 changes apart; counted at the first scheduling pass and after one re-placement
  round, with the packing against first-fit-decreasing, before and now.

Run: python bench/stranding.py [--seed N] [--quick] [--long] [--sweep] [--why] [--required] [--behind]
     [--dra] [--remember]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import heapq
import math
import random
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from webhook import settings  # noqa: E402
from webhook.core import placement, replacement  # noqa: E402

CAPACITY = 100
MIX = ((0.1, 18), (0.2, 8), (0.25, 20), (0.33, 10), (0.5, 18), (0.6, 4), (0.75, 8), (1.0, 14))
SIZES = [math.ceil(Fraction(str(q)) * CAPACITY) for q, _w in MIX]
WEIGHTS = [w for _q, w in MIX]
MEAN_SIZE = sum(s * w for s, w in zip(SIZES, WEIGHTS, strict=True)) / sum(WEIGHTS)
OWNER = replacement.Owner(replacement.REPLICA_SET, "sim")


def draw(rng: random.Random) -> int:
    return rng.choices(SIZES, WEIGHTS)[0]


@dataclass
class Pod:
    number: int
    shares: int
    card: int = 0
    preferred: int | None = None  # node position the choice named
    node: int | None = None  # where it runs
    created: float = 0.0
    ends: float = 0.0
    chooser: int = 0
    seen_at: int = 0  # position in the change log of its creation (when views learn of it)
    forgotten: bool = False  # dropped out of the views while unbound (the old 30 s memory)
    fitted: bool = False  # its chooser's view showed room for it (else it waits on a drawn index)
    recreated: bool = False  # made again after a re-placement evicted the pod before it


class Chooser:
    """One webhook process: its own view, lagging the cluster, plus its own recent choices."""

    def __init__(self, sim: Sim, number: int):
        self.sim, self.number = sim, number
        self.used = [row[:] for row in sim.used]
        self.seen = len(sim.log)
        # log position of the pod's creation -> (node, card, shares, when chosen)
        self.mine: dict[int, tuple[int, int, int, float]] = {}
        self.view = placement.View(tuple(sim.node(i, self.used) for i in range(sim.nodes)))

    def share(self) -> tuple[int, int] | None:
        """(rank, count) of this chooser for its share of the cards; None (all alike) unless partitioned."""
        count = len(self.sim.choosers) if hasattr(self.sim, "choosers") else 1
        return (self.number % count, count) if self.sim.partition and count > 1 else None

    def choose(self, pod: Pod) -> None:
        sim, touched = self.sim, set()
        upto = max(self.seen, len(sim.log) - sim.lag)
        if sim.remember_ttl is not None:  # the live view's time to live: choices its view has not shown yet
            for position in [p for p, m in self.mine.items() if m[3] + sim.remember_ttl <= pod.created]:
                ci, ck, s, _made = self.mine.pop(position)
                self.used[ci][ck] -= s
                touched.add(ci)
        for position in range(self.seen, upto):
            i, k, delta = sim.log[position]
            if i is not None:
                self.used[i][k] += delta
                touched.add(i)
            mine = self.mine.pop(position, None)
            if mine is not None:  # the view now shows the pod: the remembered choice is done
                ci, ck, s, _made = mine
                self.used[ci][ck] -= s
                touched.add(ci)
        self.seen = upto
        if touched:
            self.view = placement.replace_nodes(self.view, {sim.names[i]: sim.node(i, self.used) for i in touched})
        rng = random.Random(f"{sim.seed}-{pod.number}") if sim.randomized else None
        choice = placement.choose(self.view, placement.Ask(shares=pod.shares), "binpack", rng, self.share())
        if not choice.fits and not sim.spread_waiting:  # as before: wait on the most free card's index
            choice = placement.choose(self.view, placement.Ask(shares=pod.shares), "binpack")
        pod.card, pod.fitted = choice.card, choice.fits
        pod.preferred = sim.position[choice.node] if choice.node is not None else None
        pod.chooser = self.number
        sim.log_created(pod)
        if pod.preferred is not None:
            self.mine[pod.seen_at] = (pod.preferred, pod.card, pod.shares, pod.created)
            self.used[pod.preferred][pod.card] += pod.shares
            self.view = placement.replace_nodes(self.view, {choice.node: sim.node(pod.preferred, self.used)})


class Sim:
    chooser_class = Chooser

    def __init__(self, used: list[list[int]], choosers: int, lag: int, randomized: bool, honour: bool, seed: int,
                 forget_after: float | None = None, spread_waiting: bool = True):
        self.nodes, self.cards = len(used), len(used[0])
        self.used = used  # the truth: shares held by bound pods
        self.names = [f"n{i:03d}" for i in range(self.nodes)]
        self.position = {name: i for i, name in enumerate(self.names)}
        self.lag, self.randomized, self.honour, self.seed = lag, randomized, honour, seed
        self.spread_waiting = spread_waiting  # a pod that fits nowhere waits on a drawn index (admission's rng)
        # The accounting before pinned pods were kept: an unbound pod counted for 30 s only.
        self.forget_after = forget_after
        # How long a chooser counts a choice its lagging view does not show yet (None: until it shows).
        self.remember_ttl: float | None = None
        # Replicas try their own share of the cards first: placement's ``share``.
        self.partition = False
        self.unbound: collections.deque = collections.deque()  # (created, pod), for forgetting
        self.rng = random.Random(seed + 1)
        self.log: list[tuple[int | None, int, int]] = []  # (node, card, delta) of what views count
        self.choosers = [self.chooser_class(self, c) for c in range(choosers)]
        self.pending: dict[int, Pod] = {}  # number -> pod, oldest first
        self.running: dict[int, Pod] = {}
        self.created = 0
        self.evicted = 0
        self.just_bound: list[Pod] = []

    def node(self, i: int, used: list[list[int]]) -> placement.Node:
        return placement.Node(self.names[i], cards=tuple(placement.Card(k, CAPACITY, used[i][k])
                                                          for k in range(self.cards)))

    def log_created(self, pod: Pod) -> None:
        pod.seen_at = len(self.log)
        self.log.append((pod.preferred, pod.card, pod.shares))

    def create(self, shares: int, now: float = 0.0, recreated: bool = False) -> Pod:
        pod = Pod(self.created, shares, created=now, recreated=recreated)
        self.created += 1
        self.choosers[pod.number % len(self.choosers)].choose(pod)
        self.pending[pod.number] = pod
        if self.forget_after is not None and pod.preferred is not None:
            self.unbound.append((now, pod))
        return pod

    def forget(self, now: float) -> None:
        """The old accounting: a pod still unbound after ``forget_after`` s stops counting anywhere."""
        while self.unbound and self.unbound[0][0] + self.forget_after <= now:
            _created, pod = self.unbound.popleft()
            if pod.number in self.pending and not pod.forgotten:
                pod.forgotten = True
                self.log.append((pod.preferred, pod.card, -pod.shares))

    def allowed(self, pod: Pod) -> Iterable[int]:
        """The nodes the scheduler may bind ``pod`` on: any (RequiredSim narrows them)."""
        return range(self.nodes)

    def has_room(self, pod: Pod, used: list[list[int]], best: list[int]) -> bool:
        """Whether card k has room for ``pod`` on a node it may run on (``best``: card k's most free shares)."""
        return pod.shares <= best[pod.card]

    def try_bind(self, pod: Pod) -> bool:
        k, s, used = pod.card, pod.shares, self.used
        if self.honour and pod.preferred is not None and used[pod.preferred][k] + s <= CAPACITY:
            i = pod.preferred
        else:
            room = [i for i in self.allowed(pod) if used[i][k] + s <= CAPACITY]
            if not room:
                return False
            i = self.rng.choice(room)
        used[i][k] += s
        pod.node = i
        self.log.append((i, k, s))
        if pod.preferred is not None and not pod.forgotten:
            self.log.append((pod.preferred, k, -s))  # it no longer counts where it was chosen
        del self.pending[pod.number]
        self.running[pod.number] = pod
        self.just_bound.append(pod)
        return True

    def schedule(self) -> None:
        """Every waiting pod, oldest first, on any node whose card k has room."""
        best = [max(CAPACITY - self.used[i][k] for i in range(self.nodes)) for k in range(self.cards)]
        for pod in list(self.pending.values()):
            if pod.shares <= best[pod.card] and self.try_bind(pod):
                best[pod.card] = max(CAPACITY - self.used[i][pod.card] for i in range(self.nodes))

    def leave(self, pod: Pod) -> None:
        self.used[pod.node][pod.card] -= pod.shares
        self.log.append((pod.node, pod.card, -pod.shares))
        del self.running[pod.number]

    def delete_pending(self, pod: Pod) -> None:
        del self.pending[pod.number]
        if pod.preferred is not None and not pod.forgotten:
            self.log.append((pod.preferred, pod.card, -pod.shares))

    def stranded(self, now: float = 0.0, older_than: float | None = None, claimed: bool = False,
                 counted: list[tuple[Pod, float]] | None = None) -> int:
        """Waiting pods whose card has no room anywhere that the free cards could take together
        (of those waiting longer than ``older_than`` seconds at ``now``).

        ``claimed``: the free cards' room that waiting pods whose own card has room will take is
        set aside first, as ``replacement.plan`` sets it aside (on the preferred node when the
        scheduler honours it and it fits there, else on the tightest card k with room). Right
        after a re-placement pass those are the recreated pods, bound in the next second.
        ``counted``: each pod counted is appended with its age at ``now``.
        """
        used, placed = self.used, set()
        if claimed:
            used = [row[:] for row in used]
            for pod in self.pending.values():
                k, s = pod.card, pod.shares
                if self.honour and pod.preferred is not None and used[pod.preferred][k] + s <= CAPACITY:
                    used[pod.preferred][k] += s
                    placed.add(pod.number)
                    continue
                room = [i for i in self.allowed(pod) if used[i][k] + s <= CAPACITY]
                if room:
                    used[max(room, key=lambda i: used[i][k])][k] += s
                    placed.add(pod.number)
        best = [max(CAPACITY - used[i][k] for i in range(self.nodes)) for k in range(self.cards)]
        free = sorted(CAPACITY - used[i][k] for i in range(self.nodes) for k in range(self.cards))
        count = 0
        for pod in self.pending.values():
            if (self.has_room(pod, used, best) or pod.number in placed
                    or (older_than is not None and now - pod.created <= older_than)):
                continue  # its own card has room: the scheduler will place it
            for j, room in enumerate(free):
                if room >= pod.shares:
                    free[j] -= pod.shares
                    count += 1
                    if counted is not None:
                        counted.append((pod, now - pod.created))
                    break
        return count

    def replace(self, now: float, pending_seconds: float) -> int:
        """One pass of the re-placement decision; its moves are evicted and recreated at once."""
        view = placement.View(tuple(self.node(i, self.used) for i in range(self.nodes)))
        waiting = [replacement.Waiting(uid=str(p.number), namespace="sim", name=str(p.number), card=p.card,
                                       shares=p.shares, age=now - p.created,
                                       preferred=self.names[p.preferred] if p.preferred is not None else None,
                                       owner_kind=OWNER.kind, owner_name=OWNER.name)
                   for p in self.pending.values()]
        plan = replacement.plan(view, waiting, pending_seconds, {w.uid: OWNER for w in waiting})
        for move in plan.moves:
            pod = self.pending[int(move.pod.uid)]
            self.delete_pending(pod)
            self.evicted += 1
            self.create(pod.shares, now, recreated=True)
        return len(plan.moves)


def start_cluster(rng: random.Random, nodes: int = 100, cards: int = 8, low: float = 0.70,
                  high: float = 0.80) -> list[list[int]]:
    used = [[0] * cards for _ in range(nodes)]
    target = rng.uniform(low, high) * nodes * cards * CAPACITY
    total, misses = 0, 0
    while total < target and misses < 10_000:
        s, i, k = draw(rng), rng.randrange(nodes), rng.randrange(cards)
        if used[i][k] + s <= CAPACITY:
            used[i][k] += s
            total += s
        else:
            misses += 1
    return used


def burst(seed: int, choosers: int, lag: int, randomized: bool, honour: bool = False, delay: float = 0.0,
          forget_after: float | None = None, rate: float = 5.0, sim_class: type[Sim] = Sim,
          remember_ttl: float | None = None) -> tuple[int, int]:
    """(pods in the burst, stranded pods at its end).

    Pods are created ``rate`` a second; the scheduler binds each ``delay`` seconds after its creation
    (a backlog, gates, waiting for CPU), trying again whenever a pod binds.
    """
    rng = random.Random(seed)
    used = start_cluster(rng)
    count = rng.randint(330, 500)
    sim = sim_class(used, choosers, lag, randomized, honour, seed, forget_after)
    sim.remember_ttl = remember_ttl
    due: collections.deque = collections.deque()
    for n in range(count):
        now = n / rate
        while due and due[0][0] <= now:
            _t, pod = due.popleft()
            if forget_after is not None:
                sim.forget(_t)
            sim.try_bind(pod)
        if forget_after is not None:
            sim.forget(now)
        due.append((now + delay, sim.create(draw(rng), now)))
    for when, pod in due:
        if forget_after is not None:
            sim.forget(when)
        sim.try_bind(pod)
    sim.schedule()
    return count, sim.stranded()


def burst_replaced(seed: int, choosers: int, lag: int, honour: bool, sim_class: type[Sim] = Sim,
                   interval: float = settings.Replacement().interval, settle: float = 60.0,
                   rate: float = 5.0) -> tuple[int, int, int]:
    """(pods in the burst, stranded pods at its end, evictions): a burst whose pods bind at once, with a
    re-placement pass every ``interval`` seconds during it and for ``settle`` seconds after its last pod."""
    rng = random.Random(seed)
    used = start_cluster(rng)
    count = rng.randint(330, 500)
    sim = sim_class(used, choosers, lag, True, honour, seed)
    next_pass = interval
    for n in range(count + int(settle * rate)):
        now = n / rate
        if n < count:
            sim.try_bind(sim.create(draw(rng), now))
        if now >= next_pass:
            next_pass += interval
            sim.replace(now, 0.0)
            sim.schedule()
    return count, sim.stranded(), sim.evicted


def burst_bound(seed: int) -> tuple[int, int]:
    """The scheduler choosing the card itself (first fit at scheduling time): stranded by definition only
    when nothing fits, so what the free cards could take at the end is the bound."""
    rng = random.Random(seed)
    used = start_cluster(rng)
    count = rng.randint(330, 500)
    cards = len(used[0])
    waiting = []
    for _ in range(count):
        s = draw(rng)
        spot = next(((i, k) for i in range(len(used)) for k in range(cards) if used[i][k] + s <= CAPACITY), None)
        if spot is None:
            waiting.append(s)
        else:
            used[spot[0]][spot[1]] += s
    free = [CAPACITY - u for row in used for u in row]
    return count, sum(1 for s in waiting if any(f >= s for f in free))


def first_fit_decreasing(used: list[list[int]], sizes: list[int]) -> int:
    """Shares that first-fit-decreasing places into ``used`` (not changed): the offline packing bound."""
    used = [row[:] for row in used]
    placed = 0
    for s in sorted(sizes, reverse=True):
        spot = next(((i, k) for i, row in enumerate(used) for k, u in enumerate(row) if u + s <= CAPACITY), None)
        if spot is not None:
            used[spot[0]][spot[1]] += s
            placed += s
    return placed


@dataclass
class Behind:
    pods: int
    stranded_first: int  # waiting on a full card while another had room, after the first scheduling pass
    stranded_after: int  # the same after one re-placement round and the scheduling pass that follows it
    evicted: int
    placed: int  # shares bound after the re-placement round
    ffd: int  # shares first-fit-decreasing places from the same start
    moved: int  # bound elsewhere than the node chosen for it, its card there full


def behind(seed: int, choosers: int = 2, lag: int = 20, fill: float = 0.80, demand: float = 0.9,
           honour: bool = True, sim_class: type[Sim] = Sim, at_once: bool = False, partition: bool = False) -> Behind:
    """A burst the scheduler is behind: every pod is admitted before the first one binds (a Job of
    hundreds of pods, a slow scheduler). The cluster starts ``fill`` full; the burst asks ``demand`` of
    the free shares; ``choosers`` webhook replicas, each with a view ``lag`` changes behind, choose in
    turn. Then the scheduler binds the pods, oldest first; then one re-placement round and its
    scheduling pass. ``at_once``: each pod bound right after its admission instead (the scheduler
    keeping up), for comparison."""
    rng = random.Random(seed)
    used = start_cluster(rng, low=fill, high=fill)
    free = sum(CAPACITY - u for row in used for u in row)
    sizes, total = [], 0
    while total < demand * free:
        size = draw(rng)
        sizes.append(size)
        total += size
    ffd = first_fit_decreasing(used, sizes)
    sim = sim_class([row[:] for row in used], choosers, lag, True, honour, seed)
    sim.partition = partition
    for size in sizes:
        pod = sim.create(size, 0.0)
        if at_once:  # for comparison: the scheduler keeps up, each pod bound as soon as it is admitted
            sim.try_bind(pod)
    sim.schedule()
    first = sim.stranded()
    moved = sum(1 for p in sim.running.values() if p.preferred is not None and p.node != p.preferred)
    sim.replace(1.0, 0.0)
    sim.schedule()
    after = sim.stranded()
    placed = sum(p.shares for p in sim.running.values())
    return Behind(len(sizes), first, after, sim.evicted, placed, ffd, moved)


def partition_report(seed: int, runs: int) -> None:
    """Replicas choosing over all cards against replicas trying their own card indexes first, in the burst
    the real scheduler measures (bench/e2e_scale.py): an empty cluster filled to 95 % by one burst admitted
    ahead of the scheduler, views ``lag`` changes apart."""
    print(f"bursts from empty to 95 % of 100 nodes x 8 cards, admitted ahead of the scheduler, {runs} runs per row")
    print(f"{'replicas':>8} {'lag':>4} {'partition':>9} {'stranded first':>14} {'after 1 round':>13} "
          f"{'evicted':>7} {'packing vs FFD':>14}")
    for choosers in (1, 2, 3):
        for lag in (20, 60):
            for partition in (False, True):
                if choosers == 1 and partition:
                    continue
                out = [behind(seed + i, choosers, lag, fill=0.0, demand=0.95, partition=partition) for i in range(runs)]
                first = statistics.mean(b.stranded_first / b.pods for b in out)
                after = statistics.mean(b.stranded_after / b.pods for b in out)
                print(f"{choosers:>8} {lag:>4} {str(partition):>9} {first:>14.2%} {after:>13.2%} "
                      f"{statistics.mean(b.evicted for b in out):>7.1f} "
                      f"{statistics.mean(b.placed / b.ffd for b in out):>14.4f}", flush=True)


@contextlib.contextmanager
def candidates(count: int):
    """Choices drawn among up to ``count`` candidates (placement.CHOICE_CANDIDATES) for a while."""
    was = placement.CHOICE_CANDIDATES
    placement.CHOICE_CANDIDATES = count
    try:
        yield
    finally:
        placement.CHOICE_CANDIDATES = was


BEFORE_CANDIDATES = 16  # the draw before it took up to 64 candidates


def behind_report(seed: int, runs: int) -> dict:
    """The burst the scheduler is behind, as ``behind`` runs it, for each scheduler, before and now."""
    print(f"\nburst the scheduler is behind (all pods admitted, then scheduled): 100 nodes x 8 cards 80 % full, "
          f"demand 0.9 of the free shares, 2 choosers with views 20 changes behind, {runs} runs "
          f"(seeds {seed}..{seed + runs - 1})")
    print("moved: bound elsewhere than the node chosen for it (its card there was full: the other replica chose it "
          "too); stranded: waiting on a full card while another card had room, as many as the free cards could "
          "take together; packing: shares bound after the round over first-fit-decreasing's from the same start")
    print(f"{'scheduler, choice':58} {'pods':>5} {'moved':>6} {'stranded first':>14} {'worst':>6} "
          f"{'after 1 round':>13} {'worst':>6} {'evicted':>7} {'packing':>8} {'worst':>6}")
    out = {}
    for honour, scheduler in ((True, "preferred node"), (False, "any node with room on k")):
        for label, count, at_once in (
                (f"before ({BEFORE_CANDIDATES} candidates)", BEFORE_CANDIDATES, False),
                (f"now ({placement.CHOICE_CANDIDATES} candidates)", placement.CHOICE_CANDIDATES, False),
                ("now, bound at once (no backlog)", placement.CHOICE_CANDIDATES, True)):
            with candidates(count):
                results = [behind(seed + i, honour=honour, at_once=at_once) for i in range(runs)]
            first = [r.stranded_first / r.pods for r in results]
            after = [r.stranded_after / r.pods for r in results]
            packing = [r.placed / r.ffd for r in results]
            moved = sum(r.moved for r in results) / sum(r.pods for r in results)
            print(f"{scheduler + ', ' + label:58} {statistics.mean(r.pods for r in results):>5.0f} {moved:>6.1%} "
                  f"{statistics.mean(first):>14.1%} {max(first):>6.1%} {statistics.mean(after):>13.1%} "
                  f"{max(after):>6.1%} {statistics.mean(r.evicted for r in results):>7.1f} "
                  f"{statistics.mean(packing):>8.3f} {min(packing):>6.3f}")
            if not at_once:
                out[("behind", honour, count)] = (max(first), max(after), statistics.mean(packing))
        worst_first, worst_after, packing = out[("behind", honour, placement.CHOICE_CANDIDATES)]
        met = worst_first <= 0.05 and worst_after <= 0.01 and packing >= 0.98
        print(f"now, {scheduler}: worst {worst_first:.1%} stranded at first scheduling (goal <= 5 %), "
              f"{worst_after:.1%} after one round (goal <= 1 %), packing {packing:.3f} of FFD (goal >= 0.98): "
              f"{'met' if met else 'MISSED'}")
    return out


OLD = 60.0  # seconds: the churn tables also count the stranded pods that waited longer than this


@dataclass
class Churn:
    stranded_mean: float  # waiting on a full card while another card had room, sampled every 10 s
    stranded_max: int
    stranded_old_mean: float  # the same, counting only pods waiting longer than OLD seconds
    pending_mean: float
    started: int
    evicted: int
    stranded_claimed_mean: float = 0.0  # the same, with the room waiting pods will take set aside (--why only)


def churn(seed: int, choosers: int, lag: int, randomized: bool, replace: bool, hours: float = 2.0,
          load: float = 0.95, lifetime: float = 1800.0,
          pending_seconds: float = settings.Replacement().pending_seconds,
          interval: float = settings.Replacement().interval,
          warmup: float = 3600.0, forget_after: float | None = None, honour: bool = True,
          spread_waiting: bool = True, counted: list[tuple[Pod, float]] | None = None, phase: int = 0,
          sim_class: type[Sim] = Sim) -> Churn:
    """Pods arrive (Poisson) and run for an exponential lifetime, at ``load`` of the capacity on average.

    ``honour``: the scheduler binds a pod on its preferred node when card k has room there, as
    kube-scheduler's default scoring does (below); else on any node whose card k has room.
    ``phase``: the samples are taken when the second modulo 10 is this (0: right after a pass at
    the default 5 s interval; 3: 3 s after one, 2 s before the next).
    """
    rng = random.Random(seed)
    nodes, cards = 100, 8
    sim = sim_class([[0] * cards for _ in range(nodes)], choosers, lag, randomized, honour, seed, forget_after,
              spread_waiting)
    rate = load * nodes * cards * CAPACITY / (MEAN_SIZE * lifetime)  # arrivals per second
    end = warmup + hours * 3600
    samples, old, pendings, claimed = [], [], [], []
    started, evicted_before = 0, 0
    now, next_arrival, next_pass = 0.0, rng.expovariate(rate), interval
    ends: list[tuple[float, int]] = []
    while now < end:
        now += 1.0
        while next_arrival <= now:
            sim.create(draw(rng), next_arrival)
            next_arrival += rng.expovariate(rate)
        while ends and ends[0][0] <= now:
            _t, number = heapq.heappop(ends)
            sim.leave(sim.running[number])
        if forget_after is not None:
            sim.forget(now)
        sim.schedule()
        for pod in sim.just_bound:
            heapq.heappush(ends, (now + rng.expovariate(1 / lifetime), pod.number))
            started += now > warmup
        sim.just_bound.clear()
        if replace and now >= next_pass:
            next_pass += interval
            sim.replace(now, pending_seconds)
        if now == warmup:
            evicted_before = sim.evicted
        if now > warmup and int(now) % 10 == phase:
            samples.append(sim.stranded(now, counted=counted))
            old.append(sim.stranded(now, OLD))
            if counted is not None:  # the breakdown (--why) only
                claimed.append(sim.stranded(claimed=True))
            pendings.append(len(sim.pending))
    return Churn(statistics.mean(samples), max(samples), statistics.mean(old), statistics.mean(pendings), started,
                 sim.evicted - evicted_before, statistics.mean(claimed) if claimed else 0.0)


def report(seed: int, bursts: int, churns: int, hours: float) -> dict:
    print(f"stranded pods (waiting on a full card while another card had room, as many as the free cards "
          f"could take together): 100 nodes x 8 cards; views 20 changes behind; {bursts} bursts per row "
          f"(seeds {seed}..{seed + bursts - 1})")
    schemes = (("before: best card, unbound pods forgotten after 30 s", False, 30.0),
               ("now: drawn among the best, pinned pods kept", True, None))
    out: dict = {}
    for honour, scheduler in ((False, "any node whose card k has room"),
                              (True, "the preferred node when it has room")):
        print(f"\nburst of 330-500 pods, 70-80 % full; scheduler: {scheduler}")
        print(f"{'scheme':58} {'binds after':>11} {'choosers':>8} {'stranded mean':>13} {'worst':>6} {'worst %':>8}")
        for delay in (0, 29, 31):
            for label, draw, forget in schemes:
                for choosers in (1, 2, 4):
                    runs = [burst(seed + i, choosers, 20, draw, honour=honour, delay=delay, forget_after=forget)
                            for i in range(bursts)]
                    worst = max(s / n for n, s in runs)
                    mean = statistics.mean(s for _n, s in runs)
                    out[(honour, delay, draw, choosers)] = worst
                    print(f"{label:58} {delay:>9} s {choosers:>8} {mean:>13.1f} {max(s for _n, s in runs):>6} "
                          f"{worst:>8.1%}")
        for delay in (0, 31):
            goal = max(out[(honour, delay, True, c)] for c in (1, 2, 4))
            print(f"now, binding after {delay} s, worst burst over 1, 2 and 4 choosers: {goal:.1%} stranded "
                  f"(goal <= 2 %): {'met' if goal <= 0.02 else 'MISSED'}")
    bound = [burst_bound(seed + i) for i in range(bursts)]
    print(f"\n{'scheduler-time first fit (the bound)':58} {'-':>11} {'any':>8} "
          f"{statistics.mean(s for _n, s in bound):>13.1f} {max(s for _n, s in bound):>6}")

    defaults = settings.Replacement()
    print(f"\nchurn at 95 % load (Poisson arrivals, 30 min mean lifetime), 1 chooser, views 20 changes behind, "
          f"{churns} run(s) of {hours:g} h after 1 h warm-up; stranded and pending pods sampled every 10 s")
    rows = (  # label, drawn, waiting pods spread over the indexes, re-placement (pendingSeconds, interval), forget
        ("before: best card, forgotten after 30 s, no re-placement", False, False, None, 30.0),
        ("drawn, kept, waiting on the most free index", True, False, None, None),
        ("drawn, most free index, re-placement 60 s / 15 s (old)", True, False, (60, 15), None),
        ("now: waiting pods spread over the indexes", True, True, None, None),
        (f"now, re-placement {defaults.pending_seconds} s / {defaults.interval} s (the defaults)", True, True,
         (defaults.pending_seconds, defaults.interval), None),
    )
    for honour, scheduler, which in ((True, "scheduler: the preferred node when it has room",
                                      range(len(rows))),
                                     (False, "scheduler: any node whose card k has room", (0, 2, 4))):
        print(f"\n{scheduler:58} {'stranded mean':>13} {'max':>5} {'> 60 s':>8} {'pending':>8} "
              f"{'evicted/started':>16}")
        means = {}
        for index in which:
            label, draw, spread, replace, forget = rows[index]
            pending_seconds, interval = replace or (60, 15)
            runs = [churn(seed + i, 1, 20, draw, replace is not None, hours=hours, pending_seconds=pending_seconds,
                          interval=interval, forget_after=forget, honour=honour, spread_waiting=spread)
                    for i in range(churns)]
            means[index] = statistics.mean(r.stranded_mean for r in runs)
            evicted, started_pods = sum(r.evicted for r in runs), sum(r.started for r in runs)
            print(f"{label:58} {means[index]:>13.2f} {max(r.stranded_max for r in runs):>5} "
                  f"{statistics.mean(r.stranded_old_mean for r in runs):>8.2f} "
                  f"{statistics.mean(r.pending_mean for r in runs):>8.1f} {evicted / max(1, started_pods):>16.3f}")
        if not means[0]:
            print("churn: no pod stranded before in these runs, nothing to compare (longer runs: --long)")
            continue
        ratio = means[4] / means[0]
        print(f"churn, now with re-placement vs before: {ratio:.2f} of the stranded pods (goal <= 0.10): "
              f"{'met' if ratio <= 0.10 else 'MISSED'}")
        out[("churn", honour)] = ratio
    out.update(behind_report(seed, bursts))
    return out


def why(seed: int, churns: int, hours: float) -> None:
    """Which pods the churn figure with the defaults counts as stranded: size, origin, age, and
    whether the free room they were counted against was already claimed by a waiting pod; and the
    same figures sampled between two passes instead of right after one."""
    print(f"churn at 95 % load, 1 chooser, views 20 changes behind, {churns} run(s) of {hours:g} h after 1 h "
          f"warm-up; re-placement with the defaults; the pods counted as stranded at the samples")
    for honour, scheduler in ((False, "any node whose card k has room"), (True, "the preferred node when it has room")):
        counted: list[tuple[Pod, float]] = []
        runs = [churn(seed + i, 1, 20, True, True, hours=hours, honour=honour, counted=counted)
                for i in range(churns)]
        total = max(1, len(counted))
        print(f"\nscheduler: {scheduler}: stranded mean {statistics.mean(r.stranded_mean for r in runs):.2f}, "
              f"with claimed room set aside {statistics.mean(r.stranded_claimed_mean for r in runs):.2f}")
        sizes = collections.Counter(pod.shares for pod, _age in counted)
        print("  by shares asked: " + ", ".join(f"{s}: {n / total:.0%}" for s, n in sorted(sizes.items())))
        origin = collections.Counter((pod.recreated, pod.fitted) for pod, _age in counted)
        for (recreated, fitted), n in sorted(origin.items()):
            how = "chosen where its view showed room" if fitted else "fitting nowhere in its view"
            print(f"  {'recreated after an eviction' if recreated else 'created by its owner':28} {how:34} "
                  f"{n / total:.0%}")
        ages = sorted(age for _pod, age in counted) or [0.0]
        print("  waiting for (s), quantiles 0.25 / 0.5 / 0.75 / 0.9: "
              + " / ".join(f"{ages[int(q * (len(ages) - 1))]:.0f}" for q in (0.25, 0.5, 0.75, 0.9)))
        between = [churn(seed + i, 1, 20, True, True, hours=hours, honour=honour, counted=[], phase=3)
                   for i in range(churns)]
        print(f"  sampled 3 s after a pass instead: stranded mean "
              f"{statistics.mean(r.stranded_mean for r in between):.2f}, with claimed room set aside "
              f"{statistics.mean(r.stranded_claimed_mean for r in between):.2f}")


def remembering(seed: int, bursts: int) -> None:
    """Bursts as in the report, with the chooser's remembered choices expiring after a time to live
    (the live view's REMEMBER_TTL_S) instead of lasting until its view shows the pod."""
    print(f"stranded pods in bursts of 330-500 pods at 5 a second, 70-80 % full, 4 choosers, {bursts} bursts "
          f"per row; a chooser's view lags the cluster by `lag` changes (3 per pod: created, bound, its choice "
          f"done), so about lag / 15 seconds; its choices count until its view shows the pod, or the time to live")
    print(f"{'lag (changes)':>13} {'~seconds':>8} {'time to live':>12} {'stranded mean':>13} {'worst %':>8}")
    for lag in (20, 75, 150):
        for ttl in (None, 30.0, 5.0, 2.0, 1.0):
            runs = [burst(seed + i, 4, lag, True, honour=True, remember_ttl=ttl) for i in range(bursts)]
            label = "until shown" if ttl is None else f"{ttl:g} s"
            print(f"{lag:>13} {lag / 15:>8.1f} {label:>12} {statistics.mean(s for _n, s in runs):>13.1f} "
                  f"{max(s / n for n, s in runs):>8.1%}")


SWEEP = ((60, 15), (30, 10), (10, 5), (0, 10), (0, 5), (0, 2))


def sweep(seed: int, churns: int, hours: float) -> None:
    """Churn as in the report, now with re-placement, for each (pendingSeconds, interval) of SWEEP."""
    print(f"churn at 95 % load, 1 chooser, views 20 changes behind, {churns} run(s) of {hours:g} h after 1 h "
          f"warm-up; re-placement with pendingSeconds / interval")
    for honour, scheduler in ((True, "the preferred node when it has room"), (False, "any node whose card k has room")):
        print(f"\nscheduler: {scheduler:47} {'stranded mean':>13} {'> 60 s':>8} {'pending':>8} {'evicted/started':>16}")
        for pending_seconds, interval in ((None, None), *SWEEP):
            runs = [churn(seed + i, 1, 20, True, pending_seconds is not None, hours=hours,
                          pending_seconds=pending_seconds or 0, interval=interval or 5, honour=honour)
                    for i in range(churns)]
            label = "no re-placement" if pending_seconds is None else f"{pending_seconds} s / {interval} s"
            evicted, started_pods = sum(r.evicted for r in runs), sum(r.started for r in runs)
            print(f"{label:58} {statistics.mean(r.stranded_mean for r in runs):>13.2f} "
                  f"{statistics.mean(r.stranded_old_mean for r in runs):>8.2f} "
                  f"{statistics.mean(r.pending_mean for r in runs):>8.1f} {evicted / max(1, started_pods):>16.3f}")


# --- required instead of preferred: what a scheduler could not ignore -------------------------------


class RequiredChooser(Chooser):
    """A chooser that also names the nodes a pod must run on: the chosen node alone (``NODE``), or it
    and up to ``SET_SIZE`` nodes whose card k fits within CHOICE_SLACK shares of it (``SET``)."""

    def choose(self, pod: Pod) -> None:
        super().choose(pod)
        pod.allowed = None
        if pod.preferred is None:
            return  # fits nowhere in its view: no node to require, it waits on its index
        if self.sim.required == NODE:
            pod.allowed = {pod.preferred}
            return
        k, s = pod.card, pod.shares
        chosen_free = CAPACITY - self.used[pod.preferred][k] + s  # before this pod was counted there
        fits = [i for i in range(self.sim.nodes) if s <= CAPACITY - self.used[i][k] <= chosen_free
                + placement.CHOICE_SLACK]
        random.Random(f"{self.sim.seed}-set-{pod.number}").shuffle(fits)
        pod.allowed = {*fits[:SET_SIZE], pod.preferred}


NODE, SET = "node", "set"
SET_SIZE = 16


class RequiredSim(Sim):
    """The scheduler binds a pod only on the nodes its chooser required (any of them with room on k,
    the chosen one first when ``honour``); re-placement counts a pod as stranded when none of them has
    room on k, and moves it to the tightest card anywhere that fits (its recreated pod is chosen afresh)."""

    chooser_class = RequiredChooser
    required = NODE

    def allowed(self, pod: Pod) -> Iterable[int]:
        allowed = getattr(pod, "allowed", None)
        return sorted(allowed) if allowed is not None else range(self.nodes)

    def schedule(self) -> None:
        for pod in list(self.pending.values()):
            self.try_bind(pod)

    def has_room(self, pod: Pod, used: list[list[int]], best: list[int]) -> bool:
        return any(used[i][pod.card] + pod.shares <= CAPACITY for i in self.allowed(pod))

    def replace(self, now: float, pending_seconds: float) -> int:
        used = [row[:] for row in self.used]
        stranded = []
        for pod in sorted(self.pending.values(), key=lambda p: p.created):
            fits = [i for i in self.allowed(pod) if used[i][pod.card] + pod.shares <= CAPACITY]
            if fits:  # the scheduler will bind it: its room is set aside, the tightest first
                used[max(fits, key=lambda i: used[i][pod.card])][pod.card] += pod.shares
            else:
                stranded.append(pod)
        moves = []
        for pod in stranded:
            if now - pod.created < pending_seconds:
                continue
            spots = [(CAPACITY - used[i][k], i, k) for i in range(self.nodes) for k in range(self.cards)
                     if used[i][k] + pod.shares <= CAPACITY]
            if spots:
                _free, i, k = min(spots)
                used[i][k] += pod.shares
                moves.append(pod)
        for pod in moves:
            self.delete_pending(pod)
            self.evicted += 1
            self.create(pod.shares, now, recreated=True)
        return len(moves)


class RequiredSetSim(RequiredSim):
    required = SET


def required(seed: int, bursts: int, churns: int, hours: float) -> None:
    """Churn (re-placement with the defaults) and bursts with a required node or set, against today's preferred term."""
    defaults = settings.Replacement()
    print(f"required instead of preferred: churn at 95 % load, {churns} run(s) of {hours:g} h, re-placement "
          f"{defaults.pending_seconds} s / {defaults.interval} s; bursts of 330-500 pods, {bursts} per row")
    print(f"{'form':46} {'churn stranded':>14} {'evicted/started':>16}  "
          "bursts worst (at once; after 31 s; 1/2/4 choosers)")
    forms = (("preferred, any-node scheduler", Sim, False), ("preferred, kube-scheduler's placement", Sim, True),
             ("required node", RequiredSim, True), ("required set, any-node scheduler", RequiredSetSim, False))
    for label, sim_class, honour in forms:
        runs = [churn(seed + i, 1, 20, True, True, hours=hours, honour=honour, sim_class=sim_class)
                for i in range(churns)]
        worst = []
        for delay in (0, 31):
            rows = []
            for c in (1, 2, 4):
                outcomes = [burst(seed + i, c, 20, True, honour=honour, delay=delay, sim_class=sim_class)
                            for i in range(bursts)]
                rows.append(f"{max(s / n for n, s in outcomes):.1%}")
            worst.append(" / ".join(rows))
        replaced = [[burst_replaced(seed + i, c, 20, honour, sim_class) for i in range(bursts)] for c in (1, 2, 4)]
        with_passes = " / ".join(f"{max(s / n for n, s, _e in rows):.1%}" for rows in replaced)
        evictions = " / ".join(f"{sum(e for _n, _s, e in rows) / sum(n for n, _s, _e in rows):.3f}"
                               for rows in replaced)
        evicted, started_pods = sum(r.evicted for r in runs), sum(r.started for r in runs)
        print(f"{label:46} {statistics.mean(r.stranded_mean for r in runs):>14.2f} "
              f"{evicted / max(1, started_pods):>16.3f}  {worst[0]}; {worst[1]}")
        print(f"{'':46} {'':>14} {'':>16}  with passes every {defaults.interval} s: worst {with_passes}, "
              f"evictions per pod {evictions}")


class DraChooser(Chooser):
    """backend dra: the webhook chooses nothing; the pod names a claim for its shares of one card."""

    def choose(self, pod: Pod) -> None:
        pod.card, pod.fitted, pod.preferred, pod.chooser = -1, True, None, self.number
        self.sim.log_created(pod)


class DraSim(Sim):
    """The scheduler chooses the card, as its DRA allocator does: among the nodes where some card has room for
    the claim's shares, one node (kube-scheduler scores nodes without looking at DRA capacity, so any of them:
    drawn here), then on it the first card with room (the allocator's first fit; it scores no cards)."""

    chooser_class = DraChooser

    def try_bind(self, pod: Pod) -> bool:
        s, used = pod.shares, self.used
        room = [i for i in self.allowed(pod) if any(u + s <= CAPACITY for u in used[i])]
        if not room:
            return False
        i = self.rng.choice(room)
        k = next(k for k, u in enumerate(used[i]) if u + s <= CAPACITY)
        used[i][k] += s
        pod.node, pod.card = i, k
        self.log.append((i, k, s))
        del self.pending[pod.number]
        self.running[pod.number] = pod
        self.just_bound.append(pod)
        return True

    def schedule(self) -> None:
        for pod in list(self.pending.values()):
            self.try_bind(pod)

    def has_room(self, pod: Pod, used: list[list[int]], best: list[int]) -> bool:
        return any(u + pod.shares <= CAPACITY for row in used for u in row)

    def delete_pending(self, pod: Pod) -> None:
        del self.pending[pod.number]

    def replace(self, now: float, pending_seconds: float) -> int:
        return 0  # no card is pinned before scheduling: nothing to re-place


class DraHintChooser(Chooser):
    """backend dra with a node hint: the webhook's binpack choice names a preferred node, never a card."""

    def choose(self, pod: Pod) -> None:
        super().choose(pod)
        pod.hint_card = pod.card  # what the chooser's view counts until the pod binds


class DraHintSim(DraSim):
    """The scheduler honours the preferred node when some card there has room (kube-scheduler's NodeAffinity
    score), then the allocator takes the first card with room on it."""

    chooser_class = DraHintChooser

    def try_bind(self, pod: Pod) -> bool:
        s, used = pod.shares, self.used
        if pod.preferred is not None and any(u + s <= CAPACITY for u in used[pod.preferred]):
            i = pod.preferred
        else:
            room = [i for i in self.allowed(pod) if any(u + s <= CAPACITY for u in used[i])]
            if not room:
                return False
            i = self.rng.choice(room)
        k = next(k for k, u in enumerate(used[i]) if u + s <= CAPACITY)
        used[i][k] += s
        self.log.append((i, k, s))
        if pod.preferred is not None:
            self.log.append((pod.preferred, pod.hint_card, -s))
        pod.node, pod.card = i, k
        del self.pending[pod.number]
        self.running[pod.number] = pod
        self.just_bound.append(pod)
        return True

    def delete_pending(self, pod: Pod) -> None:
        del self.pending[pod.number]
        if pod.preferred is not None:
            self.log.append((pod.preferred, pod.hint_card, -pod.shares))


def fill(seed: int, sim_class: type[Sim], honour: bool = True) -> float:
    """The packing figure: an empty 100 x 8 cluster filled with the size mix, each pod scheduled at once, until
    the first pod that stays Pending; the fraction of all shares then in use."""
    rng = random.Random(seed)
    sim = sim_class([[0] * 8 for _ in range(100)], 1, 0, True, honour, seed)
    while True:
        pod = sim.create(draw(rng))
        if not sim.try_bind(pod):
            return sum(map(sum, sim.used)) / (100 * 8 * CAPACITY)


def dra(seed: int, bursts: int, churns: int, hours: float) -> dict:
    """backend dra (the scheduler picks the card) beside the device-plugin backend with its defaults."""
    defaults = settings.Replacement()
    print(f"backend dra beside deviceplugin: 100 nodes x 8 cards, the size mix; {bursts} bursts, {churns} churn "
          f"run(s) of {hours:g} h at 95 % load; deviceplugin as installed (drawn choice, kube-scheduler's "
          f"preferred node, re-placement {defaults.pending_seconds} s / {defaults.interval} s)")
    out: dict = {}
    print(f"\n{'backend':44} {'packing at first Pending':>24}")
    for label, sim_class in (("deviceplugin (webhook picks the card)", Sim), ("dra (scheduler picks the card)", DraSim),
                             ("dra with a preferred-node hint", DraHintSim)):
        figures = [fill(seed + i, sim_class) for i in range(bursts)]
        out[("fill", label)] = statistics.mean(figures)
        print(f"{label:44} {statistics.mean(figures):>23.1%} (min {min(figures):.1%})")
    print(f"\n{'burst of 330-500 pods, 70-80 % full':44} {'stranded worst':>14} {'pending mean':>12} "
          f"{'evictions/pod':>13}")
    for label, sim_class in (("deviceplugin, 1 chooser", Sim), ("deviceplugin, 4 choosers", Sim),
                             ("dra", DraSim), ("dra with a preferred-node hint, 1 chooser", DraHintSim),
                             ("dra with a preferred-node hint, 4 choosers", DraHintSim)):
        choosers = 4 if "4" in label else 1
        runs = [burst_replaced(seed + i, choosers, 20, True, sim_class) for i in range(bursts)]
        pending = []
        for i in range(bursts):  # the same bursts, counting what waits at the end (fits nowhere, or stranded)
            rng = random.Random(seed + i)
            used = start_cluster(rng)
            count = rng.randint(330, 500)
            sim = sim_class(used, choosers, 20, True, True, seed + i)
            for _ in range(count):
                sim.try_bind(sim.create(draw(rng)))
            sim.schedule()
            pending.append(len(sim.pending))
        out[("burst", label)] = max(s / n for n, s, _e in runs)
        print(f"{label:44} {max(s / n for n, s, _e in runs):>14.1%} {statistics.mean(pending):>12.1f} "
              f"{sum(e for _n, _s, e in runs) / sum(n for n, _s, _e in runs):>13.3f}")
    print(f"\n{'churn at 95 % load':44} {'stranded mean':>14} {'pending mean':>12} {'evicted/started':>15}")
    for label, sim_class, replace in (("deviceplugin, no re-placement", Sim, False),
                                      ("deviceplugin, re-placement (defaults)", Sim, True),
                                      ("dra", DraSim, False), ("dra with a preferred-node hint", DraHintSim, False)):
        runs = [churn(seed + i, 1, 20, True, replace, hours=hours, honour=True, sim_class=sim_class)
                for i in range(churns)]
        out[("churn", label)] = statistics.mean(r.pending_mean for r in runs)
        evicted, started_pods = sum(r.evicted for r in runs), sum(r.started for r in runs)
        print(f"{label:44} {statistics.mean(r.stranded_mean for r in runs):>14.2f} "
              f"{statistics.mean(r.pending_mean for r in runs):>12.1f} {evicted / max(1, started_pods):>15.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--quick", action="store_true", help="2 bursts a row, 1 churn run of 1 h")
    parser.add_argument("--long", action="store_true",
                        help="10 bursts a row, 8 churn runs of 3 h (default: 4 bursts, 3 runs of 1 h)")
    parser.add_argument("--sweep", action="store_true",
                        help="also churn with re-placement for several pendingSeconds / interval pairs")
    parser.add_argument("--remember", action="store_true",
                        help="bursts with remembered choices expiring after a time to live, by view lag")
    parser.add_argument("--required", action="store_true",
                        help="only churn and bursts with a required node or node set instead of the preferred term")
    parser.add_argument("--behind", action="store_true",
                        help="only the burst the scheduler is behind (all pods admitted before one binds)")
    parser.add_argument("--why", action="store_true",
                        help="only which pods the churn figure with the defaults counts as stranded")
    parser.add_argument("--partition", action="store_true",
                        help="replicas trying their own share of the cards first, against all alike")
    parser.add_argument("--dra", action="store_true",
                        help="only backend dra (the scheduler picks the card) beside the device-plugin backend")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.partition:
        partition_report(args.seed, runs=10 if args.long else (2 if args.quick else 4))
        return 0
    if args.dra:
        dra(args.seed, bursts=10 if args.long else (2 if args.quick else 4),
            churns=3 if args.long else 1, hours=3.0 if args.long else 1.0)
        print(f"\nbackend comparison finished in {time.perf_counter() - started:.0f} s")
        return 0
    if args.behind:
        behind_report(args.seed, runs=20 if args.long else (4 if args.quick else 10))
        print(f"\nbehind-the-scheduler bench finished in {time.perf_counter() - started:.0f} s")
        return 0
    if args.why:
        why(args.seed, churns=8 if args.long else 3, hours=3.0 if args.long else 1.0)
        print(f"\nstranding breakdown finished in {time.perf_counter() - started:.0f} s")
        return 0
    if args.remember:
        remembering(args.seed, bursts=10 if args.long else (2 if args.quick else 4))
        return 0
    if args.required:
        required(args.seed, bursts=10 if args.long else 2, churns=3 if args.long else 1,
                 hours=3.0 if args.long else 1.0)
        print(f"\nrequired comparison finished in {time.perf_counter() - started:.0f} s")
        return 0
    if args.sweep:
        sweep(args.seed, churns=8 if args.long else 3, hours=3.0 if args.long else 1.0)
        print(f"\nstranding sweep finished in {time.perf_counter() - started:.0f} s")
        return 0
    report(args.seed, bursts=10 if args.long else (2 if args.quick else 4),
           churns=8 if args.long else (1 if args.quick else 3), hours=3.0 if args.long else 1.0)
    print(f"\nstranding bench finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
