"""`gpushard status` and `gpushard audit` on a half-done install: the real kubernetes client talking to tests/fakekube.

We test, with deploy/base's own admission objects and webhook configuration put on the fake API server
(the webhook's namespace, a ready EndpointSlice of its Service, a caBundle in every entry):
- the whole install, the chart's renders with every kustomization's values alike, shows no state at all;
- each half-done state is told once, on the object it concerns, with what to run: a binding whose policy
  is missing, a policy without a binding, a binding that still names params and a policy that still reads
  them (an earlier version's; one whose binding names none refuses everything now), the webhook's Service
  without a ready endpoint, its namespace being deleted or gone, an entry without a caBundle, an enforce
  entry that fails closed for every pod, the ConfigMap an earlier version's policies read, with the
  lists it still holds, and a device policy list that is not one string of names (a value whose quotes ended
  its CEL string, as kustomize writes it unchecked); lists of names are no state;
- `status` prints each under its table ("install:", then "  run:"), and in `-o json` as "install"; its
  exit stays 0; `audit` of the cluster reports each as a finding (exit 1) with its fix, counts the
  objects it looked at, and `audit -n NS` reads none of them (they are cluster-wide);
- a cluster without gpushard, and an API server that serves none of these kinds, show nothing.
"""

from __future__ import annotations

import copy
import json

import pytest

from tests import fakekube
from tests.audit import world
from tests.chart import helm
from tests.chart.kustomizations import VALUES
from tests.deploy import rendering
from tests.deploy.test_manifests import BASE
from webhook import cli
from webhook.core import installation, names

RESOURCES = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
             "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
             "MutatingWebhookConfiguration": "mutatingwebhookconfigurations"}


def shipped(objects: list[dict]) -> list[tuple[str, dict]]:
    """The admission objects of a rendering, as the API server holds them once the certificate Job has run."""
    out = []
    for obj in objects:
        if obj["kind"] in RESOURCES:
            obj = copy.deepcopy(obj)
            for hook in obj.get("webhooks", []):
                hook["clientConfig"]["caBundle"] = "Q0E="
            out.append((RESOURCES[obj["kind"]], obj))
    return out


def endpoint_slice(ready: bool | None = True, namespace: str = names.SYSTEM_NAMESPACE) -> dict:
    conditions = {} if ready is None else {"ready": ready}
    return {"metadata": {"name": "gpushard-abcde", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": names.WEBHOOK_SERVICE}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.5"], "conditions": conditions}]}


def install(fake: fakekube.FakeKube, objects: list[dict], namespace: str = names.SYSTEM_NAMESPACE) -> None:
    for resource, obj in shipped(objects):
        fake.put(resource, obj)
    fake.put("namespaces", world.namespace(namespace))
    fake.put("endpointslices", endpoint_slice(namespace=namespace))


@pytest.fixture
def fake():
    with fakekube.FakeKube() as server:
        install(server, rendering.render(BASE))
        yield server


def status(kubeconfig: str, capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["status", "--kubeconfig", kubeconfig, *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def states(kubeconfig: str, capsys) -> dict[tuple[str, str], tuple[str, str]]:
    """(rule, object name) -> (message, what to run), as `status -o json` says them."""
    code, out, err = status(kubeconfig, capsys, "-o", "json")
    assert code == 0 and err == "", err
    return {(s["rule"], s["name"]): (s["message"], s["run"]) for s in json.loads(out)["install"]}


def audit_report(kubeconfig: str, capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["audit", "--kubeconfig", kubeconfig, "-o", "json", *argv])
    captured = capsys.readouterr()
    assert captured.err == "", captured.err
    return code, json.loads(captured.out)


def test_the_whole_install_shows_no_state(kubeconfig, capsys):
    assert states(kubeconfig, capsys) == {}
    code, out, _err = status(kubeconfig, capsys)
    assert code == 0 and "install:" not in out
    code, report = audit_report(kubeconfig, capsys)
    assert code == 0 and report["findings"] == []
    # The namespace gpushard-system (as every namespace), the policies, their bindings and the webhook
    # configuration were looked at.
    assert report["summary"]["objects"] == 1 + 6 + 6 + 1


@pytest.mark.parametrize("folder", sorted(VALUES))
def test_every_chart_render_is_whole(folder):
    helm.skip_module_without_helm()
    objects = [o for o in helm.template(VALUES[folder]) if not helm.is_test_hook(o)]
    found = [obj for _resource, obj in shipped(objects)]
    config = next(o for o in found if o["kind"] == "MutatingWebhookConfiguration")
    installed = installation.Installed(
        policies=[o for o in found if o["kind"] == "ValidatingAdmissionPolicy"],
        bindings=[o for o in found if o["kind"] == "ValidatingAdmissionPolicyBinding"],
        webhook_configuration=config, namespace=world.namespace(names.SYSTEM_NAMESPACE), namespace_read=True,
        endpoint_slices=[endpoint_slice()])
    assert installation.check(installed) == []


def test_a_binding_without_its_policy(fake, kubeconfig, capsys):
    fake.delete("validatingadmissionpolicies", "gpushard-device-channels")
    found = states(kubeconfig, capsys)
    message, run = found[installation.BINDING_WITHOUT_POLICY, "gpushard-device-channels"]
    assert "does not exist: the API server ignores the binding" in message
    assert run.startswith("install again: kubectl apply -k deploy/base") and "helm upgrade gpushard" in run
    assert "kubectl delete validatingadmissionpolicybinding gpushard-device-channels" in run
    assert set(found) == {(installation.BINDING_WITHOUT_POLICY, "gpushard-device-channels")}


def test_a_policy_without_its_binding(fake, kubeconfig, capsys):
    fake.delete("validatingadmissionpolicybindings", "gpushard-device-claims")
    found = states(kubeconfig, capsys)
    assert set(found) == {(installation.POLICY_WITHOUT_BINDING, "gpushard-device-claims")}
    message, run = found[installation.POLICY_WITHOUT_BINDING, "gpushard-device-claims"]
    assert "has no binding, so it enforces nothing" in message and "kubectl apply -k" in run


def test_an_earlier_versions_params(fake, kubeconfig, capsys):
    binding = fake.get("validatingadmissionpolicybindings", "gpushard-device-channels")
    binding["spec"]["paramRef"] = {"name": names.OLD_DEVICE_POLICY_CONFIG_MAP, "namespace": names.SYSTEM_NAMESPACE,
                                   "parameterNotFoundAction": "Deny"}
    fake.put("validatingadmissionpolicybindings", binding)
    found = states(kubeconfig, capsys)
    message, _run = found[installation.POLICY_PARAMS, "gpushard-device-channels"]
    assert "still names params (paramRef gpushard-system/gpushard-device-policy)" in message
    assert "the API server ignores it" in message
    # The policy of before reads them too, and a binding that names none refuses everything it matches.
    policy = fake.get("validatingadmissionpolicies", "gpushard-device-claims")
    policy["spec"]["paramKind"] = {"apiVersion": "v1", "kind": "ConfigMap"}
    fake.put("validatingadmissionpolicies", policy)
    found = states(kubeconfig, capsys)
    message, run = found[installation.POLICY_PARAMS, "gpushard-device-claims"]
    assert "reads params (paramKind ConfigMap)" in message
    assert "its binding gpushard-device-claims names none, so every object the policy matches is refused now" in \
        message
    assert '"What the policies trust"' in run and "kubectl apply -k" in run
    assert len(found) == 2


@pytest.mark.parametrize("ready", [False, "none"])
def test_the_webhook_without_ready_endpoints(fake, kubeconfig, capsys, ready):
    if ready == "none":
        fake.delete("endpointslices", "gpushard-abcde", names.SYSTEM_NAMESPACE)
    else:
        fake.put("endpointslices", endpoint_slice(ready))
    found = states(kubeconfig, capsys)
    assert set(found) == {(installation.WEBHOOK_WITHOUT_ENDPOINTS, names.WEBHOOK_CONFIGURATION)}
    message, run = found[installation.WEBHOOK_WITHOUT_ENDPOINTS, names.WEBHOOK_CONFIGURATION]
    assert "calls Service gpushard-system/gpushard, which has no ready endpoint" in message
    assert "pods that ask for a GPU or name a device are refused, and the others are admitted" in message
    assert "kubectl -n gpushard-system get pods -l app.kubernetes.io/component=webhook" in run
    assert "kubectl delete mutatingwebhookconfiguration gpushard" in run


def test_an_endpoint_whose_readiness_is_not_said_is_ready(fake, kubeconfig, capsys):
    fake.put("endpointslices", endpoint_slice(None))
    assert states(kubeconfig, capsys) == {}


@pytest.mark.parametrize("gone", [True, False], ids=["gone", "terminating"])
def test_the_webhooks_namespace_gone_or_going(fake, kubeconfig, capsys, gone):
    if gone:
        fake.delete("namespaces", names.SYSTEM_NAMESPACE)
    else:
        ns = fake.get("namespaces", names.SYSTEM_NAMESPACE)
        ns["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        fake.put("namespaces", ns)
    found = states(kubeconfig, capsys)
    # One state: the endpoints of a namespace that is going are not told again.
    assert set(found) == {(installation.WEBHOOK_NAMESPACE_GONE, names.WEBHOOK_CONFIGURATION)}
    message, run = found[installation.WEBHOOK_NAMESPACE_GONE, names.WEBHOOK_CONFIGURATION]
    assert f"namespace gpushard-system {'does not exist' if gone else 'is being deleted'}" in message
    assert "kubectl wait --for=delete namespace/gpushard-system --timeout=5m" in run and "kubectl apply -k" in run


def test_an_entry_without_a_ca_bundle(fake, kubeconfig, capsys):
    config = fake.get("mutatingwebhookconfigurations", names.WEBHOOK_CONFIGURATION)
    del config["webhooks"][1]["clientConfig"]["caBundle"]
    fake.put("mutatingwebhookconfigurations", config)
    found = states(kubeconfig, capsys)
    message, run = found[installation.WEBHOOK_WITHOUT_CA, names.WEBHOOK_CONFIGURATION]
    assert f"has no caBundle for {names.HIDE_WEBHOOK}" in message
    assert 'create job --from=cronjob/gpushard-certs-renew "gpushard-certs-$(date +%s)"' in run
    assert len(found) == 1


def test_an_enforce_entry_that_fails_closed_for_every_pod(fake, kubeconfig, capsys):
    config = fake.get("mutatingwebhookconfigurations", names.WEBHOOK_CONFIGURATION)
    # The configuration of before: one enforce entry, for every pod, failing closed.
    config["webhooks"] = [h for h in config["webhooks"] if h["name"] != names.HIDE_WEBHOOK]
    del config["webhooks"][0]["matchConditions"]
    fake.put("mutatingwebhookconfigurations", config)
    found = states(kubeconfig, capsys)
    message, run = found[installation.WEBHOOK_FAILS_CLOSED, names.WEBHOOK_CONFIGURATION]
    assert "every pod of enforce namespaces is refused, GPU or not" in message and "kubectl apply -k" in run
    assert len(found) == 1


def test_an_earlier_versions_config_map(fake, kubeconfig, capsys):
    fake.put("configmaps", {"metadata": {"name": names.OLD_DEVICE_POLICY_CONFIG_MAP,
                                         "namespace": names.SYSTEM_NAMESPACE},
                            "data": {"exemptNamespaces": "gpu-operator", "exemptServiceAccounts": "",
                                     "allowedDeviceClasses": ""}})
    found = states(kubeconfig, capsys)
    message, run = found[installation.LEFTOVER_DEVICE_POLICY, names.OLD_DEVICE_POLICY_CONFIG_MAP]
    assert "no policy reads it, so nothing in it is trusted (it lists exemptNamespaces \"gpu-operator\")" in message
    assert "examples/device-policy" in run and "delete configmap gpushard-device-policy" in run


def _with_list(fake, policy: str, variable: str, expression: str) -> None:
    obj = fake.get("validatingadmissionpolicies", policy)
    for v in obj["spec"]["variables"]:
        if v["name"] == variable:
            v["expression"] = expression
    fake.put("validatingadmissionpolicies", obj)


def test_a_device_policy_list_that_is_not_a_string_of_names(fake, kubeconfig, capsys):
    quotes = "'" * 3
    _with_list(fake, "gpushard-device-channels", "trustedServiceAccounts", f"r{quotes}gpu/dcgm-exporter a/b{quotes}")
    _with_list(fake, "gpushard-device-claims", "allowed", f"r{quotes}nic.example.com{quotes}")
    assert states(kubeconfig, capsys) == {}
    # As kustomize writes the value <3 quotes> + request.namespace + r<3 quotes>: it trusts every namespace.
    broken = f"r{quotes}{quotes} + request.namespace + r{quotes}{quotes}"
    _with_list(fake, "gpushard-device-channels", "trustedNamespaces", broken)
    found = states(kubeconfig, capsys)
    message, run = found[installation.POLICY_LIST_NOT_NAMES, "gpushard-device-channels"]
    assert "variable trustedNamespaces is not one list of names but the CEL" in message and "request.namespace" \
        in message
    assert "write names only" in run and "kubectl apply -k" in run
    assert len(found) == 1


def test_status_tells_each_state_under_its_table_and_audit_reports_it(fake, kubeconfig, capsys):
    fake.delete("validatingadmissionpolicies", "gpushard-device-channels")
    fake.put("endpointslices", endpoint_slice(False))
    code, out, err = status(kubeconfig, capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    told = [i for i, line in enumerate(lines) if line.startswith("install: ")]
    assert len(told) == 2
    for i in told:
        assert lines[i + 1].startswith("  run: "), lines[i + 1]
    assert any("ValidatingAdmissionPolicyBinding gpushard-device-channels binds policy" in lines[i] for i in told)
    code, report = audit_report(kubeconfig, capsys)
    assert code == 1
    rules = {(x["kind"], x["name"], x["rule"]): x for x in report["findings"]}
    assert set(rules) == {("ValidatingAdmissionPolicyBinding", "gpushard-device-channels",
                           installation.BINDING_WITHOUT_POLICY),
                          ("MutatingWebhookConfiguration", "gpushard", installation.WEBHOOK_WITHOUT_ENDPOINTS)}
    assert all(x["fix"] and x["message"].startswith("gpushard: ") for x in rules.values())
    code = cli.main(["audit", "--kubeconfig", kubeconfig])
    table = capsys.readouterr().out
    assert code == 1 and "ValidatingAdmissionPolicyBinding gpushard-device-channels" in table
    assert "fix: install again: kubectl apply -k deploy/base" in table


def test_audit_of_one_namespace_reads_none_of_them(fake, kubeconfig, capsys):
    fake.delete("validatingadmissionpolicies", "gpushard-device-channels")
    fake.put("namespaces", world.namespace("ml", "enforce"))
    fake.requests.clear()
    code, report = audit_report(kubeconfig, capsys, "-n", "ml")
    assert code == 0 and report["findings"] == []
    assert not [p for _m, p, _b in fake.requests if "admissionregistration" in p or "endpointslices" in p]


def test_a_cluster_without_gpushard_shows_nothing(capsys, tmp_path):
    with fakekube.FakeKube() as server:
        path = tmp_path / "kubeconfig"
        path.write_text(world.kubeconfig(server))
        assert states(str(path), capsys) == {}
        # An API server that serves none of these kinds (404) is the same.
        server.unserved = {"admissionregistration.k8s.io/v1", "discovery.k8s.io/v1"}
        assert states(str(path), capsys) == {}
