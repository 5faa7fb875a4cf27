"""The `gpushard` command: wiring of the front doors to the core and the adapters, nothing more."""

from __future__ import annotations

import argparse
import sys

from webhook import __version__


def _settings(path: str | None):
    from webhook import settings

    try:
        return settings.load(path)
    except settings.SettingsError as exc:
        raise SystemExit(f"gpushard: bad config: {exc}") from None


def _static_view(path: str | None, shares_per_card: int):
    if path is None:
        return None
    from webhook.cluster import static

    try:
        return static.StaticView(static.load(path, shares_per_card))
    except static.ViewFileError as exc:
        raise SystemExit(f"gpushard: bad cluster file: {exc}") from None


# --- certs -----------------------------------------------------------------------------------

def cmd_certs(args: argparse.Namespace) -> int:
    from webhook import certificates

    paths = certificates.write_bundle(args.out, service=args.service, namespace=args.namespace, days=args.days)
    for path in paths:
        print(path)
    return 0


# --- serve -----------------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from webhook.admission import serving

    _settings(args.config)  # fail fast, before gunicorn forks, on a bad file
    return serving.serve(args)


# --- review ----------------------------------------------------------------------------------

def cmd_review(args: argparse.Namespace) -> int:
    from webhook import reviewing

    settings = _settings(args.config)
    view = _static_view(args.cluster, settings.policy.shares_per_card)
    return reviewing.review_files(args.files, settings, view, mode=args.mode, out=sys.stdout)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpushard", description="Fractional GPUs on Kubernetes: one pod, one physical card.")
    parser.add_argument("--version", action="version", version=f"gpushard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("certs", help="make a CA and a serving certificate for the webhook Service")
    p.add_argument("--out", required=True, help="folder for ca.crt, tls.crt and tls.key")
    p.add_argument("--service", default="gpushard", help="webhook Service name (default: gpushard)")
    p.add_argument("--namespace", default="gpushard-system", help="its namespace (default: gpushard-system)")
    p.add_argument("--days", type=int, default=365, help="serving certificate lifetime (default: 365)")
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("serve", help="run the admission webhook over TLS under gunicorn")
    p.add_argument("--cert", required=True, help="serving certificate (PEM)")
    p.add_argument("--key", required=True, help="serving key (PEM)")
    p.add_argument("--bind", default="0.0.0.0:8443", help="HOST:PORT (default: 0.0.0.0:8443)")
    p.add_argument("--config", help="gpushard config file (default: built-in defaults)")
    p.add_argument("--cluster", help="static cluster view file; without it the view is the Kubernetes API")
    p.add_argument("--workers", type=int, default=2, help="gunicorn worker processes (default: 2)")
    p.add_argument("--threads", type=int, default=4, help="threads per worker (default: 4)")
    p.add_argument("--timeout", type=int, default=30, help="seconds before a stuck worker is restarted")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("review", help="decide offline what the webhook would do to manifests")
    p.add_argument("files", nargs="+", help="YAML manifests (- for standard input)")
    p.add_argument("--cluster", help="static cluster view file for card choice")
    p.add_argument("--mode", choices=("enforce", "audit"), default="enforce")
    p.add_argument("--config", help="gpushard config file")
    p.set_defaults(func=cmd_review)

    p = sub.add_parser("agent", help="run the node agent: NVML discovery and the kubelet device plugin")
    p.add_argument("--config", help="gpushard config file")
    p.add_argument("--node-name", help="this node's name (default: $NODE_NAME)")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("audit", help="audit manifests, or the live cluster, against gpushard's rules")
    p.add_argument("-f", "--filename", dest="files", action="append", default=[],
                   help="manifest file or folder, - for standard input (repeatable); none: the live cluster")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--config", help="gpushard config file")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("status", help="shares used and free per node and card, and who holds them")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--config", help="gpushard config file")
    p.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
