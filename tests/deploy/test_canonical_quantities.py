"""Every quantity in deploy/ is written as the API server stores it, so that a server-side apply after a
client-side one (`kubectl apply --server-side -k deploy/base` after `kubectl apply -k deploy/base`), or a
GitOps diff, finds nothing of its own to change: the API server stores "1000" as "1k", and a field the
applier owns with another value is a conflict.

We test:
- every field of type resource.Quantity in every rendered kustomization (deploy/base, each overlay,
  examples/kind), found through the Kubernetes schemas kubernetes-validate ships (requests and limits of
  every container, emptyDir sizeLimit, quota hard values, DRA capacities, whatever the schema says), is
  in canonical form (webhook.core.quantities.canonical);
- the walk finds the fields it must, so that a broken walk cannot pass by finding nothing;
- kubectl's own resource.Quantity (`kubectl create quota --dry-run=client`) writes what the canonicaliser
  writes, on the known pairs and on generated quantities.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy import rendering
from webhook.core import quantities

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
FOLDERS = [DEPLOY / "base", *sorted(p for p in (DEPLOY / "overlays").iterdir() if p.is_dir()), ROOT / "examples/kind"]
KUBECTL = shutil.which("kubectl")
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
VERSION = kubernetes_validate.utils.latest_version()
SCHEMAS = f"kubernetes-json-schema/v{VERSION}-local"
# Kinds of CRDs, for which kubernetes-validate ships no schema. None of the fields gpushard writes in
# them is a Quantity: issuers and certificates name secrets, issuers and DNS names; the monitors name
# selectors and endpoints; rules are PromQL text.
NO_SCHEMA = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate"),
             ("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule")}


def render(folder: Path) -> list[dict]:
    """The objects `kubectl kustomize` renders; the test renderer where kubectl is not installed (the two
    agree: tests/deploy/test_rendered.py)."""
    if KUBECTL is None:
        return rendering.render(folder)
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


_definitions: dict | None = None


def definitions() -> dict:
    global _definitions
    if _definitions is None:
        _definitions = kubernetes_validate.utils.schema_contents(f"{SCHEMAS}/_definitions.json", VERSION)["$defs"]
    return _definitions


def schema_of(obj: dict) -> dict | None:
    """The kind's schema, as kubernetes-validate names its files (rbac.authorization.k8s.io/v1 -> rbac-v1)."""
    api_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    try:
        return kubernetes_validate.utils.schema_contents(f"{SCHEMAS}/{obj['kind'].lower()}-{api_version}.json",
                                                         VERSION)
    except FileNotFoundError:
        return None


def typed_values(value, schema: dict, path: str = ""):
    """(path, definition name, value) of every value under ``value`` whose schema names a definition."""
    ref = schema.get("$ref")
    if ref is not None:
        name = ref.rpartition("/$defs/")[2]
        yield path, name, value
        yield from typed_values(value, definitions()[name], path)
    for branch in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(branch, ()):
            yield from typed_values(value, sub, path)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                yield from typed_values(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from typed_values(item, extra, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from typed_values(item, schema["items"], f"{path}[{index}]")


def quantity_fields(value, schema: dict, path: str = ""):
    """(path, value) of every field under ``value`` whose schema is resource.Quantity."""
    return ((where, item) for where, name, item in typed_values(value, schema, path) if name == QUANTITY)


@pytest.fixture(scope="module")
def found() -> dict[str, list[tuple[str, str, object]]]:
    """Per kustomization: (object, path, value) of every Quantity field."""
    out = {}
    for folder in FOLDERS:
        fields = []
        for obj in render(folder):
            schema = schema_of(obj)
            if schema is None:
                assert (obj["apiVersion"], obj["kind"]) in NO_SCHEMA, \
                    f"{obj['apiVersion']} {obj['kind']}: no schema to find its quantities in; say here which it has"
                continue
            name = f"{obj['kind']}/{obj['metadata'].get('name')}"
            fields += [(name, path, value) for path, value in quantity_fields(obj, schema)]
        out[str(folder.relative_to(ROOT))] = fields
    return out


def test_every_quantity_is_written_as_the_api_server_stores_it(found):
    wrong = [f"{where}: {name} {path}: {value!r}, stored as {quantities.canonical(value)!r}"
             for where, fields in found.items() for name, path, value in fields
             if not isinstance(value, str) or quantities.canonical(value) != value]
    assert not wrong, "write these as the API server stores them:\n" + "\n".join(wrong)


def test_the_walk_finds_the_quantities_it_must(found):
    paths = {(name, re.sub(r"\[\d+\]", "[]", path)) for name, path, _value in found["deploy/base"]}
    for must in [("ResourceQuota/gpushard-critical-pods", ".spec.hard.pods"),
                 ("Deployment/gpushard-webhook", ".spec.template.spec.containers[].resources.limits.memory"),
                 ("Deployment/gpushard-webhook", ".spec.template.spec.containers[].resources.requests.cpu"),
                 ("Deployment/gpushard-webhook", ".spec.template.spec.volumes[].emptyDir.sizeLimit"),
                 ("DaemonSet/gpushard-agent", ".spec.template.spec.containers[].resources.requests.memory"),
                 ("CronJob/gpushard-certs-renew",
                  ".spec.jobTemplate.spec.template.spec.containers[].resources.limits.cpu")]:
        assert must in paths, (must, sorted(paths))
    assert all(fields for fields in found.values())


# --- the canonicaliser against kubectl's own resource.Quantity -------------------------------------

def _kubectl_stores(texts: list[str]) -> list[str]:
    hard = ",".join(f"q{i}={text}" for i, text in enumerate(texts))
    done = subprocess.run([KUBECTL, "create", "quota", "canonical", f"--hard={hard}", "--dry-run=client", "-o", "json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    stored = json.loads(done.stdout)["spec"]["hard"]
    return [stored[f"q{i}"] for i in range(len(texts))]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
def test_kubectl_stores_what_the_canonicaliser_writes():
    pairs = ["1Ki", "1024Mi", "1000M", ".001Ki", ".000001Ki", ".000000001Ki", ".000000000001Ki", "1000", "0.5",
             "100m", "1.5", "2000m", "1500k", "1.", ".5", "0.1n", "1.5Gi", "0.5Gi", "1.5Ki", "1024Ki", "1023Ki",
             "5120Mi", "16Ei", "12e6", "15e2", "1.5e3", "1e-10", "10e3", "0", "0Mi", "-0", "-1000", "-1.5Gi",
             "1e-05", "+1", "010", "1E3"]
    generator = random.Random(7)
    suffixes = ["", "n", "u", "m", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti", "e3", "e-4", "e6"]
    for _ in range(300):
        whole, places = generator.randrange(-(10**9), 10**9), generator.randrange(0, 7)
        number = f"{whole / 10**places:.{places}f}" if places else str(whole)
        pairs.append(number + generator.choice(suffixes))
    stored = _kubectl_stores(pairs)
    rewritten = 0
    for text, kept in zip(pairs, stored, strict=True):
        ours = quantities.canonical(text)
        if ours == text:
            assert kept == text, f"{text!r} is canonical, yet stored as {kept!r}"
        elif kept != text:
            # ParseQuantity hands some spellings back as written ("+1", "010", "1E3", "1."), and
            # rewrites all others into the one canonical form.
            assert kept == ours, f"{text!r} is stored as {kept!r}, not {ours!r}"
            rewritten += 1
    assert rewritten > 100
