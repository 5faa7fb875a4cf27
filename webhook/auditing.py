"""`gpushard audit` and `gpushard status`: objects from manifests or the live cluster in, tables or JSON out."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import yaml

from webhook.core import audit, names
from webhook.core import findings as f

EXIT_CLEAN = 0
EXIT_FOUND = 1
EXIT_USAGE = 2

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
REPORT_API_VERSION = "gpushard.io/v1"
PAGE = 500
TIMEOUT_S = 30
FINISHED_PODS_OUT = "status.phase!=Succeeded,status.phase!=Failed"


class UsageError(Exception):
    """Input gpushard cannot audit (a file, a document, the cluster); the message starts with gpushard:."""


# --- manifests -------------------------------------------------------------------------------------

def _expand(obj: object, source: str) -> list[audit.Located]:
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not obj["kind"]:
        raise UsageError(f"gpushard: {source}: not a Kubernetes object (expected a mapping with a kind)")
    if obj["kind"].endswith("List") and isinstance(obj.get("items"), list):
        out = []
        for i, item in enumerate(obj["items"]):
            out += _expand(item, f"{source} items[{i}]")
        return out
    return [audit.Located(obj, source)]


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


def _text_keys(value: object) -> object:
    """Mapping keys as text, as kubectl writes YAML into JSON (`5:` becomes "5", `true:` "true"), so that
    the audit reads what the API server would receive."""
    if isinstance(value, dict):
        return {_key_text(k): _text_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_text_keys(v) for v in value]
    return value


def _key_text(key: object) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return str(key)


def parse_text(text: str, name: str, as_json: bool = False) -> list[audit.Located]:
    """The objects in one file's text: YAML documents (or one JSON value), List kinds expanded."""
    if as_json:
        try:
            return _expand(json.loads(text), f"{name}")
        except json.JSONDecodeError as exc:
            raise UsageError(f"gpushard: {name}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    out: list[audit.Located] = []
    docs = yaml.safe_load_all(text)
    number = 0
    while True:
        number += 1
        try:
            doc = next(docs)
        except StopIteration:
            break
        except yaml.YAMLError as exc:
            raise UsageError(f"gpushard: {name}: document {number} is not valid YAML: {_yaml_problem(exc)}") from None
        if doc is None:
            continue  # an empty document, as helm leaves between templates
        out += _expand(_text_keys(doc), f"{name}#{number}")
    return out


def _files(path: str) -> list[Path]:
    root = Path(path)
    if root.is_dir():
        found = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in MANIFEST_SUFFIXES)
        if not found:
            raise UsageError(f"gpushard: {path}: no *.yaml, *.yml or *.json files in this folder")
        return found
    return [root]


def read_manifests(paths: Iterable[str], stdin: IO[str]) -> list[audit.Located]:
    """Every object in the files, folders (recursively) and standard input (``-``) named."""
    out: list[audit.Located] = []
    for path in paths:
        if path == "-":
            out += parse_text(stdin.read(), "<stdin>")
            continue
        for file in _files(path):
            try:
                text = file.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise UsageError(f"gpushard: cannot read {file}: {reason}") from None
            out += parse_text(text, str(file), as_json=file.suffix.lower() == ".json")
    return out


# --- the live cluster ------------------------------------------------------------------------------

def api_client(kubeconfig: str | None = None, context: str | None = None):
    """A kubernetes ApiClient from the kubeconfig (flag, $KUBECONFIG, ~/.kube/config), else in-cluster."""
    import kubernetes

    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    if path is None and Path("~/.kube/config").expanduser().is_file():
        path = str(Path("~/.kube/config").expanduser())
    try:
        if path is not None:
            return kubernetes.config.new_client_from_config(config_file=path, context=context)
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=configuration)
        return kubernetes.client.ApiClient(configuration)
    except (kubernetes.config.ConfigException, OSError, yaml.YAMLError) as exc:
        where = path or "the in-cluster service account"
        raise UsageError(f"gpushard: cannot use {where} to reach the Kubernetes API: {exc}") from None


def _list(call: Callable, what: str) -> list[dict]:
    """Every item of a list call, page by page, as raw JSON (the kinds are set on each item)."""
    import kubernetes

    items, token = [], None
    while True:
        try:
            response = call(limit=PAGE, _continue=token, _preload_content=False, _request_timeout=TIMEOUT_S)
        except kubernetes.client.ApiException as exc:
            raise UsageError(f"gpushard: cannot list {what}: {exc.status} {exc.reason}") from None
        body = json.loads(response.data)
        kind = str(body.get("kind") or "").removesuffix("List")
        for item in body.get("items") or []:
            item.setdefault("kind", kind)  # list items come without their kind
            items.append(item)
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return items


def _workload_calls(client) -> list[tuple[str, Callable]]:
    import kubernetes

    core = kubernetes.client.CoreV1Api(client)
    apps = kubernetes.client.AppsV1Api(client)
    batch = kubernetes.client.BatchV1Api(client)
    return [
        ("deployments", apps.list_deployment_for_all_namespaces),
        ("statefulsets", apps.list_stateful_set_for_all_namespaces),
        ("daemonsets", apps.list_daemon_set_for_all_namespaces),
        ("replicasets", apps.list_replica_set_for_all_namespaces),
        ("jobs", batch.list_job_for_all_namespaces),
        ("cronjobs", batch.list_cron_job_for_all_namespaces),
        ("replicationcontrollers", core.list_replication_controller_for_all_namespaces),
        ("podtemplates", core.list_pod_template_for_all_namespaces),
    ]


# Kinds whose objects repeat the template of a controlling owner that the audit reads anyway.
AUDITED_OWNERS = {"ReplicaSet": "Deployment", "Job": "CronJob"}


def _owned(obj: dict) -> bool:
    """A ReplicaSet of a Deployment, or a Job of a CronJob: its owner's findings already cover it.

    Objects owned by anything else (an operator's custom resource) are audited themselves,
    since nothing else would show their findings.
    """
    owner = AUDITED_OWNERS.get(str(obj.get("kind")))
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return owner is not None and any(
        isinstance(r, dict) and r.get("controller") and r.get("kind") == owner for r in refs)


def _calling(action: Callable[[], object], where: str):
    """Run one cluster read, turning transport failures into a usage error."""
    import urllib3

    try:
        return action()
    except urllib3.exceptions.HTTPError as exc:
        raise UsageError(f"gpushard: cannot reach the Kubernetes API at {where}: {exc}") from None


def _live_pods(core) -> Callable:
    # Finished pods hold nothing; the API server can leave them out (the core skips them anyway).
    def call(**kwargs):
        return core.list_pod_for_all_namespaces(field_selector=FINISHED_PODS_OUT, **kwargs)

    return call


def read_cluster(client, err: IO[str]) -> list[audit.Located]:
    """Namespaces, nodes, pods and pod-template workloads of the live cluster."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(client)
    host = client.configuration.host

    def read() -> list[audit.Located]:
        objects = []
        for what, call in (("namespaces", core.list_namespace), ("nodes", core.list_node), ("pods", _live_pods(core))):
            objects += [audit.Located(o) for o in _list(call, what)]
        for what, call in _workload_calls(client):
            try:
                objects += [audit.Located(o) for o in _list(call, what) if not _owned(o)]
            except UsageError as exc:
                # An API without that group, or RBAC without that read, leaves the rest worth auditing.
                print(f"{exc}; {what} not audited", file=err)
        return objects

    return _calling(read, host)


def read_usage_inputs(client) -> tuple[list[dict], list[dict]]:
    import kubernetes

    core = kubernetes.client.CoreV1Api(client)
    return _calling(lambda: (_list(core.list_node, "nodes"), _list(_live_pods(core), "pods")),
                    client.configuration.host)


# --- output ----------------------------------------------------------------------------------------

def _width() -> int:
    # Readable in an 80 to 120 column terminal; a pipe gets 100.
    return max(80, min(120, shutil.get_terminal_size((100, 24)).columns))


def _counts(items: list[audit.Item]) -> dict[str, int]:
    counts = {f.DENY: 0, f.WARN: 0, f.CHANGE: 0}
    for item in items:
        counts[item.finding.severity] = counts.get(item.finding.severity, 0) + 1
    return counts


def audit_json(items: list[audit.Item], audited: int, target: str) -> dict:
    """The `-o json` document (fields documented in docs/audit.md)."""
    return {
        "apiVersion": REPORT_API_VERSION,
        "kind": "AuditReport",
        "target": target,
        "summary": {"objects": audited, "objectsWithFindings": len({i.ref for i in items}),
                    "findings": len(items), **_counts(items)},
        "findings": [{
            "kind": i.ref.kind, "namespace": i.ref.namespace or None, "name": i.ref.name,
            "container": i.finding.container, "rule": i.finding.rule, "severity": i.finding.severity,
            "message": i.finding.message, "fix": i.fix, "source": i.source or None,
        } for i in items],
    }


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def audit_table(items: list[audit.Item], audited: int, width: int) -> str:
    """Findings grouped by object, wrapped to ``width`` columns."""
    lines: list[str] = []
    last = None
    indent = " " * 8
    for item in items:
        if (item.ref, item.source) != last:
            if lines:
                lines.append("")
            last = (item.ref, item.source)
            lines.append(str(item.ref) + (f"  ({item.source})" if item.source else ""))
        finding = item.finding
        head = f"  {finding.severity:<5} {finding.rule}"
        if finding.container:
            head += f'  container "{finding.container}"'
        lines.append(head)
        message = finding.message.removeprefix("gpushard: ")
        lines += textwrap.wrap(message, width, initial_indent=indent, subsequent_indent=indent)
        if item.fix:
            lines += textwrap.wrap("fix: " + item.fix, width, initial_indent=indent,
                                   subsequent_indent=indent + "     ")
    counts = _counts(items)
    objects = len({i.ref for i in items})
    if items:
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        lines += ["", f"gpushard: {_plural(len(items), 'finding')} ({parts}) in {objects} of "
                  f"{_plural(audited, 'object')}"]
    else:
        lines.append(f"gpushard: no findings in {_plural(audited, 'object')}")
    return "\n".join(lines) + "\n"


def _audited(objects: list[audit.Located]) -> int:
    kinds = {audit.NAMESPACE_KIND, audit.NODE_KIND, names.POD_KIND, *names.TEMPLATE_PATHS}
    return sum(1 for o in objects if isinstance(o.obj.get("kind"), str) and o.obj["kind"] in kinds)


def _failed(command: str, exc: Exception, args: argparse.Namespace, err: IO[str]) -> int:
    """An error nobody foresaw: one gpushard: line, the traceback only with --debug, and exit 2,
    so that exit 1 keeps meaning "findings" to scripts and CI."""
    debug = bool(getattr(args, "debug", False))
    if debug:
        traceback.print_exception(exc, file=err)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" in {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    reason = " ".join(str(exc).split())
    reason = f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__
    if len(reason) > 200:
        reason = reason[:197] + "..."
    hint = "" if debug else "; run it again with --debug for the traceback"
    print(f"gpushard: {command} stopped by an unexpected error{where}: {reason}{hint}", file=err)
    return EXIT_USAGE


def run_audit(args: argparse.Namespace, settings, stdin: IO[str] | None = None, out: IO[str] | None = None,
              err: IO[str] | None = None) -> int:
    """`gpushard audit`: 1 when anything is found, 0 when clean, 2 when the input cannot be read or the
    audit fails."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    try:
        if args.files:
            objects, target = read_manifests(args.files, stdin), "manifests"
        else:
            client = api_client(getattr(args, "kubeconfig", None), getattr(args, "context", None))
            objects, target = read_cluster(client, err), "cluster"
        items = audit.audit(objects, settings.policy)
        # The whole report is made before any of it is written: a failure leaves no half a report.
        if args.output == "json":
            text = json.dumps(audit_json(items, _audited(objects), target), indent=2) + "\n"
        else:
            text = audit_table(items, _audited(objects), _width())
        out.write(text)
    except UsageError as exc:
        print(exc, file=err)
        return EXIT_USAGE
    except Exception as exc:  # a bug or an input nobody foresaw: still not "findings"
        return _failed("audit", exc, args, err)
    return EXIT_FOUND if items else EXIT_CLEAN


def status_json(use: audit.Usage, shares_per_card: int) -> dict:
    """The `-o json` document of `gpushard status` (fields documented in docs/audit.md)."""
    def holders(hs):
        return [{"namespace": h.namespace, "name": h.name, "shares": h.shares} for h in hs]

    return {
        "apiVersion": REPORT_API_VERSION,
        "kind": "StatusReport",
        "sharesPerCard": shares_per_card,
        "nodes": [{
            "name": n.name, "capacity": n.capacity, "used": n.used, "free": n.free,
            "cards": [{"index": c.index, "model": c.model or None, "uuid": c.uuid or None,
                       "capacity": c.capacity, "used": c.used, "free": c.free, "pods": holders(c.holders)}
                      for c in n.cards],
        } for n in use.nodes],
        "pending": [{"namespace": h.namespace, "name": h.name, "card": k, "shares": h.shares}
                    for h, k in use.pending],
        "stranded": [{"namespace": h.namespace, "name": h.name, "card": k, "shares": h.shares, "hint": hint}
                     for h, k, hint in use.stranded],
        "totals": {"nodes": len(use.nodes), "cards": sum(len(n.cards) for n in use.nodes),
                   "capacity": use.capacity, "used": use.used, "free": use.free},
    }


def _percent(used: int, capacity: int) -> str:
    return f"{100 * used // capacity}%" if capacity else "-"


def status_table(use: audit.Usage, width: int) -> str:
    """One row per card, a total row per node and for the cluster; holders wrap under PODS."""
    node_w = max([len("NODE")] + [len(n.name) for n in use.nodes] + [len("TOTAL")])
    model_w = min(24, max([len("MODEL")] + [len(c.model) for n in use.nodes for c in n.cards]))
    head = (f"{'NODE':<{node_w}}  {'CARD':>4}  {'MODEL':<{model_w}}  {'USED':>5}  {'FREE':>5}  {'TOTAL':>5}  "
            f"{'USE%':>4}  ")
    pods_w = max(20, width - len(head))
    rows = [head + "PODS"]

    def row(node: str, card: str, model: str, used: int, free: int, capacity: int, pods: str) -> None:
        left = (f"{node:<{node_w}}  {card:>4}  {model[:model_w]:<{model_w}}  {used:>5}  {free:>5}  {capacity:>5}  "
                f"{_percent(used, capacity):>4}  ")
        wrapped = textwrap.wrap(pods, pods_w) or [""]
        rows.append((left + wrapped[0]).rstrip())
        rows.extend(" " * len(left) + more for more in wrapped[1:])

    for n in use.nodes:
        for c in n.cards:
            pods = ", ".join(f"{h.namespace}/{h.name} ({h.shares})" for h in c.holders) or "-"
            row(n.name, str(c.index), c.model, c.used, c.free, c.capacity, pods)
        if len(n.cards) > 1:
            count = sum(len(c.holders) for c in n.cards)
            row(n.name, "all", "", n.used, n.free, n.capacity, f"{count} pod{'s' if count != 1 else ''}")
    count = sum(len(c.holders) for n in use.nodes for c in n.cards)
    row("TOTAL", str(sum(len(n.cards) for n in use.nodes)), "", use.used, use.free, use.capacity,
        f"{count} pod{'s' if count != 1 else ''} on {len(use.nodes)} node{'s' if len(use.nodes) != 1 else ''}")
    if not use.nodes:
        rows.append("gpushard: no shared nodes (none offers a per-card resource)")
    for h, k in use.pending:
        rows.append(f"pending: {h.namespace}/{h.name} waits for card {k} ({h.shares} shares)")
    for h, k, hint in use.stranded:
        rows.append(f"stranded: {h.namespace}/{h.name} waits on full card {k} while another card has room: {hint}")
    return "\n".join(rows) + "\n"


def run_status(args: argparse.Namespace, settings, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """`gpushard status`: 0 when the cluster was read, 2 when it could not be or the report fails."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        client = api_client(getattr(args, "kubeconfig", None), getattr(args, "context", None))
        nodes, pods = read_usage_inputs(client)
        use = audit.usage(nodes, pods, settings.policy)
        if args.output == "json":
            text = json.dumps(status_json(use, settings.policy.shares_per_card), indent=2) + "\n"
        else:
            text = status_table(use, _width())
        out.write(text)
    except UsageError as exc:
        print(exc, file=err)
        return EXIT_USAGE
    except Exception as exc:  # a bug or an input nobody foresaw: never a traceback alone
        return _failed("status", exc, args, err)
    return EXIT_CLEAN
