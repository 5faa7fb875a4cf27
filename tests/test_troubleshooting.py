"""docs/troubleshooting.md and the command line say the same: every line it lists is one a failure prints.

We test:
- the doc's tables parse: each row a `gpushard:` line, its exit code (or codes), what it means and
  what to do next, with only the placeholders its introduction names;
- every row is printed for real, with its exit code, by one of the failures below, the placeholders
  read as wildcards: a missing kubeconfig (none at all, --kubeconfig or $KUBECONFIG naming a missing
  file), an unknown --context, a kubeconfig without contexts or a current one, a bad --request-timeout,
  a closed port, a server that never answers (SilentServer), one whose TLS certificate is not trusted,
  the local API server (tests/fakekube.py) refusing the token (401), forbidding a call (403, per
  namespace and per resource or subresource), failing (500) or refusing (400, 422) a call, lacking an
  object (a namespace, the webhook configuration, DRA's API, gpushard's DeviceClass), a cluster with
  no shared node or no agent, agents that do not answer, a Secret of another type or written meanwhile,
  a health port in use, the agent's startup failures, a bad config or cluster file, bad flags; the
  commands run in-process through `webhook.cli.main` (the agent as a process), as an operator runs
  them; a row none of them prints fails;
- each `gpushard:` line these failures print is a row of the doc, and none prints a traceback;
- the reverse, from the code: every message starting `gpushard:` in the modules the command line
  reports failures from has its literal parts, in order, in a row of the doc;
- each shipped role or ServiceAccount a row names exists in deploy/.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests import fakekube
from webhook import certificates, cli
from webhook.agent.metrics import exporting
from webhook.agent.node import nvml
from webhook.core import draobjects

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs/troubleshooting.md"
GPUSHARD = Path(sys.executable).with_name("gpushard")
# The placeholders of the doc's introduction, and a few that only name a part of one message.
PLACEHOLDERS = {"server", "context", "kubeconfig", "file", "value", "action", "reason", "namespace", "node", "pod",
                "name", "contexts", "seconds", "code", "resource", "selector", "count", "k", "max", "flag",
                "command", "choices", "port", "key"}
PLACEHOLDER = re.compile(r"<([a-z-]+)>")
TIMEOUT = "1s"
AGENT_NS = "gpushard-system"


# --- the doc ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    group: str
    message: str
    codes: frozenset[int]
    means: str
    next_step: str

    @property
    def pattern(self) -> re.Pattern:
        parts = PLACEHOLDER.split(self.message)
        # split() alternates literal text and placeholder names: the names become wildcards.
        return re.compile("".join(re.escape(p) if i % 2 == 0 else ".+?" for i, p in enumerate(parts)))

    def prints(self, line: str) -> bool:
        return self.pattern.fullmatch(line) is not None


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def parse(text: str) -> list[Row]:
    """The rows of every table whose first column is "message", under their "##" heading."""
    rows, group, header = [], "", None
    for line in text.splitlines():
        if line.startswith("## "):
            group, header = line[3:].strip(), None
        elif not line.startswith("|"):
            header = None
        elif header is None:
            header = _cells(line)
        elif header[0] == "message" and not set(line) <= set("|-"):
            cells = _cells(line)
            assert len(cells) == 4, f"{group}: a row of {len(cells)} cells: {line}"
            message, codes, means, next_step = cells
            assert message.startswith("`gpushard: ") and message.endswith("`") and message.count("`") == 2, line
            rows.append(Row(group, message.strip("`"), frozenset(int(c) for c in codes.split(" or ")), means,
                            next_step))
    return rows


ROWS = parse(DOC.read_text())


def test_the_doc_has_a_table_per_command_group_and_one_way_of_writing_each_placeholder():
    assert {r.group for r in ROWS} == {"Finding and reaching the cluster", "status and audit", "top", "certs",
                                      "replace", "agent", "Configuration and flags"}
    for row in ROWS:
        assert set(PLACEHOLDER.findall(row.message)) <= PLACEHOLDERS, row.message
        assert row.codes <= {0, 1, 2, 3, 4}, row
        assert row.means and row.next_step, row
    for group in {r.group for r in ROWS}:
        messages = [r.message for r in ROWS if r.group == group]
        assert len(set(messages)) == len(messages), f"{group}: a row listed twice"


# --- producing each failure ----------------------------------------------------------------------

@dataclass
class Printed:
    code: int
    out: str
    err: str
    stdout_too: bool = False  # status's notes are part of its table, on standard output

    @property
    def lines(self) -> list[str]:
        text = self.err + (self.out if self.stdout_too else "")
        return [line for line in text.splitlines() if line.startswith("gpushard: ")]


class Kit:
    """Files, kubeconfigs and runs for one failure, in its own folder."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True)
        (root / "home").mkdir()

    def file(self, name: str, text: str | bytes | None = None) -> Path:
        path = self.root / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        elif text is not None:
            path.write_text(text)
        return path

    def kubeconfig(self, server: str, token: str | None = None, contexts: tuple[str, ...] = ("on-call",),
                   current: str | None = "on-call", namespace: str | None = None) -> str:
        context = {"cluster": "c", "user": "u", **({"namespace": namespace} if namespace else {})}
        config = {"apiVersion": "v1", "kind": "Config",
                  "clusters": [{"name": "c", "cluster": {"server": server}}],
                  "users": [{"name": "u", "user": {"token": token} if token else {}}],
                  "contexts": [{"name": name, "context": context} for name in contexts]}
        if current:
            config["current-context"] = current
        return str(self.file("kubeconfig", json.dumps(config)))

    def run(self, *argv: str, env: dict[str, str] | None = None, stdout_too: bool = False) -> Printed:
        """The command in this process, with an environment of its own (no kubeconfig, not in a pod)."""
        out, err = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as patch:
            for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "NODE_NAME"):
                patch.delenv(name, raising=False)
            patch.setenv("HOME", str(self.root / "home"))
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = cli.main(list(argv))
                except SystemExit as exc:  # argparse's own exit, for bad flags
                    code = exc.code or 0
        return Printed(int(code), out.getvalue(), err.getvalue(), stdout_too)

    def agent(self, *argv: str, env: dict[str, str] | None = None) -> Printed:
        """`gpushard agent` as the DaemonSet runs it: its own process, which exits on a startup failure."""
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "NODE_NAME")}
        environ.update({"HOME": str(self.root / "home"), **(env or {})})
        done = subprocess.run([str(GPUSHARD), "agent", *argv], capture_output=True, text=True, timeout=120,
                              env=environ, cwd=ROOT)
        return Printed(done.returncode, done.stdout, done.stderr)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


@contextlib.contextmanager
def untrusted_tls(kit: Kit) -> Iterator[str]:
    """A server whose certificate is signed by a CA that no kubeconfig names."""
    paths = certificates.write_bundle(kit.root / "tls", service="api", namespace="default")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(paths[1]), str(paths[2]))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def agent_pod(name: str = "agent-a", node: str = "node-a") -> dict:
    return {"metadata": {"name": name, "namespace": AGENT_NS,
                         "labels": {"app.kubernetes.io/name": "gpushard", "app.kubernetes.io/component": "agent"}},
            "spec": {"nodeName": node, "containers": [{"name": "agent", "ports": [
                {"name": "metrics", "containerPort": 9401}]}]},
            "status": {"phase": "Running"}}


def webhook_configuration() -> dict:
    return yaml.safe_load((ROOT / "deploy/base/webhook-configuration.yaml").read_text())


SCENARIOS: dict[str, Callable[[Kit], Printed]] = {}


def scenario(name: str):
    def register(fn):
        SCENARIOS[name] = fn
        return fn
    return register


# Every command that reads the cluster, and how each is run once.
CLUSTER_COMMANDS = {"status": ("status",), "audit": ("audit",), "top": ("top",),
                    "replace": ("replace", "--once", "--dry-run"), "certs": ("certs", "--install")}


def _for_every_cluster_command(name: str, fn: Callable[[Kit, tuple[str, ...]], Printed]) -> None:
    for command, argv in CLUSTER_COMMANDS.items():
        SCENARIOS[f"{name}/{command}"] = lambda kit, argv=argv: fn(kit, argv)


def _kubeconfig_missing(kit, argv):
    return kit.run(*argv, "--kubeconfig", str(kit.file("missing")))


def _kubeconfig_env_missing(kit, argv):
    return kit.run(*argv, env={"KUBECONFIG": f"{kit.file('gone')}:{kit.file('gone-too')}"})


def _no_kubeconfig_outside_a_pod(kit, argv):
    return kit.run(*argv)


def _context_without_kubeconfig(kit, argv):
    return kit.run(*argv, "--context", "prod")


def _unknown_context(kit, argv):
    return kit.run(*argv, "--kubeconfig", kit.kubeconfig("http://127.0.0.1:9"), "--context", "prod")


def _no_contexts_at_all(kit, argv):
    return kit.run(*argv, "--kubeconfig", kit.kubeconfig("http://127.0.0.1:9", contexts=(), current=None),
                   "--context", "prod")


def _no_current_context(kit, argv):
    return kit.run(*argv, "--kubeconfig", kit.kubeconfig("http://127.0.0.1:9", contexts=("a", "b"), current=None))


def _unusable_kubeconfig(kit, argv):
    return kit.run(*argv, "--kubeconfig", str(kit.file("kubeconfig", "clusters: [\n")))


def _timeout_not_a_duration(kit, argv):
    return kit.run(*argv, "--kubeconfig", kit.kubeconfig("http://127.0.0.1:9"), "--request-timeout", "soon")


def _timeout_negative(kit, argv):
    return kit.run(*argv, "--kubeconfig", kit.kubeconfig("http://127.0.0.1:9"), "--request-timeout", "-1")


def _refused(kit, argv):
    return kit.run(*argv, "--kubeconfig", kit.kubeconfig(f"http://127.0.0.1:{closed_port()}"))


def _silent(kit, argv):
    with fakekube.SilentServer() as silent:
        return kit.run(*argv, "--kubeconfig", kit.kubeconfig(silent.url), "--request-timeout", TIMEOUT)


def _untrusted(kit, argv):
    with untrusted_tls(kit) as url:
        return kit.run(*argv, "--kubeconfig", kit.kubeconfig(url), "--request-timeout", TIMEOUT)


def _unauthorized(kit, argv):
    with fakekube.FakeKube() as fake:
        fake.tokens = {}
        return kit.run(*argv, "--kubeconfig", kit.kubeconfig(fake.url, "expired"))


for _name, _fn in (("kubeconfig-missing", _kubeconfig_missing), ("kubeconfig-env-missing", _kubeconfig_env_missing),
                   ("no-kubeconfig", _no_kubeconfig_outside_a_pod),
                   ("context-no-kubeconfig", _context_without_kubeconfig),
                   ("unknown-context", _unknown_context), ("no-contexts", _no_contexts_at_all),
                   ("no-current-context", _no_current_context), ("unusable-kubeconfig", _unusable_kubeconfig),
                   ("timeout-not-a-duration", _timeout_not_a_duration), ("timeout-negative", _timeout_negative),
                   ("refused", _refused), ("silent", _silent), ("untrusted", _untrusted),
                   ("unauthorized", _unauthorized)):
    _for_every_cluster_command(_name, _fn)


@contextlib.contextmanager
def cluster(kit: Kit, token: str | None = None,
            namespace: str | None = None) -> Iterator[tuple[fakekube.FakeKube, str]]:
    with fakekube.FakeKube() as fake:
        yield fake, kit.kubeconfig(fake.url, token, namespace=namespace)


# --- status and audit

@scenario("status/forbidden")
def _(kit):
    with cluster(kit, "ml-only") as (fake, path):
        fake.tokens = {"ml-only": ("ml",)}
        return kit.run("status", "--kubeconfig", path)


@scenario("audit/forbidden")
def _(kit):
    with cluster(kit, "ml-only") as (fake, path):
        fake.tokens = {"ml-only": ("ml",)}
        return kit.run("audit", "--kubeconfig", path)


@scenario("audit/forbidden-in-namespace")
def _(kit):
    with cluster(kit, "t") as (fake, path):
        fake.put("namespaces", {"metadata": {"name": "ml"}})
        fake.tokens, fake.refused = {"t": ("ml",)}, {"t": ("pods",)}
        return kit.run("audit", "-n", "ml", "--kubeconfig", path)


@scenario("audit/a-workload-kind-forbidden")
def _(kit):
    with cluster(kit, "t") as (fake, path):
        fake.tokens, fake.refused = {"t": None}, {"t": ("deployments",)}
        return kit.run("audit", "--kubeconfig", path, "-o", "json")


@scenario("status/install-unreadable")
def _(kit):
    with cluster(kit, "t") as (fake, path):
        fake.tokens = {"t": None}
        fake.refused = {"t": ("validatingadmissionpolicies", "validatingadmissionpolicybindings")}
        return kit.run("status", "--kubeconfig", path)


@scenario("audit/namespace-unreadable")
def _(kit):
    with cluster(kit, "t") as (fake, path):
        fake.tokens, fake.refused = {"t": ("ml",)}, {"t": ("namespaces",)}
        return kit.run("audit", "-n", "ml", "--kubeconfig", path, "-o", "json")


@scenario("audit/namespace-missing")
def _(kit):
    with cluster(kit) as (_fake, path):
        return kit.run("audit", "-n", "research", "--kubeconfig", path)


@scenario("status/refused-list")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.fail_next = [400]
        return kit.run("status", "-l", "pool in (a", "--kubeconfig", path)


@scenario("audit/failed-list")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.fail_next = [500]
        return kit.run("audit", "--kubeconfig", path)


@scenario("status/no-shared-node")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("nodes", {"metadata": {"name": "cpu-1"}, "status": {"allocatable": {"cpu": "8"}}})
        return kit.run("status", "--kubeconfig", path, stdout_too=True)


def _slice() -> dict:
    return draobjects.resource_slice("node-a", [draobjects.CardFacts(0, "GPU-0", "NVIDIA L4", 23034)], 100, 1)


def _dra_config(kit: Kit) -> str:
    return str(kit.file("dra.yaml", "version: v1\nbackend: dra\n"))


@scenario("status/device-plugin-on-dra")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("resourceslices", _slice())
        return kit.run("status", "--kubeconfig", path, stdout_too=True)


@scenario("status/dra-without-slices")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("deviceclasses", draobjects.device_class())
        return kit.run("status", "--config", _dra_config(kit), "--kubeconfig", path, stdout_too=True)


@scenario("status/dra-without-device-class")
def _(kit):
    with cluster(kit) as (_fake, path):
        return kit.run("status", "--config", _dra_config(kit), "--kubeconfig", path)


@scenario("status/dra-without-the-api")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.unserved.add("resource.k8s.io/v1")
        return kit.run("status", "--config", _dra_config(kit), "--kubeconfig", path)


@scenario("status/selector-matches-none")
def _(kit):
    with cluster(kit) as (fake, path):
        for name in ("gpu-1", "gpu-2"):
            fake.put("nodes", {"metadata": {"name": name, "labels": {"gpushard.io/cards": "1", "pool": "train"}},
                               "status": {"allocatable": {"gpushard.io/card-0": "100", "gpushard.io/gpu": "100"}}})
        return kit.run("status", "-l", "pool=infer", "--kubeconfig", path, stdout_too=True)


# --- top

@scenario("top/forbidden-list")
def _(kit):
    with cluster(kit, "ml-only") as (fake, path):
        fake.tokens = {"ml-only": ("ml",)}
        return kit.run("top", "--kubeconfig", path)


@scenario("top/forbidden-port-forward")
def _(kit):
    with cluster(kit, "viewer") as (fake, path):
        fake.put("pods", agent_pod())
        fake.tokens, fake.refused = {"viewer": None}, {"viewer": ("pods/portforward",)}
        return kit.run("top", "--kubeconfig", path)


@scenario("top/no-agent")
def _(kit):
    with cluster(kit) as (_fake, path):
        return kit.run("top", "--kubeconfig", path)


@scenario("top/no-agent-on-node")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("pods", agent_pod())
        return kit.run("top", "--node", "node-z", "--kubeconfig", path)


@scenario("top/no-agent-answers")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("pods", agent_pod())  # and nothing listens behind its port-forward
        return kit.run("top", "--kubeconfig", path)


@scenario("top/kubelet-unreachable")
def _(kit):
    card = nvml.Card(0, "GPU-0", "NVIDIA L4", 16384)
    usage = nvml.Usage(10 * nvml.MIB, 16384 * nvml.MIB, 1, process_utilization=True)
    row = exporting.CardRow(card, True, True, usage, shares_allocated=0, containers=[])
    observation = exporting.Observation("node-a", 100, [row], pod_resources_up=False)
    server = exporting.Server(exporting.new_registry(lambda: observation), 0, addr="127.0.0.1")
    try:
        with cluster(kit) as (fake, path):
            fake.put("pods", agent_pod())
            fake.forwards[(AGENT_NS, "agent-a", 9401)] = ("127.0.0.1", server.port)
            return kit.run("top", "--kubeconfig", path)
    finally:
        server.close()


@scenario("top/failed-list")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.fail_next = [500]
        return kit.run("top", "--kubeconfig", path)


# --- certs

@scenario("certs/no-out")
def _(kit):
    return kit.run("certs")


@scenario("certs/days")
def _(kit):
    return kit.run("certs", "--days", "0", "--out", str(kit.root / "certs"))


@scenario("certs/service-name")
def _(kit):
    return kit.run("certs", "--service", "Web_Hook", "--out", str(kit.root / "certs"))


@scenario("certs/out-below-a-file")
def _(kit):
    return kit.run("certs", "--out", str(kit.file("file", "a regular file\n") / "certs"))


@scenario("certs/days-within-renewal")
def _(kit):
    with cluster(kit) as (_fake, path):
        return kit.run("certs", "--install", "--days", "20", "--kubeconfig", path)


@scenario("certs/forbidden")
def _(kit):
    with cluster(kit, "ns-admin") as (fake, path):
        fake.tokens = {"ns-admin": ("gpushard-system",)}
        return kit.run("certs", "--install", "--kubeconfig", path)


@scenario("certs/no-webhook-configuration")
def _(kit):
    with cluster(kit) as (_fake, path):
        return kit.run("certs", "--install", "--kubeconfig", path)


@scenario("certs/no-webhooks")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("mutatingwebhookconfigurations", {**webhook_configuration(), "webhooks": []})
        return kit.run("certs", "--install", "--kubeconfig", path)


@scenario("certs/secret-of-another-type")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("mutatingwebhookconfigurations", webhook_configuration())
        fake.put("secrets", {"metadata": {"name": "gpushard-tls", "namespace": "gpushard-system"}, "type": "Opaque"})
        return kit.run("certs", "--install", "--kubeconfig", path)


@scenario("certs/patch-refused")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("mutatingwebhookconfigurations", webhook_configuration())

        def reorder(method: str, _path: str) -> None:
            # Someone renamed the first webhook between the read and the patch: its "test" fails (422).
            if method == "PATCH":
                config = fake.get("mutatingwebhookconfigurations", "gpushard")
                config["webhooks"][0]["name"] = "renamed.gpushard.io"
                fake.put("mutatingwebhookconfigurations", config)

        fake.on_request = reorder
        return kit.run("certs", "--install", "--kubeconfig", path)


@scenario("certs/failed")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.fail_next = [500]
        return kit.run("certs", "--install", "--kubeconfig", path)


@scenario("certs/secret-written-meanwhile")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.put("mutatingwebhookconfigurations", webhook_configuration())

        def race(method: str, path: str) -> None:
            if method == "POST" and "/secrets" in path:
                fake.put("secrets", {"metadata": {"name": "gpushard-tls", "namespace": "gpushard-system"},
                                     "type": "kubernetes.io/tls"})

        fake.on_request = race
        return kit.run("certs", "--install", "--kubeconfig", path)


# --- replace

@scenario("replace/forbidden")
def _(kit):
    with cluster(kit, "ns-admin") as (fake, path):
        fake.tokens = {"ns-admin": ("gpushard-system",)}
        return kit.run("replace", "--once", "--kubeconfig", path)


@scenario("replace/failed")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.fail_next = [500]
        return kit.run("replace", "--once", "--kubeconfig", path)


@scenario("replace/refused")
def _(kit):
    with cluster(kit) as (fake, path):
        fake.fail_next = [400]
        return kit.run("replace", "--once", "--kubeconfig", path)


@scenario("replace/health-port-taken")
def _(kit):
    with cluster(kit) as (_fake, path), taken_port() as port:
        return kit.run("replace", "--health-port", str(port), "--kubeconfig", path)


# --- agent

def _plugins(kit: Kit) -> str:
    return str(kit.root / "device-plugins")


@scenario("agent/poll-interval")
def _(kit):
    return kit.agent("--allow-no-gpus", "--no-publish", "--device-plugin-dir", _plugins(kit), "--poll-interval", "0")


@scenario("agent/metrics-port")
def _(kit):
    return kit.agent("--allow-no-gpus", "--no-publish", "--device-plugin-dir", _plugins(kit), "--metrics-port", "70000")


@scenario("agent/no-node-name")
def _(kit):
    return kit.agent("--allow-no-gpus", "--device-plugin-dir", _plugins(kit))


@scenario("agent/no-nvml")
def _(kit):
    # As on a node whose image lacks nvidia-ml-py: its import fails, whatever this machine has.
    shadow = kit.root / "no-nvml"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text("raise ImportError(\"No module named 'pynvml'\")\n")
    return kit.agent("--no-publish", "--device-plugin-dir", _plugins(kit), env={"PYTHONPATH": str(shadow)})


@scenario("agent/bad-inventory")
def _(kit):
    return kit.agent("--fake-inventory", str(kit.file("missing.yaml")), "--no-publish",
                     "--device-plugin-dir", _plugins(kit))


@scenario("agent/dra-without-the-api")
def _(kit):
    return kit.agent("--config", _dra_config(kit), "--allow-no-gpus", "--no-publish",
                     "--device-plugin-dir", _plugins(kit))


@scenario("agent/no-credentials")
def _(kit):
    return kit.agent("--allow-no-gpus", "--node-name", "n1", "--device-plugin-dir", _plugins(kit),
                     env={"KUBECONFIG": str(kit.file("no-kubeconfig"))})


@scenario("agent/device-plugin-dir")
def _(kit):
    return kit.agent("--allow-no-gpus", "--no-publish",
                     "--device-plugin-dir", str(kit.file("file", "not a folder\n") / "device-plugins"))


@scenario("agent/metrics-port-taken")
def _(kit):
    with taken_port() as port:
        return kit.agent("--allow-no-gpus", "--no-publish", "--device-plugin-dir", _plugins(kit),
                         "--metrics-port", str(port))


# --- configuration and flags

@scenario("config/bad-key")
def _(kit):
    config = kit.file("config.yaml", "version: v1\npolicy: {placement: fast}\n")
    return kit.run("review", "--config", str(config), "examples/pod-quarter.yaml")


@scenario("config/missing")
def _(kit):
    return kit.run("status", "--config", str(kit.file("missing.yaml")))


@scenario("config/bad-cluster-file")
def _(kit):
    view = kit.file("cluster.yaml", "nodes:\n- {labels: {}}\n")
    return kit.run("review", "--cluster", str(view), "examples/pod-quarter.yaml")


@scenario("config/missing-cluster-file")
def _(kit):
    return kit.run("review", "--cluster", str(kit.file("missing.yaml")), "examples/pod-quarter.yaml")


@scenario("flags/unknown")
def _(kit):
    return kit.run("status", "--watch")


@scenario("flags/choice")
def _(kit):
    return kit.run("status", "-o", "xml")


@scenario("flags/number")
def _(kit):
    return kit.run("certs", "--days", "soon")


@scenario("flags/required")
def _(kit):
    return kit.run("serve")


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, Printed]:
    """What each failure printed, and its exit code; run once for every test here."""
    root = tmp_path_factory.mktemp("troubleshooting")
    results = {}
    for i, (name, produce) in enumerate(SCENARIOS.items()):
        results[name] = produce(Kit(root / f"{i:03d}"))
    return results


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.group}: {r.message[10:60]}" for r in ROWS])
def test_each_row_is_printed_by_a_failure_with_its_exit_code(printed, row):
    by = [name for name, p in printed.items() if p.code in row.codes and any(row.prints(line) for line in p.lines)]
    near = {name: (p.code, p.lines) for name, p in printed.items() if any(row.prints(line) for line in p.lines)}
    assert by, f"no failure prints this row with exit {sorted(row.codes)} (printed with another exit: {near})"


def test_each_line_a_failure_prints_is_in_the_doc_in_one_line(printed):
    undocumented = {}
    for name, p in printed.items():
        assert "Traceback" not in p.out + p.err, (name, p.err)
        assert p.lines, f"{name} printed no gpushard: line: {p.err!r}"
        if not name.startswith("agent/"):  # the agent's log lines go there too
            others = [line for line in p.err.splitlines()
                      if line and not line.startswith(("gpushard: ", "usage: ", " "))]
            assert not others, (name, others)  # nothing but its line, after argparse's usage for a bad flag
        missing = [line for line in p.lines if not any(row.prints(line) for row in ROWS)]
        if missing:
            undocumented[name] = missing
    assert not undocumented


def test_each_cluster_command_fails_alike(printed):
    # The first table holds for all five: each of its failures prints the same row from each command.
    for name in {n.removesuffix("/status") for n in SCENARIOS if n.endswith("/status")}:
        rows = {command: {r.message for r in ROWS for line in printed[f"{name}/{command}"].lines if r.prints(line)}
                for command in CLUSTER_COMMANDS}
        assert len({frozenset(v) for v in rows.values()}) == 1, (name, rows)
        assert {printed[f"{name}/{command}"].code for command in CLUSTER_COMMANDS} != {0}, name


# --- the reverse: messages in the code ----------------------------------------------------------

# The modules the command line reports failures from, each with the functions that only inform
# (success, progress) and so are not failures the doc lists.
SOURCES = {
    "webhook/cli.py": (), "webhook/kubeapi/connecting.py": (), "webhook/kubectlflags.py": (), "webhook/settings.py": (),
    "webhook/auditing.py": ("audit_table", "_without_summary", "read_manifests", "parse_text", "_expand", "_files",
                            "_failed"),
    "webhook/top.py": (), "webhook/installing.py": ("lines",),
    "webhook/replacement/controller.py": (), "webhook/kubeapi/lease.py": (), "webhook/replacement/cache.py": (),
    "webhook/agent/running.py": (),
}
# Lines that say what was done, not what failed; and an error nobody foresaw (a bug), which no failure
# can be made to print on purpose (the doc says how it is told, below its tables).
INFORMING = ("gpushard: re-placement is off", "gpushard: another replacer holds Lease", "gpushard: evicted ",
             "gpushard: the re-placement pass stopped by an unexpected error", "gpushard: the agent's ")


def code_messages() -> list[tuple[str, int, list[str]]]:
    """(module, line, literal parts) of every string that starts with "gpushard: ", outside log calls and
    the functions that only inform."""
    found = []
    for module, informing in SOURCES.items():
        tree = ast.parse((ROOT / module).read_text())
        skipped: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in informing:
                skipped |= {id(n) for n in ast.walk(node)}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "log":
                skipped |= {id(n) for n in ast.walk(node)}  # the component's log, not the command's line
            elif isinstance(node, ast.JoinedStr):
                skipped |= {id(v) for v in node.values}  # its parts are read with it
        for node in ast.walk(tree):
            if id(node) in skipped or not isinstance(node, (ast.Constant, ast.JoinedStr)):
                continue
            parts = [node.value] if isinstance(node, ast.Constant) else \
                [v.value for v in node.values if isinstance(v, ast.Constant)]
            if not parts or not isinstance(parts[0], str) or not parts[0].startswith("gpushard: ") \
                    or parts[0].startswith(INFORMING):
                continue
            found.append((module, node.lineno, [p.rstrip("\n") for p in parts]))
    return found


def _in_order(parts: list[str], message: str) -> bool:
    at = 0
    for part in parts:
        at = message.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


def test_each_message_the_code_holds_is_a_row_of_the_doc():
    messages = code_messages()
    assert len(messages) > 40  # the scan sees the messages at all
    missing = [(module, line, "".join(parts)) for module, line, parts in messages
               if not any(_in_order(parts, row.message) for row in ROWS)]
    assert not missing


def test_the_roles_the_rows_name_are_shipped():
    shipped = set()
    for path in (ROOT / "deploy").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") in ("ClusterRole", "Role", "ServiceAccount"):
                meta = doc["metadata"]
                shipped.add((doc["kind"], meta["name"]))
                if doc["kind"] == "ServiceAccount":
                    shipped.add(("ServiceAccount", f"{meta.get('namespace')}/{meta['name']}"))
    named = set()
    for row in ROWS:
        named |= set(re.findall(r"\b(ClusterRole|Role|ServiceAccount) ((?:[a-z0-9-]+/)?gpushard-[a-z0-9-]+)",
                                row.message))
    assert named and named <= shipped, named - shipped
