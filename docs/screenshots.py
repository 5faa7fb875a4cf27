"""Renders docs/img/dashboard-*.png: the Grafana dashboard's queries over metrics of a real test run.

A fake node (two cards, pods that grow, exit, restart and go above their share) is observed by
the agent's own collector once a simulated minute for an hour, with the stand-in kubelet
PodResources server on a unix socket, a fake /proc tree and the local Kubernetes API server;
the webhook's state collector runs beside it over its live view of the same API server and a
real certificate.
Each panel's PromQL (the subset the dashboard uses) is evaluated over those scrapes and drawn
with matplotlib in the dashboard's layout.

    python docs/screenshots.py     # from the repository root; pip install -e '.[agent,test,docs]'
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

DASHBOARD = ROOT / "deploy/overlays/monitoring/dashboard.json"
OUT = ROOT / "docs/img"
# The run's simulated hour starts now (the certificate is made now, so its expiry reads true).
START = datetime.datetime.now().replace(second=0, microsecond=0)
NODE = "gpu-node-1"

# --- the PromQL the dashboard uses: selectors, sum/min/max/avg [by (...)], binary ops, comparisons,
# rate()/increase() over the scrapes before, histogram_quantile() ------------------------------------------

_TOKEN = re.compile(r'\s*(?:(?P<dur>\d+[smh](?![A-Za-z0-9_]))|(?P<num>\d+(?:\.\d+)?)'
                    r'|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<str>"(?:[^"\\]|\\.)*")'
                    r'|(?P<op>=~|!~|!=|==|>=|<=|[(){}\[\]=,/*+\-<>]))')
SECONDS = {"s": 1, "m": 60, "h": 3600}
STEP_S = 60  # the simulated run scrapes once a minute
AGGREGATIONS = {"sum": sum, "min": min, "max": max, "avg": lambda v: sum(v) / len(v), "count": len}
ARITHMETIC = {"/": lambda a, b: a / b if b else math.nan, "*": lambda a, b: a * b,
              "+": lambda a, b: a + b, "-": lambda a, b: a - b}
COMPARISON = {"==": lambda a, b: a == b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
              ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "!=": lambda a, b: a != b}


class Query:
    """One PromQL expression of the supported subset, evaluated over one scrape's samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = []
        pos = 0
        while pos < len(text.rstrip()):
            match = _TOKEN.match(text, pos)
            if not match or match.end() == pos:
                raise ValueError(f"cannot read {text!r} at {pos}")
            kind = match.lastgroup
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.pos = 0
        self.tree = self._expr()
        if self.pos != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.pos]} in {text!r}")

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def _take(self, value=None):
        token = self._peek()
        if value is not None and token[1] != value:
            raise ValueError(f"expected {value!r}, got {token[1]!r} in {self.text!r}")
        self.pos += 1
        return token

    def _expr(self):
        left = self._unary()
        while self._peek()[1] in (*ARITHMETIC, *COMPARISON):
            op = self._take()[1]
            left = ("binary", op, left, self._unary())
        return left

    def _unary(self):
        kind, value = self._peek()
        if kind == "num":
            self._take()
            return ("number", float(value))
        if value == "(":
            self._take("(")
            inner = self._expr()
            self._take(")")
            return inner
        if kind == "name" and value in ("rate", "increase") and self.tokens[self.pos + 1][1] == "(":
            self._take()
            self._take("(")
            inner = self._unary()
            if inner[0] != "select":
                raise ValueError(f"{value}() takes a selector in {self.text!r}")
            self._take("[")
            window = self._take()
            if window[0] != "dur":
                raise ValueError(f"expected a range such as [5m], got {window[1]!r} in {self.text!r}")
            self._take("]")
            self._take(")")
            return (value, inner, int(window[1][:-1]) * SECONDS[window[1][-1]])
        if kind == "name" and value == "histogram_quantile":
            self._take()
            self._take("(")
            q = self._take()
            if q[0] != "num":
                raise ValueError(f"histogram_quantile takes a number first in {self.text!r}")
            self._take(",")
            inner = self._expr()
            self._take(")")
            return ("quantile", float(q[1]), inner)
        if kind == "name" and value in AGGREGATIONS:
            self._take()
            by = ()
            if self._peek()[1] == "by":
                self._take()
                self._take("(")
                names = []
                while self._peek()[1] != ")":
                    names.append(self._take()[1])
                    if self._peek()[1] == ",":
                        self._take(",")
                self._take(")")
                by = tuple(names)
            self._take("(")
            inner = self._expr()
            self._take(")")
            return ("aggregate", value, by, inner)
        if kind == "name":
            self._take()
            matchers = []
            if self._peek()[1] == "{":
                self._take("{")
                while self._peek()[1] != "}":
                    label = self._take()[1]
                    op = self._take()[1]
                    text = json.loads(self._take()[1])
                    matchers.append((label, op, text))
                    if self._peek()[1] == ",":
                        self._take(",")
                self._take("}")
            return ("select", value, tuple(matchers))
        raise ValueError(f"unexpected {value!r} in {self.text!r}")

    def evaluate(self, samples: dict[frozenset, float], history: list[dict[frozenset, float]] | None = None):
        """A vector ({labels: value}) or a number; ``history``: the scrapes up to this one, one a
        minute apart, for rate() and increase() (without it they have no data)."""
        return _evaluate(self.tree, samples, history or [samples])


def _matches(labels: dict, matchers) -> bool:
    for label, op, text in matchers:
        value = labels.get(label, "")
        ok = {"=": value == text, "!=": value != text, "=~": re.fullmatch(text, value) is not None,
              "!~": re.fullmatch(text, value) is None}[op]
        if not ok:
            return False
    return True


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """histogram_quantile over one histogram's cumulative (le, count) buckets, as Prometheus interpolates."""
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if not total or buckets[-1][0] != math.inf:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == math.inf:
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 0)
        lower, below = le, count
    return lower


def _evaluate(node, samples, history):
    kind = node[0]
    if kind == "number":
        return node[1]
    if kind in ("rate", "increase"):
        _, inner, window = node
        # Over the window's scrapes, from the first that has the series (as Prometheus, less its
        # extrapolation to the window's edges); one sample only: no data.
        last = len(history) - 1
        window_scrapes = [_evaluate(inner, history[j], history)
                          for j in range(max(0, last - window // STEP_S), last + 1)]
        out = {}
        for key in window_scrapes[-1]:
            first = next(i for i, scrape in enumerate(window_scrapes) if key in scrape)
            steps = len(window_scrapes) - 1 - first
            if steps < 1:
                continue
            grown, before = 0.0, window_scrapes[first][key]
            for scrape in window_scrapes[first + 1:]:
                now = scrape.get(key, before)
                grown += now - before if now >= before else now  # a counter reset
                before = now
            label = frozenset((k, v) for k, v in key if k != "__name__")
            out[label] = grown / (steps * STEP_S) if kind == "rate" else grown
        return out
    if kind == "quantile":
        _, q, inner = node
        histograms: dict[frozenset, list[tuple[float, float]]] = {}
        for key, value in _evaluate(inner, samples, history).items():
            labels = dict(key)
            group = frozenset((k, v) for k, v in labels.items() if k not in ("le", "__name__"))
            histograms.setdefault(group, []).append((float(labels["le"]), value))
        result = {group: _quantile(q, buckets) for group, buckets in histograms.items()}
        return {group: value for group, value in result.items() if not math.isnan(value)}
    if kind == "select":
        _, name, matchers = node
        return {key: value for key, value in samples.items()
                if dict(key)["__name__"] == name and _matches(dict(key), matchers)}
    if kind == "aggregate":
        _, op, by, inner = node
        groups: dict[frozenset, list[float]] = {}
        for key, value in _evaluate(inner, samples, history).items():
            labels = dict(key)
            groups.setdefault(frozenset((k, labels.get(k, "")) for k in by), []).append(value)
        return {key: AGGREGATIONS[op](values) for key, values in groups.items()}
    _, op, left_node, right_node = node
    left, right = _evaluate(left_node, samples, history), _evaluate(right_node, samples, history)

    def strip(key):
        return frozenset((k, v) for k, v in key if k != "__name__")

    if isinstance(left, dict) and isinstance(right, dict):
        right = {strip(k): v for k, v in right.items()}
        pairs = [(strip(k), v, right[strip(k)]) for k, v in left.items() if strip(k) in right]
    elif isinstance(left, dict):
        pairs = [(strip(k), v, right) for k, v in left.items()]
    elif isinstance(right, dict):
        pairs = [(strip(k), left, v) for k, v in right.items()]
    else:
        return ARITHMETIC[op](left, right) if op in ARITHMETIC else float(COMPARISON[op](left, right))
    if op in COMPARISON:
        return {k: a for k, a, b in pairs if COMPARISON[op](a, b)}
    return {k: ARITHMETIC[op](a, b) for k, a, b in pairs}


def parse_samples(text: str) -> dict[frozenset, float]:
    return {frozenset({"__name__": s.name, **s.labels}.items()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def expand(expr: str) -> str:
    """The dashboard's variables at "All"."""
    return expr.replace("$node", ".*")


# --- the test run -------------------------------------------------------------------------------------------

def simulate(minutes: int = 60, workdir: str | None = None) -> list[dict[frozenset, float]]:
    """One parsed scrape of the agent and the webhook per simulated minute."""
    import grpc

    from tests.agent import fakenode, fakepodresources
    from tests.fakekube import FakeKube
    from webhook import certificates
    from webhook import settings as settings_mod
    from webhook.admission import metrics
    from webhook.agent.metrics import attributing, exporting, podlisting
    from webhook.agent.node import health, nvml, podresources
    from webhook.cluster import kube as kube_view
    from webhook.core import names
    from webhook.core import policy as policy_mod

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="gsd-", dir="/tmp")  # short: unix socket paths are limited
    proc_root = os.path.join(workdir, "proc")
    os.makedirs(proc_root, exist_ok=True)
    cards = [nvml.Card(0, "GPU-5f1c0a7e-0000-4000-8000-000000000000", "NVIDIA L4", 23034),
             nvml.Card(1, "GPU-5f1c0a7e-0000-4000-8000-000000000001", "NVIDIA L4", 23034)]
    devices = nvml.FakeDevices(cards)
    node = fakenode.FakeNode(proc_root, devices)
    trainer = fakenode.Container("trainer", 0, 25, 0)
    server = fakenode.Container("server", 0, 50, 25)
    jupyter = fakenode.Container("jupyter", 1, 30, 0)
    worker = fakenode.Container("worker", 1, 40, 30)
    evaluator = fakenode.Container("eval", 1, 20, 70)
    pods = {"train": fakenode.Pod("ml", "train", [trainer, fakenode.Container("sidecar")], layout="cgroupfs-v1"),
            "infer": fakenode.Pod("ml", "infer", [server]),
            "notebook": fakenode.Pod("lab", "notebook", [jupyter], layout="systemd-v2-crio"),
            "batch": fakenode.Pod("lab", "batch", [worker]),
            "eval": fakenode.Pod("lab", "eval", [evaluator])}
    socket = os.path.join(workdir, "kubelet.sock")
    kubelet = fakepodresources.FakePodResources(socket).start()
    kube = FakeKube().start()
    client = podresources.Client(socket)
    policy = policy_mod.Policy()
    board = health.Board(cards)
    observer = exporting.Observer(NODE, cards, devices, board, policy,
                                  lambda: client.holdings(policy), attributing.ProcReader(proc_root),
                                  podlisting.NodePods(kube.api_client(), NODE, min_interval=0),
                                  exporting.memory_cap_for("memory", policy.shares_per_card))
    agent = exporting.new_registry(observer)
    certificates.write_bundle(os.path.join(workdir, "certs"), service="gpushard", namespace="gpushard-system",
                              days=90)
    cert = os.path.join(workdir, "certs", "tls.crt")
    t0 = START.timestamp()
    for name in (NODE, "gpu-node-2"):
        kube.put("nodes", {"metadata": {"name": name, "labels": {names.CARDS_LABEL: "2"}}, "status": {"allocatable": {
            names.card_resource(names.CARD_PREFIX, k): "100" for k in (0, 1)}, "conditions": [
                {"type": "Ready", "status": "True"}]}})
    view = kube_view.KubeView.start(settings_mod.Settings(), api_client=kube.api_client(), watch_timeout=30)
    # The webhook's own counters, as its replicas would have counted the hour's admissions.
    webhook = metrics.Metrics()
    seen: set[str] = set()
    scrapes = []
    last_agent_text[0] = ""
    try:
        for minute in range(minutes + 1):
            wave = math.sin(minute / 4.0)
            present = ["train", "infer", "notebook", "batch"] + (["eval"] if minute >= 25 else [])
            # (pid, MiB, SM %) of each container's processes on its card.
            trainer.processes = [(1001, int(900 + 95 * minute), 30 + 8 * wave), (1002, 600, 6)]  # grows past its share
            server.processes = [(1101, int(7200 + 400 * wave), 38 + 14 * wave)]
            jupyter.processes = [(1201, 2500 + 20 * minute, 4)] if minute < 20 else []  # the notebook stops
            if minute == 40:
                worker.restarts = 1  # the kubelet restarts it: a new container ID
            worker.processes = [(1301 + worker.restarts, int(5200 if minute < 40 else 300 * (minute - 40) + 500),
                                 22 + 8 * math.cos(minute / 5.0) if minute >= 5 else 2)]
            evaluator.processes = [(1401, 2600 + 30 * (minute - 25), 12)] if minute >= 27 else []
            node.pods = [pods[name] for name in present]
            node.loose = {1: [(2001, 700, "0::/system.slice/render.service\n")]} if 10 <= minute < 30 else {}
            # The card's utilization: its processes' SM time, and a little the host's process adds.
            node.utilization = {k: min(100, round(sum(p[2] for pod in node.pods for c in pod.containers
                                                      if c.card == k for p in c.processes)
                                                  + (6 if k == 1 and node.loose else 0))) for k in (0, 1)}
            node.sync()
            kubelet.set(node.pod_resources())
            # The kubelet's PodResources does not answer for three minutes: the shares are unknown.
            kubelet.fail = grpc.StatusCode.UNAVAILABLE if 52 <= minute < 55 else None
            for pod in node.pods:
                # The API shows the restarted container's ID a couple of minutes late.
                if pod.name != "batch" or worker.restarts == 0 or minute >= 42:
                    kube.put("pods", pod.api_object(NODE))
            if minute == 48:
                # A critical Xid: the agent marks card 1 Unhealthy and counts it.
                board.apply(nvml.HealthEvent(cards[1].uuid, healthy=False, reason="critical Xid 79"))
            if minute >= 48:
                usage = devices.usage()[cards[1].uuid]
                devices.set_usage(cards[1].uuid, dataclasses.replace(usage, xid_errors=1))
            text = exporting.text(agent)
            last_agent_text[0] = text
            # The webhook's live view watches the same API server: the pods as the webhook rewrote them.
            for name in sorted(seen - set(present)):
                kube.delete("pods", name, pods[name].namespace)
            seen = set(present)
            for pod in node.pods:
                obj = pod.api_object(NODE)
                obj["metadata"]["labels"] = {names.SHARED_LABEL: names.SHARED_LABEL_VALUE}
                obj["spec"]["containers"] = [
                    {"name": c.name, "resources": {k: {names.SHARES_RESOURCE: str(c.shares),
                                                       names.card_resource(names.CARD_PREFIX, c.card): str(c.shares)}
                                                   for k in ("requests", "limits")}} if c.card is not None
                    else {"name": c.name} for c in pod.containers]
                kube.put("pods", obj)
            if minute == 50:
                # The API server drops the view's watches and fails its next requests: the view
                # counts the failures, backs off, and lists or watches again.
                errors = sum(view.watch_errors.values())
                opened = sum(view.watches.values())
                kube.fail_next = [500, 500]
                kube.drop_watches()
                deadline = time.monotonic() + 10
                while sum(view.watch_errors.values()) == errors and time.monotonic() < deadline:
                    time.sleep(0.01)
                kube.fail_next = []
                while sum(view.watches.values()) < opened + 2 and time.monotonic() < deadline:
                    time.sleep(0.01)  # both watches open again
            wanted = {k: sum(c.shares for p in node.pods for c in p.containers if c.card == k) for k in (0, 1)}
            deadline = time.monotonic() + 10
            while [_used(view, k) for k in (0, 1)] != [wanted[0], wanted[1]]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the webhook's view did not catch up")
                time.sleep(0.01)
            # Admissions: a steady flow of pods, a denied one now and then, a burst of denials at
            # 33 minutes (a Deployment asking 1.5 GPUs), and two errors at 50 (the view's API server away).
            for i in range(20 + int(8 * math.sin(minute / 6.0))):
                outcome = "patched" if i % 3 else "allowed"
                webhook.admissions.labels(outcome, "Pod", "enforce").inc()
                webhook.latency.labels("enforce").observe(0.004 + 0.003 * ((i * 7 + minute) % 5))
            denied = (6 if 33 <= minute < 36 else 0) + (1 if minute % 11 == 0 else 0)
            for _ in range(denied):
                webhook.admissions.labels("denied", "Deployment" if denied > 1 else "Pod", "enforce").inc()
                webhook.latency.labels("enforce").observe(0.003)
            if minute == 50:
                webhook.admissions.labels("error", "Pod", "enforce").inc(2)
                webhook.latency.labels("enforce").observe(0.8)
            now = t0 + 60 * minute
            text += metrics.prometheus_client.generate_latest(webhook.registry).decode()
            certificate = metrics.StateCollector(None, cert, clock=lambda now=now: now)
            for collector in (metrics.StateCollector(view), certificate):
                reg = metrics.prometheus_client.CollectorRegistry(auto_describe=False)
                reg.register(collector)
                text += metrics.prometheus_client.generate_latest(reg).decode()
            scrapes.append(parse_samples(text))
    finally:
        view.close()
        client.close()
        kubelet.stop()
        kube.stop()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return scrapes


last_agent_text = [""]  # the agent's last scrape, for `gpushard top`'s sample in docs/metrics.md


def top_sample() -> str:
    """What `gpushard top` prints for the last minute of the run."""
    from webhook import top

    cards, pods = top.parse(last_agent_text[0])
    pods.sort(key=lambda p: (p.node, p.gpu, p.namespace, p.pod, p.container))
    return top.cards_table(cards) + "\n" + top.pods_table(pods)


def _used(view, card: int) -> int | None:
    snapshot = view.snapshot()
    for node in snapshot.nodes if snapshot else ():
        if node.name == NODE:
            return next((c.used for c in node.cards if c.index == card), None)
    return None


# --- drawing ------------------------------------------------------------------------------------------------

UNITS = {"bytes": (1 / 2**30, "GiB"), "percentunit": (100, "%"), "d": (1, "days"), "s": (1, "s"), "short": (1, "")}
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#b877d9", "#f2495c", "#8ab8ff", "#fade2a"]


_COLOR_OF: dict[tuple, str] = {}


def _color(key: frozenset, target: dict, index: int) -> str:
    """One colour per container (or pod, or node and card) across every panel, so that a line keeps
    its colour from panel to panel; other series take the panel's own order."""
    labels = dict(key)
    who = tuple(labels.get(k, "") for k in ("namespace", "pod", "container"))
    if not any(who):
        return COLORS[index % len(COLORS)]
    return _COLOR_OF.setdefault(who, COLORS[len(_COLOR_OF) % len(COLORS)])


def _legend(fmt: str, key: frozenset) -> str:
    labels = dict(key)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or \
        ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def render(scrapes: list[dict], out: Path = OUT) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    times = [START + datetime.timedelta(minutes=i) for i in range(len(scrapes))]
    groups: list[tuple[str, list[dict]]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            groups.append((panel["title"], []))
        else:
            groups[-1][1].append(panel)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    plt.rcParams.update({"font.size": 9, "axes.edgecolor": "#444", "axes.labelcolor": "#ccc", "text.color": "#ddd",
                         "xtick.color": "#aaa", "ytick.color": "#aaa", "axes.facecolor": "#181b1f",
                         "figure.facecolor": "#111217", "grid.color": "#2c3035"})
    width, row_h, band = 14.0, 0.42, 0.45  # inches: figure width, one grid row, the title band
    for title, panels in groups:
        top = min(p["gridPos"]["y"] for p in panels)
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) - top
        height = band + rows * row_h + 0.1
        fig = plt.figure(figsize=(width, height))
        fig.text(0.01, 1 - 0.3 / height, f"gpushard: shared GPUs — {title}", fontsize=12, color="#eee")
        fig.text(0.99, 1 - 0.3 / height, "simulated: one node of two cards in a test run, not a real cluster",
                 fontsize=10, color="#f2cc0c", ha="right")
        for panel in panels:
            pos = panel["gridPos"]
            # Room above each panel for its title, below for the time axis, left for the y axis.
            left, right = pos["x"] / 24 * width + 0.65, (pos["x"] + pos["w"]) / 24 * width - 0.15
            upper = band + (pos["y"] - top) * row_h + 0.3
            lower = band + (pos["y"] - top + pos["h"]) * row_h - 0.4
            ax = fig.add_axes((left / width, 1 - lower / height, (right - left) / width, (lower - upper) / height))
            ax.set_title(panel["title"], loc="left", fontsize=10, color="#eee")
            scale, unit = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", "short"), (1, ""))
            if panel["type"] == "table":
                target = panel["targets"][0]
                result = Query(expand(target["expr"])).evaluate(scrapes[-1], scrapes)
                rows = [[dict(k).get(c, "") for c in ("namespace", "pod", "container", "node", "gpu")] + [f"{v:g}"]
                        for k, v in sorted(result.items(), key=lambda kv: sorted(kv[0]))]
                ax.axis("off")
                if rows:
                    tall = min(1.0, 0.12 * (len(rows) + 1))
                    table = ax.table(cellText=rows, colLabels=["namespace", "pod", "container", "node", "gpu", "value"],
                                     bbox=(0, 1 - tall, 1, tall), cellLoc="left")
                    table.auto_set_font_size(False)
                    table.set_fontsize(8)
                    for cell in table.get_celld().values():
                        cell.set_facecolor("#181b1f")
                        cell.set_edgecolor("#444")
                        cell.get_text().set_color("#ddd")
                else:
                    ax.text(0.5, 0.5, "No data", ha="center", va="center", color="#888")
                continue
            color = 0
            for target in panel["targets"]:
                query = Query(expand(target["expr"]))
                series: dict[frozenset, list[float]] = {}
                for i, samples in enumerate(scrapes):
                    result = query.evaluate(samples, scrapes[:i + 1])
                    if not isinstance(result, dict):
                        result = {frozenset(): result}
                    for key, value in result.items():
                        series.setdefault(key, [math.nan] * len(scrapes))[i] = value * scale
                for key in sorted(series, key=lambda k: sorted(k)):
                    dashed = "total" in target.get("legendFormat", "")
                    ax.plot(times, series[key], label=_legend(target.get("legendFormat", ""), key), linewidth=1.4,
                            linestyle="--" if dashed else "-", color=_color(key, target, color))
                    color += 1
            if panel["title"] == "Memory used of its share":
                ax.axhline(100, color="#f2495c", linewidth=0.8, linestyle=":")
            ax.grid(True, linewidth=0.5)
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
            ax.set_ylabel(unit)
            ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
            ax.legend(loc="upper left", fontsize=8, frameon=False, labelcolor="#ddd",
                      ncol=2 if len(ax.get_lines()) > 4 else 1)
        path = out / f"dashboard-{title.lower()}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main() -> int:
    scrapes = simulate()
    for path in render(scrapes):
        print(path.relative_to(ROOT))
    print("\n$ gpushard top   # the run's last minute, as docs/metrics.md shows it")
    print(top_sample(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
