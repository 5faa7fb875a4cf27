"""RBAC in deploy/ grants exactly the Kubernetes API calls the code makes, to the account that makes them.

We test:
- every kubernetes client call in webhook/ (CoreV1Api, AppsV1Api, BatchV1Api,
  AdmissionregistrationV1Api methods, named anywhere in a module) is found, mapped through
  the client's own URL to (API group, resource, verb), and attributed to the program that
  runs it by following imports from its entry module; a call no program accounts for fails;
- each ServiceAccount (webhook, agent, certs Job) is granted every call its program makes,
  at the right scope (cluster-wide lists need a ClusterRoleBinding), and nothing more; the calls only
  backend dra makes (the agent's count in its Node's status) the dra overlay grants, and deploy/base not;
- the auditor ClusterRole covers `gpushard audit` and `gpushard status` and only reads;
- the top Role covers `gpushard top` (agent pods and port-forwards to them) in gpushard's namespace, and only
  reads; the cordoner ClusterRole covers `gpushard cordon` and `uncordon` exactly, and is bound to nobody;
  the metrics reader ClusterRole grants `get` on nodes/metrics alone, the right the agent checks;
- no rule uses "*", and neither the webhook, the agent nor the auditor may touch Secrets.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import pytest

from tests.deploy import rendering

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "gpushard-system"
API_CLASSES = (kubernetes.client.CoreV1Api, kubernetes.client.AppsV1Api, kubernetes.client.BatchV1Api,
               kubernetes.client.AdmissionregistrationV1Api, kubernetes.client.CoordinationV1Api,
               kubernetes.client.ResourceV1Api, kubernetes.client.AuthenticationV1Api,
               kubernetes.client.AuthorizationV1Api, kubernetes.client.DiscoveryV1Api)
VERB_PREFIXES = {"list": "list", "read": "get", "patch": "patch", "create": "create", "replace": "update",
                 "delete": "delete", "connect": "create"}
# Who runs what: the module a program starts from, and the account it runs as.
PROGRAMS = {
    "gpushard-webhook": ("webhook.admission.serving", "webhook.wsgi"),
    "gpushard-agent": ("webhook.agent.running",),
    "gpushard-certs": ("webhook.installing",),
    "auditor": ("webhook.auditing",),
    "top": ("webhook.top",),
    "gpushard-replacer": ("webhook.replacement.controller",),
    "cordoner": ("webhook.cordoning",),
}
# The modules whose calls only backend dra makes: the dra overlay grants them, deploy/base does not.
DRA_ONLY = {"gpushard-agent": ("webhook.agent.dra.nodecount",)}
# Objects named in the manifests, for rules limited by resourceNames.
NAMED = {("", "secrets"): "gpushard-tls", ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): "gpushard",
         ("coordination.k8s.io", "leases"): "gpushard-replacer", ("", "configmaps"): "gpushard-device-policy"}


@dataclass(frozen=True)
class Call:
    group: str
    resource: str  # with "/subresource" where there is one
    verb: str
    namespaced_path: bool  # the URL names a namespace: a RoleBinding there may grant it
    method: str


@functools.cache
def _client_call(method: str) -> Call | None:
    for cls in API_CLASSES:
        serialize = getattr(cls, f"_{method}_serialize", None)
        if serialize is None:
            continue
        path = re.search(r"resource_path='([^']+)'", inspect.getsource(serialize)).group(1)
        parts = path.strip("/").split("/")
        group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
        namespaced = rest[:2] == ["namespaces", "{namespace}"] and len(rest) > 2
        if namespaced:
            rest = rest[2:]
        resource = rest[0]
        if len(rest) > 2:
            resource += "/" + rest[2]
        prefix = method.split("_", 1)[0]
        verb = "deletecollection" if method.startswith("delete_collection") else VERB_PREFIXES[prefix]
        if prefix == "connect":  # a proxy or exec call: the verb follows its HTTP method
            verb = {"get": "get", "head": "get", "options": "get", "post": "create", "put": "update",
                    "patch": "patch", "delete": "delete"}[method.split("_")[1]]
        return Call(group, resource, verb, namespaced, method)
    return None


def _module_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str) -> set[str]:
    """webhook.* modules that ``module`` imports anywhere (also inside functions)."""
    tree = ast.parse(_module_file(module).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _module_file(sub) else node.module)
    return {m for m in found if m.startswith("webhook") and _module_file(m)}


def _closure(entries: tuple[str, ...]) -> set[str]:
    seen: set[str] = set()
    todo = [e for e in entries if _module_file(e)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += sorted(_imports(module) - seen)
    return seen


# A module watches what it lists when it opens a watch itself, or hands its list calls to an informer
# (webhook.kubeapi.informing), which lists, then watches with the same call.
WATCHING = re.compile(r"watch\.Watch\(|\bwatch=True\b|\binforming\.Informer\(")


@functools.cache
def _own_functions() -> set[str]:
    """Function names defined in webhook/: a helper called read_node is not CoreV1Api.read_node."""
    names = set()
    for path in (ROOT / "webhook").rglob("*.py"):
        names |= {n.name for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


@functools.cache
def _calls(module: str) -> set[Call]:
    """Client methods named in a module: as attributes (api.list_node) or strings (getattr)."""
    text = _module_file(module).read_text()
    words = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.add(node.value)
    words -= _own_functions()
    calls = {c for c in map(_client_call, words) if c is not None}
    if WATCHING.search(text):
        # A watch is a list with ?watch=true: the same call needs the "watch" verb too.
        calls |= {Call(c.group, c.resource, "watch", c.namespaced_path, c.method) for c in calls if c.verb == "list"}
    return calls


def _all_modules() -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (ROOT / "webhook").rglob("*.py") if "proto" not in p.parts)


@functools.cache
def required() -> dict[str, set[Call]]:
    """Each program's calls with either backend, but those only backend dra makes (``dra_required``)."""
    return {who: set().union(*[_calls(m) for m in _closure(entries) - set(DRA_ONLY.get(who, ()))])
            for who, entries in PROGRAMS.items()}


def dra_required() -> dict[str, set[Call]]:
    return {who: set().union(*[_calls(m) for m in modules]) for who, modules in DRA_ONLY.items()}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return rendering.render(ROOT / "deploy/base")


def _rules(objects: list[dict], kind: str, name: str) -> list[dict]:
    (role,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return role["rules"]


def grants(objects: list[dict], account: str) -> list[tuple[dict, str | None]]:
    """The rules bound to a ServiceAccount, each with the namespace it holds in (None: everywhere)."""
    out = []
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account and s["namespace"] == NAMESPACE
                   for s in binding["subjects"]):
            continue
        scope = binding["metadata"]["namespace"] if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        out += [(rule, scope) for rule in _rules(objects, ref["kind"], ref["name"])]
    return out


def _allows(rule: dict, scope: str | None, call: Call) -> bool:
    if call.group not in rule.get("apiGroups", []) or call.resource not in rule.get("resources", []):
        return False
    if call.verb not in rule["verbs"]:
        return False
    if rule.get("resourceNames"):
        if call.verb in ("list", "watch", "create", "deletecollection"):
            return False
        if NAMED.get((call.group, call.resource)) not in rule["resourceNames"]:
            return False
    # A namespaced grant reaches only calls into that namespace.
    return scope is None or (call.namespaced_path and scope == NAMESPACE)


def _triples(rules: list[tuple[dict, str | None]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule, _ in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_every_api_call_belongs_to_a_program():
    attributed = set().union(*[_closure(entries) for entries in PROGRAMS.values()])
    stray = {m: sorted(c.method for c in _calls(m)) for m in _all_modules() if m not in attributed and _calls(m)}
    assert stray == {}, "an API call that no ServiceAccount or role in deploy/ accounts for"


def test_the_scan_finds_the_calls_we_know_of():
    # Guards the scanner itself: these calls exist in the code today.
    calls = required()
    assert Call("", "nodes", "patch", False, "patch_node") in calls["gpushard-agent"]
    assert Call("", "secrets", "create", True, "create_namespaced_secret") in calls["gpushard-certs"]
    assert {c.verb for c in calls["gpushard-certs"] if c.resource == "mutatingwebhookconfigurations"} == \
        {"get", "patch"}


def test_the_dra_overlay_grants_what_only_backend_dra_calls(objects):
    overlay = rendering.render(ROOT / "deploy/overlays/dra")
    for account, calls in dra_required().items():
        assert calls, f"{DRA_ONLY[account]} makes no call the scan finds"
        rules = grants(overlay, account)
        assert sorted(c.method for c in calls if not any(_allows(rule, scope, c) for rule, scope in rules)) == []
        assert [c for c in calls if any(_allows(rule, scope, c) for rule, scope in grants(objects, account))] == []
        # Beyond those, the overlay adds only resource.k8s.io rights (slices and claims, through
        # CustomObjectsApi, which the scan does not follow: test_dra_overlay.py checks them).
        added = _triples(rules) - _triples(grants(objects, account)) - {(c.group, c.resource, c.verb) for c in calls}
        assert {t for t in added if t[0] != "resource.k8s.io"} == set()


@pytest.mark.parametrize("account", ["gpushard-webhook", "gpushard-agent", "gpushard-certs", "gpushard-replacer"])
def test_each_service_account_has_exactly_what_its_program_calls(objects, account):
    rules = grants(objects, account)
    calls = required()[account]
    missing = sorted(c.method + f" ({c.verb} {c.resource})" for c in calls
                     if not any(_allows(rule, scope, c) for rule, scope in rules))
    assert missing == []
    extra = _triples(rules) - {(c.group, c.resource, c.verb) for c in calls}
    assert extra == set(), f"{account} is granted more than its code uses"


def test_pods_run_as_the_account_their_program_needs(objects):
    accounts = {}
    for obj in objects:
        for spec in rendering.pod_specs(obj):
            accounts[(obj["kind"], obj["metadata"]["name"])] = spec["serviceAccountName"]
    assert accounts == {("Deployment", "gpushard-webhook"): "gpushard-webhook",
                        ("DaemonSet", "gpushard-agent"): "gpushard-agent",
                        ("Deployment", "gpushard-replacer"): "gpushard-replacer",
                        ("Job", "gpushard-certs"): "gpushard-certs",
                        ("CronJob", "gpushard-certs-renew"): "gpushard-certs"}


def test_the_auditor_role_covers_audit_and_status_and_only_reads(objects):
    rules = [(rule, None) for rule in _rules(objects, "ClusterRole", "gpushard-auditor")]
    calls = required()["auditor"]
    assert calls, "gpushard audit reads the live cluster"
    missing = sorted(c.method for c in calls if not any(_allows(rule, scope, c) for rule, scope in rules))
    assert missing == []
    assert {v for rule, _ in rules for v in rule["verbs"]} <= {"get", "list", "watch"}
    # Bound by the operator (examples/auditor-binding.yaml), never by the install itself.
    assert not [o for o in objects if o["kind"].endswith("Binding") and o.get("roleRef", {}).get("name") ==
                "gpushard-auditor"]


def test_the_top_role_covers_top_in_gpushard_s_namespace_and_only_reads(objects):
    (role,) = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "gpushard-top"]
    assert role["metadata"]["namespace"] == NAMESPACE
    rules = [(rule, NAMESPACE) for rule in role["rules"]]
    calls = required()["top"]
    assert {(c.resource, c.verb) for c in calls} == {("pods", "list"), ("pods/portforward", "get")}
    missing = sorted(c.method for c in calls if not any(_allows(rule, scope, c) for rule, scope in rules))
    assert missing == []
    # A WebSocket port-forward is also authorized as `create` since Kubernetes 1.35; nothing else more.
    assert _triples(rules) == {(c.group, c.resource, c.verb) for c in calls} | {("", "pods/portforward", "create")}
    assert not [o for o in objects if o["kind"].endswith("Binding") and o.get("roleRef", {}).get("name") ==
                "gpushard-top"]


def test_the_cordoner_role_covers_cordon_and_uncordon_exactly_and_is_bound_to_nobody(objects):
    rules = [(rule, None) for rule in _rules(objects, "ClusterRole", "gpushard-cordoner")]
    calls = required()["cordoner"]
    assert {(c.group, c.resource, c.verb) for c in calls} == {
        ("", "nodes", "list"), ("", "nodes", "patch"), ("", "events", "create"),
        ("authentication.k8s.io", "selfsubjectreviews", "create")}
    missing = sorted(c.method for c in calls if not any(_allows(rule, scope, c) for rule, scope in rules))
    assert missing == []
    # And the mark no call uses, by which gpushard-cordon-only holds the role to the cordon annotations.
    assert _triples(rules) == {(c.group, c.resource, c.verb) for c in calls} | {("", "nodes", "cordon-cards")}
    assert not [o for o in objects if o["kind"].endswith("Binding") and o.get("roleRef", {}).get("name") ==
                "gpushard-cordoner"]


def test_the_metrics_reader_grants_what_the_agent_checks(objects):
    from webhook import authorizing

    attributes = authorizing.node_metrics("n").attributes["resourceAttributes"]
    url = authorizing.METRICS_URL.attributes["nonResourceAttributes"]
    rules = _rules(objects, "ClusterRole", "gpushard-metrics-reader")
    assert rules == [{"apiGroups": [attributes["group"]],
                      "resources": [f"{attributes['resource']}/{attributes['subresource']}"],
                      "verbs": [attributes["verb"]]}, {"nonResourceURLs": [url["path"]], "verbs": [url["verb"]]}]


def test_no_wildcards_and_no_secrets_where_none_are_needed(objects):
    for obj in objects:
        for rule in obj.get("rules", []) if obj["kind"] in ("Role", "ClusterRole") else []:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), f"{obj['kind']} {obj['metadata']['name']}: '*' in {field}"
    for account in ("gpushard-webhook", "gpushard-agent", "gpushard-replacer"):
        assert not [r for r, _ in grants(objects, account) if "secrets" in r["resources"]]
    assert not [r for r in _rules(objects, "ClusterRole", "gpushard-auditor") if "secrets" in r["resources"]]
