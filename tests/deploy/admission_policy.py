"""The API server's side of a ValidatingAdmissionPolicy, for the tests: match, then evaluate its CEL.

The CEL is evaluated by a CEL library (cel-python), not read: what the API server would run.
Matching restates the API server's rules for what the policies in deploy/ use: resourceRules
(group, version, resource or resource/subresource, operation), a namespaceSelector of matchExpressions on the
namespace's labels (which always hold kubernetes.io/metadata.name), and a binding with
validationActions [Deny]; a policy with paramKind gets `params` from the binding's paramRef
(the object the test passes, or parameterNotFoundAction when it passes none). Variables are
evaluated in order, each seeing those before it; an expression that fails is an error, which
failurePolicy Fail turns into a denial.
"""

from __future__ import annotations

from dataclasses import dataclass

import celpy

NAME_LABEL = "kubernetes.io/metadata.name"
_ENV = celpy.Environment()


@dataclass
class Outcome:
    matched: bool
    allowed: bool
    message: str = ""


def _compiled(expression: str):
    return _ENV.program(_ENV.compile(expression))


def namespace_object(name: str, labels: dict[str, str] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {NAME_LABEL: name, **(labels or {})}}}


def _selector_matches(selector: dict | None, labels: dict[str, str]) -> bool:
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _rule_matches(rule: dict, group: str, version: str, resource: str, operation: str) -> bool:
    def has(field: str, value: str) -> bool:
        listed = rule.get(field) or []
        return "*" in listed or value in listed
    return (has("apiGroups", group) and has("apiVersions", version) and has("resources", resource)
            and has("operations", operation))


def matches(policy: dict, request: dict, namespace: dict) -> bool:
    constraints = policy["spec"]["matchConstraints"]
    if not _selector_matches(constraints.get("namespaceSelector"), namespace["metadata"]["labels"]):
        return False
    resource = request["resource"]
    # A subresource is matched as "resource/subresource" (resourceclaims/status).
    name = resource["resource"] + (f"/{request['subResource']}" if request.get("subResource") else "")
    return any(_rule_matches(rule, resource["group"], resource["version"], name, request["operation"])
               for rule in constraints["resourceRules"])


def _params(policy: dict, binding: dict, params: dict | None) -> tuple[dict | None, Outcome | None]:
    """The object ``params`` stands for, or the outcome when the binding's paramRef finds none."""
    kind = policy["spec"].get("paramKind")
    if kind is None:
        assert params is None, "a policy without paramKind gets no params"
        return None, None
    ref = binding["spec"]["paramRef"]
    if params is None:
        if ref.get("parameterNotFoundAction", "Allow") == "Deny":
            return None, Outcome(True, False, f"no params object {ref.get('namespace')}/{ref['name']}")
        return None, Outcome(True, True)
    assert (params["apiVersion"], params["kind"]) == (kind["apiVersion"], kind["kind"])
    assert (params["metadata"]["name"], params["metadata"].get("namespace")) == (ref["name"], ref.get("namespace"))
    return params, None


def evaluate(policy: dict, binding: dict, request: dict, obj: dict, old: dict | None, namespace: dict,
             params: dict | None = None) -> Outcome:
    """Whether the API server admits ``obj`` under this policy and binding, and its message if not."""
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    if not matches(policy, request, namespace):
        return Outcome(matched=False, allowed=True)
    params, missing = _params(policy, binding, params)
    if missing is not None:
        return missing
    spec = policy["spec"]
    activation = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel(request), "namespaceObject": celpy.json_to_cel(namespace)}
    if params is not None:
        activation["params"] = celpy.json_to_cel(params)
    variables: dict = {}
    for variable in spec.get("variables") or []:
        activation["variables"] = celpy.celtypes.MapType(variables)
        try:
            variables[celpy.celtypes.StringType(variable["name"])] = _compiled(variable["expression"]).evaluate(
                activation)
        except celpy.CELEvalError as exc:
            variables[celpy.celtypes.StringType(variable["name"])] = exc
    activation["variables"] = celpy.celtypes.MapType(variables)
    for validation in spec["validations"]:
        try:
            result = _compiled(validation["expression"]).evaluate(activation)
        except celpy.CELEvalError as exc:
            assert spec["failurePolicy"] == "Fail"
            return Outcome(True, False, f"expression error: {exc}")
        if isinstance(result, celpy.CELEvalError):
            return Outcome(True, False, f"expression error: {result}")
        if not bool(result):
            message = validation.get("message", "")
            if "messageExpression" in validation:
                message = str(_compiled(validation["messageExpression"]).evaluate(activation))
            return Outcome(True, False, message)
    return Outcome(True, True)
