"""The API server's side of a ValidatingAdmissionPolicy for the tests: match, then evaluate its CEL as strictly.

The CEL is evaluated by a CEL library (cel-python), not read: what the API server would run.
Matching restates the API server's rules for what the policies in deploy/ use: resourceRules
(group, version, resource with its subresource, operation), a namespaceSelector of
matchExpressions on the namespace's labels (which always hold kubernetes.io/metadata.name;
ignored for cluster-scoped resources such as Nodes, whose namespaceObject is null), and a
binding whose validationActions say Deny or Warn; a policy with paramKind gets ``params`` from the
binding's paramRef (the object the test passes, or parameterNotFoundAction when it passes none).
The same evaluator decides whether an entry of a MutatingWebhookConfiguration is called
(``webhook_called``): its rules, namespaceSelector and matchConditions, under its failurePolicy.

Where cel-python is more forgiving than the API server (cel-go), this module follows the API
server, so that an expression the API server would fail fails here too:

- ``has(e.f)`` answers whether the map ``e`` holds the key ``f``; if ``e`` itself is an error
  (a missing field above it, a variable that failed) or not a map, ``has`` is that error.
  cel-python answers false for any error inside ``has()``; cel-go propagates it. Field
  selection of a missing field (``object.spec.nope``) is an error ("no such key"), as it is
  in both.
- A variable that fails to evaluate is an error value wherever it is read
  (staging/src/k8s.io/apiserver/pkg/admission/plugin/cel/composition.go: the lazy
  variable's callback returns ``types.NewErr("composited variable %q fails to evaluate")``).
  Errors are values: ``true || err`` is true, ``err.f`` and ``has(err.f)`` are errors, and so
  is ``err ? a : b`` (cel-python makes that a new "no matching overload" error that hides it).
- A validation whose evaluation errs, or that returns something other than a bool, is decided
  by the policy's failurePolicy: Fail (the default) denies, Ignore admits
  (staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating/validator.go,
  ``policyDecisionActionForError``). A false validation denies with its messageExpression's
  result, trimmed; if that errs, is not a string, is blank, longer than 5 KiB
  (MaxEvaluatedMessageExpressionSizeBytes) or has a line break, with its
  ``message``; else with ``failed expression: <expression>`` (same file).
- matchConditions (staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions/
  matcher.go, which validator.go calls first): any condition false skips the policy, even
  beside errors; otherwise any error is decided by failurePolicy (Fail denies, Ignore skips the
  policy); all true evaluates the validations.
- What the API server checks when it compiles, where cel-python allows: every expression
  parses; ``has()`` takes a field selection; identifiers are the admission ones (object,
  oldObject, request, params, namespaceObject, variables, authorizer) or comprehension
  variables; a variable reads only the variables declared before it, a validation only
  declared ones. An expression that fails these is an error when evaluated, as a compile
  error is in composition.go, and ``problems()`` lists them for the tests that assert the
  shipped policies have none. cel-python has no type checker against the resources' schemas,
  so a misspelt field is found only when evaluated against an object without it.
- Functions: cel-go's ext.Strings (lowerAscii, upperAscii, trim, split, join, replace,
  substring, charAt, indexOf, lastIndexOf) and Kubernetes' list library (isSorted, sum, min, max,
  indexOf, lastIndexOf), which the API server's CEL environment declares
  (staging/src/k8s.io/apiserver/pkg/cel/environment/base.go), are added to cel-python's, with
  their errors (an index out of range) as errors.
- ``authorizer``: Kubernetes' authorizer library (``authorizer.group(g).resource(r).name(n).check(verb)
  .allowed()``), answered from the grants the test says the request's user holds, as (group, resource,
  verb) triples where ``*`` stands for any; without grants the user holds none.
- Cost: cel-python does not count cel-go's cost units. Each expression's steps (one per
  evaluated syntax node and one per comprehension iteration, a coarse proxy that over-counts
  simple expressions and under-counts string and deep-equality work) are charged against the
  API server's budgets (staging/src/k8s.io/apiserver/pkg/apis/cel/config.go:
  PerCallLimit 1,000,000 per expression, RuntimeCELCostBudget 10,000,000 per policy
  evaluation, RuntimeCELCostBudgetMatchConditions 2,500,000 for its matchConditions); past them
  the evaluation is an error. ``Outcome.steps`` reports what was spent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import CELEvalError, Evaluator

NAME_LABEL = "kubernetes.io/metadata.name"
PER_CALL_LIMIT = 1_000_000
RUNTIME_COST_BUDGET = 10_000_000
MATCH_CONDITIONS_BUDGET = 2_500_000
MESSAGE_MAX_BYTES = 5 * 1024
ROOTS = frozenset({"object", "oldObject", "request", "params", "namespaceObject", "variables", "authorizer"})
COMPREHENSIONS = frozenset({"all", "exists", "exists_one", "map", "filter"})


@dataclass
class Outcome:
    matched: bool
    allowed: bool
    message: str = ""
    errored: bool = False  # decided by failurePolicy because an expression failed
    warnings: list[str] = field(default_factory=list)
    steps: int = 0


class _Meter:
    """Steps spent by one policy evaluation, against the API server's budgets."""

    def __init__(self, per_call_limit: int = PER_CALL_LIMIT, budget: int = RUNTIME_COST_BUDGET) -> None:
        self.per_call_limit, self.budget = per_call_limit, budget
        self.total = 0
        self.call = 0
        self.exceeded = ""

    def charge(self) -> None:
        self.total += 1
        self.call += 1
        if self.call > self.per_call_limit:
            self.exceeded = f"operation cancelled: actual cost limit exceeded (per call {self.per_call_limit})"
        elif self.total > self.budget:
            self.exceeded = f"validation failed due to running out of cost budget ({self.budget})"
        if self.exceeded:
            raise _OutOfBudget(self.exceeded)


class _OutOfBudget(BaseException):
    """Ends an evaluation at once: cel-python turns an Exception inside its functions into error
    values (whose messages, nested by all() and exists(), grow without bound) and logs it."""


def _selection(tree: lark.Tree) -> lark.Tree | None:
    """The member_dot inside has(...)'s argument, through the grammar's one-child wrappers."""
    while isinstance(tree, lark.Tree):
        if tree.data == "member_dot":
            return tree
        subtrees = [c for c in tree.children if isinstance(c, lark.Tree)]
        if len(tree.children) != 1 or len(subtrees) != 1:
            return None
        tree = subtrees[0]
    return None


class _StrictEvaluator(Evaluator):
    """cel-python's evaluator with cel-go's has() and ternary, and a step meter."""

    def __init__(self, ast: lark.Tree, activation, meter: _Meter) -> None:
        super().__init__(ast, activation)
        self.meter = meter

    def sub_evaluator(self, ast: lark.Tree) -> Evaluator:
        return _StrictEvaluator(ast, self.activation, self.meter)

    def evaluate(self, context=None):
        self.meter.charge()
        return super().evaluate(context)

    def visit_children(self, tree: lark.Tree):
        self.meter.charge()
        return super().visit_children(tree)

    def expr(self, tree: lark.Tree):
        # cel-python turns an error in a ternary's condition into a new "no matching overload"
        # error that hides it; cel-go returns the condition's error itself.
        if len(tree.children) != 3:
            return super().expr(tree)
        self.meter.charge()
        condition = self.visit(tree.children[0])
        if isinstance(condition, CELEvalError):
            return condition
        if not _is_bool(condition):
            return CELEvalError(f"no matching overload for _?_:_ on a {type(condition).__name__} condition")
        return self.visit(tree.children[1] if condition else tree.children[2])

    def macro_has_eval(self, exprlist: lark.Tree) -> celtypes.BoolType | CELEvalError:
        selection = _selection(exprlist)
        if selection is None:
            return CELEvalError("invalid argument to has() macro")
        operand_tree, name = selection.children
        operand = self.visit(operand_tree)
        if isinstance(operand, CELEvalError):
            return operand
        if isinstance(operand, celtypes.MapType):
            return celtypes.BoolType(celtypes.StringType(name.value) in operand)
        return CELEvalError(f"has() of field {name.value!r} on {type(operand).__name__}, not a map or object")


class _Expression:
    """One compiled expression, with what the API server's compiler would have refused."""

    def __init__(self, text: str, visible_variables: set[str]) -> None:
        self.text = text
        self.problems: list[str] = []
        self.ast = None
        try:
            self.ast = _ENV.compile(text)
        except celpy.CELParseError as exc:
            self.problems.append(f"does not parse: {exc}")
            return
        self.problems.extend(_static_problems(self.ast, visible_variables))

    def evaluate(self, activation: dict, meter: _Meter):
        """The value, or the CELEvalError the API server would have got."""
        if self.problems:
            return CELEvalError(f"expression {self.text!r} fails to compile: {'; '.join(self.problems)}")
        meter.call = 0
        if meter.total <= meter.budget:
            meter.exceeded = ""  # a per-call limit holds for one expression only
        runner = _ENV.program(self.ast, functions=_K8S_FUNCTIONS)
        runner.meter = meter
        try:
            return runner.evaluate(activation)
        except CELEvalError as exc:
            return exc
        except _OutOfBudget as exc:
            return CELEvalError(str(exc))


def _static_problems(ast: lark.Tree, visible_variables: set[str]) -> list[str]:
    problems = []
    bound = set()
    for node in ast.iter_subtrees():
        if node.data == "member_dot_arg" and str(node.children[1]) in COMPREHENSIONS:
            args = node.children[2]
            first = args.children[0] if isinstance(args, lark.Tree) and args.children else None
            found = list(first.find_data("ident")) if isinstance(first, lark.Tree) else []
            bound.update(str(i.children[0]) for i in found[:1])
    for node in ast.iter_subtrees():
        if node.data == "ident_arg" and str(node.children[0]) == "has":
            if _selection(node.children[1]) is None:
                problems.append("has() needs a field selection")
        if node.data == "primary" and isinstance(node.children[0], lark.Tree) and node.children[0].data == "ident":
            name = str(node.children[0].children[0])
            if name not in ROOTS and name not in bound:
                problems.append(f"undeclared reference to {name!r}")
        if node.data == "member_dot":
            operand, name = node.children
            inner = _selection_root(operand)
            if inner == "variables" and str(name) not in visible_variables:
                problems.append(f"undefined field 'variables.{name}'")
    return problems


def _selection_root(tree: lark.Tree) -> str | None:
    """The identifier a bare `member` names (member -> primary -> ident), else None."""
    if tree.data == "member" and len(tree.children) == 1 and isinstance(tree.children[0], lark.Tree):
        primary = tree.children[0]
        if primary.data == "primary" and isinstance(primary.children[0], lark.Tree) and \
                primary.children[0].data == "ident":
            return str(primary.children[0].children[0])
    return None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise CELEvalError(message)


def _ascii(text: str, upper: bool) -> celtypes.StringType:
    low, high, shift = ("a", "z", -32) if upper else ("A", "Z", 32)
    return celtypes.StringType("".join(chr(ord(c) + shift) if low <= c <= high else c for c in text))


def _index_of(target, item, start=None):
    if isinstance(target, str):
        start = 0 if start is None else int(start)
        _check(0 <= start <= len(target), f"index out of range: {start}")
        return celtypes.IntType(target.find(item, start))
    _check(start is None, "no such overload: list.indexOf(item, start)")
    return celtypes.IntType(next((i for i, x in enumerate(target) if x == item), -1))


def _last_index_of(target, item, end=None):
    if isinstance(target, str):
        end = len(target) if end is None else int(end)
        _check(0 <= end <= len(target), f"index out of range: {end}")
        return celtypes.IntType(target.rfind(item, 0, end + len(item)))
    _check(end is None, "no such overload: list.lastIndexOf(item, end)")
    return celtypes.IntType(max((i for i, x in enumerate(target) if x == item), default=-1))


def _split(text, separator, limit=None):
    limit = -1 if limit is None else int(limit)
    if limit == 0:
        return celtypes.ListType([])
    if separator == "":
        parts = list(text)
        if limit > 0 and len(parts) > limit:
            parts = parts[:limit - 1] + ["".join(parts[limit - 1:])]
    else:
        parts = text.split(separator, limit - 1 if limit > 0 else -1)
    return celtypes.ListType([celtypes.StringType(p) for p in parts])


def _substring(text, start, end=None):
    start, end = int(start), len(text) if end is None else int(end)
    _check(0 <= start <= end <= len(text), f"index out of range: substring({start}, {end}) of {len(text)}")
    return celtypes.StringType(text[start:end])


def _char_at(text, index):
    index = int(index)
    _check(0 <= index <= len(text), f"index out of range: {index}")
    return celtypes.StringType(text[index:index + 1])


def _replace(text, old, new, limit=None):
    return celtypes.StringType(text.replace(old, new, -1 if limit is None else int(limit)))


def _join(items, separator=""):
    _check(all(isinstance(x, str) for x in items), "join: a list of strings only")
    return celtypes.StringType(separator.join(items))


def _is_sorted(items):
    return celtypes.BoolType(all(a <= b for a, b in zip(items, items[1:], strict=False)))


def _extreme(pick):
    def function(items):
        _check(len(items) > 0, f"{pick.__name__}(list) of an empty list")
        return pick(items)
    return function


@dataclass(frozen=True)
class Authorizer:
    """``authorizer`` for one request's user: what RBAC grants it, as (group, resource, verb) triples."""

    grants: frozenset = frozenset()
    group: str = ""
    resource: str = ""

    def allows(self, verb: str) -> bool:
        return any(g in (self.group, "*") and r in (self.resource, "*") and v in (verb, "*")
                   for g, r, v in self.grants)


@dataclass(frozen=True)
class _Decision:
    allowed: bool


_AUTHORIZER_FUNCTIONS = {
    "group": lambda a, g: Authorizer(a.grants, str(g), a.resource),
    "resource": lambda a, r: Authorizer(a.grants, a.group, str(r)),
    "name": lambda a, _n: a,
    "check": lambda a, verb: _Decision(a.allows(str(verb))),
    "allowed": lambda d: celtypes.BoolType(d.allowed),
}


# The string functions of cel-go's ext.Strings and the list functions of Kubernetes' CEL library,
# which the API server's environment declares and cel-python lacks.
_K8S_FUNCTIONS = {
    "lowerAscii": lambda s: _ascii(s, upper=False), "upperAscii": lambda s: _ascii(s, upper=True),
    "trim": lambda s: celtypes.StringType(s.strip()), "split": _split, "join": _join, "replace": _replace,
    "substring": _substring, "charAt": _char_at, "indexOf": _index_of, "lastIndexOf": _last_index_of,
    "isSorted": _is_sorted, "sum": lambda items: sum(items[1:], items[0]) if items else celtypes.IntType(0),
    "min": _extreme(min), "max": _extreme(max), **_AUTHORIZER_FUNCTIONS,
}


class _StrictRunner(celpy.InterpretedRunner):
    meter: _Meter

    def evaluate(self, context):
        return _StrictEvaluator(self.ast, self.new_activation(), self.meter).evaluate(context)


_ENV = celpy.Environment(runner_class=_StrictRunner)


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
    def has(field_name: str, value: str) -> bool:
        listed = rule.get(field_name) or []
        return "*" in listed or value in listed
    return (has("apiGroups", group) and has("apiVersions", version) and has("resources", resource)
            and has("operations", operation))


def matches(policy: dict, request: dict, namespace: dict | None) -> bool:
    """matchConstraints alone (matchConditions are CEL, evaluated by evaluate)."""
    constraints = policy["spec"]["matchConstraints"]
    # A namespaceSelector does not apply to cluster-scoped objects (there is no namespace).
    if namespace is not None and not _selector_matches(constraints.get("namespaceSelector"),
                                                       namespace["metadata"]["labels"]):
        return False
    resource = request["resource"]
    # A subresource is matched as "resource/subresource" (resourceclaims/status).
    name = resource["resource"] + (f"/{request['subResource']}" if request.get("subResource") else "")
    return any(_rule_matches(rule, resource["group"], resource["version"], name, request["operation"])
               for rule in constraints["resourceRules"])


@dataclass
class Compiled:
    """A policy's expressions compiled once, as the API server does when the policy is created."""

    policy: dict
    variables: list[tuple[str, _Expression]]
    conditions: list[tuple[str, _Expression]]
    validations: list[tuple[dict, _Expression, _Expression | None]]

    @property
    def failure_policy(self) -> str:
        return self.policy["spec"].get("failurePolicy", "Fail")


def compile_policy(policy: dict) -> Compiled:
    key = json.dumps(policy["spec"], sort_keys=True)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(policy)
    return _COMPILED[key]


_COMPILED: dict[str, Compiled] = {}


def _compile(policy: dict) -> Compiled:
    spec = policy["spec"]
    declared: set[str] = set()
    variables = []
    for variable in spec.get("variables") or []:
        variables.append((variable["name"], _Expression(variable["expression"], set(declared))))
        declared.add(variable["name"])
    # matchConditions see no variables in the API server's compositions for them.
    conditions = [(c["name"], _Expression(c["expression"], set())) for c in spec.get("matchConditions") or []]
    validations = []
    for validation in spec.get("validations") or []:
        message = validation.get("messageExpression")
        validations.append((validation, _Expression(validation["expression"], declared),
                            _Expression(message, declared) if message is not None else None))
    return Compiled(policy, variables, conditions, validations)


def problems(policy: dict) -> list[str]:
    """What the API server's compiler would refuse in this policy's expressions, one line each."""
    compiled = compile_policy(policy)
    found = [f"variable {name}: {p}" for name, e in compiled.variables for p in e.problems]
    found += [f"matchCondition {name}: {p}" for name, e in compiled.conditions for p in e.problems]
    for validation, expression, message in compiled.validations:
        found += [f"validation {validation['expression']!r}: {p}" for p in expression.problems]
        found += [f"messageExpression {message.text!r}: {p}" for p in (message.problems if message else [])]
    return found


def _message(validation: dict, message: _Expression | None, activation: dict, meter: _Meter) -> str:
    if message is not None:
        value = message.evaluate(activation, meter)
        text = value.strip() if isinstance(value, str) else ""
        if text and "\n" not in text and len(text.encode()) <= MESSAGE_MAX_BYTES:
            return str(text)
    if validation.get("message", "").strip():
        return validation["message"].strip()
    return f"failed expression: {validation['expression'].strip()}"


def shipped(objects: list[dict], name: str) -> tuple[dict, dict]:
    """The ValidatingAdmissionPolicy ``name`` among rendered ``objects``, and its one binding."""
    policy, = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == name]
    binding, = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                and o["spec"]["policyName"] == name]
    return policy, binding


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


def evaluate(policy: dict, binding: dict, request: dict, obj: dict | None, old: dict | None,
             namespace: dict | None, params: dict | None = None, per_call_limit: int = PER_CALL_LIMIT,
             budget: int = RUNTIME_COST_BUDGET, grants: frozenset = frozenset()) -> Outcome:
    """Whether the API server admits ``obj`` under this policy and binding, and its message if not.

    The limits are the API server's; a test lowers them to exercise them without a huge object.
    """
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    actions = set(binding["spec"]["validationActions"])
    assert actions and actions <= {"Deny", "Warn", "Audit"}, actions
    if not matches(policy, request, namespace):
        return Outcome(matched=False, allowed=True)
    params, missing = _params(policy, binding, params)
    if missing is not None:
        return missing
    compiled = compile_policy(policy)
    meter = _Meter(per_call_limit, budget)
    conditions_meter = _Meter(per_call_limit, min(budget, MATCH_CONDITIONS_BUDGET))
    activation: dict = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old),
                        "request": celpy.json_to_cel(request), "namespaceObject": celpy.json_to_cel(namespace),
                        "authorizer": Authorizer(frozenset(grants))}
    if params is not None:
        activation["params"] = celpy.json_to_cel(params)

    def decided(allowed: bool, message: str, errored: bool) -> Outcome:
        if allowed:
            return Outcome(True, True, "", errored, steps=meter.total + conditions_meter.total)
        warnings = [message] if "Warn" in actions else []
        return Outcome(True, "Deny" not in actions, message, errored, warnings, meter.total + conditions_meter.total)

    # matchConditions: any false skips; otherwise an error goes to failurePolicy. They have a budget of their own.
    errors = []
    for name, condition in compiled.conditions:
        value = condition.evaluate(activation, conditions_meter)
        if isinstance(value, CELEvalError) or not _is_bool(value):
            errors.append(f"matchCondition {name!r}: {_describe(value)}")
        elif not value:
            return Outcome(matched=False, allowed=True, steps=conditions_meter.total)
    if errors:
        if compiled.failure_policy == "Ignore":
            return Outcome(matched=False, allowed=True, errored=True, steps=conditions_meter.total)
        return decided(False, "; ".join(errors), True)

    # Variables, each seeing those before it; one that fails is an error value where it is read.
    variables: dict = {}
    for name, expression in compiled.variables:
        activation["variables"] = celtypes.MapType(variables)
        value = expression.evaluate(activation, meter)
        if isinstance(value, CELEvalError):
            value = CELEvalError(f"composited variable {name!r} fails to evaluate: {value}")
        variables[celtypes.StringType(name)] = value
    activation["variables"] = celtypes.MapType(variables)

    for validation, expression, message in compiled.validations:
        value = expression.evaluate(activation, meter)
        if isinstance(value, CELEvalError) or not _is_bool(value):
            if compiled.failure_policy == "Ignore":
                continue
            return decided(False, f"expression {validation['expression'].strip()!r} resulted in error: "
                                  f"{_describe(value)}", True)
        if not value:
            return decided(False, _message(validation, message, activation, meter), False)
    return Outcome(True, True, steps=meter.total + conditions_meter.total)


def _is_bool(value) -> bool:
    return isinstance(value, (bool, celtypes.BoolType))


def _describe(value) -> str:
    if isinstance(value, CELEvalError):
        return str(value.args[0]) if value.args else repr(value)
    return f"no matching overload: expected bool, got {type(value).__name__}"


# --- a MutatingWebhookConfiguration's entry: is it called? ----------------------------------------

def _webhook_conditions(hook: dict) -> list[tuple[str, _Expression]]:
    key = json.dumps(hook.get("matchConditions") or [], sort_keys=True)
    if key not in _WEBHOOK_CONDITIONS:
        # A webhook's matchConditions see object, oldObject, request and authorizer, and no variables.
        _WEBHOOK_CONDITIONS[key] = [(c["name"], _Expression(c["expression"], set()))
                                    for c in hook.get("matchConditions") or []]
    return _WEBHOOK_CONDITIONS[key]


_WEBHOOK_CONDITIONS: dict[str, list[tuple[str, _Expression]]] = {}


def webhook_problems(hook: dict) -> list[str]:
    """What the API server's compiler would refuse in this webhook entry's matchConditions."""
    return [f"matchCondition {name}: {p}" for name, e in _webhook_conditions(hook) for p in e.problems]


def webhook_called(hook: dict, request: dict, obj: dict | None, old: dict | None, namespace: dict) -> Outcome:
    """Whether the API server calls this entry of a MutatingWebhookConfiguration for the request.

    Its rules and namespaceSelector as for a policy; then its matchConditions as the API server's
    matcher evaluates them (staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions/
    matcher.go): any false skips the entry, even beside errors; otherwise an error is decided by
    failurePolicy: Fail refuses the request (``allowed`` False, ``errored``), Ignore skips the entry.
    ``matched`` says the webhook is called; what it answers is the webhook's own business.
    """
    if not _selector_matches(hook.get("namespaceSelector"), namespace["metadata"]["labels"]):
        return Outcome(matched=False, allowed=True)
    if not _selector_matches(hook.get("objectSelector"), ((obj or {}).get("metadata") or {}).get("labels") or {}):
        return Outcome(matched=False, allowed=True)
    resource = request["resource"]
    name = resource["resource"] + (f"/{request['subResource']}" if request.get("subResource") else "")
    if not any(_rule_matches(rule, resource["group"], resource["version"], name, request["operation"])
               for rule in hook["rules"]):
        return Outcome(matched=False, allowed=True)
    meter = _Meter(PER_CALL_LIMIT, MATCH_CONDITIONS_BUDGET)
    activation = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel(request)}
    errors = []
    for name, condition in _webhook_conditions(hook):
        value = condition.evaluate(activation, meter)
        if isinstance(value, CELEvalError) or not _is_bool(value):
            errors.append(f"matchCondition {name!r}: {_describe(value)}")
        elif not value:
            return Outcome(matched=False, allowed=True, steps=meter.total)
    if errors:
        if hook.get("failurePolicy", "Fail") == "Ignore":
            return Outcome(matched=False, allowed=True, errored=True, steps=meter.total)
        return Outcome(matched=False, allowed=False, message="; ".join(errors), errored=True, steps=meter.total)
    return Outcome(matched=True, allowed=True, steps=meter.total)
