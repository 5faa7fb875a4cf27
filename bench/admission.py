"""How many AdmissionReviews per second `gpushard serve` answers over TLS, next to a trivial Flask endpoint.

Both servers run under the same gunicorn settings on 127.0.0.1; clients hold HTTP/1.1 keep-alive
connections as the API server does. Two loads: a fixed offered rate (latency measured from each
request's scheduled time, so queueing counts), and saturation (every connection back to back).
Prints reviews/s and p50/p99/p999 latency per server and load, and gpushard's share of the ceiling.

    python bench/admission.py [--seconds 6] [--rate 200] [--connections 24] [--workers 2] [--threads 4]

With --cpu: the realistic review (a fractional GPU container and a sidecar, not a dry run) against
gpushard, optionally a --baseline checkout, and a trivial endpoint that parses the same review with
the standard library and allows it, in alternating rounds under wrk; prints each server's own CPU
(user + system time of the gunicorn master and its workers, from /proc) per answered request,
medians, and p50/p99 at --rate.

    python bench/admission.py --cpu [--baseline DIR] [--rounds 3] [--seconds 4] [--rate 200]

With --instructions: the same servers and review, each run under valgrind's callgrind and sent
reviews one after another on one kept-alive TLS connection; prints the instructions the server's
processes (gunicorn's master and worker, TLS and HTTP included) execute per answered review, from
two runs that differ only in the number of reviews. Unlike CPU time, the count does not move with
the machine's other load (it leaves out what instructions cost: cache misses, mispredictions).

    python bench/admission.py --instructions [--baseline DIR] [--reviews 400]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = "gpushard.gpushard-system.svc"


# --- the framework ceiling: the same gunicorn settings, an endpoint that only echoes the uid ---------

def ceiling_app():
    import flask

    app = flask.Flask("ceiling")

    @app.post("/mutate")
    def mutate():
        uid = json.loads(flask.request.get_data())["request"]["uid"]
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": {"uid": uid, "allowed": True}})
        return flask.Response(body, mimetype="application/json")

    app.add_url_rule("/audit", "audit", mutate, methods=["POST"])

    @app.get("/healthz")
    def healthz():
        return "ok\n"

    return app


def run_ceiling(argv: list[str]) -> int:
    """Serve the ceiling app with exactly the options `gpushard serve` would use for these arguments."""
    import gunicorn.app.base

    from webhook import cli
    from webhook.admission import serving

    args = cli.build_parser().parse_args(["serve", *argv])
    context = serving.ReloadingContext(args.cert, args.key, args.client_timeout)
    options = serving.gunicorn_options(args, context)
    options.pop("child_exit")

    class Ceiling(gunicorn.app.base.BaseApplication):
        def load_config(self):
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self):
            return ceiling_app()

    Ceiling().run()
    return 0


# --- a realistic mix of reviews -------------------------------------------------------------------

def _container(name: str, gpu: str | None = None) -> dict:
    c = {"name": name, "image": "nvcr.io/nvidia/pytorch:24.05-py3", "command": ["python", "train.py"],
         "env": [{"name": "EPOCHS", "value": "10"}],
         "resources": {"limits": {"cpu": "4", "memory": "16Gi"}, "requests": {"cpu": "2", "memory": "8Gi"}}}
    if gpu is not None:
        c["resources"]["limits"]["nvidia.com/gpu"] = gpu
        c["resources"]["requests"]["nvidia.com/gpu"] = gpu
    return c


def _pod(*containers: dict, init: list | None = None) -> dict:
    spec = {"containers": list(containers), "restartPolicy": "Never", "serviceAccountName": "default",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "train-", "namespace": "ml", "labels": {"app": "train"}}, "spec": spec}


def _review(obj: dict, kind: str, dry_run: bool = False) -> dict:
    group = "apps" if kind == "Deployment" else ""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": group, "version": "v1", "kind": kind},
        "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
        "namespace": "ml", "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:ml:ci"},
        "object": obj, "oldObject": None, "dryRun": dry_run}}


def review_mix(count: int = 200, seed: int = 7) -> list[tuple[str, bytes, str]]:
    """(path, body, uid): 40 % fractional pods, 15 % whole cards, 20 % no GPU, 10 % denials,
    10 % Deployments, 5 % audits; a third of the pods are dry runs."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        r = rng.random()
        dry = rng.random() < 0.33
        path = "/mutate"
        if r < 0.40:
            q = rng.choice(["0.1", "0.25", "250m", "0.5", "0.333", "0.05"])
            obj, kind = _pod(_container("train", q), _container("sidecar")), "Pod"
        elif r < 0.55:
            obj, kind = _pod(_container("train", "1")), "Pod"
        elif r < 0.75:
            obj, kind = _pod(_container("web"), _container("proxy")), "Pod"
        elif r < 0.85:
            obj, kind = _pod(_container("train", rng.choice(["1.5", "2", "-1", "lots"]))), "Pod"
        elif r < 0.95:
            template = {"metadata": {"labels": {"app": "serve"}},
                        "spec": {"containers": [_container("serve", rng.choice(["0.25", "0.5"]))]}}
            obj, kind = {"apiVersion": "apps/v1", "kind": "Deployment",
                         "metadata": {"name": "serve", "namespace": "ml"},
                         "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "serve"}},
                                  "template": template}}, "Deployment"
        else:
            obj, kind, path = _pod(_container("train", "0.25")), "Pod", "/audit"
        review = _review(obj, kind, dry)
        out.append((path, json.dumps(review).encode(), review["request"]["uid"]))
    return out


def realistic_review() -> bytes:
    """The review the CPU comparison sends: a fractional GPU container and a sidecar, not a dry run.

    A twentieth of a card (5 shares): rounds of a few seconds at ~1,500/s each never fill the
    200 x 8 cards within the 30 s a remembered choice counts, so every review is placed.
    """
    return json.dumps(_review(_pod(_container("train", "0.05"), _container("sidecar")), "Pod")).encode()


def cluster_yaml(nodes: int = 200, cards: int = 8) -> str:
    lines = ["nodes:"]
    for n in range(nodes):
        lines += [f"- name: gpu-{n:04d}", f"  labels: {{kubernetes.io/hostname: gpu-{n:04d}}}", "  cards:"]
        lines += [f"  - {{index: {k}, uuid: GPU-{n:04d}-{k}, usedShares: {(n * 7 + k * 13) % 60}}}"
                  for k in range(cards)]
    return "\n".join(lines) + "\n"


# --- load -----------------------------------------------------------------------------------------

def _connect(port: int, context: ssl.SSLContext) -> http.client.HTTPSConnection:
    conn = http.client.HTTPSConnection(HOST, port, timeout=30, context=context)
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    # http.client writes headers and body apart; Go's client (the API server's) disables Nagle, and so
    # must this one, or every review waits for a delayed ACK (40 ms).
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sock = context.wrap_socket(raw, server_hostname=HOST)
    return conn


def _client_process(port: int, ca: str, conns: int, rate: float | None, seconds: float, seed: int, out,
                    mix: list[tuple[str, bytes, str]] | None = None) -> None:
    """``conns`` threads, one kept-alive connection each; sends its latencies and errors to ``out``."""
    context = ssl.create_default_context(cafile=ca)
    mix = mix or review_mix(seed=seed)
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start = time.monotonic() + 0.2
    stop = start + seconds

    def worker(i: int) -> None:
        mine, bad = [], 0
        conn = _connect(port, context)
        interval = conns / rate if rate else 0.0
        # Spread the connections' schedules over one interval, so the offered load is smooth.
        next_at = start + interval * i / conns
        n = i
        while True:
            now = time.monotonic()
            if rate:
                if next_at >= stop:
                    break
                if next_at > now:
                    time.sleep(next_at - now)
                sent_at = next_at
                next_at += interval
            else:
                if now >= stop:
                    break
                sent_at = now
            path, body, uid = mix[n % len(mix)]
            n += conns
            try:
                conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200 or json.loads(data)["response"]["uid"] != uid:
                    bad += 1
            except (OSError, http.client.HTTPException, ValueError):
                bad += 1
                conn.close()
                conn = _connect(port, context)
                continue
            mine.append(time.monotonic() - sent_at)
        conn.close()
        with lock:
            latencies.extend(mine)
            errors[0] += bad

    while time.monotonic() < start - 0.1:
        time.sleep(0.01)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send((latencies, errors[0]))
    out.close()


def drive(port: int, ca: str, connections: int, processes: int, rate: float | None, seconds: float,
          mix: list[tuple[str, bytes, str]] | None = None) -> dict:
    """Run one load against a server (``mix``: the bodies, else review_mix()); reviews/s and latency
    percentiles in ms."""
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    per = [connections // processes + (1 if i < connections % processes else 0) for i in range(processes)]
    for i, conns in enumerate(per):
        receiver, sender = ctx.Pipe(duplex=False)
        share = rate * conns / connections if rate else None
        proc = ctx.Process(target=_client_process, args=(port, ca, conns, share, seconds, 100 + i, sender, mix))
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    latencies: list[float] = []
    errors = 0
    for receiver, proc in zip(pipes, procs, strict=True):
        if receiver.poll(seconds + 60):
            lat, err = receiver.recv()
            latencies += lat
            errors += err
        else:
            errors += 1
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    latencies.sort()

    def pct(p: float) -> float:
        if not latencies:
            return float("nan")
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000

    return {"rps": len(latencies) / seconds, "p50": pct(0.50), "p99": pct(0.99), "p999": pct(0.999),
            "n": len(latencies), "errors": errors}


class Server:
    def __init__(self, argv: list[str], port: int, ca: str, log: Path, cwd: Path = ROOT):
        self.port, self.ca, self.log = port, ca, log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=cwd)

    def wait_ready(self, within: float = 60) -> None:
        context = ssl.create_default_context(cafile=self.ca)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"gpushard: bench server exited:\n{self.log.read_text()[-2000:]}")
            try:
                conn = _connect(self.port, context)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit("gpushard: bench server did not start")

    def stop(self, grace: float = 30) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._out.close()


# --- CPU per answered request: the servers' own user + system time, not the client's ---------------

TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def server_cpu(pid: int) -> float:
    """User + system seconds of a gunicorn master and its workers (every thread), from /proc."""
    total = 0
    for p in (pid, *_children(pid)):
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a worker that just exited
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total / TICK


def _lua(path: str, body: bytes) -> str:
    text = body.decode()
    assert "]==]" not in text
    return (f'wrk.method = "POST"\nwrk.path = "{path}"\nwrk.headers["Content-Type"] = "application/json"\n'
            f'wrk.body = [==[{text}]==]\n')


def wrk_load(port: int, script: Path, seconds: float, connections: int) -> tuple[int, int, float]:
    """(responses, errors, seconds) of one wrk run against a server: keep-alive, back to back."""
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "5s", "-s", str(script),
                          f"https://127.0.0.1:{port}"], capture_output=True, text=True, timeout=seconds + 30)
    text = out.stdout + out.stderr
    match = re.search(r"(\d+) requests in ([\d.]+)(m?s)", text)
    if out.returncode != 0 or match is None:
        raise SystemExit(f"gpushard: wrk failed:\n{text}")
    took = float(match.group(2)) / (1000 if match.group(3) == "ms" else 1)
    errors = 0
    for pattern in (r"Non-2xx or 3xx responses: (\d+)", r"Socket errors: connect (\d+), read (\d+), "
                    r"write (\d+), timeout (\d+)"):
        found = re.search(pattern, text)
        if found:
            errors += sum(int(x) for x in found.groups())
    return int(match.group(1)), errors, took


def _check_answer(port: int, ca: str, body: bytes, patched: bool) -> None:
    conn = _connect(port, ssl.create_default_context(cafile=ca))
    conn.request("POST", "/mutate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())["response"]
    conn.close()
    if resp.status != 200 or not answer["allowed"] or patched != ("patch" in answer):
        raise SystemExit(f"gpushard: unexpected answer to the realistic review: {answer}")


def cpu_compare(args, tmp: Path, ca: str, serve: list[str]) -> int:
    """Requests per CPU second of gpushard (and a baseline checkout) and the trivial endpoint, alternating."""
    if shutil.which("wrk") is None:
        raise SystemExit("gpushard: --cpu needs wrk on the PATH (e.g. apt-get install wrk)")
    body = realistic_review()
    script = tmp / "review.lua"
    script.write_text(_lua("/mutate", body))
    names = ["gpushard", *(["baseline"] if args.baseline else []), "trivial"]
    servers: dict[str, Server] = {}
    try:
        for name in names:
            port = _free_port()
            bind = ["--bind", f"127.0.0.1:{port}"]
            if name == "trivial":
                cmd, cwd = [sys.executable, str(Path(__file__).resolve()), "--ceiling-server", *serve, *bind], ROOT
            else:
                cmd = [sys.executable, "-m", "webhook.cli", "serve", *serve, *bind,
                       "--cluster", str(tmp / "cluster.yaml")]
                cwd = Path(args.baseline).resolve() if name == "baseline" else ROOT
            servers[name] = Server(cmd, port, ca, tmp / f"{name}.log", cwd=cwd)
        for name, server in servers.items():
            server.wait_ready()
            _check_answer(server.port, ca, body, patched=name != "trivial")
            wrk_load(server.port, script, 1, args.wrk_connections)  # warm up
        samples: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # alternate who goes first
            for name in order:
                server = servers[name]
                before = server_cpu(server.proc.pid)
                done, errors, took = wrk_load(server.port, script, args.seconds, args.wrk_connections)
                cpu = server_cpu(server.proc.pid) - before
                samples[name].append((cpu / max(done, 1) * 1e6, done / took, done, errors))
        rated = {}
        if args.rate:
            for name, server in servers.items():
                rated[name] = drive(server.port, ca, args.connections, args.clients, args.rate, args.seconds,
                                    mix=[("/mutate", body, json.loads(body)["request"]["uid"])])
    finally:
        for server in servers.values():
            server.stop()

    print(f"CPU per answered request, realistic review (fractional GPU container + sidecar, not a dry run, "
          f"200 nodes x 8 cards), {args.rounds} alternating rounds of {args.seconds:g} s, "
          f"wrk -c{args.wrk_connections}, "
          f"gunicorn gthread {args.workers_used} worker x {args.threads_used} threads, {os.cpu_count()} CPUs")
    print(f"{'server':10} {'us CPU/req (median)':>20} {'all rounds':>24} {'req/CPU s':>10} {'wall req/s':>11} "
          f"{'requests':>9} {'errors':>7}")
    medians = {}
    for name in names:
        rows = samples[name]
        cpu = statistics.median(x[0] for x in rows)
        medians[name] = cpu
        print(f"{name:10} {cpu:20.0f} {' '.join(f'{x[0]:.0f}' for x in rows):>24} {1e6 / cpu:10.0f} "
              f"{statistics.median(x[1] for x in rows):11.0f} {sum(x[2] for x in rows):9d} "
              f"{sum(x[3] for x in rows):7d}")
    for name in names[:-1]:
        paired = sorted(t[0] / x[0] for x, t in zip(samples[name], samples["trivial"], strict=True))
        print(f"{name} / trivial: {medians['trivial'] / medians[name]:.2f} of the trivial endpoint's requests per "
              f"CPU second (medians); round by round {statistics.median(paired):.2f} "
              f"(from {paired[0]:.2f} to {paired[-1]:.2f})")
    for name, r in rated.items():
        print(f"{name:10} at {args.rate:g}/s: p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms, p999 {r['p999']:.2f} ms, "
              f"{r['n']} reviews, {r['errors']} errors")
    errors = sum(x[3] for rows in samples.values() for x in rows) + sum(r["errors"] for r in rated.values())
    return 1 if errors else 0


# --- instructions per answered request: the servers under valgrind, counted, not timed -------------

def _callgrind_total(log: Path) -> int:
    """The instructions every process of a server executed, from callgrind's lines in its log."""
    counts = [int(x) for x in re.findall(r"^==\d+== Collected : (\d+)$", log.read_text(), re.M)]
    if not counts:
        raise SystemExit(f"gpushard: no instruction count in {log}:\n{log.read_text()[-2000:]}")
    return sum(counts)


def _counted_run(cmd: list[str], cwd: Path, port: int, ca: str, body: bytes, reviews: int, log: Path) -> int:
    """Total instructions of one server run under callgrind that answers ``reviews`` reviews in a row."""
    server = Server(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd], port, ca, log, cwd=cwd)
    try:
        server.wait_ready(within=900)  # imports under valgrind take a minute or more
        conn = _connect(port, ssl.create_default_context(cafile=ca))
        uid = json.loads(body)["request"]["uid"]
        for _ in range(reviews):
            conn.request("POST", "/mutate", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200 or json.loads(data)["response"]["uid"] != uid:
                raise SystemExit(f"gpushard: unexpected answer under valgrind: {resp.status} {data[:300]!r}")
        conn.close()
    finally:
        server.stop(grace=600)  # callgrind writes its counts as each process exits
    return _callgrind_total(log)


def instructions_compare(args, tmp: Path, ca: str, serve: list[str]) -> int:
    """Instructions per answered review of gpushard (and a baseline checkout) and the trivial endpoint."""
    if shutil.which("valgrind") is None:
        raise SystemExit("gpushard: --instructions needs valgrind on the PATH (e.g. apt-get install valgrind)")
    body = realistic_review()
    names = ["gpushard", *(["baseline"] if args.baseline else []), "trivial"]
    # Two runs per server, the second with more reviews: the difference is the reviews alone, without
    # the start and the shutdown. All runs at once (each valgrind runs one thread at a time).
    few, many = 20, 20 + args.reviews
    results: dict[tuple[str, int], int] = {}
    errors: list[BaseException] = []

    def one(name: str, count: int) -> None:
        port = _free_port()
        bind = ["--bind", f"127.0.0.1:{port}"]
        if name == "trivial":
            cmd, cwd = [sys.executable, str(Path(__file__).resolve()), "--ceiling-server", *serve, *bind], ROOT
        else:
            cmd = [sys.executable, "-m", "webhook.cli", "serve", *serve, *bind, "--cluster", str(tmp / "cluster.yaml")]
            cwd = Path(args.baseline).resolve() if name == "baseline" else ROOT
        try:
            results[(name, count)] = _counted_run(cmd, cwd, port, ca, body, count, tmp / f"{name}-{count}.log")
        except BaseException as exc:  # noqa: BLE001 - reported after every run has ended
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(name, count)) for name in names for count in (few, many)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    per = {name: (results[(name, many)] - results[(name, few)]) / args.reviews for name in names}
    print(f"Instructions per answered request (valgrind callgrind, every process of the server: gunicorn, TLS, "
          f"HTTP, the app), realistic review, {args.reviews} reviews in a row on one kept-alive connection, "
          f"gunicorn gthread {args.workers_used} worker x {args.threads_used} threads")
    print(f"{'server':10} {'instructions/req':>17}")
    for name in names:
        print(f"{name:10} {per[name]:17,.0f}")
    for name in names[:-1]:
        print(f"{name} / trivial: {per['trivial'] / per[name]:.3f} of the trivial endpoint's requests per "
              f"instruction ({per[name] - per['trivial']:+,.0f} instructions per request)")
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds per load and server (default: 6)")
    parser.add_argument("--rate", type=float, default=200.0, help="offered reviews/s of the fixed load (default: 200)")
    parser.add_argument("--connections", type=int, default=24, help="keep-alive connections (default: 24)")
    parser.add_argument("--clients", type=int, default=2, help="client processes (default: 2)")
    parser.add_argument("--workers", type=int, default=None, help="gunicorn workers (default: serve's default)")
    parser.add_argument("--threads", type=int, default=None, help="threads per worker (default: serve's default)")
    parser.add_argument("--only", choices=("gpushard", "ceiling"), help="run one server only")
    parser.add_argument("--cpu", action="store_true",
                        help="compare the servers' own CPU per request on the realistic review (needs wrk)")
    parser.add_argument("--baseline", metavar="DIR", help="with --cpu: also serve another checkout, e.g. a git "
                        "worktree of an older commit")
    parser.add_argument("--instructions", action="store_true",
                        help="count the servers' instructions per request on the realistic review (needs valgrind)")
    parser.add_argument("--reviews", type=int, default=400,
                        help="with --instructions: reviews counted per server (default: 400)")
    parser.add_argument("--rounds", type=int, default=3, help="with --cpu: alternating rounds (default: 3)")
    parser.add_argument("--wrk-connections", type=int, default=8, help="with --cpu: wrk connections (default: 8)")
    parser.add_argument("--ceiling-server", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ceiling_server is not None:
        return run_ceiling(args.ceiling_server)

    sys.path.insert(0, str(ROOT))
    from webhook import cli

    defaults = cli.build_parser().parse_args(["serve", "--cert", "x", "--key", "x"])
    workers = args.workers or defaults.workers
    threads = args.threads or defaults.threads
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpushard-bench-") as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "webhook.cli", "certs", "--out", str(tmp / "certs")], check=True,
                       capture_output=True, cwd=ROOT)
        (tmp / "cluster.yaml").write_text(cluster_yaml())
        ca = str(tmp / "certs" / "ca.crt")
        if args.cpu or args.instructions:
            args.workers_used, args.threads_used = workers, threads
            serve = ["--cert", str(tmp / "certs" / "tls.crt"), "--key", str(tmp / "certs" / "tls.key"),
                     "--workers", str(workers), "--threads", str(threads)]
            if args.instructions:
                # Under valgrind a worker boots and stops many times slower: gunicorn must not take
                # it for a stuck one, nor kill it before callgrind has written its count.
                return instructions_compare(args, tmp, ca, [*serve, "--timeout", "900", "--graceful-timeout", "600"])
            return cpu_compare(args, tmp, ca, serve)
        for name in ("gpushard", "ceiling"):
            if args.only and name != args.only:
                continue
            port = _free_port()
            serve = ["--cert", str(tmp / "certs" / "tls.crt"), "--key", str(tmp / "certs" / "tls.key"),
                     "--bind", f"127.0.0.1:{port}", "--workers", str(workers), "--threads", str(threads)]
            if name == "gpushard":
                cmd = [sys.executable, "-m", "webhook.cli", "serve", *serve, "--cluster", str(tmp / "cluster.yaml")]
            else:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--ceiling-server", *serve]
            server = Server(cmd, port, ca, tmp / f"{name}.log")
            try:
                server.wait_ready()
                drive(port, ca, args.connections, args.clients, None, 1.0)  # warm up every worker
                for load, rate in ((f"{args.rate:g}/s", args.rate), ("saturation", None)):
                    results[(name, load)] = drive(port, ca, args.connections, args.clients, rate, args.seconds)
            finally:
                server.stop()

    print(f"admission over TLS, keep-alive: {args.connections} connections from {args.clients} client processes, "
          f"gunicorn gthread {workers} workers x {threads} threads, {os.cpu_count()} CPUs, {args.seconds:g} s per load")
    print(f"{'server':10} {'load':>11} {'reviews/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'p999 ms':>8} {'errors':>7}")
    for (name, load), r in results.items():
        print(f"{name:10} {load:>11} {r['rps']:10.0f} {r['p50']:8.2f} {r['p99']:8.2f} {r['p999']:8.2f} "
              f"{r['errors']:7d}")
    for load in {load for _, load in results}:
        if ("gpushard", load) in results and ("ceiling", load) in results:
            ours, ceiling = results[("gpushard", load)], results[("ceiling", load)]
            print(f"gpushard / ceiling at {load}: {ours['rps'] / ceiling['rps']:.2f} of the throughput, "
                  f"p50 {ours['p50'] / ceiling['p50']:.2f}x, p99 {ours['p99'] / ceiling['p99']:.2f}x")
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
