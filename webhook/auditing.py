"""`gpushard audit` and `gpushard status`: objects from manifests or the live cluster in, tables or JSON out."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from webhook import kubectlflags, tables
from webhook.core import auditing, installation, isolation, names, refusals
from webhook.core import findings as f
from webhook.kubeapi import connecting

EXIT_CLEAN = kubectlflags.OK
EXIT_FOUND = kubectlflags.FOUND
EXIT_USAGE = kubectlflags.USAGE
EXIT_UNREACHABLE = kubectlflags.UNREACHABLE

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
REPORT_API_VERSION = "gpushard.io/v1"
PAGE = 500
FINISHED_PODS_OUT = "status.phase!=Succeeded,status.phase!=Failed"
FAILED_PODS = "status.phase=Failed"


class UsageError(Exception):
    """Input gpushard cannot audit (a file, a document, the cluster); the message starts with gpushard:.

    ``status`` is the API server's HTTP status, for a refusal of the cluster."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


# What grants the reads of `audit` and `status`, told with a 403 (webhook.kubeapi.connecting.forbidden).
AUDITOR_RIGHTS = ("the ClusterRole gpushard-auditor grants it (deploy/base/rbac-auditor.yaml): bind it to this "
                  "account, as examples/auditor-binding.yaml does")
DRA_AUDITOR_RIGHTS = ("the ClusterRole gpushard-auditor of deploy/overlays/dra grants it: bind it to this account, "
                      "as examples/auditor-binding.yaml does")


def namespace_rights(namespace: str) -> str:
    """As AUDITOR_RIGHTS, for `audit -n NS`: a RoleBinding in that namespace is enough."""
    return (f'the ClusterRole gpushard-auditor grants it (deploy/base/rbac-auditor.yaml): bind it to this account '
            f'in namespace "{namespace}" (a RoleBinding), or cluster-wide as examples/auditor-binding.yaml does')


# --- manifests -------------------------------------------------------------------------------------

def _expand(obj: object, source: str) -> list[auditing.Located]:
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not obj["kind"]:
        raise UsageError(f"gpushard: {source}: not a Kubernetes object (expected a mapping with a kind)")
    if obj["kind"].endswith("List") and isinstance(obj.get("items"), list):
        out = []
        for i, item in enumerate(obj["items"]):
            out += _expand(item, f"{source} items[{i}]")
        return out
    return [auditing.Located(obj, source)]


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


def parse_text(text: str, name: str, as_json: bool = False) -> list[auditing.Located]:
    """The objects in one file's text: YAML documents (or one JSON value), List kinds expanded."""
    if as_json:
        try:
            return _expand(json.loads(text), f"{name}")
        except json.JSONDecodeError as exc:
            raise UsageError(f"gpushard: {name}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    out: list[auditing.Located] = []
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


def _foreign(text: str, as_json: bool) -> bool:
    """True for a file that parses but holds no Kubernetes object at all (a Grafana dashboard, a
    cluster-view file): found in a folder, it is no manifest. A file that does not parse is not
    foreign: parse_text says what is wrong with it."""
    try:
        docs = [json.loads(text)] if as_json else list(yaml.safe_load_all(text))
    except (ValueError, yaml.YAMLError):
        return False
    docs = [d for d in docs if d is not None]
    return bool(docs) and not any(isinstance(d, dict) and isinstance(d.get("kind"), str) and d["kind"]
                                  for d in docs)


def read_manifests(paths: Iterable[str], stdin: IO[str], err: IO[str] | None = None) -> list[auditing.Located]:
    """Every object in the files, folders (recursively) and standard input (``-``) named.

    Files found in a folder that hold no Kubernetes object at all are skipped, with one note on
    ``err`` naming them; a file named itself must hold objects.
    """
    out: list[auditing.Located] = []
    skipped: list[str] = []
    for path in paths:
        if path == "-":
            out += parse_text(stdin.read(), "<stdin>")
            continue
        in_folder = Path(path).is_dir()
        for file in _files(path):
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise UsageError(f"gpushard: cannot read {file}: {reason}") from None
            as_json = file.suffix.lower() == ".json"
            if in_folder and _foreign(text, as_json):
                skipped.append(str(file))
                continue
            out += parse_text(text, str(file), as_json=as_json)
    if skipped and err is not None:
        one = len(skipped) == 1
        print(f"gpushard: skipped {len(skipped)} file{'' if one else 's'} that hold{'s' if one else ''} no "
              f"Kubernetes objects: {', '.join(skipped)}", file=err)
    return out


# --- the live cluster ------------------------------------------------------------------------------

def _list(call: Callable, what: str, conn: connecting.Client, **selectors) -> list[dict]:
    """Every item of a list call, page by page, as raw JSON (the kinds are set on each item).

    A transport failure, 401 or 403 is a connecting.ApiError; any other refusal a UsageError.
    """
    import kubernetes

    items, token = [], None
    while True:
        with connecting.reaching(conn.target, f"list {what}"):
            try:
                response = call(limit=PAGE, _continue=token, _preload_content=False, _request_timeout=conn.timeout,
                                **{k: v for k, v in selectors.items() if v})
            except kubernetes.client.ApiException as exc:
                if exc.status in (401, 403):
                    raise
                raise UsageError(str(connecting.answered(conn.target.where, f"list {what}", exc)),
                                 exc.status) from None
            body = json.loads(response.data)
        kind = str(body.get("kind") or "").removesuffix("List")
        for item in body.get("items") or []:
            item.setdefault("kind", kind)  # list items come without their kind
            items.append(item)
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return items


def _workload_calls(api, namespace: str | None) -> list[tuple[str, Callable]]:
    """The list call of each pod-template kind: cluster-wide, or (with a namespace) namespaced only."""
    import functools

    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    apps = kubernetes.client.AppsV1Api(api)
    batch = kubernetes.client.BatchV1Api(api)
    if namespace is None:
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
    calls = [("deployments", apps.list_namespaced_deployment), ("statefulsets", apps.list_namespaced_stateful_set),
             ("daemonsets", apps.list_namespaced_daemon_set), ("replicasets", apps.list_namespaced_replica_set),
             ("jobs", batch.list_namespaced_job), ("cronjobs", batch.list_namespaced_cron_job),
             ("replicationcontrollers", core.list_namespaced_replication_controller),
             ("podtemplates", core.list_namespaced_pod_template)]
    return [(f"{what} in namespace {namespace}", functools.partial(call, namespace)) for what, call in calls]


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


def _live_pods(core, namespace: str | None = None) -> Callable:
    # Finished pods hold nothing; the API server can leave them out (the core skips them anyway).
    def call(**kwargs):
        if namespace is not None:
            return core.list_namespaced_pod(namespace, field_selector=FINISHED_PODS_OUT, **kwargs)
        return core.list_pod_for_all_namespaces(field_selector=FINISHED_PODS_OUT, **kwargs)

    return call


def _failed_pods(core) -> Callable:
    def call(**kwargs):
        return core.list_pod_for_all_namespaces(field_selector=FAILED_PODS, **kwargs)

    return call


def _namespace(core, namespace: str, conn: connecting.Client, err: IO[str]) -> list[auditing.Located]:
    """The one namespace's object, for its mode. A user with rights only inside it may not read it:
    then its pods are audited as if it enforced gpushard, and a note says so."""
    import kubernetes

    try:
        with connecting.reaching(conn.target, f"get namespace {namespace}"):
            try:
                response = core.read_namespace(namespace, _preload_content=False, _request_timeout=conn.timeout)
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    raise UsageError(f'gpushard: namespace "{namespace}" not found at {conn.target.where}; check '
                                     "its name (kubectl get namespaces), or leave -n out", 404) from None
                if exc.status in (401, 403):
                    raise  # reaching() words it, naming the server and the context
                raise UsageError(str(connecting.answered(conn.target.where, f"get namespace {namespace}", exc)),
                                 exc.status) from None
    except connecting.ApiError as exc:
        if exc.status != 403:
            raise
        print(f"gpushard: cannot read namespace {namespace} (403), so its {names.MODE_LABEL} label is unknown; "
              "its objects are audited as if it enforced gpushard (to audit it as it is, get the right to read "
              "it: the ClusterRole gpushard-auditor grants it)", file=err)
        return []
    obj = json.loads(response.data)
    obj.setdefault("kind", auditing.NAMESPACE_KIND)
    return [auditing.Located(obj)]


DEVICE_CLASSES = "deviceclasses"


def read_cluster(conn: connecting.Client, err: IO[str], namespace: str | None = None,
                 selector: str | None = None) -> list[auditing.Located]:
    """Namespaces, nodes, pods, pod-template workloads and DeviceClasses of the live cluster.

    With ``namespace``, only namespaced calls (and a get of that namespace): a user with rights in
    one namespace can audit it. Nodes and DeviceClasses are then not read, so findings about shared
    nodes and about other drivers serving gpushard's resources are left out.
    ``selector`` (a label selector) narrows pods and workloads.
    """
    import kubernetes

    core = kubernetes.client.CoreV1Api(conn.api)
    objects: list[auditing.Located] = []
    if namespace is None:
        objects += [auditing.Located(o) for o in _list(core.list_namespace, "namespaces", conn)]
        objects += [auditing.Located(o) for o in _list(core.list_node, "nodes", conn)]
        objects += [auditing.Located(o) for o in _list(_live_pods(core), "pods", conn, label_selector=selector)]
    else:
        objects += _namespace(core, namespace, conn, err)
        objects += [auditing.Located(o) for o in _list(_live_pods(core, namespace), f"pods in namespace {namespace}",
                                                     conn, label_selector=selector)]
    calls = _workload_calls(conn.api, namespace)
    if namespace is None:
        # Cluster-wide only, as nodes: another driver's DeviceClass serving an extended resource
        # (resource.k8s.io/v1, Kubernetes 1.34+; DRAExtendedResource, 1.36+).
        calls.append((DEVICE_CLASSES, kubernetes.client.ResourceV1Api(conn.api).list_device_class))
    for what, call in calls:
        try:
            found = _list(call, what, conn, label_selector=selector if what != DEVICE_CLASSES else None)
            objects += [auditing.Located(o) for o in found if not _owned(o)]
        except (UsageError, connecting.ApiError) as exc:
            if isinstance(exc, connecting.ApiError) and exc.status != 403:
                raise  # unreachable, or the credentials refused: nothing else will work either
            if what == DEVICE_CLASSES and isinstance(exc, UsageError) and exc.status == 404:
                continue  # a cluster without resource.k8s.io/v1 has none
            # An API without that group, or RBAC without that read, leaves the rest worth auditing.
            print(f"{exc}; {what.split(' ')[0]} not audited", file=err)
    return objects


# --- the install's own objects -----------------------------------------------------------------------

def _get(call: Callable, what: str, conn: connecting.Client, *args: str) -> dict | None:
    """One object as raw JSON, or None when it does not exist (404)."""
    import kubernetes

    with connecting.reaching(conn.target, f"get {what}"):
        try:
            response = call(*args, _preload_content=False, _request_timeout=conn.timeout)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status in (401, 403):
                raise
            raise UsageError(str(connecting.answered(conn.target.where, f"get {what}", exc)), exc.status) from None
        return json.loads(response.data)


def read_install(conn: connecting.Client, err: IO[str]) -> installation.Installed:
    """gpushard's admission objects, for the install's states (core/installation.py). A read RBAC refuses
    (403) or the API server does not serve (404) is left out, with one note for the refusals."""
    import kubernetes

    admission = kubernetes.client.AdmissionregistrationV1Api(conn.api)
    core = kubernetes.client.CoreV1Api(conn.api)
    refused: list[str] = []

    def attempt(read: Callable[[], Any], what: str, unread: object = None) -> Any:  # raw JSON, or unread
        try:
            return read()
        except connecting.ApiError as exc:
            if exc.status != 403:
                raise  # unreachable, or the credentials refused: nothing else will work either
            refused.append(what)
        except UsageError as exc:
            if exc.status != 404:
                raise
        return unread

    policies = attempt(lambda: _list(admission.list_validating_admission_policy, "validatingadmissionpolicies",
                                     conn), "validatingadmissionpolicies")
    bindings = attempt(lambda: _list(admission.list_validating_admission_policy_binding,
                                     "validatingadmissionpolicybindings", conn), "validatingadmissionpolicybindings")
    config = attempt(lambda: _get(admission.read_mutating_webhook_configuration,
                                  f"mutatingwebhookconfiguration {names.WEBHOOK_CONFIGURATION}", conn,
                                  names.WEBHOOK_CONFIGURATION), "mutatingwebhookconfigurations")
    namespace_obj, namespace_read, slices = None, False, None
    service = installation.service_of(config)
    namespace, name = service or (names.SYSTEM_NAMESPACE, names.WEBHOOK_SERVICE)
    if service is not None:
        missing = object()
        found = attempt(lambda: _get(core.read_namespace, f"namespace {namespace}", conn, namespace), "namespaces",
                        missing)
        namespace_obj, namespace_read = (None, False) if found is missing else (found, True)
        discovery = kubernetes.client.DiscoveryV1Api(conn.api)
        slices = attempt(lambda: _list(functools.partial(discovery.list_namespaced_endpoint_slice, namespace),
                                       f"endpointslices in namespace {namespace}", conn,
                                       label_selector=f"kubernetes.io/service-name={name}"), "endpointslices")
    old = attempt(lambda: _get(core.read_namespaced_config_map, f"configmap {names.OLD_DEVICE_POLICY_CONFIG_MAP}",
                               conn, names.OLD_DEVICE_POLICY_CONFIG_MAP, namespace), "configmaps")
    if refused:
        print(f"gpushard: cannot read {', '.join(refused)} (403), so the install's state is checked without them "
              f"({AUDITOR_RIGHTS})", file=err)
    return installation.Installed(policies=policies, bindings=bindings, webhook_configuration=config,
                                  namespace=namespace_obj, namespace_read=namespace_read, endpoint_slices=slices,
                                  old_device_policy=old)


def read_usage_inputs(conn: connecting.Client, selector: str | None = None
                      ) -> tuple[list[dict], list[dict], set[str] | None]:
    """Every node and live pod, for `gpushard status`, and the names of the nodes ``selector`` picks
    (None without one). The verdicts (pending, stranded) are made over the whole cluster whatever
    the selector, which narrows only the rows shown: a pod waiting for a card of a node the
    selector leaves out is not stranded for that."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(conn.api)
    nodes = _list(core.list_node, "nodes", conn)
    return nodes, _list(_live_pods(core), "pods", conn), picked_nodes(conn, selector)


def picked_nodes(conn: connecting.Client, selector: str | None) -> set[str] | None:
    """The names of the nodes ``selector`` picks, None without one. The API server reads the
    selector, so that it means what it means to kubectl."""
    if not selector:
        return None
    import kubernetes

    core = kubernetes.client.CoreV1Api(conn.api)
    return {str((n.get("metadata") or {}).get("name")) for n in
            _list(core.list_node, "nodes", conn, label_selector=selector)}


DRA_BACKEND = "dra"


def read_dra_usage(conn: connecting.Client, policy) -> auditing.Usage:
    """With backend dra: cards from gpushard's ResourceSlices, holders from the allocated claims."""
    import functools

    import kubernetes

    from webhook.core import drausage, names

    custom = kubernetes.client.CustomObjectsApi(conn.api)
    group, version = names.DRA_API_VERSION.split("/")
    try:
        slices = _list(functools.partial(custom.list_cluster_custom_object, group, version, "resourceslices"),
                       "resourceslices", conn, field_selector=f"spec.driver={names.DRA_DRIVER}")
    except UsageError as exc:
        if exc.status != 404:
            raise
        raise connecting.ApiError(
            f"gpushard: backend dra, but {conn.target.where} serves no {names.DRA_API_VERSION} ResourceSlices "
            "(404): backend dra needs Kubernetes 1.36 or newer, or 1.34 with DRAConsumableCapacity on (docs/dra.md); "
            "on an older cluster, leave backend: dra out of --config", 404) from None
    if not slices:
        _need_device_class(custom, conn)
    claims = _list(functools.partial(custom.list_cluster_custom_object, group, version, "resourceclaims"),
                   "resourceclaims", conn)
    # The nodes, for the cards an operator cordoned: those have left the slices.
    nodes = _list(kubernetes.client.CoreV1Api(conn.api).list_node, "nodes", conn)
    return drausage.usage(slices, claims, policy.shares_per_card, nodes=nodes)


def _need_device_class(custom, conn: connecting.Client) -> None:
    """No slice of gpushard's driver: an ApiError when gpushard's DeviceClass is missing too (the dra overlay
    was never applied). The auditor role may not read DeviceClasses: anything but a 404 says nothing, and
    the caller tells the missing slices instead."""
    import kubernetes

    from webhook.core import names

    group, version = names.DRA_API_VERSION.split("/")
    try:
        custom.get_cluster_custom_object(group, version, "deviceclasses", names.DRA_DEVICE_CLASS,
                                         _request_timeout=conn.timeout)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            raise connecting.ApiError(
                f"gpushard: backend dra, but {conn.target.where} has no DeviceClass {names.DRA_DEVICE_CLASS}: the dra "
                "overlay is not applied; apply it (kubectl apply -k deploy/overlays/dra), or leave backend: dra out "
                "of --config", 404) from None
    except Exception:  # noqa: BLE001 - unreachable now, or a timeout: the missing slices are told all the same
        pass


def dra_slices_exist(conn: connecting.Client) -> bool:
    """Whether gpushard's driver publishes any ResourceSlice: a cluster that runs backend dra. False when
    they cannot be read (no DRA API, or no right to list them)."""
    import kubernetes

    from webhook.core import names

    group, version = names.DRA_API_VERSION.split("/")
    try:
        response: Any = kubernetes.client.CustomObjectsApi(conn.api).list_cluster_custom_object(  # read raw
            group, version, "resourceslices", field_selector=f"spec.driver={names.DRA_DRIVER}", limit=1,
            _preload_content=False, _request_timeout=conn.timeout)
        return bool(json.loads(response.data).get("items"))
    except Exception:  # noqa: BLE001 - only a hint for an empty status: never its failure
        return False


AGENT_PODS = "kubectl -n gpushard-system get pods -l app.kubernetes.io/component=agent -o wide"


def empty_cluster_note(conn: connecting.Client, policy) -> str:
    """What `status` says when no node is shared, with where to look next."""
    from webhook.core import names

    where = conn.target.where
    if policy.backend == DRA_BACKEND:
        return (f"gpushard: no shared nodes at {where}: no ResourceSlice of driver {names.DRA_DRIVER}; check that "
                f"the agents run there with backend: dra ({AGENT_PODS}) and read their log")
    offered = f"{policy.resources.card_prefix}<k>"
    if dra_slices_exist(conn):
        return (f"gpushard: no node at {where} offers {offered}, but ResourceSlices of driver {names.DRA_DRIVER} "
                "exist: the cluster runs backend dra; pass --config a file with backend: dra (the cluster's own: "
                "kubectl -n gpushard-system get configmap gpushard-config -o yaml)")
    return (f"gpushard: no shared nodes at {where}: no node offers {offered}; check that the agent runs on the "
            f"GPU nodes ({AGENT_PODS}) and read its log")


# --- output ----------------------------------------------------------------------------------------

def _width() -> int:
    # Readable in an 80 to 120 column terminal; a pipe gets 100.
    return max(80, min(120, shutil.get_terminal_size((100, 24)).columns))


def _counts(items: list[auditing.Item]) -> dict[str, int]:
    counts = {f.DENY: 0, f.WARN: 0, f.CHANGE: 0}
    for item in items:
        counts[item.finding.severity] = counts.get(item.finding.severity, 0) + 1
    return counts


def audit_json(items: list[auditing.Item], audited: int, target: str) -> dict:
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


def audit_table(items: list[auditing.Item], audited: int, width: int) -> str:
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


def _audited(objects: list[auditing.Located]) -> int:
    kinds = {auditing.NAMESPACE_KIND, auditing.NODE_KIND, auditing.DEVICE_CLASS_KIND, names.POD_KIND,
             *names.TEMPLATE_PATHS}
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


def audit_wide(items: list[auditing.Item], no_headers: bool = False) -> str:
    """One line per finding, every field a column (for grep and awk)."""
    rows = [[i.ref.namespace or "-", i.ref.kind, i.ref.name, i.finding.container or "-", i.finding.severity,
             i.finding.rule, " ".join(i.finding.message.removeprefix("gpushard: ").split())] for i in items]
    return tables.aligned(rows, None if no_headers else
                          ["NAMESPACE", "KIND", "NAME", "CONTAINER", "SEVERITY", "RULE", "MESSAGE"])


def audit_names(items: list[auditing.Item]) -> str:
    """kubectl's ``-o name``: each object with a finding once, as ``kind[.group]/name``."""
    seen = dict.fromkeys(kubectlflags.resource_name(i.ref.kind, i.ref.name) for i in items)
    return "".join(f"{name}\n" for name in seen)


def _document(data: dict, output: str) -> str:
    if output == kubectlflags.YAML:
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return json.dumps(data, indent=2) + "\n"


def _without_summary(text: str) -> str:
    """The grouped audit table without its closing "gpushard: ..." summary line (--no-headers)."""
    lines = text.splitlines()
    if lines and lines[-1].startswith("gpushard: "):
        lines = lines[:-1]
        while lines and not lines[-1]:
            lines.pop()
    return "\n".join(lines) + ("\n" if lines else "")


def _cluster_failure(exc: Exception, err: IO[str]) -> int:
    """The exit code for a failure to get at the cluster, its message on ``err``."""
    print(exc, file=err)
    return EXIT_UNREACHABLE if isinstance(exc, connecting.ApiError) else EXIT_USAGE


def run_audit(args: argparse.Namespace, settings, stdin: IO[str] | None = None, out: IO[str] | None = None,
              err: IO[str] | None = None) -> int:
    """`gpushard audit`: 1 when anything is found, 0 when clean, 2 when the input cannot be read or the
    audit fails, 3 when the cluster cannot be reached or refuses (see webhook.kubectlflags.EXIT_CODES)."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    output = getattr(args, "output", kubectlflags.TABLE)
    try:
        namespace = None
        if args.files:
            objects, target = read_manifests(args.files, stdin, err), "manifests"
        else:
            conn = kubectlflags.client_for(args)
            namespace = kubectlflags.namespace_of(args, conn.target)
            conn.target.rights = AUDITOR_RIGHTS if namespace is None else namespace_rights(namespace)
            objects = read_cluster(conn, err, namespace, getattr(args, "selector", None))
            target = "cluster" if namespace is None else f"namespace {namespace}"
        items = auditing.audit(objects, settings.policy)
        audited = _audited(objects)
        if not args.files and namespace is None:
            # The install's own objects are cluster-wide, as nodes: not read for one namespace.
            installed = read_install(conn, err)
            items += installation.check(installed)
            audited += installation.checked(installed)
        # The whole report is made before any of it is written: a failure leaves no half a report.
        if output in (kubectlflags.JSON, kubectlflags.YAML):
            text = _document(audit_json(items, audited, target), output)
        elif output == kubectlflags.WIDE:
            text = audit_wide(items, getattr(args, "no_headers", False))
        elif output == kubectlflags.NAME:
            text = audit_names(items)
        else:
            text = audit_table(items, audited, _width())
            if getattr(args, "no_headers", False):
                text = _without_summary(text)
        out.write(text)
    except (UsageError, connecting.ConfigError, connecting.ApiError) as exc:
        return _cluster_failure(exc, err)
    except Exception as exc:  # a bug or an input nobody foresaw: still not "findings"
        return _failed("audit", exc, args, err)
    return EXIT_FOUND if items else EXIT_CLEAN


def status_json(use: auditing.Usage, shares_per_card: int, capped: bool = False) -> dict:
    """The `-o json` document of `gpushard status` (fields documented in docs/audit.md)."""
    def holders(hs, memory_mib):
        # memoryMiB: the memory cap such a share gets under isolation memory or mps (null when unknown,
        # and with isolation none, where nothing is capped).
        # memoryAskedMiB and sizedForMiB, only for a pod placed by its memory ask (gpushard.io/memory): what
        # it asked, and the card size its shares were computed for.
        return [{"namespace": h.namespace, "name": h.name, "shares": h.shares,
                 "memoryMiB": _cap(h.shares, memory_mib if capped else 0, shares_per_card), **_asked(h)} for h in hs]

    return {
        "apiVersion": REPORT_API_VERSION,
        "kind": "StatusReport",
        "sharesPerCard": shares_per_card,
        "nodes": [{
            "name": n.name, "capacity": n.capacity, "used": n.used, "free": n.free,
            "cards": [{"index": c.index, "model": c.model or None, "uuid": c.uuid or None,
                       "capacity": c.capacity, "used": c.used, "free": c.free, "pods": holders(c.holders, c.memory_mib),
                       # null, or the operator's cordon: {reason, by, at}, each "" when not recorded
                       "cordoned": c.cordon.as_json() if c.cordon is not None else None}
                      for c in n.cards],
        } for n in use.nodes],
        "pending": [{"namespace": h.namespace, "name": h.name, "card": k, "shares": h.shares, **_asked(h)}
                    for h, k in use.pending],
        "stranded": [{"namespace": h.namespace, "name": h.name, "card": k, "shares": h.shares, "hint": hint}
                     for h, k, hint in use.stranded],
        "totals": {"nodes": len(use.nodes), "cards": sum(len(n.cards) for n in use.nodes),
                   "capacity": use.capacity, "used": use.used, "free": use.free},
    }


def _asked(holder: auditing.Holder) -> dict:
    if not holder.memory_asked_mib:
        return {}
    return {"memoryAskedMiB": holder.memory_asked_mib,
            **({"sizedForMiB": holder.sized_for_mib} if holder.sized_for_mib else {})}


def _asked_text(holder: auditing.Holder) -> str:
    """For a pod placed by its memory ask, what it asked and the card size it got: ", asked 12288 MiB of a
    23034 MiB card"; else nothing."""
    if not holder.memory_asked_mib:
        return ""
    of = f" of a {holder.sized_for_mib} MiB card" if holder.sized_for_mib else ""
    return f", asked {holder.memory_asked_mib} MiB{of}"


def _cap(shares: int, memory_mib: int, shares_per_card: int) -> int | None:
    return isolation.memory_cap_mib(shares, memory_mib, shares_per_card) if memory_mib else None


def _held(shares: int, memory_mib: int, shares_per_card: int) -> str:
    cap = _cap(shares, memory_mib, shares_per_card)
    return f"{shares}" if cap is None else f"{shares}, {cap} MiB"


def _percent(used: int, capacity: int) -> str:
    return f"{100 * used // capacity}%" if capacity else "-"


def status_table(use: auditing.Usage, wide: bool = False, no_headers: bool = False, shares_per_card: int = 100,
                 capped: bool = False, selector: str | None = None, shared_nodes: int | None = None,
                 namespace: str | None = None, empty: str | None = None) -> str:
    """One row per card, a total row per node and for the cluster; every row on one line, as kubectl
    prints tables (a long PODS cell runs on instead of wrapping, so grep and awk see whole rows).
    ``wide`` adds the card's UUID and the model in full; ``namespace`` names the one namespace whose
    pods ``use`` holds (`status -n`), in the TOTAL row; ``empty`` is the line for a cluster without a
    shared node (``empty_cluster_note``).

    Each holder shows its shares and, where the card's memory is known, the memory cap those shares
    get under isolation (shares x the card's memory / sharesPerCard, floored); ``capped`` is False
    with isolation none, where nothing is capped.
    """
    model_w = 10_000 if wide else 24
    head = ["NODE", "CARD", "MODEL", *(["UUID"] if wide else []), "USED", "FREE", "TOTAL", "USE%", "PODS"]
    rows: list[list[str]] = []

    def row(node: str, card: str, model: str, uuid: str, used: int, free: int, capacity: int, pods: str) -> None:
        rows.append([node, card, model[:model_w], *([uuid] if wide else []), str(used), str(free), str(capacity),
                     _percent(used, capacity), pods])

    for n in use.nodes:
        for c in n.cards:
            memory = c.memory_mib if capped else 0
            pods = ", ".join(f"{h.namespace}/{h.name} ({_held(h.shares, memory, shares_per_card)}{_asked_text(h)})"
                             for h in c.holders) or "-"
            card = f"{c.index} (cordoned)" if c.cordon is not None else str(c.index)
            row(n.name, card, c.model, c.uuid or "-", c.used, c.free, c.capacity, pods)
        if len(n.cards) > 1:
            count = sum(len(c.holders) for c in n.cards)
            row(n.name, "all", "", "", n.used, n.free, n.capacity, f"{count} pod{'s' if count != 1 else ''}")
    if not no_headers:
        count = sum(len(c.holders) for n in use.nodes for c in n.cards)
        row("TOTAL", str(sum(len(n.cards) for n in use.nodes)), "", "", use.used, use.free, use.capacity,
            f"{count} pod{'s' if count != 1 else ''}{f' in {namespace}' if namespace else ''} on {len(use.nodes)} "
            f"node{'s' if len(use.nodes) != 1 else ''}")
    text = tables.aligned(rows, None if no_headers else head, right={1, *range(len(head) - 5, len(head) - 1)}, gap="  ")
    lines = []
    if not no_headers and not use.nodes:
        if selector and shared_nodes:
            lines.append(f"gpushard: no shared node matches -l {selector} ({shared_nodes} shared "
                         f"node{'s' if shared_nodes != 1 else ''} in all); see their labels with kubectl get nodes "
                         f"-l {names.CARDS_LABEL} --show-labels")
        elif empty:
            lines.append(empty)
    # One verdict per pod: a stranded pod is told as stranded, not also as pending.
    stranded = {(h.namespace, h.name) for h, _k, _hint in use.stranded}
    lines += [f"pending: {h.namespace}/{h.name} waits for card {k} ({h.shares} shares)" for h, k in use.pending
              if (h.namespace, h.name) not in stranded]
    lines += [f"stranded: {h.namespace}/{h.name} waits on full card {k} while another card has room: {hint}"
              for h, k, hint in use.stranded]
    # Who cordoned what, and why: the card takes no new pod; its pods run on until they end.
    lines += [f"cordoned: card {c.index} of {n.name} ({c.cordon.said()}), {len(c.holders)} "
              f"pod{'s' if len(c.holders) != 1 else ''} still on it"
              for n in use.nodes for c in n.cards if c.cordon is not None]
    return text + "".join(line + "\n" for line in lines)


def install_json(items: list[auditing.Item]) -> list[dict]:
    """The install's half-done states, for `status -o json` (fields documented in docs/audit.md)."""
    return [{"kind": i.ref.kind, "namespace": i.ref.namespace or None, "name": i.ref.name, "rule": i.finding.rule,
             "message": i.finding.message, "run": i.fix} for i in items]


def install_lines(items: list[auditing.Item]) -> str:
    """The install's half-done states under the status table: what was found, then what to run."""
    return "".join(f"install: {i.finding.message.removeprefix('gpushard: ')}\n  run: {i.fix}\n" for i in items)


def toolkit_problems(nodes: list[dict], picked: set[str] | None = None) -> list[tuple[str, str]]:
    """(node, message) for each shared node whose NVIDIA toolkit honours an outsider's NVIDIA_VISIBLE_DEVICES, as
    its agent found it (core/auditing.py toolkit_problem); only the nodes ``picked`` when a selector picked some."""
    found = []
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name") or "")
        shared = names.CARDS_LABEL in (meta.get("labels") or {})  # set by gpushard's agent, as the verdict is
        problem = auditing.toolkit_problem(node) if shared and (picked is None or name in picked) else None
        if problem:
            found.append((name, problem))
    return found


def held_cards(nodes: list[dict], picked: set[str] | None = None) -> list[tuple[str, str]]:
    """(node, message) for each card an agent withholds because another device plugin's pods hold it."""
    return [(str((n.get("metadata") or {}).get("name") or ""), message) for n in nodes
            if picked is None or (n.get("metadata") or {}).get("name") in picked
            for message in auditing.held_by_others(n)]


def refused_pods(pods: list[dict], policy) -> list[dict]:
    """The pods the kubelet refused at admission (``UnexpectedAdmissionError``) that asked gpushard's shares, as
    core/refusals.py reads them (docs/operations.md): each with its node, the kubelet's message and what brings
    it back: its controller, or nobody."""
    return [{"namespace": r.namespace, "name": r.name, "node": r.node, "message": r.message[:200],
             "controller": r.controller} for r in refusals.found(pods, policy)]


def refused_lines(refused: list[dict]) -> str:
    lines = []
    for p in refused:
        again = (f"its controller {p['controller']} makes a new pod; delete this one once read" if p["controller"]
                 else refusals.BARE_POD_ADVICE)
        lines.append(f"refused: {p['namespace']}/{p['name']} on {p['node']} by the kubelet "
                     f"({refusals.KUBELET_REASON}: {p['message']}): {again}\n")
    return "".join(lines)


def starting_nodes(nodes: list[dict], policy, picked: set[str] | None = None) -> list[tuple[str, str]]:
    """(node, message) for each node still coming up for gpushard (core/auditing.py starting): a node an
    autoscaler just added, whose cards are not advertised yet."""
    found = []
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        message = auditing.starting(node, policy) if picked is None or name in picked else None
        if message:
            found.append((name, message))
    return sorted(found)


def node_lines(problems: list[tuple[str, str]], held: Sequence[tuple[str, str]] = (),
               starting: Sequence[tuple[str, str]] = ()) -> str:
    """Under the status table: what was found on each node, then what to do."""
    fix = auditing.FIXES[auditing.TOOLKIT_ACCEPTS_ENVVAR]
    lines = [f"starting: {message.removeprefix('gpushard: ')}\n" for _, message in starting]
    lines += [f"node: {message.removeprefix('gpushard: ')}\n  fix: {fix}\n" for _, message in problems]
    lines += [f"node: {message.removeprefix('gpushard: ')}\n" for _, message in held]
    return "".join(lines)


def kubernetes_core(conn: connecting.Client):
    import kubernetes

    return kubernetes.client.CoreV1Api(conn.api)


def status_names(use: auditing.Usage) -> str:
    return "".join(kubectlflags.resource_name("Node", n.name) + "\n" for n in use.nodes)


def run_status(args: argparse.Namespace, settings, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """`gpushard status`: 0 when the cluster was read, 2 on bad flags or a failing report, 3 when the
    cluster cannot be reached or refuses."""
    out, err = out or sys.stdout, err or sys.stderr
    output = getattr(args, "output", kubectlflags.TABLE)
    try:
        selector = getattr(args, "selector", None)
        conn = kubectlflags.client_for(args)
        conn.target.rights = DRA_AUDITOR_RIGHTS if settings.policy.backend == DRA_BACKEND else AUDITOR_RIGHTS
        if settings.policy.backend == DRA_BACKEND:
            use, picked = read_dra_usage(conn, settings.policy), picked_nodes(conn, selector)
            nodes = None
        else:
            nodes, pods, picked = read_usage_inputs(conn, selector)
            use = auditing.usage(nodes, pods, settings.policy)
        shared_nodes = len(use.nodes)
        empty = empty_cluster_note(conn, settings.policy) if not shared_nodes and output == kubectlflags.TABLE \
            and not getattr(args, "no_headers", False) else None
        if picked is not None:
            use = dataclasses.replace(use, nodes=tuple(n for n in use.nodes if n.name in picked))
        # Only an explicit -n narrows (the pods shown); -A, or neither, shows every namespace's.
        namespace = None if getattr(args, "all_namespaces", False) else getattr(args, "namespace", None) or None
        if namespace is not None:
            use = auditing.pods_of_namespace(use, namespace)
        capped = settings.policy.isolation != "none"
        install = installation.check(read_install(conn, err)) if output != kubectlflags.NAME else []
        listed = (nodes if nodes is not None else _list(kubernetes_core(conn).list_node, "nodes", conn)) \
            if output != kubectlflags.NAME else []
        toolkit, held = toolkit_problems(listed, picked), held_cards(listed, picked)
        starting = starting_nodes(listed, settings.policy, picked)
        refused = [] if output == kubectlflags.NAME or settings.policy.backend == DRA_BACKEND else [
            p for p in refused_pods(_list(_failed_pods(kubernetes_core(conn)), "pods", conn), settings.policy)
            if picked is None or p["node"] in picked]
        if namespace is not None:
            refused = [p for p in refused if p["namespace"] == namespace]
        if output in (kubectlflags.JSON, kubectlflags.YAML):
            document = status_json(use, settings.policy.shares_per_card, capped)
            if namespace is not None:
                document = {**document, "namespace": namespace}
            document["install"] = install_json(install)
            fix = auditing.FIXES[auditing.TOOLKIT_ACCEPTS_ENVVAR]
            document["toolkit"] = [{"node": name, "message": message, "fix": fix}
                                   for name, message in toolkit]
            document["heldByOtherPlugins"] = [{"node": name, "message": message} for name, message in held]
            document["starting"] = [{"node": name, "message": message} for name, message in starting]
            document["refused"] = refused
            text = _document(document, output)
        elif output == kubectlflags.NAME:
            text = status_names(use)
        else:
            text = status_table(use, wide=output == kubectlflags.WIDE, no_headers=getattr(args, "no_headers", False),
                                shares_per_card=settings.policy.shares_per_card, capped=capped, selector=selector,
                                shared_nodes=shared_nodes, namespace=namespace, empty=empty)
            text += refused_lines(refused) + install_lines(install) + node_lines(toolkit, held, starting)
        out.write(text)
    except (UsageError, connecting.ConfigError, connecting.ApiError) as exc:
        return _cluster_failure(exc, err)
    except Exception as exc:  # a bug or an input nobody foresaw: never a traceback alone
        return _failed("status", exc, args, err)
    return EXIT_CLEAN
