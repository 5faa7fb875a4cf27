"""Whether gpushard's admission objects are whole: the states a half-done install or removal leaves behind.

Each state is a finding about one object, with what to run. The objects come in as raw JSON, read
elsewhere (webhook/auditing.py); a read that could not be made is None here and its checks are skipped.
What each state does to pods, and why, is docs/operations.md's "States of the install".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from webhook.core import auditing, names
from webhook.core import findings as f

BINDING_WITHOUT_POLICY = "binding-without-policy"
POLICY_WITHOUT_BINDING = "policy-without-binding"
POLICY_PARAMS = "policy-params"
WEBHOOK_NAMESPACE_GONE = "webhook-namespace-gone"
WEBHOOK_WITHOUT_ENDPOINTS = "webhook-without-endpoints"
WEBHOOK_WITHOUT_CA = "webhook-without-ca"
WEBHOOK_FAILS_CLOSED = "webhook-fails-closed"
LEFTOVER_DEVICE_POLICY = "leftover-device-policy"
POLICY_LIST_NOT_NAMES = "policy-list-not-names"
RULES = (BINDING_WITHOUT_POLICY, POLICY_WITHOUT_BINDING, POLICY_PARAMS, WEBHOOK_NAMESPACE_GONE,
         WEBHOOK_WITHOUT_ENDPOINTS, WEBHOOK_WITHOUT_CA, WEBHOOK_FAILS_CLOSED, LEFTOVER_DEVICE_POLICY,
         POLICY_LIST_NOT_NAMES)

# The variables of the device policies that hold the operator's lists, each written in as one CEL raw string
# (deploy/base/kustomization.yaml's replacements; the chart's devicePolicy values). Kustomize checks no value:
# one that holds three quotes ends the string, and what follows is CEL (a value of three quotes, then
# ` + request.namespace + r`, then three quotes, trusts every namespace). No admission check can catch it: the
# API server exempts ValidatingAdmissionPolicies from policies and webhooks alike (k8s.io/apiserver
# pkg/admission/plugin/policy/generic/plugin.go, admissionResources; plugin/webhook/predicates/rules/rules.go,
# IsExemptAdmissionConfigurationResource). So the audit says it.
POLICY_LISTS = {"gpushard-device-channels": ("trustedNamespaces", "trustedServiceAccounts"),
                "gpushard-device-claims": ("allowed", "own")}
_LIST = re.compile(r"r'''[A-Za-z0-9./ -]*'''")

POLICY_KIND = "ValidatingAdmissionPolicy"
BINDING_KIND = "ValidatingAdmissionPolicyBinding"
WEBHOOK_KIND = "MutatingWebhookConfiguration"
CONFIG_MAP_KIND = "ConfigMap"

# Running the install again finishes a half-done one: both tools apply every object, policies before
# their bindings, the webhook configuration last.
REINSTALL = ("install again: kubectl apply -k deploy/base (or your overlay); with Helm, helm upgrade gpushard "
             "charts/gpushard -n gpushard-system --reuse-values")
# What the webhook configuration does to enforce namespaces while nothing answers it.
WHILE_DOWN = ("in enforce namespaces pods that ask for a GPU or name a device are refused, and the others are "
              "admitted without the GPU-hiding rewrite (gpushard audit lists them afterwards)")


@dataclass(frozen=True)
class Installed:
    """gpushard's admission objects as the API server holds them (raw JSON)."""

    policies: list[dict] | None = None  # every ValidatingAdmissionPolicy
    bindings: list[dict] | None = None  # every ValidatingAdmissionPolicyBinding
    webhook_configuration: dict | None = None  # MutatingWebhookConfiguration gpushard; None when absent or unread
    # The namespace and EndpointSlices of the Service the webhook configuration calls (service_of).
    namespace: dict | None = None  # None when gone or unread
    namespace_read: bool = False  # whether ``namespace`` was read (then None means gone)
    endpoint_slices: list[dict] | None = None
    old_device_policy: dict | None = None  # ConfigMap gpushard-device-policy, when it is still there


def _meta(obj: dict) -> dict:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _spec(obj: dict) -> dict:
    spec = obj.get("spec")
    return spec if isinstance(spec, dict) else {}


def _name(obj: dict) -> str:
    return str(_meta(obj).get("name") or "")


def _ours(name: str) -> bool:
    return name.startswith(names.POLICY_PREFIX)


def _item(kind: str, name: str, rule: str, message: str, fix: str, namespace: str = "") -> auditing.Item:
    return auditing.Item(auditing.Ref(kind, namespace, name), f.Finding(rule, f.WARN, message), fix_here=fix)


def _policy_items(policies: list[dict], bindings: list[dict]) -> list[auditing.Item]:
    by_name = {_name(p): p for p in policies}
    ours = sorted(n for n in by_name if _ours(n))
    bound: dict[str, list[dict]] = {}
    for binding in bindings:
        bound.setdefault(str(_spec(binding).get("policyName") or ""), []).append(binding)
    items = []
    for binding in sorted(bindings, key=_name):
        name, policy_name = _name(binding), str(_spec(binding).get("policyName") or "")
        if not (_ours(name) or _ours(policy_name)):
            continue
        policy = by_name.get(policy_name)
        if policy is None:
            items.append(_item(BINDING_KIND, name, BINDING_WITHOUT_POLICY, (
                f'gpushard: ValidatingAdmissionPolicyBinding {name} binds policy "{policy_name}", which does not '
                "exist: the API server ignores the binding, so nothing that policy refuses is refused"),
                f"{REINSTALL}; or, if gpushard is being removed, kubectl delete validatingadmissionpolicybinding "
                f"{name}"))
            continue
        ref = _spec(binding).get("paramRef")
        if "paramKind" in _spec(policy):
            continue  # said once, on the policy
        if isinstance(ref, dict):
            items.append(_item(BINDING_KIND, name, POLICY_PARAMS, (
                f"gpushard: ValidatingAdmissionPolicyBinding {name} still names params (paramRef "
                f"{ref.get('namespace') or ''}{'/' if ref.get('namespace') else ''}{ref.get('name') or ''}) "
                f"from an earlier gpushard; policy {policy_name} reads none, so the API server ignores it"),
                REINSTALL))
    for name in ours:
        spec = _spec(by_name[name])
        for variable in spec.get("variables") or []:
            if not isinstance(variable, dict) or variable.get("name") not in POLICY_LISTS.get(name, ()):
                continue
            expression = variable.get("expression")
            if not (isinstance(expression, str) and _LIST.fullmatch(expression.strip())):
                items.append(_item(POLICY_KIND, name, POLICY_LIST_NOT_NAMES, (
                    f"gpushard: ValidatingAdmissionPolicy {name} variable {variable['name']} is not one list of "
                    f"names but the CEL {str(expression)[:200]!r}: a value with three quotes in it ended its string, "
                    "and the rest is evaluated, which can trust any namespace or account"),
                    "write names only (letters, digits, '.', '-', '/' between a namespace and a ServiceAccount, "
                    f"single spaces between them) in the device policy lists, then {REINSTALL}"))
        if not bound.get(name):
            items.append(_item(POLICY_KIND, name, POLICY_WITHOUT_BINDING, (
                f"gpushard: ValidatingAdmissionPolicy {name} has no binding, so it enforces nothing"), REINSTALL))
        kind = spec.get("paramKind")
        if isinstance(kind, dict):
            unbound = [_name(b) for b in bound.get(name, []) if not isinstance(_spec(b).get("paramRef"), dict)]
            now = (f"; its binding {', '.join(unbound)} names none, so every object the policy matches is refused "
                   "now") if unbound else ""
            items.append(_item(POLICY_KIND, name, POLICY_PARAMS, (
                f"gpushard: ValidatingAdmissionPolicy {name} reads params (paramKind {kind.get('kind')}), as "
                "gpushard did before: while that object is missing every object the policy matches is refused, "
                f"and the API server may stop watching it for good once the policy's binding has gone{now}"),
                f"move the lists you set there into your overlay or the chart's values (docs/install.md, \"What "
                f"the policies trust\"), then {REINSTALL}"))
    return items


def _ready(slices: list[dict]) -> int:
    count = 0
    for item in slices:
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") if isinstance(endpoint, dict) else None
            # An endpoint whose readiness is not said is ready (discovery.k8s.io/v1).
            if not isinstance(conditions, dict) or conditions.get("ready") is not False:
                count += 1
    return count


def service_of(config: dict | None) -> tuple[str, str] | None:
    """(namespace, name) of the Service the webhook configuration calls first, or None (a URL, or nothing)."""
    for hook in (config or {}).get("webhooks") or []:
        service = (hook.get("clientConfig") or {}).get("service") if isinstance(hook, dict) else None
        if isinstance(service, dict) and service.get("namespace") and service.get("name"):
            return str(service["namespace"]), str(service["name"])
    return None


def _webhook_items(installed: Installed) -> list[auditing.Item]:
    config = installed.webhook_configuration
    if config is None:
        return []
    name = _name(config)
    hooks = [h for h in config.get("webhooks") or [] if isinstance(h, dict)]
    items = []
    services = sorted({(s.get("namespace") or "", s.get("name") or "") for h in hooks
                       for s in [(h.get("clientConfig") or {}).get("service")] if isinstance(s, dict)})
    # The reads are of the first Service's namespace and EndpointSlices (service_of): the shipped entries
    # all call one Service.
    for namespace, service in services[:1]:
        meta = _meta(installed.namespace) if installed.namespace is not None else {}
        if installed.namespace_read and (installed.namespace is None or meta.get("deletionTimestamp")):
            state = "does not exist" if installed.namespace is None else "is being deleted"
            items.append(_item(WEBHOOK_KIND, name, WEBHOOK_NAMESPACE_GONE, (
                f"gpushard: MutatingWebhookConfiguration {name} calls Service {namespace}/{service}, but namespace "
                f"{namespace} {state}: {WHILE_DOWN}"),
                f"wait until it is gone (kubectl wait --for=delete namespace/{namespace} --timeout=5m), then "
                f"{REINSTALL}; or, to take gpushard out, kubectl delete mutatingwebhookconfiguration {name}"))
        elif installed.endpoint_slices is not None and not _ready(installed.endpoint_slices):
            items.append(_item(WEBHOOK_KIND, name, WEBHOOK_WITHOUT_ENDPOINTS, (
                f"gpushard: MutatingWebhookConfiguration {name} calls Service {namespace}/{service}, which has no "
                f"ready endpoint: {WHILE_DOWN}"),
                f"check the webhook's pods and their log (kubectl -n {namespace} get pods -l "
                f"app.kubernetes.io/component=webhook); or, to take gpushard out, kubectl delete "
                f"mutatingwebhookconfiguration {name}"))
    missing = [str(h.get("name")) for h in hooks if not (h.get("clientConfig") or {}).get("caBundle")]
    if missing:
        items.append(_item(WEBHOOK_KIND, name, WEBHOOK_WITHOUT_CA, (
            f"gpushard: MutatingWebhookConfiguration {name} has no caBundle for {', '.join(missing)}, so the API "
            f"server cannot trust the webhook and every call fails: {WHILE_DOWN}"),
            f"make the certificate again: kubectl -n {(service_of(config) or (names.SYSTEM_NAMESPACE, ''))[0]} "
            "create job "
            "--from=cronjob/gpushard-certs-renew \"gpushard-certs-$(date +%s)\" (with cert-manager, check its CA "
            "injector)"))
    closed = [str(h.get("name")) for h in hooks if h.get("name") == names.ENFORCE_WEBHOOK
              and h.get("failurePolicy", "Fail") == "Fail" and not h.get("matchConditions")]
    if closed:
        items.append(_item(WEBHOOK_KIND, name, WEBHOOK_FAILS_CLOSED, (
            f"gpushard: webhook {closed[0]} of MutatingWebhookConfiguration {name} fails closed for every pod "
            "(failurePolicy Fail and no matchConditions, as gpushard had before): while the webhook is down every "
            "pod of enforce namespaces is refused, GPU or not"), REINSTALL))
    return items


def _leftover_items(installed: Installed) -> list[auditing.Item]:
    config_map = installed.old_device_policy
    if config_map is None:
        return []
    namespace = str(_meta(config_map).get("namespace") or names.SYSTEM_NAMESPACE)
    data = cast(dict, config_map.get("data") if isinstance(config_map.get("data"), dict) else {})
    listed = [f'{k} "{v}"' for k, v in sorted(data.items()) if isinstance(v, str) and v.strip()]
    lists = f" (it lists {', '.join(listed)})" if listed else ""
    return [_item(CONFIG_MAP_KIND, names.OLD_DEVICE_POLICY_CONFIG_MAP, LEFTOVER_DEVICE_POLICY, (
        f"gpushard: ConfigMap {namespace}/{names.OLD_DEVICE_POLICY_CONFIG_MAP} is left from an earlier gpushard: "
        f"no policy reads it, so nothing in it is trusted{lists}"),
        "write those lists in your overlay (examples/device-policy) or the chart's devicePolicy values and "
        f"install again (docs/install.md, \"What the policies trust\"), then kubectl -n {namespace} delete "
        f"configmap {names.OLD_DEVICE_POLICY_CONFIG_MAP}", namespace)]


def checked(installed: Installed) -> int:
    """How many of gpushard's objects ``check`` looked at (for an audit's count of objects)."""
    count = sum(1 for p in installed.policies or [] if _ours(_name(p)))
    count += sum(1 for b in installed.bindings or []
                 if _ours(_name(b)) or _ours(str(_spec(b).get("policyName") or "")))
    return count + (installed.webhook_configuration is not None) + (installed.old_device_policy is not None)


def check(installed: Installed) -> list[auditing.Item]:
    """Every half-done state of the install, each with what to run."""
    items = []
    if installed.policies is not None and installed.bindings is not None:
        items += _policy_items(installed.policies, installed.bindings)
    items += _webhook_items(installed)
    items += _leftover_items(installed)
    return items
