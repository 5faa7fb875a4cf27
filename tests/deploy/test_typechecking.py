"""Every CEL expression gpushard ships compiles in the API server's environment, checked as strictly as it checks.

We test, with tests/deploy/typechecking.py (the API server's compiler restated):
- every expression of the base and of every overlay compiles: each ValidatingAdmissionPolicy's
  matchConditions, variables, validations and messageExpressions, the webhooks' matchConditions,
  the DeviceClass selectors; and the collector sees every one of them;
- the device-channels policy as it was (its text kept here) is refused with the API server's own
  message: `spec.variables[10].expression ... 1:39: expected type 'dyn' but found 'string'`;
- list and map literals must be homogeneous: `[[dyn, string]]`, `['a', dyn]`, a map with keys or
  values of two types are refused; lists of one type, of dyn alone, an empty list beside a typed
  one, and a mixed list inside `format` pass;
- overloads: `'a' == 1`, `1 == 1u`, `request.namespace == null`, `size(1)`, `'x'.startsWith(1)`,
  `['a'].join(1)` are refused ("found no matching overload ..."), `1 && true` too ("expected type
  'bool'"); mixed int and double comparisons, string() of dyn and the libraries' functions pass;
- undeclared references: an unknown identifier or function, `params` without paramKind,
  `variables` in a matchCondition, `authorizer` in a messageExpression, a variable read before it
  is declared, a field typed objects lack (`request.nope`, `namespaceObject.metadata.uid`);
- what each field must evaluate to: a validation exactly bool (dyn is refused), a messageExpression
  string, an audit annotation string or null, a selector bool or the unknown type;
- variables are typed by what they compile to for later expressions (a list of strings stays one,
  anything typed otherwise or a variable that failed is dyn);
- literal arguments: a bad regex, duration or timestamp is refused;
- what the checker does not model is refused, never passed: a macro it does not expand, syntax
  cel-python cannot read, a kind that carries CEL it does not know;
- errors sit where cel-go puts them (the dot of a selection, an operator, a bracket), counted
  after the trim the API server gives matchConditions.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import rendering
from tests.deploy import typechecking as tc
from tests.deploy.test_manifests import BASE, KUSTOMIZATIONS

# deploy/base/device-channels.yaml before it was fixed: the API server refused the policy (so its
# binding enforced nothing) with "spec.variables[10].expression: Invalid value: ...: compilation failed:
# ERROR: <input>:1:39: expected type 'dyn' but found 'string'".
OLD_DEVICE_CHANNEL_VARIABLES = {
    "trustedNamespaces":
        "has(params.data) && 'exemptNamespaces' in params.data ? params.data.exemptNamespaces : ''",
    "trustedServiceAccounts":
        "has(params.data) && 'exemptServiceAccounts' in params.data ? params.data.exemptServiceAccounts : ''",
    "exempt":
        "[[variables.trustedNamespaces, request.namespace], [variables.trustedServiceAccounts, request.namespace + "
        "'/' + variables.serviceAccount]].exists(t, t[0] == t[1] || t[0].startsWith(t[1] + ' ') || "
        "t[0].endsWith(' ' + t[1]) || t[0].contains(' ' + t[1] + ' '))",
}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(BASE.parents[1])))
def rendered(request):
    return rendering.render(request.param)


def test_every_shipped_expression_compiles(rendered):
    assert [str(r) for r in tc.refusals(rendered)] == []


def _cel_fields(obj: dict) -> int:
    """How many CEL expressions an object carries, counted from its fields alone."""
    spec = obj.get("spec") or {}
    if obj["kind"] == "ValidatingAdmissionPolicy":
        return (len(spec.get("matchConditions") or []) + len(spec.get("variables") or [])
                + sum(1 + bool(v.get("messageExpression")) for v in spec.get("validations") or [])
                + len(spec.get("auditAnnotations") or []))
    if obj["kind"].endswith("WebhookConfiguration"):
        return sum(len(w.get("matchConditions") or []) for w in obj.get("webhooks") or [])
    if obj["kind"] == "DeviceClass":
        return sum("cel" in s for s in spec.get("selectors") or [])
    return 0


def test_the_checker_sees_every_expression(rendered):
    seen = tc.expressions(rendered)
    assert len(seen) == sum(_cel_fields(o) for o in rendered) > 0
    assert len(seen) == len(set(seen))
    assert "ValidatingAdmissionPolicy/gpushard-device-channels spec.variables[10].expression" in seen


def test_the_dra_overlay_selectors_are_compiled():
    seen = tc.expressions(rendering.render(BASE.parent / "overlays" / "dra"))
    assert "DeviceClass/gpu.gpushard.io spec.selectors[0].cel.expression" in seen


def _device_channels() -> dict:
    objects = rendering.render(BASE)
    policy, = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"
               and o["metadata"]["name"] == "gpushard-device-channels"]
    return policy


def test_the_old_device_channel_policy_is_refused_as_the_api_server_refused_it():
    policy = copy.deepcopy(_device_channels())
    policy["spec"]["paramKind"] = {"apiVersion": "v1", "kind": "ConfigMap"}  # it read a ConfigMap then
    variables = policy["spec"]["variables"]
    for variable in variables:
        if variable["name"] in OLD_DEVICE_CHANNEL_VARIABLES:
            variable["expression"] = OLD_DEVICE_CHANNEL_VARIABLES[variable["name"]]
    assert variables[10]["name"] == "exempt"
    refused = tc.refusals([policy])
    assert [r.where for r in refused] == ["ValidatingAdmissionPolicy/gpushard-device-channels "
                                          "spec.variables[10].expression"]
    detail = refused[0].detail
    assert detail.startswith("compilation failed: ERROR: <input>:1:39: expected type 'dyn' but found 'string'\n")
    # The caret sits under the dot of request.namespace, the element cel-go names.
    assert detail.splitlines()[2] == " | " + "." * 38 + "^"
    # The second pair is refused too, at the + that makes its string.
    assert "ERROR: <input>:1:111: expected type 'dyn' but found 'string'" in detail
    # The validations that read variables.exempt still compile: a failed variable is dyn to them.
    assert all("variables[10]" in r.where for r in refused)


def test_the_shipped_device_channel_policy_types_its_pairs_as_strings():
    policy = _device_channels()
    compiled = {path: checked for path, checked, _ in tc._compiled_fields(policy)}
    names = [v["name"] for v in policy["spec"]["variables"]]
    for name in ("trustedNamespaces", "trustedServiceAccounts"):
        assert compiled[f"spec.variables[{names.index(name)}].expression"].output == tc.STRING
    assert compiled["spec.variables[10].expression"].output == tc.BOOL


ENV = tc.admission_env(params=True, authorizer=True, variables={})


def refused(text: str, env: tc.Env = ENV, returns: tuple[tc.Type, ...] | None = None) -> str:
    """The refusal's first line (the position and the reason), '' when ``text`` compiles."""
    _, refusal = tc.compile_expression(text, env, returns)
    return (refusal or "").split("\n")[0].removeprefix("compilation failed: ")


@pytest.mark.parametrize(("text", "message"), [
    ("[[params.x, request.namespace]]", "ERROR: <input>:1:20: expected type 'dyn' but found 'string'"),
    ("[params.x, 'a']", "ERROR: <input>:1:12: expected type 'dyn' but found 'string'"),
    ("['a', object.b]", "ERROR: <input>:1:13: expected type 'string' but found 'dyn'"),
    ("[1, 2.0]", "ERROR: <input>:1:5: expected type 'int' but found 'double'"),
    ("[[1], ['a']]", "ERROR: <input>:1:7: expected type 'list(int)' but found 'list(string)'"),
    ("{'a': 1, 'b': 'c'}", "ERROR: <input>:1:15: expected type 'int' but found 'string'"),
    ("{'a': 1, 2: 3}", "ERROR: <input>:1:10: expected type 'string' but found 'int'"),
    ("{'a': object.x, 'b': 'c'}", "ERROR: <input>:1:22: expected type 'dyn' but found 'string'"),
    ("dyn([1, 'a'])", "ERROR: <input>:1:9: expected type 'int' but found 'string'"),
])
def test_mixed_literals_are_refused(text, message):
    assert refused(text) == message


@pytest.mark.parametrize("text", [
    "[[string(params.x), request.namespace]]", "[object.a, object.b, params.c]", "{'a': [1], 'b': []}",
    "[[], [1]]", "[request.namespace, request.name + '/']", "'%s %d'.format(['a', 1])",
    "{'a': object.x, 'b': params.y}",
])
def test_homogeneous_literals_pass(text):
    assert refused(text) == ""


@pytest.mark.parametrize(("text", "message"), [
    ("'a' == 1", "ERROR: <input>:1:5: found no matching overload for '_==_' applied to '(string, int)'"),
    ("1 == 1u", "ERROR: <input>:1:3: found no matching overload for '_==_' applied to '(int, uint)'"),
    ("request.namespace == null",
     "ERROR: <input>:1:19: found no matching overload for '_==_' applied to '(string, null)'"),
    ("size(1)", "ERROR: <input>:1:5: found no matching overload for 'size' applied to '(int)'"),
    ("'x'.startsWith(1)", "ERROR: <input>:1:15: found no matching overload for 'startsWith' applied to 'string.(int)'"),
    ("['a'].join(1)", "ERROR: <input>:1:11: found no matching overload for 'join' applied to 'list(string).(int)'"),
    ("'a' + 1", "ERROR: <input>:1:5: found no matching overload for '_+_' applied to '(string, int)'"),
    ("true ? 1 : 'a'", "ERROR: <input>:1:6: found no matching overload for '_?_:_' applied to '(bool, int, string)'"),
    ("!1", "ERROR: <input>:1:1: found no matching overload for '!_' applied to '(int)'"),
    ("-1u", "ERROR: <input>:1:1: found no matching overload for '-_' applied to '(uint)'"),
    ("1 && true", "ERROR: <input>:1:1: expected type 'bool' but found 'int'"),
    ("request.userInfo.groups.all(g, g)", "ERROR: <input>:1:32: expected type 'bool' but found 'string'"),
    ("request.dryRun.exists(x, x)",
     "ERROR: <input>:1:8: expression of type 'bool' cannot be range of a comprehension (must be list, map, or "
     "dynamic)"),
    ("request.name.size", "ERROR: <input>:1:13: type 'string' does not support field selection"),
])
def test_wrong_overloads_are_refused(text, message):
    assert refused(text) == message


@pytest.mark.parametrize("text", [
    "1 < 2.0 && 2u > 1 && 1.5 <= 2", "string(object.x) + request.name", "object.a + object.b == params.c",
    "'a' in object.x && object.y in ['b']", "request.userInfo.extra['k'].exists(n, n == object.metadata.name)",
    "namespaceObject.metadata.labels.filter(k, k.startsWith('a')).size() == 1",
    "object.spec.containers.map(c, c.name).join(',') != ''", "type(1) == int", "sets.contains([1], [2])",
    "ip('10.0.0.1').family() == 4 && cidr('10.0.0.0/8').containsIP('10.0.0.1')",
    "quantity('1Gi').isGreaterThan(quantity('1Mi'))", "url('https://a/b').getHostname() == 'a'",
    "authorizer.group('').resource('pods').check('get').allowed()",
    "authorizer.requestResource.check('get').reason() == ''", "[3, 1].sort().isSorted() && [1].sum() == 1",
    "lists.range(2).size() == 2", "[1].all(i, v, v > i)", "{'a': 1}.transformMap(k, v, v + 1)['a'] == 2",
    "has(request.userInfo.extra) && has(object.metadata.labels)", "'abc'.indexOf('b') == [1].indexOf(1)",
    "optional.of(1).orValue(2) == 1", "semver('1.2.3').isLessThan(semver('1.3.0'))",
    "format.dns1123Label().validate('x').hasValue()", "timestamp(object.t) > timestamp('2020-01-01T00:00:00Z')",
    "duration('1h30m') > duration('90s')", "'a1'.matches('^[a-z][0-9]$')",
])
def test_correct_expressions_pass(text):
    assert refused(text) == ""


@pytest.mark.parametrize(("text", "env", "message"), [
    ("foo.bar", ENV, "ERROR: <input>:1:1: undeclared reference to 'foo' (in container '')"),
    ("nope(1)", ENV, "ERROR: <input>:1:5: undeclared reference to 'nope' (in container '')"),
    ("'a'.nope()", ENV, "ERROR: <input>:1:9: undeclared reference to 'nope' (in container '')"),
    ("params.x", tc.admission_env(params=False, authorizer=True, variables={}),
     "ERROR: <input>:1:1: undeclared reference to 'params' (in container '')"),
    ("variables.x", tc.admission_env(params=True, authorizer=True, variables=None),
     "ERROR: <input>:1:1: undeclared reference to 'variables' (in container '')"),
    ("authorizer.group('')", tc.admission_env(params=True, authorizer=False, variables={}),
     "ERROR: <input>:1:1: undeclared reference to 'authorizer' (in container '')"),
    ("variables.later", ENV, "ERROR: <input>:1:10: undefined field 'later'"),
    ("request.nope", ENV, "ERROR: <input>:1:8: undefined field 'nope'"),
    ("namespaceObject.metadata.uid", ENV, "ERROR: <input>:1:25: undefined field 'uid'"),
    ("has(request.userInfo.nope)", ENV, "ERROR: <input>:1:4: undefined field 'nope'"),
    ("has(object)", ENV, "ERROR: <input>:1:5: invalid argument to has() macro"),
    ("[1].map(x.y, x)", ENV, "ERROR: <input>:1:10: argument is not an identifier"),
    ("cel.bind(x, 1, x)", ENV, "ERROR: <input>:1:1: undeclared reference to 'cel' (in container '')"),
])
def test_undeclared_references_are_refused(text, env, message):
    assert refused(text, env) == message


def _policy(**spec) -> dict:
    base = {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]}}
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": "p"}, "spec": {**base, **spec}}


def _refusals(obj: dict) -> dict[str, str]:
    return {r.where.split(" ", 1)[1]: r.detail.split("\n")[0] for r in tc.refusals([obj])}


def test_each_field_gets_the_environment_and_the_result_the_api_server_gives_it():
    policy = _policy(
        paramKind={"apiVersion": "v1", "kind": "ConfigMap"},
        matchConditions=[{"name": "a", "expression": "  variables.names.size() > 0"},
                         {"name": "b", "expression": "params.data.x == 'y'"}],
        variables=[{"name": "names", "expression": "request.userInfo.groups.filter(g, g != '')"},
                   {"name": "user", "expression": "request.userInfo"},
                   {"name": "broken", "expression": "request.nope"},
                   {"name": "early", "expression": "variables.late"},
                   {"name": "late", "expression": "1"}],
        validations=[{"expression": "variables.names.exists(n, n.startsWith('x'))",
                      "messageExpression": "'x' + variables.names[0]"},
                     {"expression": "object.spec.enabled"},
                     {"expression": "variables.user.username == 1 && variables.broken == 1",
                      "messageExpression": "authorizer.group('') == null ? 'a' : 'b'"},
                     {"expression": "true", "messageExpression": "size(variables.names)"}],
        auditAnnotations=[{"key": "k", "valueExpression": "variables.names[0]"},
                          {"key": "l", "valueExpression": "null"},
                          {"key": "m", "valueExpression": " true"}])
    assert _refusals(policy) == {
        # matchConditions see no variables; the expression is trimmed first, so the column counts from 'v'.
        "spec.matchConditions[0].expression": "compilation failed: ERROR: <input>:1:1: undeclared reference to "
                                              "'variables' (in container '')",
        "spec.variables[2].expression": "compilation failed: ERROR: <input>:1:8: undefined field 'nope'",
        "spec.variables[3].expression": "compilation failed: ERROR: <input>:1:10: undefined field 'late'",
        "spec.validations[1].expression": "must evaluate to bool but got dyn",
        "spec.validations[2].messageExpression": "compilation failed: ERROR: <input>:1:1: undeclared reference to "
                                                 "'authorizer' (in container '')",
        "spec.validations[3].messageExpression": "must evaluate to string but got int",
        "spec.auditAnnotations[2].valueExpression": "must evaluate to one of [string null_type] but got bool",
    }


def test_variables_are_typed_by_what_they_compile_to():
    assert tc.declared_type(tc.list_of(tc.STRING)) == tc.list_of(tc.STRING)
    assert tc.declared_type(tc.map_of(tc.STRING, tc.list_of(tc.STRING))) == tc.map_of(tc.STRING, tc.list_of(tc.STRING))
    assert tc.declared_type(tc.struct("kubernetes.UserInfo")) == tc.DYN
    assert tc.declared_type(None) == tc.DYN  # a variable that failed
    policy = _policy(variables=[{"name": "names", "expression": "request.userInfo.groups"},
                                {"name": "user", "expression": "request.userInfo"}],
                     validations=[{"expression": "variables.names == 1"}, {"expression": "variables.user.x == 1"}])
    assert _refusals(policy) == {"spec.validations[0].expression": "compilation failed: ERROR: <input>:1:17: found "
                                 "no matching overload for '_==_' applied to '(list(string), int)'"}


@pytest.mark.parametrize(("text", "message"), [
    ("'a'.matches('(?=a)')", "ERROR: <input>:1:13: invalid matches argument"),
    ("'a'.matches('[')", "ERROR: <input>:1:13: invalid matches argument"),
    ("duration('1 hour') > duration('1h')", "ERROR: <input>:1:10: invalid duration argument"),
    ("timestamp('2020-13-01T00:00:00Z') == timestamp(0)", "ERROR: <input>:1:11: invalid timestamp argument"),
])
def test_bad_literal_arguments_are_refused(text, message):
    assert refused(text) == message


def test_what_the_checker_does_not_model_is_refused():
    assert refused("[2, 1].sortBy(x, x)") == "ERROR: <input>:1:14: macro sortBy() is not modelled by this checker"
    assert refused("object.metadata.?name").startswith("ERROR: <input>:1:17: Syntax error:")
    mutating = {"apiVersion": "admissionregistration.k8s.io/v1beta1", "kind": "MutatingAdmissionPolicy",
                "metadata": {"name": "m"}, "spec": {}}
    assert [str(r) for r in tc.refusals([mutating])] == [
        "MutatingAdmissionPolicy/m : MutatingAdmissionPolicy carries CEL this checker does not model"]


def test_webhook_conditions_and_device_selectors_are_compiled_in_their_environments():
    webhooks = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": "w"}, "webhooks": [{"name": "a.b", "matchConditions": [
                    {"name": "ok", "expression": "request.namespace != 'kube-system'"},
                    {"name": "params", "expression": " params.x == 'y'"},
                    {"name": "typed", "expression": "request.namespace == 1"}]}]}
    assert _refusals(webhooks) == {
        "webhooks[0].matchConditions[1].expression": "compilation failed: ERROR: <input>:1:1: undeclared reference "
                                                     "to 'params' (in container '')",
        "webhooks[0].matchConditions[2].expression": "compilation failed: ERROR: <input>:1:19: found no matching "
                                                     "overload for '_==_' applied to '(string, int)'"}
    device_class = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "d"},
                    "spec": {"selectors": [
                        {"cel": {"expression": "device.driver == 'a' && device.attributes['a'].model == 'x'"}},
                        {"cel": {"expression": "device.attributes['a'].on"}},
                        {"cel": {"expression": "device.driver"}},
                        {"cel": {"expression": "cel.bind(d, device.driver, d == 'a')"}},
                        {"cel": {"expression": "device.capacity['a'].memory.isGreaterThan(quantity('1Gi'))"}},
                        {"cel": {"expression": "request.namespace == ''"}}]}}
    assert _refusals(device_class) == {
        "spec.selectors[2].cel.expression": "must evaluate to bool or the unknown type, not string",
        "spec.selectors[5].cel.expression": "compilation failed: ERROR: <input>:1:1: undeclared reference to "
                                            "'request' (in container '')"}


@pytest.mark.parametrize(("text", "column"), [
    ("request.userInfo.nope", 17), ("object.a[request.nope]", 17), ("1 + request.nope", 12),
    ("[request.nope]", 9), ("{1: request.nope}", 12), ("object.a.exists(x, request.nope)", 27),
    ("size(request.nope)", 13), ("(request).nope", 10), ("request // comment\n  .nope", 3),
])
def test_errors_sit_where_cel_go_puts_them(text, column):
    first = refused(text)
    line = 2 if "\n" in text else 1
    assert first == f"ERROR: <input>:{line}:{column}: undefined field 'nope'"
