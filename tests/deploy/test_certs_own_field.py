"""The certificates' own-field policy (gpushard-certs-own-field in deploy/base/certs-job.yaml), its CEL evaluated
for real.

We test, with the policy and binding as deploy/base renders them (tests/deploy/admission_policy.py evaluates the
CEL as the API server would), for updates of the MutatingWebhookConfiguration gpushard:
- by the certificates' ServiceAccount: a new caBundle in one webhook or in all three (what `gpushard certs
  --install` patches) passes; a changed service, URL, rules, failurePolicy, namespace selector or match
  condition, a webhook added, removed or renamed, and changed labels or annotations are denied, naming the
  webhook where there is one;
- by anyone else (an admin, cert-manager's CA injector) nothing is matched;
- each way of breaking the policy (a validation dropped, a field left out of the comparison, the match
  condition widened) flips a verdict above.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_manifests import BASE

CERTS = "system:serviceaccount:gpushard-system:gpushard-certs"
NAMES = ("enforce.gpushard.io", "hide.gpushard.io", "audit.gpushard.io")


@pytest.fixture(scope="module")
def shipped():
    return admission_policy.shipped(rendering.render(BASE), "gpushard-certs-own-field")


@pytest.fixture(scope="module")
def configuration() -> dict:
    found, = [o for o in rendering.render(BASE) if o["kind"] == "MutatingWebhookConfiguration"]
    return found


def admit(policy_and_binding, new: dict, old: dict, username: str = CERTS):
    request = {"operation": "UPDATE", "name": new["metadata"]["name"],
               "kind": {"group": "admissionregistration.k8s.io", "version": "v1",
                        "kind": "MutatingWebhookConfiguration"},
               "resource": {"group": "admissionregistration.k8s.io", "version": "v1",
                            "resource": "mutatingwebhookconfigurations"},
               "userInfo": {"username": username}}
    return admission_policy.evaluate(*policy_and_binding, request, new, old, None)


def changed(old: dict, change) -> dict:
    new = copy.deepcopy(old)
    change(new)
    return new


def _bundle(index: int | None = None):
    def change(config: dict) -> None:
        for i, hook in enumerate(config["webhooks"]):
            if index is None or i == index:
                hook["clientConfig"]["caBundle"] = "TkVXIENB"
    return change


def _hook(index: int, change):
    def apply(config: dict) -> None:
        change(config["webhooks"][index])
    return apply


def verdicts(policy_and_binding, configuration: dict) -> dict[str, admission_policy.Outcome]:
    old = copy.deepcopy(configuration)
    for hook in old["webhooks"]:
        hook["clientConfig"]["caBundle"] = "T0xEIENB"
    service = _hook(1, lambda h: h["clientConfig"]["service"].update(name="elsewhere"))
    cases = {
        "one caBundle": (_bundle(0), CERTS),
        "every caBundle": (_bundle(), CERTS),
        "a service": (service, CERTS),
        "a URL": (_hook(0, lambda h: h["clientConfig"].update(url="https://evil.example/mutate")), CERTS),
        "rules": (_hook(2, lambda h: h["rules"].pop()), CERTS),
        "failurePolicy": (_hook(0, lambda h: h.update(failurePolicy="Ignore")), CERTS),
        "a namespace selector": (_hook(0, lambda h: h.update(namespaceSelector={})), CERTS),
        "a match condition": (_hook(1, lambda h: h["matchConditions"][0].update(expression="false")), CERTS),
        "a webhook removed": (lambda c: c["webhooks"].pop(), CERTS),
        "a webhook added": (lambda c: c["webhooks"].append({**copy.deepcopy(c["webhooks"][2]), "name": "x.io"}),
                            CERTS),
        "a webhook renamed": (_hook(2, lambda h: h.update(name="other.gpushard.io")), CERTS),
        "labels": (lambda c: c["metadata"].update(labels={"evil": "yes"}), CERTS),
        "annotations added": (lambda c: c["metadata"].update(annotations={"evil": "yes"}), CERTS),
        "an admin changes a service": (service, "admin"),
        "cert-manager's injector": (_bundle(), "system:serviceaccount:cert-manager:cert-manager-cainjector"),
    }
    out = {}
    for name, (change, user) in cases.items():
        outcome = admit(policy_and_binding, changed(old, change), old, user)
        assert not outcome.errored, (name, outcome.message)
        out[name] = outcome
    return out


EXPECTED = {
    "one caBundle": True, "every caBundle": True, "a service": False, "a URL": False, "rules": False,
    "failurePolicy": False, "a namespace selector": False, "a match condition": False, "a webhook removed": False,
    "a webhook added": False, "a webhook renamed": False, "labels": False, "annotations added": False,
    "an admin changes a service": True, "cert-manager's injector": True,
}
NAMED = {"a service": NAMES[1], "a URL": NAMES[0], "rules": NAMES[2], "failurePolicy": NAMES[0],
         "a namespace selector": NAMES[0], "a match condition": NAMES[1], "a webhook renamed": "other.gpushard.io",
         "a webhook added": "x.io"}


def test_the_certificates_account_changes_only_the_ca_bundles(shipped, configuration):
    outcomes = verdicts(shipped, configuration)
    assert {name: o.allowed for name, o in outcomes.items()} == EXPECTED
    for name, hook in NAMED.items():
        assert outcomes[name].message == ("gpushard: the certificates' ServiceAccount may change only "
                                          f'clientConfig.caBundle, not webhook "{hook}"'), name
    assert outcomes["a webhook removed"].message == "gpushard: the certificates' ServiceAccount may not add or " \
                                                    "remove webhooks"
    for name in ("labels", "annotations added"):
        assert "may not change the configuration's metadata" in outcomes[name].message
    for name in ("an admin changes a service", "cert-manager's injector"):
        assert not outcomes[name].matched, name


def _no_field_check(p: dict) -> None:
    p["spec"]["variables"][0]["expression"] = "[]"


def _service_not_compared(p: dict) -> None:
    p["spec"]["variables"][0]["expression"] = p["spec"]["variables"][0]["expression"].replace(
        "w.clientConfig.service == o.clientConfig.service", "true")


def _rules_not_compared(p: dict) -> None:
    p["spec"]["variables"][0]["expression"] = p["spec"]["variables"][0]["expression"].replace("w.rules == o.rules",
                                                                                            "true")


def _count_unchecked(p: dict) -> None:
    p["spec"]["validations"] = [v for v in p["spec"]["validations"] if "size(oldObject.webhooks)" not in
                                v["expression"]]


def _metadata_unchecked(p: dict) -> None:
    p["spec"]["validations"] = [v for v in p["spec"]["validations"] if "metadata" not in v["expression"]]


def _everyone(p: dict) -> None:
    p["spec"]["matchConditions"][0]["expression"] = "true"


@pytest.mark.parametrize("break_it", [_no_field_check, _service_not_compared, _rules_not_compared, _count_unchecked,
                                      _metadata_unchecked, _everyone])
def test_each_break_of_the_policy_flips_a_verdict(shipped, configuration, break_it):
    policy, binding = shipped
    broken = copy.deepcopy(policy)
    break_it(broken)
    outcomes = verdicts((broken, binding), configuration)
    assert {name: o.allowed for name, o in outcomes.items()} != EXPECTED


def test_the_policy_compiles_as_the_api_server_would(shipped):
    assert admission_policy.problems(shipped[0]) == []
