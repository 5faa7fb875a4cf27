"""What a run cost the control plane, and what the time-slicing setup did to the cards: the pure parts of
bench/e2e_scale.py's side-by-side mode, kept apart so that tests can check them without a cluster.

- ``Counters``: the API server's requests (``apiserver_request_total``, by verb and resource), etcd's
  writes (its revision: one per write transaction) and the CPU seconds of each component's processes,
  read before and after a burst; ``delta`` is what the burst cost.
- ``Counters.timings``: where a create's time went as the API server measures it (the sums of its histograms:
  the create request, each admission step, the webhooks), per pod.
- ``timeslice``: the cards NVIDIA's device plugin gives each pod of a node under time-slicing. The node
  offers every card as ``replicas`` devices of ``nvidia.com/gpu``; the kubelet asks the plugin for its
  preferred allocation (GetPreferredAllocation), and for replicated cards the plugin (v0.19.0,
  internal/rm/allocate.go, ``distributedAlloc``: its only policy for them) takes one replica at a time from
  a card with the fewest allocated replicas, those it has just taken counted. On a tie it takes any of them
  (its candidates come out of a Go map, through an unstable sort); the replay takes the card it took fewest
  from, then the lowest index: one of the plugin's choices. tests/runtime/test_nvidia.py holds the replay
  against the real plugin on a real kubelet. ``packed`` (the fullest card first) is no policy of the
  plugin's: it is the other bound, a plugin that packed replicas as tightly as it could. A pod of 25
  replicas on an empty node so sees 8 cards, each of which it may use whole: nothing keeps a card's
  total at one card. ``Spread`` counts the pods that see more than one card and the cards whose pods
  may use more than one card's worth (the sum of the asks of the pods that see it).
"""

from __future__ import annotations

import math
import os
import re
import urllib.request
from dataclasses import dataclass, field

SERIES = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')
DISTRIBUTED, PACKED = "distributed", "packed"


def series(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """Every labelled sample of ``metric`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        m = SERIES.match(line)
        if m and m.group(1) == metric:
            out.append((dict(LABEL.findall(m.group(2))), float(m.group(3))))
    return out


def gauge(text: str, metric: str) -> float | None:
    """An unlabelled sample of ``metric``."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == metric:
            return float(parts[1])
    return None


def requests_by_kind(text: str) -> dict[tuple[str, str], float]:
    """The API server's requests so far, by (verb, resource[/subresource])."""
    out: dict[tuple[str, str], float] = {}
    for labels, value in series(text, "apiserver_request_total"):
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource = f"{resource}/{labels['subresource']}"
        key = (labels.get("verb", "?"), resource)
        out[key] = out.get(key, 0.0) + value
    return out


# Where a create's time goes, as the API server's own histograms sum it: (metric, labels that must match).
# The request is the pods' POST; the admission steps count every CREATE (bindings and events too), the
# webhooks only what they match (gpushard's: pods in opted-in namespaces). The ValidatingAdmissionPolicies
# have no series of their own here: the API server times a policy only when it errs or denies
# (apiserver_validating_admission_policy_check_duration_seconds), so their cost is in the validating step.
TIMINGS = {
    "create": ("apiserver_request_duration_seconds", {"verb": "POST", "resource": "pods", "subresource": ""}),
    "mutating admission": ("apiserver_admission_step_admission_duration_seconds",
                           {"type": "admit", "operation": "CREATE"}),
    "validating admission": ("apiserver_admission_step_admission_duration_seconds",
                             {"type": "validate", "operation": "CREATE"}),
    "webhooks": ("apiserver_admission_webhook_admission_duration_seconds", {"operation": "CREATE"}),
}


def histogram_sum(text: str, metric: str, match: dict[str, str]) -> tuple[float, float]:
    """(sum, count) of ``metric``'s series whose labels match ``match`` (a label absent counts as empty)."""
    total, count = 0.0, 0.0
    for suffix in ("_sum", "_count"):
        for labels, value in series(text, metric + suffix):
            if all(labels.get(k, "") == v for k, v in match.items()):
                if suffix == "_sum":
                    total += value
                else:
                    count += value
    return total, count


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User and system CPU seconds of a live process (and, with ``children``, of its live children: a
    gunicorn master's workers); 0 when it is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    if children:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except OSError:
            pass
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                # The command may hold spaces and parentheses: the fields start after the last ')'.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def fetch(url: str, context=None, timeout: float = 30) -> str:
    return urllib.request.urlopen(url, context=context, timeout=timeout).read().decode()


@dataclass
class Counters:
    """One reading of what the control plane has done so far."""

    requests: dict[tuple[str, str], float]
    etcd_revision: float
    cpu: dict[str, float]
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def read(cls, apiserver_metrics: str, etcd_metrics: str, pids: dict[str, tuple[int, bool]]) -> Counters:
        revision = gauge(etcd_metrics, "etcd_debugging_mvcc_current_revision")
        if revision is None:
            raise ValueError("etcd's metrics have no etcd_debugging_mvcc_current_revision")
        return cls(requests_by_kind(apiserver_metrics), revision,
                   {name: cpu_seconds(pid, children) for name, (pid, children) in pids.items()},
                   {name: histogram_sum(apiserver_metrics, metric, match) for name, (metric, match) in TIMINGS.items()})


@dataclass
class Delta:
    """What happened between two readings, per pod of the burst."""

    pods: int
    requests: dict[tuple[str, str], float]
    etcd_writes: float
    cpu: dict[str, float]
    # Requests the bench made itself while it waited (its own lists): not the setup's cost.
    own_requests: dict[tuple[str, str], float] = field(default_factory=dict)
    # (seconds, observations) of each of TIMINGS over the burst.
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)

    def ms_per_pod(self) -> dict[str, float]:
        """Each of TIMINGS' seconds over the burst, in milliseconds per pod of it."""
        return {name: round(1000 * seconds / max(1, self.pods), 2) for name, (seconds, _n) in self.timings.items()}

    def calls_per_pod(self) -> dict[str, float]:
        """How many times each of TIMINGS was observed over the burst, per pod of it (a webhook called twice
        for one pod, reinvoked, shows as 2)."""
        return {name: self.per_pod(count) for name, (_s, count) in self.timings.items()}

    @property
    def requests_total(self) -> float:
        return sum(self.requests.values()) - sum(self.own_requests.values())

    def per_pod(self, value: float) -> float:
        return round(value / max(1, self.pods), 3)

    def top(self, most: int = 6) -> list[tuple[str, float]]:
        """The kinds of request that cost most, per pod (the bench's own taken out)."""
        net = {k: v - self.own_requests.get(k, 0.0) for k, v in self.requests.items()}
        ranked = sorted(((v, k) for k, v in net.items() if v > 0), reverse=True)[:most]
        return [(f"{verb} {resource}", self.per_pod(v)) for v, (verb, resource) in ranked]


# Requests no setup makes for its pods: the controller manager's TTL controller annotating every Node the bench
# has just made (node.alpha.kubernetes.io/ttl), which at 2,000 nodes is still under way during the burst and
# runs longer the longer the burst lasts. Left out with the bench's own lists.
SETUP_NOISE = (("PATCH", "nodes"),)


def delta(before: Counters, after: Counters, pods: int, own: dict[tuple[str, str], float] | None = None) -> Delta:
    requests = {k: v - before.requests.get(k, 0.0) for k, v in after.requests.items()}
    own = dict(own or {})
    noise = 0.0
    for kind in SETUP_NOISE:
        noise += requests.get(kind, 0.0)
        own[kind] = own.get(kind, 0.0) + requests.get(kind, 0.0)
    # Each of those patches is one etcd write too.
    return Delta(pods, {k: v for k, v in requests.items() if v > 0}, after.etcd_revision - before.etcd_revision - noise,
                 {name: max(0.0, after.cpu.get(name, 0.0) - before.cpu.get(name, 0.0)) for name in after.cpu},
                 own,
                 {name: (total - before.timings.get(name, (0.0, 0.0))[0],
                         count - before.timings.get(name, (0.0, 0.0))[1])
                  for name, (total, count) in after.timings.items()})


def why_stranded(pods: list[tuple[int, int, str | None, str | None]], cards: int, shares_per_card: int) -> dict:
    """``pods``: (shares, card, the node gpushard chose or None, the node it is bound to or None) of every pod
    over ``cards`` cards. Each pending pod that some card could take now falls in one class:
    ``no_room_at_admission`` (gpushard chose no node: its view had no card with room), ``taken_by_moved``
    (a pod the scheduler bound elsewhere than gpushard chose holds shares of the card chosen for it) or
    ``taken_by_choosers`` (every pod on that card was chosen for it: choosers whose views lagged each other
    over-filled it). ``moved``: bound pods the scheduler put on another node than gpushard chose."""
    used: dict[tuple[str, int], int] = {}
    moved_onto: set[tuple[str, int]] = set()
    for size, card, chosen, node in pods:
        if node:
            used[(node, card)] = used.get((node, card), 0) + size
            if chosen and chosen != node:
                moved_onto.add((node, card))
    room = shares_per_card if len(used) < cards else max(shares_per_card - u for u in used.values())
    out = {"moved": sum(1 for _s, _c, chosen, node in pods if node and chosen and chosen != node),
           "bound_without_preferred": sum(1 for _s, _c, chosen, node in pods if node and not chosen),
           "no_room_at_admission": 0, "taken_by_moved": 0, "taken_by_choosers": 0}
    for size, card, chosen, node in pods:
        if node or size > room:
            continue
        if not chosen:
            out["no_room_at_admission"] += 1
        elif (chosen, card) in moved_onto:
            out["taken_by_moved"] += 1
        else:
            out["taken_by_choosers"] += 1
    return out


@dataclass
class Spread:
    """What time-slicing gave the pods of the run: pods seeing more than one card, cards past one card's
    worth, and the most cards one pod saw."""

    pods: int = 0
    spanning: int = 0
    overcommitted_cards: int = 0
    cards: int = 0
    widest: int = 0


def allocate(allocated: list[int], replicas: int, size: int, policy: str = DISTRIBUTED) -> list[int]:
    """Replicas taken from each card for one pod of ``size`` replicas, as the plugin's greedy allocation
    takes them one at a time; ``allocated`` (replicas already taken per card) is updated."""
    if size > len(allocated) * replicas - sum(allocated):
        raise ValueError(f"{size} replicas asked, {len(allocated) * replicas - sum(allocated)} free")
    taken = [0] * len(allocated)
    for _ in range(size):
        free = [k for k in range(len(allocated)) if allocated[k] < replicas]
        if policy == DISTRIBUTED:
            k = min(free, key=lambda c: (allocated[c], taken[c], c))
        elif policy == PACKED:
            k = min(free, key=lambda c: (-allocated[c], taken[c], c))
        else:
            raise ValueError(f"unknown allocation policy {policy!r}")
        allocated[k] += 1
        taken[k] += 1
    return taken


def timeslice(bound: list[tuple[str, float, str, int]], cards: int, replicas: int,
              policy: str = DISTRIBUTED) -> Spread:
    """``bound``: (node, bind time, pod name, replicas asked) of every bound pod; the kubelet allocates in
    the order pods reach their node (bind time, then name)."""
    used: dict[str, list[int]] = {}
    seen: dict[tuple[str, int], int] = {}
    out = Spread(cards=0)
    for node, _at, _name, size in sorted(bound, key=lambda b: (b[1], b[2])):
        allocated = used.setdefault(node, [0] * cards)
        taken = allocate(allocated, replicas, size, policy)
        visible = [k for k in range(cards) if taken[k]]
        out.pods += 1
        out.spanning += len(visible) > 1
        out.widest = max(out.widest, len(visible))
        for k in visible:
            # A pod that sees a card may use all of its ask there: time-slicing caps nothing.
            seen[(node, k)] = seen.get((node, k), 0) + size
    out.cards = len(used) * cards
    out.overcommitted_cards = sum(1 for total in seen.values() if total > replicas)
    return out


def ratio(value: float, baseline: float) -> str:
    if not baseline or math.isnan(baseline):
        return "n/a"
    return f"{value / baseline:.2f}"
