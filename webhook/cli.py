"""The `gpushard` command: wiring of the front doors to the core and the adapters, nothing more."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from webhook import __version__, kubectlflags


class Parser(argparse.ArgumentParser):
    """argparse, with its complaint about a flag told as every other gpushard message: one ``gpushard:``
    line after the command's usage, saying where the flags are listed."""

    command_parsers: dict[str, argparse.ArgumentParser]  # set by _own_usage on a parser with commands

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(kubectlflags.USAGE, f"gpushard: {message}; see {self.prog} --help\n")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _settings(path: str | None):
    from webhook import settings

    try:
        return settings.load(path)
    except settings.SettingsError as exc:
        # A bad config is bad input to every command (exit 2, webhook.kubectlflags.EXIT_CODES), never
        # a denial or a finding.
        hint = "fix that key (docs/config.md lists every key)" if Path(str(path)).is_file() \
            else "check the path given to --config"
        print(f"gpushard: bad config: {_one_line(exc)}; {hint}", file=sys.stderr)
        raise SystemExit(kubectlflags.USAGE) from None


def _static_view(path: str | None, shares_per_card: int):
    """The cluster file's view and what its DeviceClasses serve; (None, None) without a file."""
    if path is None:
        return None, None
    from webhook.cluster import static

    try:
        view, served = static.load_file(path, shares_per_card)
        return static.StaticView(view), served
    except static.ViewFileError as exc:
        hint = "fix it (examples/cluster.yaml shows the format)" if Path(path).is_file() \
            else "check the path given to --cluster"
        said = _one_line(exc)
        said = said if said.startswith(f"{path}:") else f"{path}: {said}"
        print(f"gpushard: bad cluster file: {said}; {hint}", file=sys.stderr)
        raise SystemExit(kubectlflags.USAGE) from None


# --- certs -----------------------------------------------------------------------------------

def cmd_certs(args: argparse.Namespace) -> int:
    from webhook import certificates
    from webhook.kubeapi import connecting

    if args.install:
        from webhook import installing

        try:
            timeout = connecting.parse_timeout(args.request_timeout, default=None)
            conn = installing.client(args.kubeconfig, args.context, timeout)
            outcome = installing.install(
                conn.api, namespace=args.namespace, service=args.service, secret=args.secret,
                webhook_config=args.webhook_config, days=args.days, renew_before=args.renew_before, force=args.force,
                out=args.out, target=conn.target, timeout=timeout)
        except connecting.ConfigError as exc:
            print(exc, file=sys.stderr)
            return kubectlflags.USAGE
        except certificates.CertificateError as exc:  # bad --days or --out: bad input
            print(exc.code, file=sys.stderr)
            return kubectlflags.USAGE
        except installing.InstallError as exc:
            print(exc.code, file=sys.stderr)
            return exc.status
        for line in outcome.lines():
            print(line)
        return 0
    if args.out is None:
        print("gpushard: certs needs --out DIR, or --install to put the certificate in the cluster", file=sys.stderr)
        return kubectlflags.USAGE
    try:
        paths = certificates.write_bundle(args.out, service=args.service, namespace=args.namespace, days=args.days)
    except certificates.CertificateError as exc:  # bad --days, or an --out that cannot be a folder
        print(exc.code, file=sys.stderr)
        return kubectlflags.USAGE
    for path in paths:
        print(path)
    return 0


# --- serve -----------------------------------------------------------------------------------

def _replica(text: str) -> str:
    from webhook.cluster import peers

    try:
        peers.parse(text, "I/N")
    except peers.ReplicaError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def cmd_serve(args: argparse.Namespace) -> int:
    from webhook.admission import serving
    from webhook.cluster import peers

    _settings(args.config)  # fail fast, before gunicorn forks, on a bad file
    if getattr(args, "replica", None):
        os.environ[peers.REPLICA_ENV] = args.replica  # the workers read it (webhook.cluster.open_peers)
    return serving.serve(args)


# --- review ----------------------------------------------------------------------------------

def cmd_review(args: argparse.Namespace) -> int:
    from webhook import reviewing

    settings = _settings(args.config)
    view, served = _static_view(args.cluster, settings.policy.shares_per_card)
    return reviewing.review_files(args.files, settings, view, mode=args.mode, out=sys.stdout,
                                  output=args.output, served=served)


# --- agent -----------------------------------------------------------------------------------

def cmd_agent(args: argparse.Namespace) -> int:
    from webhook.agent import running

    return running.run(args, _settings(args.config))


# --- audit and status ------------------------------------------------------------------------

def cmd_audit(args: argparse.Namespace) -> int:
    from webhook import auditing

    return auditing.run_audit(args, _settings(args.config))


def cmd_status(args: argparse.Namespace) -> int:
    from webhook import auditing

    return auditing.run_status(args, _settings(args.config))


# --- the commands both `gpushard` and `kubectl gpushard` offer ---------------------------------

def _add_review(sub) -> None:
    outputs = (kubectlflags.YAML, kubectlflags.JSON, kubectlflags.NAME)
    p = sub.add_parser("review", help="decide offline what the webhook would do to manifests",
                       parents=[kubectlflags.flags(cluster=False, scope=False, outputs=outputs, tables=False)])
    p.add_argument("files", nargs="+", help="YAML manifests (- for standard input)")
    p.add_argument("--cluster", help="static cluster view file for card choice")
    p.add_argument("--mode", choices=("enforce", "audit", "none"), default="enforce",
                   help="the namespace's gpushard.io/mode, for objects whose Namespace is not among the files "
                        "(none: not opted in; default: enforce)")
    p.add_argument("--config", help="gpushard config file")
    # The objects themselves are the output: YAML with a comment per decision unless asked otherwise.
    p.set_defaults(func=cmd_review)


def _add_audit(sub) -> None:
    p = sub.add_parser("audit", help="audit manifests, or the live cluster, against gpushard's rules",
                       parents=[kubectlflags.flags()],
                       epilog="-n NS reads only that namespace, with namespaced calls, so rights in it are enough. "
                              "Without -n, the namespace of the kubeconfig's context (as kubectl); where the "
                              "context names none, the whole cluster (as with -A).")
    p.add_argument("-f", "--filename", dest="files", action="append", default=[],
                   help="manifest file or folder, - for standard input (repeatable); none: the live cluster")
    p.add_argument("--config", help="gpushard config file")
    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    p.set_defaults(func=cmd_audit)


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="shares used and free per node and card, and who holds them",
                       parents=[kubectlflags.flags(scope=False)])
    p.add_argument("-l", "--selector", help="label selector for the nodes shown (e.g. pool=train)")
    # status is a view of nodes, as `kubectl describe node`: the context's namespace does not narrow it,
    # only -n does, and then only the pods shown; the cards' numbers stay those of every namespace.
    p.add_argument("-n", "--namespace",
                   help="show only this namespace's pods (the cards' used and free shares still count every pod)")
    p.add_argument("-A", "--all-namespaces", action="store_true",
                   help="the pods of every namespace: the default (overrides -n, as in kubectl)")
    p.add_argument("--config", help="gpushard config file")
    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    p.set_defaults(func=cmd_status)


def _add_top(sub) -> None:
    p = sub.add_parser("top", help="shares held against GPU memory and utilization used, per card and pod",
                       parents=[kubectlflags.flags(scope=False, outputs=(kubectlflags.JSON, kubectlflags.YAML))])
    p.add_argument("what", nargs="?", choices=("all", "cards", "pods"), default="all",
                   help="cards, pods, or both (default)")
    p.add_argument("-n", "--namespace", help="only pods in this namespace")
    p.add_argument("-A", "--all-namespaces", action="store_true",
                   help="pods of every namespace (the default where the context names no namespace)")
    p.add_argument("--node", help="only this node")
    p.add_argument("--sort-by", choices=("memory", "shares"), help="order the pods by memory used or shares held")
    p.add_argument("--agent-namespace", default="gpushard-system",
                   help="where the agents run (default: gpushard-system)")
    p.set_defaults(func=cmd_top)


def _add_cordon(sub) -> None:
    for name, what in (("cordon", "take card CARD of NODE out of new placements; the pods on it keep running"),
                       ("uncordon", "let card CARD of NODE take new pods again")):
        p = sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}.",
                           parents=[kubectlflags.flags(scope=False, outputs=None)],
                           epilog="Writes the annotation gpushard.io/card-<CARD>.cordoned on the Node and an Event; "
                                  "needs patch on nodes and create on events (ClusterRole gpushard-cordoner).")
        p.add_argument("node", metavar="NODE", help="the node's name")
        p.add_argument("card", metavar="CARD", help="the card's index, as gpushard status lists it")
        if name == "cordon":
            p.add_argument("--reason", default="", metavar="TEXT",
                           help="why, recorded on the Node and in its Event (e.g. 'fan replacement')")
        p.set_defaults(func=cmd_cordon, cordon=name == "cordon")


def cmd_cordon(args: argparse.Namespace) -> int:
    from webhook import cordoning

    return cordoning.run(args)


PLUGIN_COMMANDS = ("status", "audit", "top", "review", "cordon", "uncordon")


def build_plugin_parser() -> argparse.ArgumentParser:
    """`kubectl gpushard ...`: the commands of a cluster's user, with kubectl's flags."""
    parser = Parser(
        prog="kubectl gpushard",
        description="gpushard as a kubectl plugin: shares per card, audits, reviews, card cordons.",
        epilog="Exit codes: " + "; ".join(f"{code} {text}" for code, text in kubectlflags.EXIT_CODES))
    parser.add_argument("--version", action="version", version=f"gpushard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_status(sub)
    _add_audit(sub)
    _add_top(sub)
    _add_review(sub)
    _add_cordon(sub)
    _own_usage(parser, sub)
    return parser


def _own_usage(parser: Parser, sub) -> None:
    """Each command's parser remembered, so that a flag it lacks is told with its own usage line."""
    parser.command_parsers = dict(sub.choices)


# --- top ---------------------------------------------------------------------------------------

def cmd_top(args: argparse.Namespace) -> int:
    from webhook import top
    from webhook.kubeapi import connecting

    try:
        conn = kubectlflags.client_for(args)
    except connecting.ConfigError as exc:
        print(exc, file=sys.stderr)
        return kubectlflags.USAGE
    return top.run_top(args, conn)


# --- replace ---------------------------------------------------------------------------------

def cmd_replace(args: argparse.Namespace) -> int:
    from webhook.replacement import controller

    return controller.run(args, _settings(args.config))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="gpushard", description="Fractional GPUs on Kubernetes: one pod, one physical card.")
    parser.add_argument("--version", action="version", version=f"gpushard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("certs", help="make a CA and a serving certificate for the webhook Service")
    p.add_argument("--out", help="folder for ca.crt, tls.crt and tls.key (needed without --install; with it, "
                                 "where a newly made bundle is also kept)")
    p.add_argument("--service", default="gpushard", help="webhook Service name (default: gpushard)")
    p.add_argument("--namespace", default="gpushard-system", help="its namespace (default: gpushard-system)")
    p.add_argument("--days", type=int, default=365, help="serving certificate lifetime (default: 365)")
    p.add_argument("--install", action="store_true",
                   help="store the certificate in a kubernetes.io/tls Secret in --namespace and its CA in "
                        "the caBundle of every webhook of --webhook-config (in-cluster, else kubeconfig)")
    p.add_argument("--secret", default="gpushard-tls", help="with --install: the Secret (default: gpushard-tls)")
    p.add_argument("--webhook-config", default="gpushard",
                   help="with --install: the MutatingWebhookConfiguration (default: gpushard)")
    p.add_argument("--renew-before", type=int, default=30, metavar="DAYS",
                   help="with --install: keep a certificate valid for more than DAYS days (default: 30)")
    p.add_argument("--force", action="store_true", help="with --install: make a new CA and certificate anyway")
    p.add_argument("--kubeconfig", help="with --install: kubeconfig file (default: $KUBECONFIG, a list separated "
                                        "by ':', then ~/.kube/config, then the in-cluster service account)")
    p.add_argument("--context", help="with --install: kubeconfig context (default: the current context)")
    p.add_argument("--request-timeout", default=kubectlflags.DEFAULT_REQUEST_TIMEOUT, metavar="DURATION",
                   help="with --install: how long to wait for each API request: seconds, or 30s, 1m, ...; "
                        f"0 waits for ever (default: {kubectlflags.DEFAULT_REQUEST_TIMEOUT})")
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("serve", help="run the admission webhook over TLS under gunicorn")
    p.add_argument("--cert", required=True, help="serving certificate (PEM)")
    p.add_argument("--key", required=True, help="serving key (PEM)")
    p.add_argument("--bind", default="0.0.0.0:8443", help="HOST:PORT (default: 0.0.0.0:8443)")
    p.add_argument("--config", help="gpushard config file (default: built-in defaults)")
    p.add_argument("--cluster", help="static cluster view file; without it the view is the Kubernetes API")
    p.add_argument("--workers", type=int, default=1,
                   help="gunicorn worker processes (default: 1: one cluster view and one memory of choices; "
                        "each further worker keeps its own)")
    p.add_argument("--threads", type=int, default=8, help="threads per worker (default: 8)")
    p.add_argument("--timeout", type=int, default=30, help="seconds before a stuck worker is restarted")
    p.add_argument("--client-timeout", type=float, default=4.0,
                   help="seconds a client may stall mid-handshake or mid-request; keep it under the webhook "
                        "entries' timeoutSeconds (default: 4)")
    p.add_argument("--graceful-timeout", type=int, default=20,
                   help="seconds to finish reviews in flight after SIGTERM (default: 20)")
    p.add_argument("--replica", type=_replica, metavar="I/N",
                   help="this webhook is replica I (from 0) of N: it tries its share of the cards first, so "
                        "replicas fill different cards (default: in a pod, its rank among the webhook Service's "
                        "ready pods; else every card alike)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("agent", help="run the node agent: NVML discovery and the kubelet device plugin")
    p.add_argument("--config", help="gpushard config file")
    p.add_argument("--node-name", help="this node's name (default: $NODE_NAME)")
    p.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins",
                   help="the kubelet's device-plugin folder (default: /var/lib/kubelet/device-plugins)")
    p.add_argument("--fake-inventory", metavar="FILE",
                   help="advertise the cards listed in FILE (YAML or JSON) instead of asking NVML")
    p.add_argument("--allow-no-gpus", action="store_true",
                   help="when NVML cannot load, advertise no cards instead of exiting")
    p.add_argument("--no-publish", action="store_true",
                   help="do not write the inventory annotation and label on the Node")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often to check for a restarted kubelet (default: 1)")
    p.add_argument("--mps-root", default="/run/gpushard/mps", metavar="DIR",
                   help="with isolation: mps, the host folder for each card's MPS pipe and log folders and the "
                        "shared shm folder, mounted at the same path in the agent (default: /run/gpushard/mps)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve per-card and per-pod GPU metrics on PORT at /metrics, over TLS, to tokens the API "
                        "server allows get nodes/metrics of this node and to port-forwards (default: 0, none)")
    p.add_argument("--pod-resources-socket", default="/var/lib/kubelet/pod-resources/kubelet.sock",
                   help="the kubelet's PodResources socket, for the shares each container holds")
    p.add_argument("--toolkit-config", action="append", metavar="PATH",
                   help="NVIDIA's container toolkit config to judge (repeatable; the first that exists is read; "
                        "default: the GPU Operator's, then /etc/nvidia-container-runtime/config.toml)")
    p.add_argument("--proc-root", default="/proc",
                   help="the host's /proc, for each GPU process's cgroup (default: /proc)")
    p.add_argument("--kubelet-registry-dir", default="/var/lib/kubelet/plugins_registry",
                   help="with backend: dra, the kubelet's plugin-registration folder")
    p.add_argument("--kubelet-plugins-dir", default="/var/lib/kubelet/plugins",
                   help="with backend: dra, the kubelet's plugins folder (the plugin's socket and checkpoint)")
    p.add_argument("--cdi-dir", default="/var/run/cdi",
                   help="with backend: dra, where the container runtime reads CDI specs (default: /var/run/cdi)")
    p.set_defaults(func=cmd_agent)

    _add_review(sub)
    _add_audit(sub)
    _add_status(sub)
    _add_top(sub)
    _add_cordon(sub)

    p = sub.add_parser("replace", help="evict pinned pods waiting on a full card while another card has room, "
                                       "so their controller recreates them (one leader, by a Lease)")
    p.add_argument("--config", help="gpushard config file (its replacement: section)")
    p.add_argument("--namespace", help="namespace of the Lease (default: $POD_NAMESPACE, else gpushard-system)")
    p.add_argument("--identity", help="this replacer's name in the Lease (default: $POD_NAME, else host-pid)")
    p.add_argument("--once", action="store_true", help="one pass (if this process gets the Lease), then exit")
    p.add_argument("--dry-run", action="store_true", help="say what would be evicted; evict nothing")
    p.add_argument("--health-port", type=int, default=0, metavar="PORT",
                   help="serve GET /healthz on PORT: 200 while the loop comes round, 503 once it stalls "
                        "(the liveness probe), and GET /metrics (default: 0, none)")
    p.add_argument("--stall-seconds", type=float, default=300.0, metavar="SECONDS",
                   help="with --health-port: how long the loop may not come round before /healthz fails "
                        "(default: 300)")
    kubectlflags.add_cluster_flags(p)
    p.set_defaults(func=cmd_replace)

    p = sub.add_parser("version", help="the version, and the Python and machine it runs on")
    p.set_defaults(func=cmd_version)
    _own_usage(parser, sub)
    return parser


def cmd_version(args: argparse.Namespace) -> int:
    """`gpushard version`: what a bug report needs first (an image's label says the same version)."""
    import platform

    print(f"gpushard {__version__} (Python {platform.python_version()}, {platform.system().lower()} "
          f"{platform.machine()})")
    return 0


def _run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse would tell them with the top-level usage line, which names no flag of the command.
        command = getattr(parser, "command_parsers", {}).get(args.command, parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return kubectlflags.INTERRUPTED
    except SystemExit as exc:
        # A command that stopped with its message already printed (a bad config) gives its status.
        if isinstance(exc.code, int):
            return exc.code
        raise


def main(argv: list[str] | None = None) -> int:
    return _run(build_parser(), argv)


def plugin_main(argv: list[str] | None = None) -> int:
    """The `kubectl-gpushard` executable: kubectl runs it for `kubectl gpushard ...`."""
    return _run(build_plugin_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
