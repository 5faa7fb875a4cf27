"""What one admission review costs in-process over the live view, and what part of it the view takes.

The live view (``kube.KubeView``, its watch threads not started) holds 200 nodes x 8 cards and
their pods, fed through the same list and event paths the watch threads use. A realistic pod (a
GPU container asking 0.25 and a sidecar, not a dry run) is reviewed the way the admission server
does (``reviews.review`` on the request body): parse, decide, choose over ``snapshot()``, patch,
and ``remember`` the choice, which updates the view. Rows:

- review: back to back, each review's remembered choice updating the view for the next;
- review through the app: the same, as gunicorn calls the app (the WSGI call with its body, the
  metrics, the response);
- review after a watch event: a pod event reaches the view (as the watch thread applies it, not
  timed) before each review, so each choice is the first on a view derived from that event;
- remember, choice after event: those two parts alone;
- full rebuild: the indexes built from scratch over the same nodes, for scale;
- stages: the parts of a review timed one by one in the order the server runs them (reading the
  body; the decision, that is the asks, the rules, the choice and the rewrite, which records the
  patch as it goes; the patch's JSON (or the walk, where the rewrite recorded none); remembering
  the choice), to show where a review's time goes.

Prints p50 and p99 microseconds per row, of wall time, or with ``--clock cpu`` of the thread's CPU
time (on a busy shared machine the wall-time p99 is mostly the bench being preempted).

    python bench/review.py [--nodes 200] [--rounds 3000] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from webhook import settings as settings_mod  # noqa: E402
from webhook.admission import app as app_mod  # noqa: E402
from webhook.admission import patches, reviews  # noqa: E402
from webhook.cluster import kube  # noqa: E402
from webhook.core import decisions, names, placement  # noqa: E402

CARDS = 8
# What the rows time: wall time (perf_counter), or with --clock cpu this thread's CPU time, which a
# busy shared machine does not inflate by preempting the bench.
now = time.perf_counter


def node(i: int) -> dict:
    name = f"gpu-{i:04d}"
    allocatable = {"cpu": "96", "memory": "1Ti", **{f"{names.CARD_PREFIX}{k}": "100" for k in range(CARDS)}}
    return {"metadata": {"name": name, "labels": {names.HOSTNAME_LABEL: name, names.CARDS_LABEL: str(CARDS),
                                                  "pool": f"p{i % 4}"}},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
            "status": {"allocatable": allocatable, "conditions": [{"type": "Ready", "status": "True"}]}}


def pod(i: int, nodes: int, card: int | None = None, shares: int | None = None) -> dict:
    card = (i * 3) % CARDS if card is None else card
    shares = (10, 20, 25, 5)[i % 4] if shares is None else shares
    resources = {names.SHARES_RESOURCE: str(shares), f"{names.CARD_PREFIX}{card}": str(shares)}
    return {"metadata": {"name": f"p{i}", "namespace": "ml", "uid": f"uid-{i}",
                         "labels": {names.SHARED_LABEL: names.SHARED_LABEL_VALUE}},
            "spec": {"nodeName": f"gpu-{i % nodes:04d}", "containers": [
                {"name": "main", "resources": {"requests": dict(resources), "limits": dict(resources)}}]},
            "status": {"phase": "Running"}}


def review_body() -> bytes:
    def container(name: str, gpu: str | None) -> dict:
        c = {"name": name, "image": "nvcr.io/nvidia/pytorch:24.05-py3", "command": ["python", "serve.py"],
             "env": [{"name": "MODEL", "value": "llama"}],
             "resources": {"limits": {"cpu": "4", "memory": "16Gi"}, "requests": {"cpu": "2", "memory": "8Gi"}}}
        if gpu:
            c["resources"]["limits"]["nvidia.com/gpu"] = gpu
            c["resources"]["requests"]["nvidia.com/gpu"] = gpu
        return c

    obj = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "infer-", "namespace": "ml", "labels": {"app": "infer"}},
           "spec": {"containers": [container("infer", "0.25"), container("proxy", None)],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "ml",
        "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:ml:ci"},
        "object": obj, "oldObject": None, "dryRun": False}}).encode()


class Clock:
    """A clock the bench moves by hand, so remembered choices expire when the bench says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def live_view(nodes: int, pods: int, clock: Clock) -> kube.KubeView:
    settings = settings_mod.Settings()
    view = kube.KubeView(None, settings.policy, clock=clock)
    view.apply_list(kube.NODES, [node(i) for i in range(nodes)])
    view.apply_list(kube.PODS, [pod(i, nodes) for i in range(pods)])
    return view


def _us(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.99)] * 1e6


def stages(body: bytes, policy, view: kube.KubeView, rounds: int, reset) -> list[tuple[str, list[float]]]:
    """A review's parts timed one by one, as ``reviews.review`` runs them for this body."""
    timed: dict[str, list[float]] = {"stage: read the body": [], "stage: decide (asks, rules, choice, rewrite)": [],
                                     "stage: the patch and its JSON": [], "stage: remember the choice": []}
    parts = list(timed.values())
    for i in range(rounds):
        t0 = now()
        request = reviews.parse(body)
        t1 = now()
        decision = decisions.decide(decisions.Request(
            request["object"], request["kind"]["kind"], request["operation"], names.MODE_ENFORCE,
            request["dryRun"], old=request["oldObject"], seed=request["uid"], namespace=request["namespace"]),
            policy, view.snapshot())
        t2 = now()
        patch = patches.make(request["object"], decision.obj)
        reviews.encode_patch(patch)
        t3 = now()
        view.remember(decision.node, decision.card, decision.shares)
        t4 = now()
        for samples, took in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            samples.append(took)
        if i % 500 == 499:
            reset()
    return list(timed.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time each row by the wall clock (default) or by this thread's CPU time")
    args = parser.parse_args(argv)
    global now
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    settings = settings_mod.Settings()
    policy = settings.policy
    body = review_body()
    rows = []

    clock = Clock()
    view = live_view(args.nodes, args.nodes * 4, clock)

    def reset() -> None:
        # Forget remembered choices between rows, so cards never fill up and every review fits.
        clock.now += 1000.0
        view.snapshot()

    def one_review() -> float:
        started = now()
        result = reviews.review(body, names.MODE_ENFORCE, policy, view)
        took = now() - started
        assert result.outcome == reviews.PATCHED, result.review
        return took

    for _ in range(200):
        one_review()
    reset()
    timed = []
    for i in range(args.rounds):
        timed.append(one_review())
        if i % 500 == 499:
            reset()
    rows.append(("review", timed))

    # The same review as gunicorn hands it to the app: the WSGI call, metrics and the response included.
    app = app_mod.create_app(settings, view)
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/mutate", "SCRIPT_NAME": "", "QUERY_STRING": "",
               "SERVER_NAME": "gpushard", "SERVER_PORT": "8443", "SERVER_PROTOCOL": "HTTP/1.1",
               "HTTP_HOST": "gpushard", "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body)),
               "wsgi.version": (1, 0), "wsgi.url_scheme": "https", "wsgi.errors": sys.stderr,
               "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
               "wsgi.input_terminated": True}

    def one_request() -> float:
        answered = []
        started = now()
        data = b"".join(app(dict(environ, **{"wsgi.input": io.BytesIO(body)}),
                            lambda status, headers, exc_info=None: answered.append(status)))
        took = now() - started
        assert answered == ["200 OK"] and b'"patch"' in data, data
        return took

    reset()
    timed = []
    for i in range(args.rounds):
        timed.append(one_request())
        if i % 500 == 499:
            reset()
    rows.append(("review through the app (WSGI call, metrics, response)", timed))

    reset()
    timed, remembers, choices = [], [], []
    ask = placement.Ask(shares=25, tolerations=({"key": "nvidia.com/gpu", "operator": "Exists",
                                                 "effect": "NoSchedule"},))
    for i in range(args.rounds):
        n = args.nodes * 4 + i
        view.apply_event(kube.PODS, "ADDED", pod(n, args.nodes, shares=1))
        timed.append(one_review())
        view.apply_event(kube.PODS, "DELETED", pod(n, args.nodes, shares=1))
        started = now()
        choice = placement.choose(view.snapshot(), ask)
        choices.append(now() - started)
        started = now()
        view.remember(choice.node, choice.card, 1)
        remembers.append(now() - started)
        if i % 500 == 499:
            reset()
    rows.append(("review after a watch event", timed))
    rows.append(("choice after a watch event", choices))
    rows.append(("remember (the view update)", remembers))

    snap = view.snapshot()
    rebuilds = []
    for _ in range(50):
        fresh = placement.View(nodes=snap.nodes)
        started = now()
        placement.choose(fresh, ask)
        rebuilds.append(now() - started)
    rows.append(("full index rebuild + choice", rebuilds))

    reset()
    rows += stages(body, policy, view, args.rounds, reset)

    print(f"{args.nodes} nodes x {CARDS} cards, {args.nodes * 4} pods; {args.rounds} rounds; microseconds "
          f"({'CPU time of the thread' if args.clock == 'cpu' else 'wall time'})")
    print("| what | p50 | p99 |")
    print("|---|---:|---:|")
    for name, samples in rows:
        p50, p99 = _us(samples)
        print(f"| {name} | {p50:.0f} | {p99:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
