"""We test, over generated pods and workloads and over valid reviews with random damage (hypothesis),
under the default policy, the passthrough policies, and 10 shares per card without hiding GPUs:
- /mutate and /audit never answer 500: a damaged envelope (or NaN, which is no JSON) gets 400, anything
  else a well-formed AdmissionReview with the request's uid;
- every allowed patch applies (jsonpatch) and leaves gpushard's resources as the API server wants them:
  integer quantities, requests == limits, no fraction left in a Pod;
- /audit never patches and never denies;
- no review finds an internal error (the answer gpushard gives to a fault of its own).
"""

from __future__ import annotations

import copy
import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.admission import objects
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.core import names, quantities
from webhook.core import policy as policy_mod

RES = policy_mod.Resources()
CONFIGS = [{}, {"policy": {"wholeCards": "passthrough", "multiCard": "passthrough"}},
           {"sharesPerCard": 10, "policy": {"hideUnrequestedGpus": False, "placement": "spread"}}]
_clients: dict[int, object] = {}
# A bounded run in the suite; `make fuzz` runs a long one (GPUSHARD_FUZZ_EXAMPLES=20000).
EXAMPLES = int(os.environ.get("GPUSHARD_FUZZ_EXAMPLES", "250"))


def _client(config: int, view):
    """One app per config for the whole module: building one per example would dominate the run."""
    if config not in _clients:
        settings = settings_mod.from_mapping(CONFIGS[config])
        _clients[config] = app_mod.create_app(settings, view).test_client()
    return _clients[config]
GPU_NAMES = st.sampled_from(["nvidia.com/gpu", "nvidia.com/gpu", "gpushard.io/gpu", "gpushard.io/card-0",
                             "gpushard.io/card-1", "gpushard.io/card-07", "example.com/fpga", "cpu"])
QUANTITIES = st.one_of(
    st.sampled_from(["0", "0.1", "0.25", "250m", "0.333", "0.5", "1", "1.0", "1.5", "2", "25", "50", "100", "101",
                     "-1", "lots", "", "1e999999", "1e-3", "100m", "0.0001", "1Ki", " 0.5 ", "9" * 300]),
    st.integers(-3, 200), st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(),
    st.lists(st.integers(), max_size=2))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=10)


@st.composite
def containers(draw, name: str) -> dict:
    c: dict = {"name": name, "image": "cuda"}
    amounts = draw(st.dictionaries(GPU_NAMES, QUANTITIES, max_size=3))
    if amounts or draw(st.booleans()):
        limits = dict(amounts)
        other = st.dictionaries(GPU_NAMES, QUANTITIES, max_size=2)
        requests = dict(amounts) if draw(st.integers(0, 4)) else draw(other)
        c["resources"] = {k: v for k, v in (("limits", limits), ("requests", requests)) if draw(st.booleans()) or v}
    if draw(st.booleans()):
        c["env"] = draw(st.lists(st.one_of(
            st.fixed_dictionaries({"name": st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "GPUSHARD_FRACTION", "X"]),
                                   "value": st.sampled_from(["all", "0", "void", "1,2", ""])}),
            st.fixed_dictionaries({"name": st.just("NVIDIA_VISIBLE_DEVICES"),
                                   "valueFrom": st.just({"fieldRef": {"fieldPath": "metadata.name"}})}),
            JSON), max_size=3))
    return c


@st.composite
def pod_specs(draw) -> dict:
    spec = {"containers": [draw(containers(f"c{i}")) for i in range(draw(st.integers(1, 3)))]}
    if draw(st.booleans()):
        init = [draw(containers(f"i{i}")) for i in range(draw(st.integers(1, 2)))]
        for c in init:
            if draw(st.booleans()):
                c["restartPolicy"] = "Always"
        spec["initContainers"] = init
    if draw(st.booleans()):
        spec["nodeSelector"] = {"kubernetes.io/hostname": draw(st.sampled_from(["node-a", "node-b", "node-z"]))}
    return spec


@st.composite
def workloads(draw) -> tuple[dict, str]:
    spec = draw(pod_specs())
    meta = {"name": "x", "namespace": "ml"}
    if draw(st.booleans()):
        meta["annotations"] = {names.CARD_ANNOTATION: draw(st.sampled_from(["0", "1", "x"]))}
    kind = draw(st.sampled_from(["Pod", "Pod", "Pod", "Deployment", "Job", "CronJob", "PodTemplate", "Service"]))
    if kind == "Pod":
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}, kind
    obj = {"kind": kind, "metadata": meta}
    node = obj
    for key in names.TEMPLATE_PATHS.get(kind, ("spec", "template")):
        node[key] = {}
        node = node[key]
    node["spec"] = spec
    return obj, kind


def _default_requests(obj: dict, kind: str) -> dict:
    """The API server defaults a Pod's requests from its limits before any webhook sees it."""
    if kind == "Pod" and isinstance(obj.get("spec"), dict):
        for key in ("initContainers", "containers"):
            for c in obj["spec"].get(key) or []:
                res = c.get("resources") if isinstance(c, dict) else None
                if isinstance(res, dict) and isinstance(res.get("limits"), dict):
                    requests = res.setdefault("requests", {})
                    if isinstance(requests, dict):
                        for name, value in res["limits"].items():
                            requests.setdefault(name, value)
    return obj


def _spec_of(obj: dict, kind: str) -> dict | None:
    if kind == "Pod":
        return obj.get("spec")
    node = obj
    for key in names.TEMPLATE_PATHS.get(kind, ()):
        node = node.get(key) if isinstance(node, dict) else None
    return node.get("spec") if isinstance(node, dict) and names.TEMPLATE_PATHS.get(kind) else None


def _ours(name: str) -> bool:
    return name in (RES.fraction, RES.shares) or RES.card_index(name) is not None


def _check_admitted(obj: dict, kind: str) -> None:
    """gpushard's resources in an admitted object, as the API server's validation wants them."""
    spec = _spec_of(obj, kind)
    if not isinstance(spec, dict):
        return
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or []:
            resources = c.get("resources") or {}
            limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
            holds = any(RES.card_index(n) is not None and v is not None and quantities.parse(v) > 0
                        for n, v in limits.items())
            for name in set(limits) | set(requests):
                if not _ours(name):
                    continue
                # null: gpushard reads it as absent (the API server decodes it as zero before any webhook).
                values = [quantities.parse(v[name]) for v in (limits, requests) if v.get(name) is not None]
                assert all(v.denominator == 1 for v in values), (name, c)
                assert len(set(values)) <= 1, (name, c)
                if kind == "Pod" and holds:
                    assert RES.fraction not in limits, c


def _post(client, path: str, review: dict):
    return client.post(path, data=json.dumps(review), content_type="application/json")


def _strict_json(doc) -> bool:
    try:
        json.dumps(doc, allow_nan=False)
        return True
    except ValueError:
        return False


def _exercise(client, review: dict, envelope_intact: bool) -> None:
    # NaN and infinities are no JSON: a body that holds them is refused as a whole.
    envelope_intact = envelope_intact and _strict_json(review)
    request = review.get("request") if isinstance(review, dict) else None
    obj = copy.deepcopy(request.get("object")) if isinstance(request, dict) else None
    for path in ("/mutate", "/audit"):
        resp = _post(client, path, review)
        assert resp.status_code in ((200,) if envelope_intact else (200, 400)), resp.get_data(as_text=True)
        if resp.status_code == 400:
            assert resp.get_data(as_text=True).startswith("gpushard:")
            continue
        response = objects.response_of(resp.get_json(), request["uid"])
        # 500 is gpushard's answer to a fault of its own: none may be found.
        assert response.get("status", {}).get("code") != 500, response
        assert not any("internal error" in w for w in response.get("warnings", [])), response
        if path == "/audit":
            assert response["allowed"] is True and "patch" not in response
            continue
        kind = request["kind"].get("kind") if isinstance(request.get("kind"), dict) else None
        # A Pod UPDATE is let through untouched: a pod's resources cannot change after creation.
        rewritten = request.get("operation", "CREATE") == "CREATE" or kind != "Pod"
        if response["allowed"] and isinstance(obj, dict) and rewritten:
            _check_admitted(objects.patched(obj, response), kind)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads(), dry_run=st.booleans(), operation=st.sampled_from(["CREATE", "CREATE", "UPDATE"]),
       config=st.integers(0, len(CONFIGS) - 1))
def test_generated_workloads(view, workload, dry_run, operation, config):
    obj, kind = workload
    review = objects.review(_default_requests(obj, kind), kind=kind, operation=operation, dry_run=dry_run)
    _exercise(_client(config, view), review, envelope_intact=True)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads(), data=st.data(), config=st.integers(0, len(CONFIGS) - 1))
def test_damaged_reviews(view, workload, data, config):
    client = _client(config, view)
    obj, kind = workload
    review = objects.review(_default_requests(obj, kind), kind=kind, uid="fuzz")
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(review) if p]
        path = data.draw(st.sampled_from(paths))
        parent = review
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON | QUANTITIES)
    request = review.get("request")
    intact = (review.get("apiVersion") == "admission.k8s.io/v1" and review.get("kind") == "AdmissionReview"
              and isinstance(request, dict) and isinstance(request.get("uid"), str) and request["uid"] != "")
    _exercise(client, review, envelope_intact=intact)
