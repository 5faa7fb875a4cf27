"""Fields the API server stores as one atomic value are written in deploy/ as it stores them, defaults and all.

Server-side apply owns an atomic struct (`x-kubernetes-map-type: atomic` in the schema) as one value: after a
client-side `kubectl apply`, a `kubectl apply --server-side` of the same files conflicts on every atomic value
whose stored form carries a default the file left out (a fieldRef without `apiVersion: v1`, a policy's
matchConstraints without `matchPolicy: Equivalent`), and a GitOps diff never settles. Seen on a real API server
(`make e2e`, test_install.py's takeover); this is the check `make test` can make without one.

We test:
- every atomic value in every rendered kustomization (found through the schemas kubernetes-validate ships)
  holds each default the API server's defaulting sets in it (pkg/apis/admissionregistration/v1/defaults.go:
  SetDefaults_MatchResources, SetDefaults_Rule; pkg/apis/core/v1/defaults.go: SetDefaults_ObjectFieldSelector;
  pkg/apis/rbac/v1/defaults.go: SetDefaults_Subject);
- every atomic type the manifests use is one whose defaulting this module knows (so a new one is a decision);
- the walk finds the atomic values it must, and the check fails on the forms that conflicted.
"""

from __future__ import annotations

import pytest

from tests.deploy import test_canonical_quantities as quantity_walk

ADMISSION = "io.k8s.api.admissionregistration.v1."
CORE = "io.k8s.api.core.v1."
# Type -> what defaulting sets inside it (a function of the value: field -> value it must hold).
DEFAULTS = {
    # An absent selector is stored as {} (matches everything); one that is written is kept as written.
    ADMISSION + "MatchResources": lambda v: {"matchPolicy": "Equivalent"} | {
        k: {} for k in ("namespaceSelector", "objectSelector") if k not in v},
    ADMISSION + "NamedRuleWithOperations": lambda v: {"scope": "*"},
    CORE + "ObjectFieldSelector": lambda v: {"apiVersion": "v1"},
    "io.k8s.api.rbac.v1.Subject": lambda v: (
        {"apiGroup": "rbac.authorization.k8s.io"} if v.get("kind") in ("User", "Group") else {}),
}
# Atomic types in which the API server defaults nothing (no SetDefaults_ for them or their fields).
NO_DEFAULTS = {
    "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector", ADMISSION + "ParamKind", ADMISSION + "ParamRef",
    ADMISSION + "Variable", CORE + "ConfigMapKeySelector", CORE + "SecretKeySelector",
    CORE + "LocalObjectReference", CORE + "NodeSelector", CORE + "NodeSelectorTerm",
    CORE + "ResourceFieldSelector", CORE + "ScopeSelector", "io.k8s.api.rbac.v1.RoleRef",
}


def atomic_values(value, schema: dict, path: str = ""):
    """(path, type name, value) of every value under ``value`` whose schema is an atomic struct."""
    return ((where, name, item) for where, name, item in quantity_walk.typed_values(value, schema, path)
            if isinstance(item, dict) and quantity_walk.definitions()[name].get("x-kubernetes-map-type") == "atomic")


def missing_defaults(name: str, value: dict) -> dict:
    want = DEFAULTS[name](value) if name in DEFAULTS else {}
    return {k: v for k, v in want.items() if value.get(k) != v}


@pytest.fixture(scope="module")
def found() -> dict[str, list[tuple[str, str, str, dict]]]:
    out = {}
    for folder in quantity_walk.FOLDERS:
        values = []
        for obj in quantity_walk.render(folder):
            schema = quantity_walk.schema_of(obj)
            if schema is None:
                continue  # CRD kinds: test_canonical_quantities.NO_SCHEMA says which, and why nothing is lost
            name = f"{obj['kind']}/{obj['metadata'].get('name')}"
            values += [(name, path, kind, value) for path, kind, value in atomic_values(obj, schema)]
        out[str(folder.relative_to(quantity_walk.ROOT))] = values
    return out


def test_every_atomic_value_holds_its_defaults(found):
    wrong = [f"{where}: {name} {path}: write {missing_defaults(kind, value)} too"
             for where, values in found.items() for name, path, kind, value in values
             if missing_defaults(kind, value)]
    assert not wrong, "atomic values a server-side apply would conflict on:\n" + "\n".join(wrong)


def test_every_atomic_type_is_one_whose_defaults_are_known(found):
    kinds = {kind for values in found.values() for _n, _p, kind, _v in values}
    assert kinds - set(DEFAULTS) - NO_DEFAULTS == set()


def test_the_walk_finds_what_conflicted(found):
    paths = {(name, path) for name, path, _k, _v in found["deploy/base"]}
    assert ("ValidatingAdmissionPolicy/gpushard-device-channels", ".spec.matchConstraints") in paths
    assert ("ValidatingAdmissionPolicy/gpushard-agent-own-node", ".spec.matchConstraints.resourceRules[0]") in paths
    assert ("DaemonSet/gpushard-agent", ".spec.template.spec.containers[0].env[0].valueFrom.fieldRef") in paths


@pytest.mark.parametrize("kind,value", [
    (CORE + "ObjectFieldSelector", {"fieldPath": "spec.nodeName"}),
    (ADMISSION + "MatchResources", {"resourceRules": []}),
    (ADMISSION + "NamedRuleWithOperations", {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
                                             "resources": ["nodes"]}),
    ("io.k8s.api.rbac.v1.Subject", {"kind": "Group", "name": "gpu-admins"}),
])
def test_the_forms_that_conflicted_are_caught(kind, value):
    assert missing_defaults(kind, value)
