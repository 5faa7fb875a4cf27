"""The stand-in for the API server's policy evaluation (tests/deploy/admission_policy.py) is as strict as it is.

We test, on small policies written here and on the shipped ones:
- has() on a missing key is false, but has() below a missing field, or on a variable that
  failed, is an error, as is selecting a missing field; errors are values (`true || err`);
- a validation that errs, or returns no bool, denies under failurePolicy Fail (and by
  default) and admits under Ignore, its message naming the expression;
- matchConditions: any false skips the policy even beside an error; an error with all else
  true denies under Fail and skips under Ignore;
- a false validation's message: messageExpression, else message (when the former errs or is
  blank, multi-line or over 5 KiB), else "failed expression: ...";
- validationActions: Warn admits with a warning, Deny denies;
- compile-time checks: undeclared identifiers, variables read before their declaration,
  has() without a field selection; every shipped policy (base and overlays) has none;
- the step budget: a comprehension past the per-call limit is an error, so a denial;
- the string and list functions the API server's CEL declares (lowerAscii, split, join, ...,
  isSorted, sum, min, max), their results, and their failures as errors;
- a shipped policy with one field path misspelt denies an object it admits as shipped, as an
  error: a forgiving evaluator let that through;
- every Pod and pod template of tests/golden and examples/ is judged by the opt-in guard and the
  device-channel policy, in enforce and other namespaces, without an expression error;
- every shipped policy has a test module that evaluates it and checks its verdicts come from
  its rules, not from errors.

Breaks tried on tests/deploy/admission_policy.py, each caught here: has() answering false on an
error below it (cel-python's own behaviour: 4 tests fail); a variable that fails dropped from
`variables` instead of kept as an error (3 fail).
"""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.deploy import admission_policy, rendering
from tests.deploy.test_manifests import BASE, KUSTOMIZATIONS
from tests.deploy.test_opt_in_guard import RESOURCES, container, pod_spec, wrap
from webhook.core import names

LAB = admission_policy.namespace_object("lab")


def policy(*validations: dict, variables: list[dict] | None = None, conditions: list[dict] | None = None,
           failure: str | None = None) -> dict:
    spec: dict = {"matchConstraints": {"resourceRules": [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}]},
        "validations": list(validations)}
    if variables:
        spec["variables"] = variables
    if conditions:
        spec["matchConditions"] = conditions
    if failure:
        spec["failurePolicy"] = failure
    return {"kind": "ValidatingAdmissionPolicy", "metadata": {"name": "p"}, "spec": spec}


def binding(*actions: str) -> dict:
    return {"kind": "ValidatingAdmissionPolicyBinding", "spec": {"policyName": "p",
                                                                 "validationActions": list(actions or ["Deny"])}}


def request(operation: str = "CREATE") -> dict:
    return {"operation": operation, "namespace": "lab", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"}, "userInfo": {"username": "alice"}}


POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", "namespace": "lab", "labels": {"app": "x"}},
       "spec": {"containers": [{"name": "app", "image": "cuda:12"}]}}


def run(p: dict, obj: dict = POD, actions: tuple[str, ...] = ("Deny",)) -> admission_policy.Outcome:
    return admission_policy.evaluate(p, binding(*actions), request(), obj, None, LAB)


def check(expression: str, **kw) -> dict:
    return {"expression": expression, **kw}


@pytest.mark.parametrize("expression,allowed", [
    ("has(object.metadata.labels)", True),
    ("!has(object.metadata.annotations)", True),          # a missing key: false, not an error
    ("!has(object.metadata.labels.team)", True),
    ("true || object.spec.nope == 1", True),              # an error absorbed by ||, as in cel-go
    ("object.spec.nope == 1 || true", True),
])
def test_what_is_not_an_error(expression, allowed):
    outcome = run(policy(check(expression)))
    assert (outcome.allowed, outcome.errored) == (allowed, False), outcome.message


@pytest.mark.parametrize("expression", [
    "has(object.spec.nope.field)",             # has() below a missing field (cel-python alone answers false)
    "object.spec.nope == 1",                   # selecting a missing field: no such key
    "!has(object.metadata.annotations.x)",     # annotations is missing, so has() below it errs
    "object.spec.containers[3].name == 'a'",   # index out of range
    "has(object.spec.containers.name)",        # has() on a list
    "size(object.metadata.name)",              # not a bool
    "oldObject.metadata.name == 'x'",          # oldObject is null on CREATE
])
def test_errors_deny_under_fail_and_admit_under_ignore(expression):
    for failure in (None, "Fail"):
        outcome = run(policy(check(expression, message="m"), failure=failure))
        assert outcome.matched and not outcome.allowed and outcome.errored
        assert outcome.message.startswith(f"expression {expression!r} resulted in error: ")
    outcome = run(policy(check(expression, message="m"), check("false", message="second"), failure="Ignore"))
    assert outcome.errored is False and outcome.message == "second"  # the error admitted; the next one judged
    assert run(policy(check(expression), failure="Ignore")).allowed


def test_a_variable_that_fails_is_an_error_where_it_is_read():
    variables = [{"name": "holder", "expression": "object.spec.templat"},   # misspelt: fails on a Pod
                 {"name": "spec", "expression": "has(variables.holder.spec) ? variables.holder.spec : {}"},
                 {"name": "unused", "expression": "object.nope"}]
    outcome = run(policy(check("!has(variables.spec.hostPID)"), variables=variables))
    assert not outcome.allowed and outcome.errored
    assert "resulted in error" in outcome.message
    # A variable that fails but is never read decides nothing (the API server evaluates them lazily).
    assert run(policy(check("true"), variables=variables)).allowed
    # Short-circuited before it is read, it decides nothing either.
    assert run(policy(check("true || variables.spec.hostPID"), variables=variables)).allowed


@pytest.mark.parametrize("conditions,failure,expected", [
    (["false", "object.nope"], "Fail", "skipped"),    # any false skips, errors or not
    (["object.nope", "false"], "Fail", "skipped"),
    (["true", "object.nope"], "Fail", "denied"),      # true and an error: failurePolicy
    (["true", "object.nope"], None, "denied"),
    (["true", "object.nope"], "Ignore", "skipped"),
    (["'a'"], "Fail", "denied"),                      # not a bool: an error
    (["true", "true"], "Fail", "evaluated"),
])
def test_match_conditions(conditions, failure, expected):
    named = [{"name": f"c{i}", "expression": e} for i, e in enumerate(conditions)]
    outcome = run(policy(check("false", message="judged"), conditions=named, failure=failure))
    verdict = ("skipped" if not outcome.matched else "denied" if outcome.errored else
               "evaluated" if outcome.message == "judged" else "?")
    assert verdict == expected, outcome
    assert outcome.allowed is (verdict == "skipped")


@pytest.mark.parametrize("validation,message", [
    (check("false", messageExpression="'from ' + object.metadata.name", message="static"), "from x"),
    (check("false", messageExpression="object.nope", message="static"), "static"),
    (check("false", messageExpression="'  '", message=" static "), "static"),
    (check("false", messageExpression="'two\\nlines'", message="static"), "static"),
    (check("false", messageExpression="1", message="static"), "static"),
    (check("false", messageExpression="'x' + object.metadata.name * 0", message="static"), "static"),
    (check("false", messageExpression="'" + "m" * 5121 + "'", message="static"), "static"),
    (check("false", messageExpression="'" + "m" * 5120 + "'", message="static"), "m" * 5120),
    (check(" false "), "failed expression: false"),
])
def test_messages_fall_back_as_the_api_server_does(validation, message):
    outcome = run(policy(validation))
    assert (outcome.allowed, outcome.errored, outcome.message) == (False, False, message)


@pytest.mark.parametrize("expression", [
    "'AbC-Z'.lowerAscii() == 'abc-z' && 'ab'.upperAscii() == 'AB' && ' a '.trim() == 'a'",
    "'a,b,c'.split(',') == ['a', 'b', 'c'] && 'a,b,c'.split(',', 2) == ['a', 'b,c'] && 'a'.split(',', 0) == []",
    "['a', 'b'].join('-') == 'a-b' && ['a', 'b'].join() == 'ab'",
    "'abcb'.replace('b', 'x') == 'axcx' && 'abcb'.replace('b', 'x', 1) == 'axcb'",
    "'abcb'.indexOf('b') == 1 && 'abcb'.lastIndexOf('b') == 3 && 'abc'.indexOf('z') == -1",
    "'abc'.substring(1) == 'bc' && 'abc'.substring(1, 2) == 'b' && 'abc'.charAt(3) == ''",
    "[1, 2, 3].isSorted() && [1, 2, 3].sum() == 6 && [3, 1].min() == 1 && [1, 2, 1].lastIndexOf(1) == 2",
])
def test_the_api_servers_string_and_list_functions(expression):
    outcome = run(policy(check(expression)))
    assert outcome.allowed and not outcome.errored, outcome.message


@pytest.mark.parametrize("expression", ["'abc'.substring(2, 9) == ''", "[].max() == 0", "'abc'.charAt(4) == ''",
                                        "'abc'.indexOf('a', 9) == 0", "[1].join() == ''"])
def test_their_errors_are_errors(expression):
    outcome = run(policy(check(expression)))
    assert not outcome.allowed and outcome.errored


def test_warn_admits_with_a_warning():
    outcome = run(policy(check("false", message="careful")), actions=("Warn",))
    assert outcome.allowed and outcome.warnings == ["careful"]
    outcome = run(policy(check("false", message="no")), actions=("Deny", "Warn"))
    assert not outcome.allowed and outcome.warnings == ["no"]


@pytest.mark.parametrize("p,problem", [
    (policy(check("objct.metadata.name == 'x'")), "undeclared reference to 'objct'"),
    (policy(check("has(object)")), "has() needs a field selection"),
    (policy(check("variables.a"), variables=[{"name": "a", "expression": "variables.b"},
                                            {"name": "b", "expression": "true"}]),
     "variable a: undefined field 'variables.b'"),
    (policy(check("variables.c")), "undefined field 'variables.c'"),
    (policy(check("object.metadata.name ==")), "does not parse"),
])
def test_what_the_compiler_refuses_is_listed_and_errs(p, problem):
    assert any(problem in found for found in admission_policy.problems(p)), admission_policy.problems(p)
    outcome = run(p)
    assert not outcome.allowed and outcome.errored and "fails to compile" in outcome.message


def test_comprehension_variables_are_declared():
    p = policy(check("object.spec.containers.all(c, c.name.size() > 0 && [1].exists(i, i == 1))"))
    assert admission_policy.problems(p) == []
    assert run(p).allowed


def test_a_runaway_comprehension_is_an_error():
    # The limits lowered a thousandfold, the pod's containers too: n x n iterations.
    p = policy(check("object.spec.containers.all(a, object.spec.containers.all(b, a.name != b.name || a == b))"))
    obj = copy.deepcopy(POD)
    obj["spec"]["containers"] = [{"name": f"c{i}", "image": "cuda:12"} for i in range(40)]
    fits = admission_policy.evaluate(p, binding(), request(), obj, None, LAB)
    assert fits.allowed and fits.steps > 1000
    for limits in ({"per_call_limit": 1000}, {"budget": 1000}):
        outcome = admission_policy.evaluate(p, binding(), request(), obj, None, LAB, **limits)
        assert not outcome.allowed and outcome.errored and "cost" in outcome.message, outcome
        assert outcome.steps <= 1001


def shipped_policies() -> list[tuple[str, dict]]:
    found = {}
    for folder in KUSTOMIZATIONS:
        for obj in rendering.render(folder):
            if obj["kind"] == "ValidatingAdmissionPolicy":
                found[(folder.name, obj["metadata"]["name"])] = obj
    return [(f"{folder}:{name}", obj) for (folder, name), obj in sorted(found.items())]


@pytest.mark.parametrize("name,shipped", shipped_policies(), ids=[n for n, _ in shipped_policies()])
def test_shipped_policies_compile_cleanly(name, shipped):
    assert admission_policy.problems(shipped) == []
    assert shipped["spec"].get("failurePolicy") == "Fail"


def test_a_broken_field_path_in_a_shipped_policy_denies():
    """Break: `object.spec.template` misspelt in the device-channel policy's `holder` variable.

    The evaluator that answered has() false on an error value admitted every Deployment under
    such a policy (has(variables.holder.spec) false, nothing judged); the API server fails the
    expression and, with failurePolicy Fail, denies. Checked against that evaluator: this test
    failed there (allowed) and passes here.
    """
    shipped = [o for o in rendering.render(BASE)
               if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == "gpushard-device-channels"][0]
    broken = copy.deepcopy(shipped)
    holder = next(v for v in broken["spec"]["variables"] if v["name"] == "holder")
    assert holder["expression"].endswith("object.spec.template")
    holder["expression"] = holder["expression"].replace("object.spec.template", "object.spec.templat")
    deployment = wrap("Deployment", pod_spec(container("app")))
    req = {"operation": "CREATE", "namespace": "lab", "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
           "resource": {"group": "apps", "version": "v1", "resource": "deployments"}, "userInfo": {"username": "a"}}
    objects = rendering.render(BASE)
    bind, = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
             and o["spec"]["policyName"] == shipped["metadata"]["name"]]
    # A Deployment from before, scaled: its template keeps a device channel, so the policy's matchConditions
    # let the request reach the variables, and the shipped policy allows it (nothing changed).
    deployment["spec"]["template"]["metadata"]["annotations"] = {"cdi.k8s.io/x": "nvidia.com/gpu=all"}
    old = copy.deepcopy(deployment)
    deployment["spec"]["replicas"] = 3
    req["operation"] = "UPDATE"
    assert admission_policy.evaluate(shipped, bind, req, deployment, old, LAB).allowed
    outcome = admission_policy.evaluate(broken, bind, req, deployment, old, LAB)
    assert not outcome.allowed and outcome.errored
    assert "resulted in error" in outcome.message


# Each shipped policy and the module that evaluates it on objects it admits and objects it denies.
EVALUATED_BY = {"gpushard-device-channels": "test_device_channels.py", "gpushard-opt-in": "test_opt_in_guard.py",
                "gpushard-agent-own-node": "test_agent_own_node.py", "gpushard-device-claims": "test_device_claims.py",
                "gpushard-agent-own-slice": "test_dra_overlay.py", "gpushard-dra-claims": "test_dra_claims.py",
                "gpushard-agent-own-count": "test_agent_own_count.py",
                "gpushard-certs-own-field": "test_certs_own_field.py", "gpushard-cordon-only": "test_cordon_only.py"}


def test_every_shipped_policy_is_evaluated_by_a_test_module():
    assert {shipped["metadata"]["name"] for _, shipped in shipped_policies()} == set(EVALUATED_BY)
    here = rendering.Path(__file__).parent
    for name, module in EVALUATED_BY.items():
        text = (here / module).read_text()
        assert name in text and "admission_policy.evaluate(" in text and "not outcome.errored" in text, module


def manifest_objects() -> list[tuple[str, dict]]:
    """Every Pod and pod template of tests/golden and examples/ (but unreadable.fail.yaml, whose
    spec.containers the API server's schema validation refuses before any policy sees it)."""
    root = BASE.parents[1]
    files = sorted((root / "tests/golden").glob("*.yaml")) + sorted((root / "examples").rglob("*.yaml"))
    found = []
    for path in files:
        if path.name == "unreadable.fail.yaml":
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if isinstance(doc, dict) and doc.get("kind") in RESOURCES:
                found.append((f"{path.relative_to(root)}#{i}", doc))
    return found


def test_every_manifest_object_is_judged_without_an_expression_error():
    objects = rendering.render(BASE)
    policies = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"
                and o["metadata"]["name"] in ("gpushard-opt-in", "gpushard-device-channels")]
    bindings = {o["spec"]["policyName"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"}
    found = manifest_objects()
    assert len(found) > 50 and len(policies) == 2
    # Each policy also without its matchConditions, so that its variables and validations meet every
    # object, not only those the conditions let through; the shipped one matches no more than that.
    unconditioned = []
    for shipped in policies:
        bare = copy.deepcopy(shipped)
        assert bare["spec"].pop("matchConditions")
        unconditioned.append(bare)
    for where, obj in found:
        group, resource = RESOURCES[obj["kind"]]
        for shipped, bare in zip(policies, unconditioned, strict=True):
            for labels in ({}, {names.MODE_LABEL: names.MODE_ENFORCE}):
                namespace = admission_policy.namespace_object(obj["metadata"].get("namespace", "lab"), labels)
                req = {"operation": "CREATE", "namespace": namespace["metadata"]["name"],
                       "kind": {"group": group, "version": "v1", "kind": obj["kind"]},
                       "resource": {"group": group, "version": "v1", "resource": resource},
                       "userInfo": {"username": "alice"}}
                binding = bindings[shipped["metadata"]["name"]]
                outcome = admission_policy.evaluate(bare, binding, req, obj, None, namespace)
                # The opt-in guard leaves enforce namespaces alone (its namespaceSelector): not evaluated there.
                expected = not (shipped["metadata"]["name"] == "gpushard-opt-in" and labels)
                assert outcome.matched == expected and not outcome.errored, (
                    where, shipped["metadata"]["name"], outcome.message)
                conditioned = admission_policy.evaluate(shipped, binding, req, obj, None, namespace)
                assert not conditioned.errored and conditioned.matched <= expected, (where, conditioned.message)
                # The conditions are never narrower than the validations: what they deny is still denied.
                assert outcome.allowed or not conditioned.allowed, (where, shipped["metadata"]["name"])
