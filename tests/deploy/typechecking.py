"""The API server's CEL compiler for the tests: every shipped expression type-checked as kube-apiserver does first.

tests/deploy/admission_policy.py evaluates CEL with cel-python, which has no type checker: an
expression the API server refuses when a policy is created (and then never stores, so its
binding enforces nothing) passed there. This module restates, in its own code, what the API
server's compiler does before it keeps an expression, and fails closed on anything it does not
know (an undeclared identifier, function, overload, macro or syntax is an error here too).

Sources (Kubernetes' vendored copies; names and signatures are taken from them, the code is ours):

- cel-go's checker (github.com/google/cel-go/checker/checker.go, types.go, mapping.go, errors.go,
  format.go): identifiers, field selection (maps give their value type, typed objects their
  declared field or "undefined field"), calls (a namespaced name such as ``sets.contains`` first,
  then a receiver call), overload resolution (every overload whose arguments are assignable
  matches; the first one's result type is the call's, several with different results give dyn;
  ``&&`` and ``||`` report each non-bool argument instead), type parameters bound by unification
  (``internalIsAssignable``, ``isValidTypeSubstitution``, ``mostGeneral``, the occurs check),
  list and map literals joined to their most general element type (dyn when they disagree: the
  checker's own homogeneity option is off), comprehensions, and at the end every unbound type
  parameter made dyn. Error texts and positions are cel-go's: ``ERROR: <input>:line:column: ...``
  at the operator of a call, the dot of a selection, the bracket of a literal or index, with the
  source line and a caret under it.
- cel-go's parser macros (parser/macro.go, ext/comprehensions.go, ext/bindings.go), expanded as
  it expands them: has, all, exists, exists_one, map, filter, the two-variable all, exists,
  existsOne, transformList, transformMap, transformMapEntry, and cel.bind where DRA declares it.
- cel-go's AST validators (cel/validator.go) that Kubernetes turns on
  (staging/src/k8s.io/apiserver/pkg/cel/environment/base.go): homogeneous aggregate literals
  (every element of a list literal, every key and every value of a map literal, must have an
  *equivalent* type: dyn is not equivalent to string; literals inside ``format`` calls are
  exempt, as ext.Strings configures), and literal arguments of ``duration``, ``timestamp`` and
  ``matches`` (a Go duration, an RFC 3339 time, an RE2 pattern: RE2 is approximated by Python's
  ``re`` without look-around or back-references).
- The declarations of that environment at the compatibility version of a 1.36 API server (1.35):
  cel-go's standard library (common/stdlib/standard.go) with cross-type numeric comparisons,
  optional types, ext.Strings v2, ext.Sets, ext.Lists v3, and Kubernetes' libraries
  (staging/src/k8s.io/apiserver/pkg/cel/library/: urls, regex, lists, authz with selectors,
  quantity, ip, cidr, format, semver v1).
- The variables an admission expression sees (staging/src/k8s.io/apiserver/pkg/admission/plugin/cel/
  compile.go, composition.go; pkg/apis/admissionregistration/validation/validation.go): ``object``,
  ``oldObject`` and ``params`` (only with paramKind) are dyn; ``request`` is the typed
  ``kubernetes.AdmissionRequest`` and ``namespaceObject`` the typed ``kubernetes.Namespace``;
  ``authorizer`` (not in messageExpressions); ``variables``, an object whose fields are the
  earlier variables' output types (lists and maps kept, primitives kept, anything else dyn, and
  dyn for a variable that failed). matchConditions (of policies and of webhooks) see no
  ``variables``. Return types: validations and matchConditions exactly bool, messageExpressions
  string, audit annotations string or null, variables anything. matchConditions and audit
  annotation values are trimmed before they are compiled, as the API server does, which moves
  the columns. DeviceClass and claim selectors are compiled in DRA's environment
  (staging/src/k8s.io/dynamic-resource-allocation/cel/compile.go): ``device`` with driver,
  attributes and capacity, bool or the unknown type.

What it does not check: cost. The API server does not estimate a ValidatingAdmissionPolicy's
cost when it stores it (compile.go); at run time its limits (PerCallLimit and the budgets of
staging/src/k8s.io/apiserver/pkg/apis/cel/config.go) are charged by admission_policy.py's step
meter. DRA's static cost estimate for selectors is not made here. Nor: the format library's
check of constant format strings, ``sortBy``/``optMap``/``optFlatMap`` (refused here as unknown
macros), the ``?.`` and ``[?`` syntax and message construction (which cel-python's parser cannot
read: refused as a parse error), the schema-based warnings of status.typeChecking, and objects
of kinds that carry CEL this module does not model (refused, not skipped).
"""

from __future__ import annotations

import codecs
import datetime
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import celpy
import lark

# --- Types, as cel-go's common/types represents them ---------------------------------------


@dataclass(frozen=True)
class Type:
    """A CEL type: ``kind`` decides how it is checked, ``name`` is its runtime type name."""

    kind: str  # bool bytes double int string uint null dyn any duration timestamp type list map struct
    #            opaque param error
    name: str
    params: tuple[Type, ...] = ()

    def __str__(self) -> str:
        return format_type(self)


BOOL, BYTES, DOUBLE = Type("bool", "bool"), Type("bytes", "bytes"), Type("double", "double")
INT, STRING, UINT = Type("int", "int"), Type("string", "string"), Type("uint", "uint")
NULL = Type("null", "null_type")
DYN = Type("dyn", "dyn")
ANY = Type("any", "google.protobuf.Any")
DURATION = Type("duration", "google.protobuf.Duration")
TIMESTAMP = Type("timestamp", "google.protobuf.Timestamp")
TYPE = Type("type", "type")
ERROR = Type("error", "*error*")


def list_of(elem: Type) -> Type:
    return Type("list", "list", (elem,))


def map_of(key: Type, value: Type) -> Type:
    return Type("map", "map", (key, value))


def type_of(t: Type) -> Type:
    return Type("type", "type", (t,))


def optional_of(t: Type) -> Type:
    return Type("opaque", "optional_type", (t,))


def struct(name: str) -> Type:
    return Type("struct", name)


def param(name: str) -> Type:
    return Type("param", name)


_DISPLAY = {"any": "any", "duration": "duration", "error": "!error!", "null": "null", "timestamp": "timestamp"}


def format_type(t: Type) -> str:
    """cel-go's FormatCELType: what its error messages call a type (``list(string)``, ``null``)."""
    if t.kind in _DISPLAY:
        return _DISPLAY[t.kind]
    if t.kind == "param" or not t.params:
        return t.name
    return f"{t.name}({', '.join(format_type(p) for p in t.params)})"


def type_string(t: Type) -> str:
    """A cel-go Type's String(): what "must evaluate to ... but got ..." says (``null_type``)."""
    if t.kind == "param":
        return f"<{t.name}>"
    if not t.params:
        return t.name
    return f"{t.name}({', '.join(type_string(p) for p in t.params)})"


def equivalent(a: Type, b: Type) -> bool:
    """cel-go's IsEquivalentType: exact, except that type parameters' names do not count."""
    if a.kind != b.kind or len(a.params) != len(b.params):
        return False
    if a.kind != "param" and a.name != b.name:
        return False
    return all(equivalent(p, q) for p, q in zip(a.params, b.params, strict=True))


def _is_dyn(t: Type) -> bool:
    return t.kind in ("dyn", "any")


def _is_dyn_or_error(t: Type) -> bool:
    return t.kind in ("dyn", "any", "error")


def _accepts(to: Type, source: Type) -> bool:
    """cel-go's defaultIsAssignableType: ``to`` is dynamic, or the same type with assignable parameters."""
    if to == source or to.kind in ("dyn", "any", "param"):
        return True
    if to.kind != source.kind or to.name != source.name or len(to.params) != len(source.params):
        return False
    return all(_accepts(p, q) for p, q in zip(to.params, source.params, strict=True))


class _Mapping:
    """Type parameter substitutions, keyed as cel-go keys them (by the formatted type)."""

    def __init__(self, items: dict[str, Type] | None = None) -> None:
        self.items = dict(items or {})

    def find(self, t: Type) -> Type | None:
        return self.items.get(format_type(t))

    def add(self, source: Type, to: Type) -> None:
        self.items[format_type(source)] = to

    def copy(self) -> _Mapping:
        return _Mapping(self.items)


_NULLABLE = frozenset({"opaque", "struct", "any", "duration", "timestamp"})
_SIMPLE = frozenset({"bool", "bytes", "double", "int", "string", "uint", "any", "duration", "timestamp", "struct"})


def _assignable(m: _Mapping, t1: Type, t2: Type) -> bool:
    """cel-go's internalIsAssignable: whether ``t1`` may stand where ``t2`` is expected, binding parameters in ``m``."""
    if t2.kind == "param":
        valid, known = _valid_substitution(m, t1, t2)
        if valid:
            return True
        if known:
            return False
    if t1.kind == "param":
        return _valid_substitution(m, t2, t1)[0]
    if _is_dyn_or_error(t1) or _is_dyn_or_error(t2):
        return True
    if t1.kind == "null":
        return t2.kind in _NULLABLE or _accepts(t2, NULL)
    if t2.kind == "null":
        return t1.kind in _NULLABLE or _accepts(t1, NULL)
    if t1.kind in _SIMPLE:
        return _accepts(t2, t1)
    if t1.kind == "type":
        return t2.kind == "type"
    if t1.kind in ("opaque", "list", "map"):
        return t1.kind == t2.kind and t1.name == t2.name and _assignable_all(m, t1.params, t2.params)
    return False


def _assignable_all(m: _Mapping, l1: Iterable[Type], l2: Iterable[Type]) -> bool:
    l1, l2 = list(l1), list(l2)
    return len(l1) == len(l2) and all(_assignable(m, a, b) for a, b in zip(l1, l2, strict=True))


def _valid_substitution(m: _Mapping, t1: Type, t2: Type) -> tuple[bool, bool]:
    """cel-go's isValidTypeSubstitution: whether ``t2`` (a parameter) may be ``t1``, and whether it was bound."""
    if t1 == t2:
        return True, True
    bound = m.find(t2)
    if bound is not None:
        if t1 == bound:
            return True, True
        if _assignable(m, t1, bound):
            general = _most_general(t1, bound)
            if _not_within(m, t2, general):
                m.add(t2, general)
            return True, True
        return False, True
    if _not_within(m, t2, t1):
        m.add(t2, t1)
        return True, False
    return False, False


def _not_within(m: _Mapping, t: Type, within: Type) -> bool:
    """The occurs check: ``t`` does not appear in ``within``, through the substitutions too."""
    if t == within:
        return False
    if within.kind == "param":
        bound = m.find(within)
        return bound is None or _not_within(m, t, bound)
    if within.kind in ("opaque", "list", "map", "type"):
        return all(_not_within(m, t, p) for p in within.params)
    return True


def _less_specific(t1: Type, t2: Type) -> bool:
    """cel-go's isEqualOrLessSpecific."""
    if _is_dyn(t1) or t1.kind == "param":
        return True
    if _is_dyn(t2) or t2.kind == "param":
        return False
    if t1.kind != t2.kind:
        return False
    if t1.kind == "opaque":
        return (t1.name == t2.name and len(t1.params) == len(t2.params)
                and all(_less_specific(p, q) for p, q in zip(t1.params, t2.params, strict=True)))
    if t1.kind in ("list", "map"):
        return all(_less_specific(p, q) for p, q in zip(t1.params, t2.params, strict=True))
    if t1.kind == "type":
        return True
    return t1 == t2


def _most_general(t1: Type, t2: Type) -> Type:
    return t1 if _less_specific(t1, t2) else t2


def substitute(m: _Mapping, t: Type, params_to_dyn: bool) -> Type:
    """cel-go's substitute: bound parameters replaced by what they are bound to, unbound ones by dyn if asked."""
    bound = m.find(t)
    if bound is not None:
        return substitute(m, bound, params_to_dyn)
    if params_to_dyn and t.kind == "param":
        return DYN
    if t.params and t.kind in ("opaque", "list", "map", "type"):
        return Type(t.kind, t.name, tuple(substitute(m, p, params_to_dyn) for p in t.params))
    return t


# --- Declarations: signatures written as cel-go declares them ------------------------------

_NAMED = {"bool": BOOL, "bytes": BYTES, "double": DOUBLE, "int": INT, "string": STRING, "uint": UINT,
          "null": NULL, "dyn": DYN, "any": ANY, "duration": DURATION, "timestamp": TIMESTAMP, "type": TYPE}
_OPAQUE = frozenset({"net.IP", "net.CIDR"})


def _parse_type(text: str) -> Type:
    tokens = re.findall(r"[A-Za-z_][\w.]*|[(),]", text)
    position = 0

    def read() -> Type:
        nonlocal position
        name = tokens[position]
        position += 1
        args: list[Type] = []
        if position < len(tokens) and tokens[position] == "(":
            position += 1
            while tokens[position] != ")":
                args.append(read())
                if tokens[position] == ",":
                    position += 1
            position += 1
        if name == "list":
            return list_of(*args)
        if name == "map":
            return map_of(*args)
        if name == "optional":
            return optional_of(*args)
        if name == "type" and args:
            return type_of(*args)
        if name in _NAMED:
            return _NAMED[name]
        if re.fullmatch(r"[A-Z]", name):
            return param(name)
        if name in _OPAQUE:
            return Type("opaque", name, tuple(args))
        return struct(name)

    found = read()
    assert position == len(tokens), text
    return found


def _split_arguments(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in parts + [current] if p.strip()]


@dataclass(frozen=True)
class Overload:
    function: str
    member: bool
    args: tuple[Type, ...]
    result: Type

    @property
    def params(self) -> list[str]:
        found: list[str] = []

        def walk(t: Type) -> None:
            if t.kind == "param" and t.name not in found:
                found.append(t.name)
            for p in t.params:
                walk(p)
        for t in (*self.args, self.result):
            walk(t)
        return found


_SIGNATURE = re.compile(r"(?:<(?P<receiver>[^>]+)>\.)?(?P<name>[^(]+)\((?P<args>.*)\)\s*->\s*(?P<result>.+)")


def _overloads(text: str) -> list[Overload]:
    """Signatures, one a line: ``name(arg, ...) -> result``, or ``<receiver>.name(arg, ...) -> result``."""
    found = []
    for line in text.strip().splitlines():
        hit = _SIGNATURE.fullmatch(line.strip())
        assert hit, line
        args = [_parse_type(a) for a in _split_arguments(hit["args"])]
        if hit["receiver"]:
            args.insert(0, _parse_type(hit["receiver"]))
        found.append(Overload(hit["name"], bool(hit["receiver"]), tuple(args), _parse_type(hit["result"])))
    return found


def _each(template: str, types: str) -> str:
    return "\n".join(template.replace("X", t) for t in types.split())


def _pairs(template: str, pairs: str) -> str:
    return "\n".join(template.replace("X", a).replace("Y", b) for a, b in (p.split("/") for p in pairs.split()))


_ORDERED = ("bool/bool int/int int/double int/uint uint/uint uint/double uint/int double/double double/int "
            "double/uint string/string bytes/bytes timestamp/timestamp duration/duration")
_TIME_PARTS = "getFullYear getMonth getDayOfYear getDayOfMonth getDate getDayOfWeek"
_CLOCK_PARTS = "getHours getMinutes getSeconds getMilliseconds"

# cel-go's common/stdlib/standard.go, in its order (cross-type comparisons included: Kubernetes turns them on).
STANDARD = _overloads("\n".join([
    "_?_:_(bool, A, A) -> A", "_&&_(bool, bool) -> bool", "_||_(bool, bool) -> bool", "!_(bool) -> bool",
    "@not_strictly_false(bool) -> bool", "_==_(A, A) -> bool", "_!=_(A, A) -> bool",
    _pairs("_+_(X, Y) -> X", "bytes/bytes double/double duration/duration"),
    "_+_(duration, timestamp) -> timestamp", "_+_(timestamp, duration) -> timestamp", "_+_(int, int) -> int",
    "_+_(list(A), list(A)) -> list(A)", "_+_(string, string) -> string", "_+_(uint, uint) -> uint",
    _each("_/_(X, X) -> X", "double int uint"), _each("_%_(X, X) -> X", "int uint"),
    _each("_*_(X, X) -> X", "double int uint"), _each("-_(X) -> X", "double int"),
    _each("_-_(X, X) -> X", "double duration int"), "_-_(timestamp, duration) -> timestamp",
    "_-_(timestamp, timestamp) -> duration", "_-_(uint, uint) -> uint",
    *(_pairs(f"{op}(X, Y) -> bool", _ORDERED) for op in ("_<_", "_<=_", "_>_", "_>=_")),
    "_[_](list(A), int) -> A", "_[_](map(A, B), A) -> B", "@in(A, list(A)) -> bool", "@in(A, map(A, B)) -> bool",
    "size(bytes) -> int", "<bytes>.size() -> int", "size(list(A)) -> int", "<list(A)>.size() -> int",
    "size(map(A, B)) -> int", "<map(A, B)>.size() -> int", "size(string) -> int", "<string>.size() -> int",
    "type(A) -> type(A)", _each("bool(X) -> bool", "bool string"), _each("bytes(X) -> bytes", "bytes string"),
    _each("double(X) -> double", "double int string uint"),
    _each("duration(X) -> duration", "duration int string"), "dyn(A) -> dyn",
    _each("int(X) -> int", "int double duration string timestamp uint"),
    _each("string(X) -> string", "string bool bytes double duration int timestamp uint"),
    _each("timestamp(X) -> timestamp", "timestamp int string"), _each("uint(X) -> uint", "uint double int string"),
    "<string>.contains(string) -> bool", "<string>.endsWith(string) -> bool", "<string>.startsWith(string) -> bool",
    "matches(string, string) -> bool", "<string>.matches(string) -> bool",
    *(f"<timestamp>.{f}() -> int\n<timestamp>.{f}(string) -> int" for f in _TIME_PARTS.split()),
    *(f"<timestamp>.{f}() -> int\n<timestamp>.{f}(string) -> int\n<duration>.{f}() -> int"
      for f in _CLOCK_PARTS.split()),
]))

# cel-go's cel/library.go, optionalLib (cel.OptionalTypes()).
OPTIONAL = _overloads("""
optional.of(V) -> optional(V)
optional.ofNonZeroValue(V) -> optional(V)
optional.none() -> optional(V)
<optional(V)>.value() -> V
<optional(V)>.hasValue() -> bool
<optional(V)>.or(optional(V)) -> optional(V)
<optional(V)>.orValue(V) -> V
_[_](optional(list(V)), int) -> optional(V)
_[_](optional(map(K, V)), K) -> optional(V)
""")

_COMPARABLE = "int uint double bool duration timestamp string bytes"

# Kubernetes' staging/src/k8s.io/apiserver/pkg/cel/library/*.go.
K8S_URLS = _overloads("""
url(string) -> kubernetes.URL
<kubernetes.URL>.getScheme() -> string
<kubernetes.URL>.getHost() -> string
<kubernetes.URL>.getHostname() -> string
<kubernetes.URL>.getPort() -> string
<kubernetes.URL>.getEscapedPath() -> string
<kubernetes.URL>.getQuery() -> map(string, list(string))
isURL(string) -> bool
""")
K8S_REGEX = _overloads("""
<string>.find(string) -> string
<string>.findAll(string) -> list(string)
<string>.findAll(string, int) -> list(string)
""")
K8S_LISTS = _overloads("\n".join([
    _each("<list(X)>.isSorted() -> bool", _COMPARABLE), _each("<list(X)>.sum() -> X", "int uint double duration"),
    _each("<list(X)>.max() -> X", _COMPARABLE), _each("<list(X)>.min() -> X", _COMPARABLE),
    "<list(A)>.indexOf(A) -> int", "<list(A)>.lastIndexOf(A) -> int"]))
_AUTHZ = "kubernetes.authorization."
K8S_AUTHZ = _overloads(f"""
<{_AUTHZ}Authorizer>.path(string) -> {_AUTHZ}PathCheck
<{_AUTHZ}Authorizer>.group(string) -> {_AUTHZ}GroupCheck
<{_AUTHZ}Authorizer>.serviceAccount(string, string) -> {_AUTHZ}Authorizer
<{_AUTHZ}GroupCheck>.resource(string) -> {_AUTHZ}ResourceCheck
<{_AUTHZ}ResourceCheck>.subresource(string) -> {_AUTHZ}ResourceCheck
<{_AUTHZ}ResourceCheck>.namespace(string) -> {_AUTHZ}ResourceCheck
<{_AUTHZ}ResourceCheck>.name(string) -> {_AUTHZ}ResourceCheck
<{_AUTHZ}PathCheck>.check(string) -> {_AUTHZ}Decision
<{_AUTHZ}ResourceCheck>.check(string) -> {_AUTHZ}Decision
<{_AUTHZ}Decision>.errored() -> bool
<{_AUTHZ}Decision>.error() -> string
<{_AUTHZ}Decision>.allowed() -> bool
<{_AUTHZ}Decision>.reason() -> string
""")
K8S_AUTHZ_SELECTORS = _overloads(f"""
<{_AUTHZ}ResourceCheck>.fieldSelector(string) -> {_AUTHZ}ResourceCheck
<{_AUTHZ}ResourceCheck>.labelSelector(string) -> {_AUTHZ}ResourceCheck
""")
_Q = "kubernetes.Quantity"
K8S_QUANTITY = _overloads(f"""
quantity(string) -> {_Q}
isQuantity(string) -> bool
sign({_Q}) -> int
<{_Q}>.isGreaterThan({_Q}) -> bool
<{_Q}>.isLessThan({_Q}) -> bool
<{_Q}>.compareTo({_Q}) -> int
<{_Q}>.asApproximateFloat() -> double
<{_Q}>.asInteger() -> int
<{_Q}>.isInteger() -> bool
<{_Q}>.add({_Q}) -> {_Q}
<{_Q}>.add(int) -> {_Q}
<{_Q}>.sub({_Q}) -> {_Q}
<{_Q}>.sub(int) -> {_Q}
""")
K8S_IP = _overloads("""
ip(string) -> net.IP
<net.IP>.family() -> int
ip.isCanonical(string) -> bool
<net.IP>.isUnspecified() -> bool
<net.IP>.isLoopback() -> bool
<net.IP>.isLinkLocalMulticast() -> bool
<net.IP>.isLinkLocalUnicast() -> bool
<net.IP>.isGlobalUnicast() -> bool
isIP(string) -> bool
string(net.IP) -> string
""")
K8S_CIDR = _overloads("""
cidr(string) -> net.CIDR
<net.CIDR>.containsIP(string) -> bool
<net.CIDR>.containsIP(net.IP) -> bool
<net.CIDR>.containsCIDR(string) -> bool
<net.CIDR>.containsCIDR(net.CIDR) -> bool
<net.CIDR>.ip() -> net.IP
<net.CIDR>.prefixLength() -> int
<net.CIDR>.masked() -> net.CIDR
isCIDR(string) -> bool
string(net.CIDR) -> string
""")
_FORMATS = ("dns1123Label dns1123Subdomain dns1035Label qualifiedName dns1123LabelPrefix dns1123SubdomainPrefix "
            "dns1035LabelPrefix labelValue uri uuid byte date datetime")
K8S_FORMAT = _overloads("\n".join([
    "<kubernetes.NamedFormat>.validate(string) -> optional(list(string))",
    "format.named(string) -> optional(kubernetes.NamedFormat)",
    *(f"format.{name}() -> kubernetes.NamedFormat" for name in _FORMATS.split())]))
_SEMVER = "kubernetes.Semver"
K8S_SEMVER = _overloads(f"""
semver(string) -> {_SEMVER}
semver(string, bool) -> {_SEMVER}
isSemver(string) -> bool
isSemver(string, bool) -> bool
<{_SEMVER}>.isGreaterThan({_SEMVER}) -> bool
<{_SEMVER}>.isLessThan({_SEMVER}) -> bool
<{_SEMVER}>.compareTo({_SEMVER}) -> int
<{_SEMVER}>.major() -> int
<{_SEMVER}>.minor() -> int
<{_SEMVER}>.patch() -> int
""")
# cel-go's ext/strings.go at version 2, ext/sets.go, ext/lists.go at version 3, ext/comprehensions.go.
EXT_STRINGS = _overloads("""
<string>.charAt(int) -> string
<string>.indexOf(string) -> int
<string>.indexOf(string, int) -> int
<string>.lastIndexOf(string) -> int
<string>.lastIndexOf(string, int) -> int
<string>.lowerAscii() -> string
<string>.replace(string, string) -> string
<string>.replace(string, string, int) -> string
<string>.split(string) -> list(string)
<string>.split(string, int) -> list(string)
<string>.substring(int) -> string
<string>.substring(int, int) -> string
<string>.trim() -> string
<string>.upperAscii() -> string
<string>.format(list(dyn)) -> string
strings.quote(string) -> string
<list(string)>.join() -> string
<list(string)>.join(string) -> string
""")
EXT_SETS = _overloads("""
sets.contains(list(T), list(T)) -> bool
sets.equivalent(list(T), list(T)) -> bool
sets.intersects(list(T), list(T)) -> bool
""")
EXT_LISTS = _overloads("\n".join([
    "<list(T)>.slice(int, int) -> list(T)", "<list(list(T))>.flatten() -> list(T)",
    "<list(dyn)>.flatten(int) -> list(dyn)", _each("<list(X)>.sort() -> list(X)", _COMPARABLE),
    _each("<list(T)>.@sortByAssociatedKeys(list(X)) -> list(T)", _COMPARABLE),
    "lists.range(int) -> list(int)", "<list(T)>.reverse() -> list(T)", "<list(T)>.distinct() -> list(T)"]))
EXT_COMPREHENSIONS = _overloads("""
cel.@mapInsert(map(K, V), K, V) -> map(K, V)
cel.@mapInsert(map(K, V), map(K, V)) -> map(K, V)
""")

# Macros: (name, argument count, receiver style).
STANDARD_MACROS = frozenset({("has", 1, False), ("all", 2, True), ("exists", 2, True), ("exists_one", 2, True),
                             ("map", 2, True), ("map", 3, True), ("filter", 2, True)})
TWO_VARIABLE_MACROS = frozenset({("all", 3, True), ("exists", 3, True), ("existsOne", 3, True),
                                 ("exists_one", 3, True), ("transformList", 3, True), ("transformList", 4, True),
                                 ("transformMap", 3, True), ("transformMap", 4, True),
                                 ("transformMapEntry", 3, True), ("transformMapEntry", 4, True)})
# Declared by the environment, not expanded here: refused, so that nothing passes unchecked.
UNMODELLED_MACROS = frozenset({("sortBy", 2, True), ("optMap", 2, True), ("optFlatMap", 2, True)})
BIND_MACRO = ("bind", 3, True)

# The type identifiers: cel-go's standard types, optional_type and the libraries' types.
_TYPE_IDENTS = {name: type_of(t) for name, t in {
    "bool": BOOL, "bytes": BYTES, "double": DOUBLE, "google.protobuf.Duration": DURATION, "int": INT,
    "list": list_of(param("A")), "map": map_of(param("A"), param("B")), "null_type": NULL, "string": STRING,
    "google.protobuf.Timestamp": TIMESTAMP, "type": TYPE, "uint": UINT, "optional_type": optional_of(param("T")),
    "net.IP": Type("opaque", "net.IP"), "net.CIDR": Type("opaque", "net.CIDR")}.items()}


def _declared_struct(type_name: str, **fields: str) -> tuple[str, dict[str, Type]]:
    return type_name, {k: _parse_type(v) for k, v in fields.items()}


# compile.go: BuildRequestType and BuildNamespaceType.
ADMISSION_STRUCTS = dict([
    _declared_struct("kubernetes.GroupVersionKind", group="string", version="string", kind="string"),
    _declared_struct("kubernetes.GroupVersionResource", group="string", version="string", resource="string"),
    _declared_struct("kubernetes.UserInfo", username="string", uid="string", groups="list(string)",
                     extra="map(string, list(string))"),
    _declared_struct("kubernetes.AdmissionRequest", kind="kubernetes.GroupVersionKind",
                     resource="kubernetes.GroupVersionResource", subResource="string",
                     requestKind="kubernetes.GroupVersionKind", requestResource="kubernetes.GroupVersionResource",
                     requestSubResource="string", name="string", namespace="string", operation="string",
                     userInfo="kubernetes.UserInfo", dryRun="bool", options="dyn"),
    _declared_struct("kubernetes.NamespaceSpec", finalizers="list(string)"),
    _declared_struct("kubernetes.NamespaceCondition", status="string", type="string", lastTransitionTime="timestamp",
                     message="string", reason="string"),
    _declared_struct("kubernetes.NamespaceStatus", conditions="list(kubernetes.NamespaceCondition)", phase="string"),
    _declared_struct("kubernetes.NamespaceMetadata", name="string", generateName="string", namespace="string",
                     labels="map(string, string)", annotations="map(string, string)", UID="string",
                     creationTimestamp="timestamp", deletionGracePeriodSeconds="int", deletionTimestamp="timestamp",
                     generation="int", resourceVersion="string", finalizers="list(string)"),
    _declared_struct("kubernetes.Namespace", metadata="kubernetes.NamespaceMetadata",
                     spec="kubernetes.NamespaceSpec", status="kubernetes.NamespaceStatus"),
])
# dynamic-resource-allocation/cel/compile.go: the device a selector sees (allowMultipleAllocations, behind the
# DRAConsumableCapacity gate, is left out: an expression reading it fails here, as it does without the gate).
DRA_STRUCTS = dict([_declared_struct("kubernetes.DRADevice", driver="string",
                                     attributes="map(string, map(string, any))",
                                     capacity="map(string, map(string, kubernetes.Quantity))")])
VARIABLES_STRUCT = "kubernetes.variables"


@dataclass
class Env:
    """What an expression may name: identifiers (with their types), functions, typed objects, macros."""

    idents: dict[str, Type]
    functions: dict[str, list[Overload]]
    structs: dict[str, dict[str, Type]]
    macros: frozenset[tuple[str, int, bool]]

    def function(self, name: str) -> list[Overload] | None:
        return self.functions.get(name.removeprefix("."))

    def ident(self, name: str) -> Type | None:
        name = name.removeprefix(".")
        if name in self.idents:
            return self.idents[name]
        if name in self.structs:
            return type_of(struct(name))
        return None


def _functions(*libraries: list[Overload]) -> dict[str, list[Overload]]:
    """Libraries merged in the order the environment adds them (cel-go appends each overload to its function)."""
    merged: dict[str, list[Overload]] = {}
    for library in libraries:
        for overload in library:
            known = merged.setdefault(overload.function, [])
            if overload not in known:
                known.append(overload)
    return merged


# environment/base.go, in its order.
BASE_FUNCTIONS = _functions(STANDARD, K8S_URLS, K8S_REGEX, K8S_LISTS, K8S_AUTHZ, OPTIONAL, K8S_QUANTITY, EXT_STRINGS,
                            EXT_SETS, K8S_IP, K8S_CIDR, K8S_FORMAT, K8S_AUTHZ_SELECTORS, EXT_COMPREHENSIONS,
                            K8S_SEMVER, EXT_LISTS)
BASE_MACROS = STANDARD_MACROS | TWO_VARIABLE_MACROS | UNMODELLED_MACROS


def admission_env(*, params: bool, authorizer: bool, variables: dict[str, Type] | None) -> Env:
    """The environment of an admission expression: ``variables`` is None where none is declared
    (matchConditions), else the fields of ``variables`` so far."""
    idents = dict(_TYPE_IDENTS)
    idents.update({"object": DYN, "oldObject": DYN, "request": struct("kubernetes.AdmissionRequest"),
                   "namespaceObject": struct("kubernetes.Namespace")})
    if params:
        idents["params"] = DYN
    if authorizer:
        idents["authorizer"] = struct(_AUTHZ + "Authorizer")
        idents["authorizer.requestResource"] = struct(_AUTHZ + "ResourceCheck")
    structs = dict(ADMISSION_STRUCTS)
    if variables is not None:
        idents["variables"] = struct(VARIABLES_STRUCT)
        structs[VARIABLES_STRUCT] = dict(variables)
    return Env(idents, BASE_FUNCTIONS, structs, BASE_MACROS)


def dra_env() -> Env:
    """The environment of a DRA device selector (ext.Bindings adds cel.bind)."""
    idents = {**_TYPE_IDENTS, "device": struct("kubernetes.DRADevice")}
    return Env(idents, BASE_FUNCTIONS, dict(DRA_STRUCTS), BASE_MACROS | {BIND_MACRO})


# --- The syntax tree, as cel-go's parser makes it (macros expanded) ----------------------------


@dataclass(eq=False)
class _Expr:
    offset: int  # where cel-go puts the node: an operator, a dot, a bracket, a name


@dataclass(eq=False)
class _Literal(_Expr):
    type: Type
    value: object = None


@dataclass(eq=False)
class _Ident(_Expr):
    name: str


@dataclass(eq=False)
class _Select(_Expr):
    operand: _Expr
    field: str
    test_only: bool = False


@dataclass(eq=False)
class _Call(_Expr):
    function: str
    target: _Expr | None
    args: list[_Expr]


@dataclass(eq=False)
class _List(_Expr):
    elements: list[_Expr]


@dataclass(eq=False)
class _Entry:
    offset: int
    key: _Expr
    value: _Expr


@dataclass(eq=False)
class _Map(_Expr):
    entries: list[_Entry]


@dataclass(eq=False)
class _Comprehension(_Expr):
    iter_range: _Expr
    iter_var: str
    iter_var2: str | None
    accu_var: str
    accu_init: _Expr
    condition: _Expr
    step: _Expr
    result: _Expr


class _CompileError(Exception):
    def __init__(self, offset: int, message: str) -> None:
        super().__init__(message)
        self.offset, self.message = offset, message


ACCUMULATOR = "@result"
_RELATIONS = {"relation_lt": "_<_", "relation_le": "_<=_", "relation_gt": "_>_", "relation_ge": "_>=_",
              "relation_eq": "_==_", "relation_ne": "_!=_", "relation_in": "@in"}
_ARITHMETIC = {"addition_add": "_+_", "addition_sub": "_-_", "multiplication_mul": "_*_",
               "multiplication_div": "_/_", "multiplication_mod": "_%_"}


def _keyword(token: lark.Token) -> lark.Token:
    # cel-python's grammar reads true and false as identifiers first; its own callback retypes them but
    # drops their positions, which the errors here need.
    if token.value in ("true", "false"):
        return lark.Token.new_borrow_pos("BOOL_LIT", token.value, token)
    return token


# cel-python's grammar (celpy/cel.lark), with its parser's options.
_PARSER = lark.Lark((Path(celpy.__file__).parent / "cel.lark").read_text(), parser="lalr", start="expr",
                    g_regex_flags=re.M, lexer_callbacks={"IDENT": _keyword}, propagate_positions=True,
                    maybe_placeholders=False, priority="invert")


class _Builder:
    """cel-python's lark tree to cel-go's syntax tree: operator positions, negation runs, macros."""

    def __init__(self, text: str, macros: frozenset[tuple[str, int, bool]]) -> None:
        self.text, self.macros = text, macros

    def after(self, position: int) -> int:
        """The next token's offset: past spaces and // comments."""
        while position < len(self.text):
            if self.text[position].isspace():
                position += 1
            elif self.text.startswith("//", position):
                end = self.text.find("\n", position)
                position = len(self.text) if end < 0 else end
            else:
                break
        return position

    def build(self, tree: lark.Tree) -> _Expr:
        kids = tree.children
        rule = tree.data
        if rule == "expr" and len(kids) == 3:
            return self.call(self.after(kids[0].meta.end_pos), "_?_:_", None, [self.build(k) for k in kids])
        if rule in ("conditionalor", "conditionaland") and len(kids) == 2:
            op = "_||_" if rule == "conditionalor" else "_&&_"
            return self.call(self.after(kids[0].meta.end_pos), op, None, [self.build(kids[0]), self.build(kids[1])])
        if rule in ("relation", "addition", "multiplication") and len(kids) == 2:
            operator, right = kids
            left = operator.children[0]
            op = _RELATIONS.get(operator.data) or _ARITHMETIC[operator.data]
            return self.call(self.after(left.meta.end_pos), op, None, [self.build(left), self.build(right)])
        if rule == "unary" and len(kids) == 2:
            return self.unary(tree)
        if rule in ("expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary",
                    "member", "primary", "paren_expr"):
            return self.build(kids[0])
        if rule == "member_dot":
            operand, name = kids
            return _Select(self.after(operand.meta.end_pos), self.build(operand), str(name))
        if rule == "member_dot_arg":
            operand, name, *rest = kids
            args = self.arguments(rest)
            return self.call(self.after(name.end_pos), str(name), self.build(operand), args)
        if rule == "member_index":
            operand, index = kids
            return self.call(self.after(operand.meta.end_pos), "_[_]", None, [self.build(operand), self.build(index)])
        if rule in ("ident_arg", "dot_ident_arg"):
            name, *rest = kids
            prefix = "." if rule == "dot_ident_arg" else ""
            return self.call(self.after(name.end_pos), prefix + str(name), None, self.arguments(rest))
        if rule in ("ident", "dot_ident"):
            (name,) = kids
            return _Ident(name.start_pos, ("." if rule == "dot_ident" else "") + str(name))
        if rule == "literal":
            return self.literal(kids[0])
        if rule == "list_lit":
            return _List(tree.meta.start_pos, self.arguments(kids))
        if rule == "map_lit":
            entries = []
            if kids:
                items = kids[0].children
                for key, value in zip(items[::2], items[1::2], strict=True):
                    entries.append(_Entry(self.after(key.meta.end_pos), self.build(key), self.build(value)))
            return _Map(tree.meta.start_pos, entries)
        raise _CompileError(tree.meta.start_pos, f"syntax this checker does not model: {rule}")

    def arguments(self, rest: list) -> list[_Expr]:
        return [self.build(e) for e in rest[0].children] if rest else []

    def unary(self, tree: lark.Tree) -> _Expr:
        # cel-go drops an even run of the same operator (!!x is x) and keeps one call for an odd run.
        kind = tree.children[0].data
        start = tree.children[0].meta.start_pos
        count, node = 0, tree
        while node.data == "unary" and len(node.children) == 2 and node.children[0].data == kind:
            count, node = count + 1, node.children[1]
        operand = self.build(node)
        if count % 2 == 0:
            return operand
        return self.call(start, "!_" if kind == "unary_not" else "-_", None, [operand])

    def literal(self, token: lark.Token) -> _Expr:
        text, kind, start = str(token), token.type, token.start_pos
        if kind == "UINT_LIT" and text.startswith("-"):
            # cel-go has no negative uint literal: -1u is the negation of 1u (which no overload takes).
            return self.call(start, "-_", None, [_Literal(start + 1, UINT, int(text[1:-1], 0))])
        if kind == "INT_LIT":
            return _Literal(start, INT, int(text, 16) if "x" in text else int(text))
        if kind == "UINT_LIT":
            return _Literal(start, UINT, int(text[:-1], 16) if "x" in text else int(text[:-1]))
        if kind == "FLOAT_LIT":
            return _Literal(start, DOUBLE, float(text))
        if kind in ("STRING_LIT", "MLSTRING_LIT"):
            return _Literal(start, STRING, _unquote(text))
        if kind == "BYTES_LIT":
            return _Literal(start, BYTES, _unquote(text[1:]))
        if kind == "BOOL_LIT":
            return _Literal(start, BOOL, text == "true")
        return _Literal(start, NULL, None)

    def call(self, offset: int, function: str, target: _Expr | None, args: list[_Expr]) -> _Expr:
        key = (function, len(args), target is not None)
        if key in self.macros:
            return self.expand(offset, function, target, args)
        return _Call(offset, function, target, args)

    def expand(self, offset: int, function: str, target: _Expr | None, args: list[_Expr]) -> _Expr:
        """The comprehensions of parser/macro.go and ext/comprehensions.go."""
        def accu() -> _Ident:
            return _Ident(offset, ACCUMULATOR)

        def lit(t: Type, v: object) -> _Literal:
            return _Literal(offset, t, v)

        def call(name: str, *call_args: _Expr) -> _Call:
            return _Call(offset, name, None, list(call_args))

        def name_of(arg: _Expr, complaint: str) -> str:
            if not isinstance(arg, _Ident):
                raise _CompileError(arg.offset, complaint)
            if arg.name in (ACCUMULATOR, "__result__"):
                raise _CompileError(arg.offset, "iteration variable overwrites accumulator variable")
            return arg.name

        def comprehension(var: str, var2: str | None, init: _Expr, condition: _Expr, step: _Expr,
                          result: _Expr) -> _Comprehension:
            return _Comprehension(offset, target, var, var2, ACCUMULATOR, init, condition, step, result)

        def quantifier(kind: str, var: str, var2: str | None, predicate: _Expr) -> _Comprehension:
            if kind == "all":
                return comprehension(var, var2, lit(BOOL, True), call("@not_strictly_false", accu()),
                                     call("_&&_", accu(), predicate), accu())
            if kind == "exists":
                return comprehension(var, var2, lit(BOOL, False), call("@not_strictly_false", call("!_", accu())),
                                     call("_||_", accu(), predicate), accu())
            return comprehension(var, var2, lit(INT, 0), lit(BOOL, True),
                                 call("_?_:_", predicate, call("_+_", accu(), lit(INT, 1)), accu()),
                                 call("_==_", accu(), lit(INT, 1)))

        if (function, len(args), target is not None) in UNMODELLED_MACROS:
            raise _CompileError(offset, f"macro {function}() is not modelled by this checker")
        if function == "has":
            (arg,) = args
            if not isinstance(arg, _Select) or arg.test_only:
                raise _CompileError(arg.offset, "invalid argument to has() macro")
            return _Select(offset, arg.operand, arg.field, test_only=True)
        if function == "bind":
            if not (isinstance(target, _Ident) and target.name == "cel"):
                return _Call(offset, function, target, args)
            if not isinstance(args[0], _Ident):
                raise _CompileError(args[0].offset, "cel.bind() variable names must be simple identifiers")
            name = args[0].name
            return _Comprehension(offset, _List(offset, []), "#unused", None, name, args[1], lit(BOOL, False),
                                  _Ident(offset, name), args[2])
        two = len(args) >= 3 and function != "map"
        if two:
            var = name_of(args[0], "argument must be a simple name")
            var2 = name_of(args[1], "argument must be a simple name")
            if var == var2:
                raise _CompileError(args[1].offset, f"duplicate variable name: {var}")
            rest = args[2:]
        else:
            complaint = "argument is not an identifier" if function in ("map", "filter") \
                else "argument must be a simple name"
            var, var2, rest = name_of(args[0], complaint), None, args[1:]
        if function in ("all", "exists", "exists_one", "existsOne"):
            return quantifier({"existsOne": "exists_one"}.get(function, function), var, var2, rest[0])
        if function == "filter":
            step = call("_?_:_", rest[0], call("_+_", accu(), _List(offset, [args[0]])), accu())
            return comprehension(var, None, _List(offset, []), lit(BOOL, True), step, accu())
        *condition, transform = rest
        if function in ("map", "transformList"):
            init: _Expr = _List(offset, [])
            step = call("_+_", accu(), _List(offset, [transform]))
        elif function == "transformMap":
            init, step = _Map(offset, []), call("cel.@mapInsert", accu(), _Ident(offset, var), transform)
        else:
            init, step = _Map(offset, []), call("cel.@mapInsert", accu(), transform)
        if condition:
            step = call("_?_:_", condition[0], step, accu())
        return comprehension(var, var2, init, lit(BOOL, True), step, accu())


def _unquote(text: str) -> str:
    raw = text[:1] in "rR"
    body = text[1:] if raw else text
    quote = body[:3] if body[:3] in ('"""', "'''") else body[:1]
    body = body[len(quote):-len(quote)]
    if raw:
        return body
    return codecs.decode(body.encode("latin-1", "backslashreplace"), "unicode_escape")


# --- The checker ---------------------------------------------------------------------------


class _Checker:
    """cel-go's checker.go over one expression."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.scopes: list[dict[str, Type]] = []
        self.types: dict[_Expr, Type] = {}
        self.mapping = _Mapping()
        self.errors: list[tuple[int, str]] = []
        self.counter = 0

    def error(self, offset: int, message: str) -> None:
        self.errors.append((offset, message))

    def mismatch(self, offset: int, expected: Type, found: Type) -> None:
        self.error(offset, f"expected type '{format_type(expected)}' but found '{format_type(found)}'")

    def set_type(self, e: _Expr, t: Type) -> None:
        if e in self.types and self.types[e] != t:
            self.error(e.offset, f"incompatible type already exists for expression: old:{self.types[e]}, new:{t}")
            return
        self.types[e] = t

    def fresh(self) -> Type:
        self.counter += 1
        return param(f"_var{self.counter - 1}")

    def assignable(self, t1: Type, t2: Type) -> bool:
        trial = self.mapping.copy()
        if _assignable(trial, t1, t2):
            self.mapping = trial
            return True
        return False

    def assignable_all(self, l1: list[Type], l2: list[Type]) -> bool:
        trial = self.mapping.copy()
        if _assignable_all(trial, l1, l2):
            self.mapping = trial
            return True
        return False

    def lookup(self, name: str) -> Type | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return self.env.ident(name)

    def check(self, e: _Expr) -> None:
        if isinstance(e, _Literal):
            self.set_type(e, e.type)
        elif isinstance(e, _Ident):
            self.check_ident(e)
        elif isinstance(e, _Select):
            self.check_select(e)
        elif isinstance(e, _Call):
            self.check_call(e)
        elif isinstance(e, _List):
            self.check_list(e)
        elif isinstance(e, _Map):
            self.check_map(e)
        else:
            self.check_comprehension(e)

    def check_ident(self, e: _Ident) -> None:
        found = self.lookup(e.name)
        if found is None:
            self.set_type(e, ERROR)
            self.error(e.offset, f"undeclared reference to '{e.name.removeprefix('.')}' (in container '')")
            return
        self.set_type(e, found)

    def check_select(self, e: _Select) -> None:
        name = _qualified(e)
        if name is not None:
            found = self.lookup(name)
            if found is not None:
                self.set_type(e, found)
                return
        result = self.select_field(e, e.operand, e.field)
        if e.test_only:
            result = BOOL
        self.set_type(e, substitute(self.mapping, result, False))

    def select_field(self, e: _Expr, operand: _Expr, name: str) -> Type:
        self.check(operand)
        operand_type = substitute(self.mapping, self.types[operand], False)
        target, optional = operand_type, False
        if target.kind == "opaque" and target.name == "optional_type":
            target, optional = target.params[0], True
        result = ERROR
        if target.kind == "map":
            result = target.params[1]
        elif target.kind == "struct":
            fields = self.env.structs.get(target.name)
            if fields is None:
                self.error(e.offset, f"unexpected failed resolution of '{target.name}'")
            elif name in fields:
                result = fields[name]
            else:
                self.error(e.offset, f"undefined field '{name}'")
        elif target.kind == "param":
            self.assignable(DYN, target)
            result = DYN
        else:
            if not _is_dyn_or_error(target):
                self.error(e.offset, f"type '{format_type(target)}' does not support field selection")
            result = DYN
        return optional_of(result) if optional else result

    def check_call(self, e: _Call) -> None:
        for arg in e.args:
            self.check(arg)
        if e.target is None:
            overloads = self.env.function(e.function)
            if overloads is None:
                self.error(e.offset, f"undeclared reference to '{e.function.removeprefix('.')}' (in container '')")
                self.set_type(e, ERROR)
                return
            self.resolve(e, overloads, None)
            return
        prefix = _qualified(e.target)
        if prefix is not None:
            overloads = self.env.function(f"{prefix}.{e.function}")
            if overloads is not None:
                self.resolve(e, overloads, None)
                return
        self.check(e.target)
        overloads = self.env.function(e.function)
        if overloads is None:
            self.set_type(e, ERROR)
            self.error(e.offset, f"undeclared reference to '{e.function}' (in container '')")
            return
        self.resolve(e, overloads, e.target)

    def resolve(self, e: _Call, overloads: list[Overload], target: _Expr | None) -> None:
        found = self.resolve_overload(e, overloads, target)
        self.set_type(e, ERROR if found is None else found)

    def resolve_overload(self, e: _Call, overloads: list[Overload], target: _Expr | None) -> Type | None:
        arg_types = ([self.types[target]] if target is not None else []) + [self.types[a] for a in e.args]
        result: Type | None = None
        for overload in overloads:
            if overload.member != (target is not None):
                continue
            if overload.function in ("_&&_", "_||_"):
                failed = False
                for arg, arg_type in zip(e.args, arg_types, strict=True):
                    if not self.assignable(arg_type, BOOL):
                        self.mismatch(arg.offset, BOOL, arg_type)
                        failed = True
                return None if failed else BOOL
            fresh = _Mapping()
            for name in overload.params:
                fresh.add(param(name), self.fresh())
            candidate_args = [substitute(fresh, t, False) for t in overload.args]
            if self.assignable_all(arg_types, candidate_args):
                candidate = substitute(self.mapping, substitute(fresh, overload.result, False), False)
                if result is None:
                    result = candidate
                elif not _is_dyn(result) and candidate != result:
                    result = DYN
        if result is None:
            shown = [format_type(substitute(self.mapping, t, True)) for t in arg_types]
            receiver = f"{shown.pop(0)}." if target is not None else ""
            self.error(e.offset, f"found no matching overload for '{e.function.removeprefix('.')}' applied to "
                                 f"'{receiver}({', '.join(shown)})'")
        return result

    def join(self, e: _Expr, previous: Type | None, current: Type) -> Type:
        if previous is None:
            return current
        if self.assignable(previous, current):
            return _most_general(previous, current)
        return DYN  # Kubernetes does not set the checker's own homogeneity option: the validator judges

    def check_list(self, e: _List) -> None:
        elem: Type | None = None
        for item in e.elements:
            self.check(item)
            elem = self.join(item, elem, self.types[item])
        self.set_type(e, list_of(elem if elem is not None else self.fresh()))

    def check_map(self, e: _Map) -> None:
        key: Type | None = None
        value: Type | None = None
        for entry in e.entries:
            self.check(entry.key)
            key = self.join(entry.key, key, self.types[entry.key])
            self.check(entry.value)
            value = self.join(entry.value, value, self.types[entry.value])
        if key is None or value is None:
            key, value = self.fresh(), self.fresh()
        self.set_type(e, map_of(key, value))

    def check_comprehension(self, e: _Comprehension) -> None:
        self.check(e.iter_range)
        self.check(e.accu_init)
        range_type = substitute(self.mapping, self.types[e.iter_range], False)
        accu_type = self.types[e.accu_init]
        self.scopes.append({e.accu_var: accu_type})
        var2: Type | None = None
        if range_type.kind == "list":
            var = range_type.params[0]
            if e.iter_var2 is not None:
                var, var2 = INT, var
        elif range_type.kind == "map":
            var, var2 = range_type.params
        elif range_type.kind in ("dyn", "error", "param"):
            self.assignable(DYN, range_type)
            var = var2 = DYN
        else:
            self.error(e.iter_range.offset, f"expression of type '{format_type(range_type)}' cannot be range of a "
                                            "comprehension (must be list, map, or dynamic)")
            var = var2 = ERROR
        loop = {e.iter_var: var}
        if e.iter_var2 is not None:
            loop[e.iter_var2] = var2 if var2 is not None else ERROR
        self.scopes.append(loop)
        self.check(e.condition)
        self.assert_type(e.condition, BOOL)
        self.check(e.step)
        self.assert_type(e.step, accu_type)
        self.scopes.pop()
        self.check(e.result)
        self.scopes.pop()
        self.set_type(e, substitute(self.mapping, self.types[e.result], False))

    def assert_type(self, e: _Expr, t: Type) -> None:
        if not self.assignable(t, self.types[e]):
            self.mismatch(e.offset, t, self.types[e])


def _qualified(e: _Expr) -> str | None:
    """cel-go's ToQualifiedName: ``a.b.c`` for a chain of selections on an identifier."""
    if isinstance(e, _Ident):
        return e.name
    if isinstance(e, _Select) and not e.test_only:
        prefix = _qualified(e.operand)
        return None if prefix is None else f"{prefix}.{e.field}"
    return None


def _children(e: _Expr) -> Iterator[_Expr]:
    if isinstance(e, _Select):
        yield e.operand
    elif isinstance(e, _Call):
        if e.target is not None:
            yield e.target
        yield from e.args
    elif isinstance(e, _List):
        yield from e.elements
    elif isinstance(e, _Map):
        for entry in e.entries:
            yield entry.key
            yield entry.value
    elif isinstance(e, _Comprehension):
        yield from (e.iter_range, e.accu_init, e.condition, e.step, e.result)


def _walk(e: _Expr, inside_format: bool = False) -> Iterator[tuple[_Expr, bool]]:
    yield e, inside_format
    inside = inside_format or (isinstance(e, _Call) and e.function == "format")
    for child in _children(e):
        yield from _walk(child, inside)


_GO_DURATION = re.compile(r"[-+]?(?:0|(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+)")
_RFC3339 = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2})")
# What RE2 refuses and Python's re accepts: look-around, back-references, possessive and atomic groups.
_NOT_RE2 = re.compile(r"\(\?[=!]|\(\?<[=!]|\(\?>|\\[1-9]|\(\?P=|[*+?}]\+")


def _literal_is_valid(function: str, literal: _Literal) -> bool:
    """cel-go's duration, timestamp and regex literal validators (ValidateDurationLiterals, ...)."""
    value = literal.value
    if not isinstance(value, str):
        return True
    if function == "duration":
        return bool(_GO_DURATION.fullmatch(value))
    if function == "timestamp":
        hit = _RFC3339.fullmatch(value)
        if not hit:
            return False
        try:
            datetime.datetime(*(int(g) for g in hit.groups()[:6]))
        except ValueError:
            return False
        return True
    if _NOT_RE2.search(value):
        return False
    try:
        re.compile(value)
    except re.error:
        return False
    return True


def _validate(root: _Expr, types: dict[_Expr, Type]) -> list[tuple[int, str]]:
    """The AST validators Kubernetes adds, on the checked tree."""
    found = []
    for e, inside_format in _walk(root):
        if isinstance(e, _Call) and e.function in ("duration", "timestamp", "matches") and e.args \
                and isinstance(e.args[0], _Literal) and not _literal_is_valid(e.function, e.args[0]):
            found.append((e.args[0].offset, f"invalid {e.function} argument"))
        if inside_format:
            continue
        if isinstance(e, _List) and e.elements:
            first = types[e.elements[0]]
            for item in e.elements[1:]:
                if not equivalent(first, types[item]):
                    found.append((item.offset, f"expected type '{format_type(first)}' but found "
                                               f"'{format_type(types[item])}'"))
                    break
        if isinstance(e, _Map) and e.entries:
            key, value = types[e.entries[0].key], types[e.entries[0].value]
            for entry in e.entries[1:]:
                if not equivalent(key, types[entry.key]):
                    found.append((entry.key.offset, f"expected type '{format_type(key)}' but found "
                                                    f"'{format_type(types[entry.key])}'"))
                if not equivalent(value, types[entry.value]):
                    found.append((entry.value.offset, f"expected type '{format_type(value)}' but found "
                                                      f"'{format_type(types[entry.value])}'"))
    return found


@dataclass
class Checked:
    """One expression compiled: its output type, or cel-go's errors as the API server prints them."""

    text: str
    output: Type | None
    errors: list[str] = field(default_factory=list)

    @property
    def issues(self) -> str:
        return "\n".join(self.errors)


def _display(text: str, offset: int, message: str) -> str:
    """cel-go's Error.ToDisplayString: the position (column counted from 1), the line and a caret."""
    line_number = text.count("\n", 0, offset) + 1
    start = text.rfind("\n", 0, offset) + 1
    column = offset - start
    end = text.find("\n", start)
    line = text[start:] if end < 0 else text[start:end]
    shown = f"ERROR: <input>:{line_number}:{column + 1}: {message}"
    if len(line) <= 16384:
        marks = "".join("\uff0e" if ord(c) > 0x7F else "." for c in line[:column])
        caret = "\uff3e" if column < len(line) and ord(line[column]) > 0x7F else "^"
        shown += f"\n | {line.replace(chr(9), ' ')}\n | {marks}{caret}"
    return shown


def check(text: str, env: Env) -> Checked:
    """Parse, check and validate ``text`` as cel-go's Env.Compile does."""
    try:
        tree = _PARSER.parse(text)
    except lark.exceptions.LarkError as exc:
        reason = (str(exc).strip().splitlines() or ["unreadable"])[0]
        return Checked(text, None, [_display(text, _parse_error_offset(text, exc), f"Syntax error: {reason}")])
    try:
        root = _Builder(text, env.macros).build(tree)
    except _CompileError as exc:
        return Checked(text, None, [_display(text, exc.offset, exc.message)])
    checker = _Checker(env)
    checker.check(root)
    errors = checker.errors
    if not errors:
        types = {e: substitute(checker.mapping, t, True) for e, t in checker.types.items()}
        errors = _validate(root, types)
    if errors:
        ordered = sorted(errors, key=lambda error: _line_column(text, error[0]))
        return Checked(text, None, [_display(text, offset, message) for offset, message in ordered])
    return Checked(text, substitute(checker.mapping, checker.types[root], True))


def _line_column(text: str, offset: int) -> tuple[int, int]:
    return text.count("\n", 0, offset), offset - (text.rfind("\n", 0, offset) + 1)


def _parse_error_offset(text: str, exc: lark.exceptions.LarkError) -> int:
    position = getattr(exc, "pos_in_stream", None)
    if isinstance(position, int):
        return min(position, len(text))
    line, column = getattr(exc, "line", None), getattr(exc, "column", None)
    if isinstance(line, int) and isinstance(column, int) and line > 0:
        return min(sum(len(x) + 1 for x in text.split("\n")[:line - 1]) + column - 1, len(text))
    return len(text)


def compile_expression(text: str, env: Env, returns: tuple[Type, ...] | None) -> tuple[Checked, str | None]:
    """The API server's CompileCELExpression: the checked expression and its refusal, None when it compiles.

    ``returns`` are the types the field must evaluate to (exactly, as compile.go compares them); None takes any.
    """
    checked = check(text, env)
    if checked.output is None:
        return checked, "compilation failed: " + checked.issues
    if returns is not None and checked.output not in returns:
        if len(returns) == 1:
            return checked, f"must evaluate to {type_string(returns[0])} but got {type_string(checked.output)}"
        return checked, (f"must evaluate to one of [{' '.join(type_string(t) for t in returns)}] but got "
                         f"{type_string(checked.output)}")
    return checked, None


def declared_type(t: Type | None) -> Type:
    """composition.go's convertCelTypeToDeclType: what ``variables.<name>`` is typed as for later expressions."""
    if t is None:
        return DYN
    if t in (ANY, BOOL, BYTES, DOUBLE, DURATION, INT, NULL, STRING, TIMESTAMP, UINT):
        return t
    if t.kind == "list":
        return list_of(declared_type(t.params[0]))
    if t.kind == "map":
        return map_of(declared_type(t.params[0]), declared_type(t.params[1]))
    return DYN


# --- What the API server compiles in gpushard's manifests ----------------------------------


@dataclass(frozen=True)
class Refusal:
    """An expression the API server would refuse, where it is and why (in the API server's words)."""

    where: str  # Kind/name field.path
    detail: str

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


# Objects whose CEL the API server compiles and this module does not model: refused, never skipped.
UNMODELLED_KINDS = frozenset({"MutatingAdmissionPolicy", "CustomResourceDefinition"})


def refusals(objects: Iterable[dict]) -> list[Refusal]:
    """Every CEL expression in ``objects`` that the API server would refuse, compiled as it compiles them."""
    found: list[Refusal] = []
    for obj in objects:
        where = f"{obj['kind']}/{(obj.get('metadata') or {}).get('name', '')}"
        for path, detail in _object_refusals(obj):
            found.append(Refusal(f"{where} {path}", detail))
    return found


def expressions(objects: Iterable[dict]) -> list[str]:
    """Where each CEL expression of ``objects`` is (Kind/name field.path), in the order they are compiled."""
    seen = []
    for obj in objects:
        where = f"{obj['kind']}/{(obj.get('metadata') or {}).get('name', '')}"
        seen += [f"{where} {path}" for path, _, _ in _compiled_fields(obj)]
    return seen


def _object_refusals(obj: dict) -> Iterator[tuple[str, str]]:
    if obj["kind"] in UNMODELLED_KINDS:
        yield "", f"{obj['kind']} carries CEL this checker does not model"
        return
    for path, _, refusal in _compiled_fields(obj):
        if refusal is not None:
            yield path, refusal


def _compiled_fields(obj: dict) -> Iterator[tuple[str, Checked, str | None]]:
    kind = obj["kind"]
    if kind == "ValidatingAdmissionPolicy":
        yield from _policy_fields(obj.get("spec") or {})
    elif kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for i, webhook in enumerate(obj.get("webhooks") or []):
            for j, condition in enumerate(webhook.get("matchConditions") or []):
                env = admission_env(params=False, authorizer=True, variables=None)
                yield (f"webhooks[{i}].matchConditions[{j}].expression",
                       *compile_expression(condition["expression"].strip(), env, (BOOL,)))
    elif kind == "DeviceClass":
        for i, selector in enumerate((obj.get("spec") or {}).get("selectors") or []):
            yield from _selector(f"spec.selectors[{i}]", selector)
    elif kind in ("ResourceClaim", "ResourceClaimTemplate"):
        spec = (obj.get("spec") or {}).get("spec") if kind == "ResourceClaimTemplate" else obj.get("spec")
        for i, request in enumerate(((spec or {}).get("devices") or {}).get("requests") or []):
            prefix = ("spec.spec" if kind == "ResourceClaimTemplate" else "spec") + f".devices.requests[{i}]"
            for j, selector in enumerate((request.get("exactly") or {}).get("selectors") or []):
                yield from _selector(f"{prefix}.exactly.selectors[{j}]", selector)
            for k, sub in enumerate(request.get("firstAvailable") or []):
                for j, selector in enumerate(sub.get("selectors") or []):
                    yield from _selector(f"{prefix}.firstAvailable[{k}].selectors[{j}]", selector)


def _selector(path: str, selector: dict) -> Iterator[tuple[str, Checked, str | None]]:
    if "cel" not in selector:
        return
    checked = check(selector["cel"]["expression"], dra_env())
    if checked.output is None:
        yield f"{path}.cel.expression", checked, "compilation failed: " + checked.issues
    elif checked.output not in (BOOL, ANY):
        yield (f"{path}.cel.expression", checked,
               f"must evaluate to bool or the unknown type, not {type_string(checked.output)}")
    else:
        yield f"{path}.cel.expression", checked, None


def _policy_fields(spec: dict) -> Iterator[tuple[str, Checked, str | None]]:
    """A ValidatingAdmissionPolicy's expressions in validation.go's order, each in the environment it gets."""
    params = spec.get("paramKind") is not None
    for i, condition in enumerate(spec.get("matchConditions") or []):
        env = admission_env(params=params, authorizer=True, variables=None)
        yield (f"spec.matchConditions[{i}].expression",
               *compile_expression(condition["expression"].strip(), env, (BOOL,)))
    variables: dict[str, Type] = {}
    for i, variable in enumerate(spec.get("variables") or []):
        env = admission_env(params=params, authorizer=True, variables=variables)
        checked, refusal = compile_expression(variable["expression"], env, None)
        variables = {**variables, variable["name"]: declared_type(checked.output)}
        yield f"spec.variables[{i}].expression", checked, refusal
    for i, validation in enumerate(spec.get("validations") or []):
        env = admission_env(params=params, authorizer=True, variables=variables)
        yield f"spec.validations[{i}].expression", *compile_expression(validation["expression"], env, (BOOL,))
        message = validation.get("messageExpression") or ""
        if message.strip():
            env = admission_env(params=params, authorizer=False, variables=variables)
            yield f"spec.validations[{i}].messageExpression", *compile_expression(message, env, (STRING,))
    for i, annotation in enumerate(spec.get("auditAnnotations") or []):
        env = admission_env(params=params, authorizer=True, variables=variables)
        yield (f"spec.auditAnnotations[{i}].valueExpression",
               *compile_expression(annotation["valueExpression"].strip(), env, (STRING, NULL)))
