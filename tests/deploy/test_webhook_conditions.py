"""The two entries of enforce namespaces (deploy/base/webhook-configuration.yaml), their matchConditions
evaluated for real (cel-python, as the API server would: tests/deploy/admission_policy.py).

We test:
- enforce.gpushard.io (failurePolicy Fail) and hide.gpushard.io (Ignore) are one entry twice: the same service
  path, rules, namespace selector and settings, one condition each; hide's is a negation whose cost is the
  same for every object (no macro over any of the object's lists or maps), so no object can make it err,
  and it names only resources enforce's condition names; both compile;
- for every Pod and pod template of tests/golden and examples/ and the cases below, on CREATE and (for
  templates) UPDATE, at least one of the two is called, never neither, enforce wherever it must, and no
  condition errs (an error would refuse the object under Fail and skip it under Ignore);
- what each sees: GPU asks of every resource name gpushard reads (limits or requests, app or init
  containers only), a DeviceClass's own extended resource, DRA claims, the host access the webhook
  denies (privileged, capabilities beyond baseline, hostPID, hostPath, the device-list folder,
  device-injecting annotations), an author's NVIDIA_VISIBLE_DEVICES other than gpushard's own ``void``, and
  every debug container go to enforce; a plain pod or template, baseline capabilities and ordinary volumes
  go to hide, in every kind that holds a pod template;
- what the hide entry sees needs no judging: the webhook's own decision (webhook/core/decisions.py, in
  enforce mode, with each golden manifest's config, under either backend) admits it, places nothing,
  and changes nothing but adding NVIDIA_VISIBLE_DEVICES=void; so while the webhook is down, skipping it
  loses that rewrite and nothing else, and everything the webhook would refuse or place is held by the
  Fail entry; and what it wrote goes back to the hide entry (a reinvocation, a pod made again from its
  manifest);
- the lists in the condition are the code's: the annotation families, Pod Security's baseline
  capabilities, the GPU resource names, the device-list folder, the env name;
- outside enforce namespaces and in gpushard-system neither entry is called.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import re

import pytest
import yaml

from tests.deploy import admission_policy, rendering
from tests.deploy.test_admission_policy import manifest_objects
from tests.deploy.test_manifests import BASE
from tests.deploy.test_opt_in_guard import ENFORCED, NOT_OPTED_IN, RESOURCES, container, pod_spec, wrap
from webhook import settings
from webhook.core import decisions, extended, names
from webhook.core import policy as policy_mod
from webhook.core.policy import Resources

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests/golden"
ENFORCE, HIDE = "enforce.gpushard.io", "hide.gpushard.io"
GPU_KINDS = ("Pod", *sorted(names.TEMPLATE_PATHS))


@pytest.fixture(scope="module")
def hooks() -> dict[str, dict]:
    config, = [o for o in rendering.render(BASE) if o["kind"] == "MutatingWebhookConfiguration"]
    return {h["name"]: h for h in config["webhooks"]}


def request_for(obj: dict, operation: str = "CREATE", sub: str = "") -> dict:
    group, resource = RESOURCES[obj["kind"]]
    return {"operation": operation, "namespace": "lab", "subResource": sub, "dryRun": False,
            "kind": {"group": group, "version": "v1", "kind": obj["kind"]},
            "resource": {"group": group, "version": "v1", "resource": resource},
            "userInfo": {"username": "alice"}}


def called(hooks: dict, obj: dict, namespace: dict = ENFORCED, operation: str = "CREATE", sub: str = "",
           old: dict | None = None) -> list[str]:
    """The entries the API server calls for the request; fails on any condition that errs."""
    out = []
    for name, hook in hooks.items():
        outcome = admission_policy.webhook_called(hook, request_for(obj, operation, sub), obj, old, namespace)
        assert not outcome.errored, (name, outcome.message)
        if outcome.matched:
            out.append(name)
    return out


def side(hooks: dict, obj: dict, **kwargs) -> str:
    """ENFORCE when the enforce entry is called (hide may be too, after it); HIDE when only hide is."""
    found = called(hooks, obj, **kwargs)
    assert found in ([ENFORCE], [ENFORCE, HIDE], [HIDE]), found
    return found[0]


def normal(text: str) -> str:
    return " ".join(text.split())


def test_the_hide_entry_is_the_enforce_entry_with_a_condition_of_fixed_cost(hooks):
    enforce, hide = hooks[ENFORCE], hooks[HIDE]
    assert (enforce["failurePolicy"], hide["failurePolicy"]) == ("Fail", "Ignore")
    same = ("clientConfig", "rules", "namespaceSelector", "matchPolicy", "admissionReviewVersions", "timeoutSeconds",
            "reinvocationPolicy")
    assert {k: enforce[k] for k in same} == {k: hide[k] for k in same}
    assert enforce["clientConfig"]["service"]["path"] == "/mutate"
    condition, = enforce["matchConditions"]
    negated, = hide["matchConditions"]
    text = normal(negated["expression"])
    assert text.startswith("!( ") and text.endswith(" )")
    # The only macros range over one-element list literals: the cost is the same for any object.
    for macro in re.finditer(r"(\S*)\.(exists|all|map|filter|exists_one)\(", text):
        assert macro.group(1).endswith("]"), macro.group(0)
    res = Resources()
    assert set(re.findall(r"'([^']*)' in c\.resources\.", text)) == {res.fraction, res.shares}
    whole = normal(condition["expression"])
    assert f"r == '{res.fraction}'" in whole and "r.startsWith('gpushard.io/')" in whole
    assert res.shares.startswith("gpushard.io/")
    assert admission_policy.webhook_problems(enforce) == [] and admission_policy.webhook_problems(hide) == []
    assert "matchConditions" not in hooks["audit.gpushard.io"]


@pytest.mark.parametrize("count", [2000, 20000])
def test_a_costly_object_is_refused_or_hidden_never_skipped(hooks, count):
    # Annotations and env entries: the enforce condition's cost grows with them (past the API server's limit at
    # 20,000), the hide condition's does not. Past the limit the enforce entry errs, which refuses under Fail.
    spec = pod_spec(container("app", env=[{"name": f"E{i}", "value": "x"} for i in range(count)]))
    obj = _object("Pod", spec, {f"example.com/a{i}": "x" for i in range(count)})
    request = request_for(obj)
    enforce = admission_policy.webhook_called(hooks[ENFORCE], request, obj, None, ENFORCED)
    hide = admission_policy.webhook_called(hooks[HIDE], request, obj, None, ENFORCED)
    assert not hide.errored and hide.matched, hide.message
    assert enforce.errored == (count == 20000) and not enforce.matched, enforce.message


def _cases() -> dict[str, tuple[dict, str]]:
    """Pod specs and the entry that must see them."""
    res = Resources()
    gpu = {res.fraction: "0.5"}
    cases = {
        "plain": (pod_spec(container("app")), HIDE),
        "plain with an init container": (pod_spec(container("app"), init=[container("setup")]), HIDE),
        "cpu and memory only": (pod_spec(container("app", {"cpu": "1", "memory": "1Gi"}, part="requests")), HIDE),
        "a look-alike resource": (pod_spec(container("app", {"example.com/gpu": "1", "nvidia.com/gpus": "1"})), HIDE),
        "an empty resources": (pod_spec(container("app", resources={})), HIDE),
        "baseline capabilities": (pod_spec(container("app", securityContext={
            "capabilities": {"add": list(names.BASELINE_CAPABILITIES), "drop": ["ALL"]}})), HIDE),
        "not privileged": (pod_spec(container("app", securityContext={"privileged": False})), HIDE),
        "ordinary volumes": ({**pod_spec(container("app", volumeMounts=[{"name": "d", "mountPath": "/data"}])),
                              "volumes": [{"name": "d", "emptyDir": {}}, {"name": "c", "configMap": {"name": "x"}}]},
                             HIDE),
        "another env": (pod_spec(container("app", env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}])), HIDE),
        "hostPID false": ({**pod_spec(container("app")), "hostPID": False}, HIDE),
        "a fraction": (pod_spec(container("train", gpu)), ENFORCE),
        "a fraction requested": (pod_spec(container("train", gpu, part="requests")), ENFORCE),
        "a whole card": (pod_spec(container("train", {res.fraction: "1"})), ENFORCE),
        "shares": (pod_spec(container("train", {res.shares: "25"})), ENFORCE),
        "a card": (pod_spec(container("train", {res.card(3): "25"})), ENFORCE),
        "memory": (pod_spec(container("train", {res.memory: "10Gi"})), ENFORCE),
        "only an init container asks": (pod_spec(container("app"), init=[container("warm", gpu)]), ENFORCE),
        "the second container asks": (pod_spec(container("app"), container("train", gpu)), ENFORCE),
        "DRA claims": ({**pod_spec(container("app")), "resourceClaims": [
            {"name": "x", "resourceClaimTemplateName": "t"}]}, ENFORCE),
        "gpushard's own claim in a plain pod": ({**pod_spec(container("app")), "resourceClaims": [
            {"name": names.DRA_POD_CLAIM, "resourceClaimTemplateName": f"{names.DRA_TEMPLATE_PREFIX}25"}]}, ENFORCE),
        "another claim of gpushard's templates": ({**pod_spec(container("app")), "resourceClaims": [
            {"name": "mine", "resourceClaimTemplateName": f"{names.DRA_TEMPLATE_PREFIX}100"}]}, ENFORCE),
        "a DeviceClass's extended resource": (pod_spec(container("app", {
            f"{names.DRA_EXTENDED_PREFIX}{names.DRA_DEVICE_CLASS}": "1"})), ENFORCE),
        "another DeviceClass's extended resource": (pod_spec(container("app", {
            f"{names.DRA_EXTENDED_PREFIX}nic.example.com": "1"}, part="requests")), ENFORCE),
        "privileged": (pod_spec(container("app", securityContext={"privileged": True})), ENFORCE),
        "privileged init": (pod_spec(container("app"), init=[container("s", securityContext={"privileged": True})]),
                            ENFORCE),
        "SYS_ADMIN": (pod_spec(container("app", securityContext={"capabilities": {"add": ["SYS_ADMIN"]}})), ENFORCE),
        "CAP_CHOWN, as written": (pod_spec(container("app", securityContext={"capabilities": {"add": ["CAP_CHOWN"]}})),
                                  ENFORCE),
        "hostPID": ({**pod_spec(container("app")), "hostPID": True}, ENFORCE),
        "a hostPath": ({**pod_spec(container("app")), "volumes": [{"name": "h", "hostPath": {"path": "/var/log"}}]},
                       ENFORCE),
        "the device-list folder": (pod_spec(container("app", volumeMounts=[
            {"name": "n", "mountPath": "/var/run/nvidia-container-devices/all"}])), ENFORCE),
        "NVIDIA_VISIBLE_DEVICES written": (pod_spec(container("app", env=[
            {"name": names.VISIBLE_DEVICES_ENV, "value": "all"}])), ENFORCE),
        # What the hide entry writes: a copy of a pod it hid, or the same pod when the API server calls the
        # entry again after another webhook, comes back to it.
        "NVIDIA_VISIBLE_DEVICES=void, as gpushard hides": (pod_spec(container("app", env=[
            {"name": names.VISIBLE_DEVICES_ENV, "value": names.VISIBLE_NONE}])), HIDE),
        "void, then written again": (pod_spec(container("app", env=[
            {"name": names.VISIBLE_DEVICES_ENV, "value": names.VISIBLE_NONE},
            {"name": names.VISIBLE_DEVICES_ENV, "value": "0"}])), ENFORCE),
        "NVIDIA_VISIBLE_DEVICES from a reference": (pod_spec(container("app", env=[
            {"name": names.VISIBLE_DEVICES_ENV, "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}])),
            ENFORCE),
        "NVIDIA_VISIBLE_DEVICES empty": (pod_spec(container("app", env=[
            {"name": names.VISIBLE_DEVICES_ENV, "value": ""}])), ENFORCE),
    }
    for family in names.INJECTING_ANNOTATION_FAMILIES:
        cases[f"annotation {family}"] = (pod_spec(container("app")), ENFORCE, {f"{family}/container.app": "x"})
    return {k: v if len(v) == 3 else (*v, None) for k, v in cases.items()}


CASES = _cases()


def _object(kind: str, spec: dict, annotations: dict | None) -> dict:
    obj = wrap(kind, copy.deepcopy(spec))
    if annotations:
        holder = obj if kind == "Pod" else (
            obj["template"] if kind == "PodTemplate" else
            obj["spec"]["jobTemplate"]["spec"]["template"] if kind == "CronJob" else obj["spec"]["template"])
        holder.setdefault("metadata", {})["annotations"] = annotations
    return obj


@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_what_each_entry_sees(hooks, case, kind):
    spec, expected, extra = CASES[case]
    obj = _object(kind, spec, extra)
    assert side(hooks, obj) == expected
    if kind != "Pod":
        assert side(hooks, obj, operation="UPDATE", old=copy.deepcopy(obj)) == expected


def test_every_debug_container_goes_to_the_enforce_entry(hooks):
    pod = wrap("Pod", pod_spec(container("app")))
    debug = copy.deepcopy(pod)
    debug["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", "targetContainerName": "app"}]
    assert side(hooks, debug, operation="UPDATE", sub="ephemeralcontainers", old=pod) == ENFORCE


def test_a_template_without_its_pod_is_seen_once_without_an_error(hooks):
    # The API server validates after mutating admission: what the webhooks see may lack required fields.
    rc = {"apiVersion": "v1", "kind": "ReplicationController", "metadata": {"name": "x"}, "spec": {"replicas": 1}}
    cron = {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "x"}, "spec": {"schedule": "* * * * *"}}
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}}
    for obj in (rc, cron, template, {**rc, "spec": {"template": {}}}):
        assert side(hooks, obj) == HIDE


def _golden() -> list[tuple[str, dict, object, object]]:
    """(where, object, policy, served) for every pod and template of tests/golden, with its rule's config."""
    found = []
    for path in sorted(GOLDEN.glob("*.yaml")):
        if path.name.endswith(".config.yaml"):
            continue
        rule = path.name.split(".")[0]
        config = GOLDEN / f"{rule}.config.yaml"
        policy = settings.load(config if config.exists() else None).policy
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        served = extended.served_by(d for d in docs if d.get("kind") == extended.KIND)
        for i, doc in enumerate(docs):
            if doc.get("kind") in RESOURCES and path.name != "unreadable.fail.yaml":
                found.append((f"{path.name}#{i}", doc, policy, served))
    return found


def _everything() -> list[tuple[str, dict, object, object]]:
    default = settings.Settings().policy
    out = _golden() + [(where, obj, default, extended.NONE) for where, obj in manifest_objects()]
    for case, (spec, _expected, extra) in CASES.items():
        out += [(f"{case} ({kind})", _object(kind, spec, extra), default, extended.NONE) for kind in GPU_KINDS]
    return out


def _without_hiding(obj: dict) -> dict:
    """The object with every NVIDIA_VISIBLE_DEVICES=void entry taken out (what the hide rewrite adds)."""
    obj = copy.deepcopy(obj)
    specs = [obj["template"].get("spec") or {}] if obj["kind"] == "PodTemplate" and "template" in obj else \
        rendering.pod_specs(obj)
    for spec in specs:
        for key in ("initContainers", "containers", "ephemeralContainers"):
            for c in spec.get(key) or []:
                if "env" in c:
                    c["env"] = [e for e in c["env"] if e != {"name": names.VISIBLE_DEVICES_ENV, "value": "void"}]
                    if not c["env"]:
                        del c["env"]
    return obj


def test_every_object_is_seen_and_what_only_the_hide_entry_sees_needs_no_judging(hooks):
    everything = _everything()
    assert len(everything) > 300
    seen = {ENFORCE: 0, HIDE: 0}
    for where, obj, policy, served in everything:
        operations = ["CREATE"] if obj["kind"] == "Pod" else ["CREATE", "UPDATE"]
        for operation in operations:
            old = copy.deepcopy(obj) if operation == "UPDATE" else None
            found = called(hooks, obj, operation=operation, old=old)
            assert found in ([ENFORCE], [ENFORCE, HIDE], [HIDE]), (where, operation, found)
            seen[found[0]] += 1
        if found != [HIDE]:
            continue
        # With either backend: under dra the webhook also judges a pod's claims.
        for backend in (policy, dataclasses.replace(policy, backend=policy_mod.DRA)):
            decision = decisions.decide(decisions.Request(copy.deepcopy(obj), obj["kind"], "CREATE",
                                                          names.MODE_ENFORCE, namespace="lab", served=served),
                                        backend, None)
            assert decision.allowed, (where, decision.message)
            assert decision.shares == 0 and decision.card is None, where
            rewritten = decision.obj if decision.obj is not None else obj
            assert _without_hiding(rewritten) == _without_hiding(obj), where
            # What the hide entry wrote goes back to it: when the API server calls the entries again (another
            # webhook added a container), and when the pod is made again from its manifest while the webhook
            # is down.
            assert called(hooks, rewritten) == [HIDE], where
    assert seen[ENFORCE] > 100 and seen[HIDE] > 50, seen


def _cel_list(expression: str, after: str) -> list[str]:
    tail = expression[expression.index(after) + len(after):]
    return re.findall(r"'([^']*)'", tail[:tail.index("]")])


def test_the_condition_names_what_the_code_names(hooks):
    text = normal(hooks[ENFORCE]["matchConditions"][0]["expression"])
    assert _cel_list(text, "k.split('/')[0] in [") == list(names.INJECTING_ANNOTATION_FAMILIES)
    assert _cel_list(text, "!(a in [") == list(names.BASELINE_CAPABILITIES)
    res = Resources()
    asked = re.findall(r"r == '([^']*)' \|\| r\.startsWith\('([^']*)'\) \|\| r\.startsWith\('([^']*)'\)", text)
    assert len(asked) == 2 and set(asked) == {(res.fraction, "gpushard.io/", names.DRA_EXTENDED_PREFIX)}
    for name in (res.shares, res.card_prefix, res.memory):
        assert name.startswith("gpushard.io/"), name
    assert all("nvidia-container-devices" in root for root in names.DEVICE_LIST_MOUNT_ROOTS)
    assert "m.mountPath.contains('nvidia-container-devices')" in text
    assert f"e.name == '{names.VISIBLE_DEVICES_ENV}'" in text
    assert f"e.value == '{names.VISIBLE_NONE}'" in text


@pytest.mark.parametrize("namespace", [*NOT_OPTED_IN, admission_policy.namespace_object("gpushard-system", {
    names.MODE_LABEL: names.MODE_ENFORCE})], ids=["no-label", "audit", "bad-label", "gpushard-system"])
def test_neither_entry_outside_enforce_namespaces(hooks, namespace):
    for spec, _expected, extra in CASES.values():
        found = called(hooks, _object("Pod", spec, extra), namespace=namespace)
        assert ENFORCE not in found and HIDE not in found
