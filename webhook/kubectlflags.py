"""kubectl's flags and habits, shared by every command that reads the cluster, and the one table of exit codes.

`gpushard status|audit|top|review` and the kubectl plugin `kubectl gpushard ...` take the same
flags, defined once here: commands add them with ``parents=[kubectlflags.flags(...)]`` (or the
``add_*`` helpers), and get their client with ``kubectlflags.client_for(args)``.
"""

from __future__ import annotations

import argparse

from webhook.kubeapi import connecting

# The exit codes of every gpushard command (docs/cli.md, "Exit codes", lists the same table).
OK = 0
FOUND = 1
USAGE = 2
UNREACHABLE = 3
INTERRUPTED = 130
EXIT_CODES = (
    (OK, "success: nothing found, nothing denied"),
    (FOUND, "`audit` found something, or `review` denied an object"),
    (USAGE, "bad flags or input: an unreadable file, a bad config, no usable kubeconfig or context, "
            "or an unexpected error (the one-line message says which)"),
    (UNREACHABLE, "the Kubernetes API could not be reached, refused the credentials (401) or forbade a "
                  "call (403), or lacks an object the command needs (`certs --install`: the webhook "
                  "configuration; `top`: an agent serving metrics)"),
    (INTERRUPTED, "interrupted (Ctrl-C)"),
)

TABLE, WIDE, JSON, YAML, NAME = "table", "wide", "json", "yaml", "name"
OUTPUTS = (JSON, YAML, WIDE, NAME)
DEFAULT_REQUEST_TIMEOUT = "30s"

# kubectl's "-o name" spells a kind as its resource, with the group for kinds outside the core group.
_GROUPS = {"Deployment": "apps", "StatefulSet": "apps", "DaemonSet": "apps", "ReplicaSet": "apps",
           "Job": "batch", "CronJob": "batch",
           "MutatingWebhookConfiguration": "admissionregistration.k8s.io",
           "ValidatingAdmissionPolicy": "admissionregistration.k8s.io",
           "ValidatingAdmissionPolicyBinding": "admissionregistration.k8s.io"}


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """--kubeconfig, --context, --request-timeout: where the cluster is and how long to wait for it."""
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, a list separated by ':', "
                                             "then ~/.kube/config, then the in-cluster service account)")
    parser.add_argument("--context", help="kubeconfig context to use (default: the current context)")
    parser.add_argument("--request-timeout", default=DEFAULT_REQUEST_TIMEOUT, metavar="DURATION",
                        help="how long to wait for each API request: seconds, or 30s, 1m, ...; 0 waits "
                             f"for ever (default: {DEFAULT_REQUEST_TIMEOUT})")


def add_scope_flags(parser: argparse.ArgumentParser) -> None:
    """-n/--namespace, -A/--all-namespaces, -l/--selector."""
    parser.add_argument("-n", "--namespace", help="only this namespace (needs only rights in it)")
    parser.add_argument("-A", "--all-namespaces", action="store_true",
                        help="every namespace (overrides -n, as in kubectl)")
    parser.add_argument("-l", "--selector", help="label selector, as kubectl's (e.g. app=train,tier!=web)")


def add_output_flags(parser: argparse.ArgumentParser, outputs: tuple[str, ...] = OUTPUTS,
                     tables: bool = True) -> None:
    """-o/--output, and --no-headers for commands that print tables."""
    parser.add_argument("-o", "--output", choices=(TABLE, *outputs) if tables else outputs,
                        default=TABLE if tables else outputs[0],
                        help=f"output format: {'|'.join(outputs)} (default: {'a table' if tables else outputs[0]})")
    if tables:
        parser.add_argument("--no-headers", action="store_true", help="leave out header and summary lines of tables")


def flags(cluster: bool = True, scope: bool = True, outputs: tuple[str, ...] | None = OUTPUTS,
          tables: bool = True) -> argparse.ArgumentParser:
    """A parent parser with the chosen flag groups, for ``add_parser(..., parents=[...])``."""
    parent = argparse.ArgumentParser(add_help=False)
    if scope:
        add_scope_flags(parent)
    if outputs:
        add_output_flags(parent, outputs, tables)
    if cluster:
        add_cluster_flags(parent)
    return parent


def client_for(args: argparse.Namespace) -> connecting.Client:
    """The API client every command uses: connecting's one loader, with the flags of ``args``."""
    timeout = connecting.parse_timeout(getattr(args, "request_timeout", None), default=None)
    return connecting.client(getattr(args, "kubeconfig", None), getattr(args, "context", None), timeout)


def namespace_of(args: argparse.Namespace, target: connecting.Target | None = None) -> str | None:
    """The one namespace asked for, or None for every namespace: -A; else -n; else, as kubectl, the
    namespace the kubeconfig's context names; else (no -n, a context without one) every namespace."""
    if getattr(args, "all_namespaces", False):
        return None
    return getattr(args, "namespace", None) or (target.namespace if target is not None else None) or None


def resource_name(kind: str, name: str) -> str:
    """kubectl's ``-o name`` form: ``pod/web``, ``deployment.apps/train``, ``node/gpu-1``."""
    group = _GROUPS.get(kind)
    return f"{kind.lower()}{'.' + group if group else ''}/{name}"
