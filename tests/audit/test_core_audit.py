"""The pure audit core: namespace modes, per-card shares as Kubernetes counts them, usage, and the context rules.

We test:
- a namespace's mode label: enforce, audit, absent (not opted in), and a bad value read as enforce
  with a message saying why;
- per-card shares of a pod: requests defaulted from limits, init containers against app
  containers and sidecars, several cards, unreadable values and shapes;
- usage: shared nodes only, finished pods not counted, pending pinned pods listed, a card the
  node stopped offering kept with capacity 0; pending pods stranded on a full card while another
  card has room named with what to do (bare pods: recreate them; ReplicaSets: gpushard replace);
- the context rules on their own: annotation and pin, nvidia.com/gpu and unpinned shares on shared
  nodes, cards the node lacks, objects that cannot be read;
- odd shapes (an env that is no list, entries that are no mappings, a kind that is no text) are
  read without an exception, in objects, in a whole audit and in usage;
- in an enforced namespace, what enforce mode rewrites is no finding in templates and in Pods still
  to be created, but stays one, saying so, in Pods that already exist (uid, node or status);
- existing GPU-less pods on shared nodes and ephemeral containers: `unhidden` per mode, wording and
  container, none for hidden ones, for GPU-requesting containers, for unknown namespaces, for
  ephemeral containers of pods still to be created, or with hideUnrequestedGpus off; odd
  ephemeralContainers shapes are no crash;
- every pass golden pod, once admitted in enforce mode, audits clean (gpushard's own writing is
  never a finding), as a manifest and as the running pod it becomes;
- the admission evaluator in audit mode on a pod gpushard itself admitted finds nothing;
- DeviceClasses among the objects: each of another driver serving a name gpushard writes is a deny finding
  of its own, one serving nvidia.com/gpu a warning, sorted after Nodes and counted as audited objects; the
  pods and workloads audited beside them get the webhook's findings of them; unreadable classes are skipped.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from webhook.core import auditing, decisions, names, policy
from webhook.core import findings as f

POLICY = policy.Policy()
GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "golden"


@pytest.mark.parametrize("labels, mode, problem", [
    ({names.MODE_LABEL: "enforce"}, "enforce", False),
    ({names.MODE_LABEL: "audit"}, "audit", False),
    ({}, None, False),
    (None, None, False),
    ({names.MODE_LABEL: "Audit"}, "enforce", True),
    ({names.MODE_LABEL: ""}, "enforce", True),
])
def test_namespace_mode(labels, mode, problem):
    got = auditing.namespace_mode("ml", labels)
    assert got.mode == mode
    assert bool(got.problem) == problem
    if problem:
        assert got.problem.startswith('gpushard: namespace "ml" has gpushard.io/mode="')


def spec(*containers: dict, init: tuple[dict, ...] = ()) -> dict:
    return {"initContainers": list(init), "containers": list(containers)}


def c(name: str, card: int | None = None, shares: int | str = 0, part: str = "limits", **extra) -> dict:
    out = {"name": name, **extra}
    if card is not None:
        out["resources"] = {part: {f"gpushard.io/card-{card}": shares}}
    return out


def test_card_shares_counts_like_kubernetes():
    # App containers and sidecars add up; a regular init container runs alone (beside earlier sidecars).
    s = spec(c("a", 0, 20), c("b", 0, "30"),
             init=(c("side", 0, 10, restartPolicy="Always"), c("warm", 0, 90), c("late-side", 0, 5,
                                                                                   restartPolicy="Always")))
    assert auditing.card_shares(s, POLICY) == {0: 100}  # max(90 + 10, 10 + 5 + 20 + 30)
    assert auditing.card_shares(spec(c("a", 0, 20, part="requests")), POLICY) == {0: 20}
    assert auditing.card_shares(spec(c("a", 0, 20), c("b", 3, 40)), POLICY) == {0: 20, 3: 40}
    assert auditing.card_shares(spec(c("a", 0, "lots"), c("b")), POLICY) == {}
    assert auditing.card_shares({"containers": "nope"}, POLICY) == {}


def node(name: str, cards: dict[int, str], labels: dict | None = None) -> dict:
    return {"kind": "Node", "metadata": {"name": name, "labels": labels or {}},
            "status": {"allocatable": {f"gpushard.io/card-{k}": v for k, v in cards.items()}}}


def pod(name: str, node_name: str | None, card: int, shares: int, phase: str = "Running", **meta) -> dict:
    s = spec(c("t", card, shares))
    if node_name:
        s["nodeName"] = node_name
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "ml", **meta}, "spec": s,
            "status": {"phase": phase}}


def test_usage():
    nodes = [node("a", {0: "100", 1: "0"}), node("plain", {}), node("labelled", {}, {names.CARDS_LABEL: "0"})]
    pods = [pod("p", "a", 0, 30), pod("q", "a", 1, 50), pod("done", "a", 0, 70, "Succeeded"),
            pod("gone", "a", 4, 10), pod("wait", None, 0, 5), pod("elsewhere", "plain", 0, 10)]
    use = auditing.usage(nodes, pods, POLICY)
    assert [n.name for n in use.nodes] == ["a", "labelled"]
    cards = {k.index: k for k in use.nodes[0].cards}
    assert (cards[0].used, cards[0].free, cards[0].capacity) == (30, 70, 100)
    assert (cards[1].used, cards[1].free, cards[1].capacity) == (50, 0, 0)  # unhealthy: offers 0
    assert (cards[4].used, cards[4].capacity) == (10, 0)  # gone from allocatable, holder still shown
    assert [h.name for h in cards[0].holders] == ["p"]
    assert use.pending == ((auditing.Holder("ml", "wait", 5), 0),)
    assert (use.capacity, use.used, use.free) == (100, 90, 70)


def test_usage_names_stranded_pods_and_what_to_do():
    nodes = [node("a", {0: "100", 1: "100"})]
    owned = {"ownerReferences": [{"kind": "ReplicaSet", "name": "web", "controller": True}]}
    pods = [pod("full", "a", 0, 90), pod("bare", None, 0, 20), pod("web-1", None, 0, 20, "Pending", **owned),
            pod("fits", None, 0, 10), pod("huge", None, 0, 100)]
    use = auditing.usage(nodes, pods, POLICY)
    stranded = {h.name: (k, hint) for h, k, hint in use.stranded}
    assert set(stranded) == {"bare", "web-1", "huge"}  # fits: card 0 has room; huge: card 1 has 100
    assert "bare pod" in stranded["bare"][1] and "delete it" in stranded["bare"][1]
    assert "gpushard replace" in stranded["web-1"][1] and "ReplicaSet" in stranded["web-1"][1]


def rules(found) -> list[str]:
    return [x.rule for x in found]


def test_context_rules_on_pods():
    nodes = {"a": auditing.node_cards(node("a", {0: "100", 1: "100"}), POLICY)}
    enforce = auditing.NamespaceMode(names.MODE_ENFORCE)
    pinned = pod("p", "a", 1, 30)
    pinned["spec"]["containers"][0]["resources"]["limits"]["gpushard.io/gpu"] = 30
    assert rules(auditing.audit_object(pinned, enforce, POLICY, nodes)) == []
    pinned["metadata"]["annotations"] = {names.CARD_ANNOTATION: "0"}
    assert rules(auditing.audit_object(pinned, enforce, POLICY, nodes)) == [auditing.ANNOTATION_MISMATCH]
    far = pod("far", "a", 7, 30)
    assert rules(auditing.audit_object(far, enforce, POLICY, nodes)) == [auditing.NO_SUCH_CARD]
    assert rules(auditing.audit_object(far, enforce, POLICY, {})) == []  # no node in sight: nothing to compare
    loose = {"kind": "Pod", "metadata": {"name": "l", "namespace": "ml"},
             "spec": {"nodeName": "a", "containers": [{"name": "t", "resources": {"limits": {"gpushard.io/gpu": 5}}}]}}
    assert rules(auditing.audit_object(loose, enforce, POLICY, nodes)) == [auditing.UNPINNED]
    loose["metadata"]["annotations"] = {names.CARD_ANNOTATION: "1"}
    assert rules(auditing.audit_object(loose, enforce, POLICY, nodes)) == [auditing.ANNOTATION_MISMATCH,
                                                                          auditing.UNPINNED]


def test_objects_gpushard_cannot_read():
    broken = {"kind": "Deployment", "metadata": {"name": "d", "namespace": "x"},
              "spec": {"template": {"spec": {"containers": "oops"}}}}
    not_opted_in = auditing.NamespaceMode(None)
    assert "unreadable" in rules(auditing.audit_object(broken, not_opted_in, POLICY))
    assert auditing.audit_object({"kind": "Service", "metadata": {"name": "s"}}, not_opted_in, POLICY) == []
    gpu_less = {"kind": "Pod", "metadata": {"name": "web"}, "spec": {"containers": [{"name": "nginx"}]}}
    assert auditing.audit_object(gpu_less, not_opted_in, POLICY) == []


PIN = {"limits": {"gpushard.io/gpu": "30", "gpushard.io/card-0": "30"}}


@pytest.mark.parametrize("env", [5, "NVIDIA_VISIBLE_DEVICES=1", {"NVIDIA_VISIBLE_DEVICES": "1"}, [1, None, "x"],
                                 [{"name": ["NVIDIA_VISIBLE_DEVICES"]}, {"value": "1"}], True])
def test_odd_env_shapes_are_no_crash(env):
    obj = {"kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
           "spec": {"nodeName": "a", "containers": [{"name": "t", "resources": PIN, "env": env}, {"name": "side",
                                                                                                "env": env}]}}
    nodes = {"a": auditing.node_cards(node("a", {0: "100"}), POLICY)}
    for mode in (None, names.MODE_AUDIT, names.MODE_ENFORCE):
        found = rules(auditing.audit_object(obj, auditing.NamespaceMode(mode), POLICY, nodes))
        assert auditing.PIN_ENV_MISMATCH not in found  # no list, or no entry naming the variable: nothing set
    assert auditing.usage([node("a", {0: "100"})], [obj], POLICY).used == 30
    auditing.audit([auditing.Located(obj), auditing.Located(node("a", {0: "100"}))], POLICY)


@pytest.mark.parametrize("obj", [
    {"kind": ["Pod"], "spec": {"containers": [{"name": "t", "resources": PIN}]}},
    {"kind": "Pod", "metadata": ["p"], "spec": {"containers": [1, "two"]}},
    {"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"name": "t", "resources": [PIN]}]}},
    {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {"spec": {"initContainers": {}}}}},
    {"kind": "Pod", "metadata": {"name": "p", "annotations": ["x"]}, "spec": {"nodeName": ["a"], "containers": [
        {"name": "t", "resources": PIN, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": ["1"]}]}]},
     "status": "Running"},
])
def test_odd_object_shapes_are_no_crash(obj):
    nodes = {"a": auditing.node_cards(node("a", {0: "100"}), POLICY)}
    for mode in (None, names.MODE_AUDIT, names.MODE_ENFORCE):
        auditing.audit_object(obj, auditing.NamespaceMode(mode), POLICY, nodes)
    auditing.audit([auditing.Located(obj), auditing.Located(node("a", {0: "100"}))], POLICY)
    auditing.usage([node("a", {0: "100"})], [obj], POLICY)


def test_a_pinned_container_with_an_env_that_is_no_list():
    obj = {"kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
           "spec": {"containers": [{"name": "t", "resources": PIN, "env": 5}]}}
    assert auditing.audit_object(obj, auditing.NamespaceMode(names.MODE_ENFORCE), POLICY) == []


def gpu_pod_with_proxy(**extra) -> dict:
    obj = {"kind": "Pod", "metadata": {"name": "notebook", "namespace": "lab"},
           "spec": {"containers": [{"name": "jupyter", "resources": PIN}, {"name": "proxy"}]}}
    for key, value in extra.items():
        if key == "uid":
            obj["metadata"]["uid"] = value
        elif key == "nodeName":
            obj["spec"]["nodeName"] = value
        else:
            obj[key] = value
    return obj


@pytest.mark.parametrize("extra", [{"uid": "6f1c"}, {"nodeName": "a"}, {"status": {"phase": "Pending"}}])
def test_enforce_mode_does_not_fix_pods_that_already_exist(extra):
    enforce = auditing.NamespaceMode(names.MODE_ENFORCE)
    # To be created: the webhook will hide the proxy, so nothing to say.
    assert auditing.audit_object(gpu_pod_with_proxy(), enforce, POLICY) == []
    assert auditing.audit_object(gpu_pod_with_proxy(status={}), enforce, POLICY) == []  # as --dry-run writes it
    # Already created: admission never sees it again, so the proxy still sees every card.
    running = gpu_pod_with_proxy(**extra)
    found = auditing.audit_object(running, enforce, POLICY)
    assert [(x.rule, x.container) for x in found] == [(f.UNHIDDEN, "proxy")]
    assert found[0].message.startswith('gpushard: container "proxy" asks no GPU but may see every card')
    assert found[0].message.endswith("so this pod stays as it is until it is recreated")
    # In audit mode the plain finding, as before.
    audited = auditing.audit_object(running, auditing.NamespaceMode(names.MODE_AUDIT), POLICY)
    assert [x.message for x in audited] == [found[0].message.split("; ")[0]]


def running_gpu_less(*containers: dict, ephemeral: object = None, node_name: str = "a") -> dict:
    spec: dict = {"nodeName": node_name, "containers": list(containers) or [{"name": "web"}]}
    if ephemeral is not None:
        spec["ephemeralContainers"] = ephemeral
    return {"kind": "Pod", "metadata": {"name": "web", "namespace": "ml", "uid": "3a7e"}, "spec": spec,
            "status": {"phase": "Running"}}


VOID = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]


def test_existing_gpu_less_pods_on_shared_nodes():
    nodes = {"a": auditing.node_cards(node("a", {0: "100"}), POLICY),
             "plain": auditing.node_cards(node("plain", {}), POLICY)}
    enforce, audited = auditing.NamespaceMode(names.MODE_ENFORCE), auditing.NamespaceMode(names.MODE_AUDIT)
    obj = running_gpu_less({"name": "web"}, {"name": "logs", "env": VOID},
                           ephemeral=[{"name": "dbg"}, {"name": "hid", "env": VOID}])
    found = auditing.audit_object(obj, enforce, POLICY, nodes)
    assert [(x.rule, x.container) for x in found] == [(f.UNHIDDEN, "web"), (f.UNHIDDEN, "dbg")]
    assert found[0].message == ('gpushard: container "web" asks no GPU but may see every card of shared node "a"; '
                                "the pod was created before gpushard hid GPUs there and must be recreated")
    assert found[1].message.startswith('gpushard: ephemeral container "dbg" asks no GPU')
    assert [x.message for x in auditing.audit_object(obj, audited, POLICY, nodes)] == [
        'gpushard: container "web" asks no GPU but may see every card of shared node "a"',
        'gpushard: ephemeral container "dbg" asks no GPU but may see every card of shared node "a"']
    # Not opted in, not known to have opted in, off shared nodes, or gpushard hides nothing.
    assert auditing.audit_object(obj, auditing.NamespaceMode(None), POLICY, nodes) == []
    assert auditing.audit_object(obj, auditing.UNKNOWN_NAMESPACE, POLICY, nodes) == []
    assert auditing.audit_object(running_gpu_less(node_name="plain"), enforce, POLICY, nodes) == []
    assert auditing.audit_object(running_gpu_less(node_name="gone"), enforce, POLICY, nodes) == []
    assert auditing.audit_object(obj, enforce, policy.Policy(hide_unrequested_gpus=False), nodes) == []
    # A GPU ask of zero is no GPU; a container asking a GPU makes it the GPU pods' business.
    zero = running_gpu_less({"name": "web", "resources": {"limits": {"nvidia.com/gpu": "0"}}})
    assert rules(auditing.audit_object(zero, enforce, POLICY, nodes)) == [f.UNHIDDEN]


def test_ephemeral_containers_of_gpu_pods():
    nodes = {"a": auditing.node_cards(node("a", {0: "100"}), POLICY)}
    enforce = auditing.NamespaceMode(names.MODE_ENFORCE)
    gpu = gpu_pod_with_proxy(uid="9d2f", nodeName="a")
    gpu["spec"]["containers"][1]["env"] = VOID
    gpu["spec"]["ephemeralContainers"] = [{"name": "dbg"}]
    found = auditing.audit_object(gpu, enforce, POLICY, nodes)
    assert [(x.rule, x.container) for x in found] == [(f.UNHIDDEN, "dbg")]
    assert found[0].message.endswith("it was added before gpushard hid GPUs there, so the pod must be recreated")
    assert rules(auditing.audit_object(gpu, auditing.NamespaceMode(None), POLICY, nodes)) == [auditing.NOT_OPTED_IN]
    # Still to be created: the webhook hides debug containers when they are added.
    del gpu["metadata"]["uid"], gpu["spec"]["nodeName"]
    assert auditing.audit_object(gpu, enforce, POLICY, nodes) == []


@pytest.mark.parametrize("ephemeral", [5, "dbg", [1, None, "x"], [{"name": ["dbg"], "env": 3}], {}])
def test_odd_ephemeral_shapes_are_no_crash(ephemeral):
    nodes = {"a": auditing.node_cards(node("a", {0: "100"}), POLICY)}
    obj = running_gpu_less(ephemeral=ephemeral)
    for mode in (None, names.MODE_AUDIT, names.MODE_ENFORCE):
        auditing.audit_object(obj, auditing.NamespaceMode(mode), POLICY, nodes)
    auditing.audit([auditing.Located(obj), auditing.Located(node("a", {0: "100"}))], POLICY)


def test_enforce_mode_still_fixes_templates_that_exist():
    deployment = {"kind": "Deployment", "metadata": {"name": "d", "namespace": "ml", "uid": "1b2c"},
                  "spec": {"template": {"spec": {"containers": [
                      {"name": "t", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}, {"name": "side"}]}}},
                  "status": {"replicas": 1}}
    # Each new pod of it goes through admission: rewritten then.
    assert auditing.audit_object(deployment, auditing.NamespaceMode(names.MODE_ENFORCE), POLICY) == []
    assert rules(auditing.audit_object(deployment, auditing.NamespaceMode(names.MODE_AUDIT), POLICY)) == [
        f.FRACTION_UNREWRITTEN]


def admitted_pods():
    for path in sorted(GOLDEN.glob("*.pass.yaml")):
        if (GOLDEN / path.name.replace(".pass.yaml", ".config.yaml")).exists():
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == names.POD_KIND:
                yield pytest.param(doc, id=path.name)


@pytest.mark.parametrize("obj", list(admitted_pods()))
def test_what_gpushard_admits_audits_clean(obj):
    decision = decisions.decide(decisions.Request(obj, names.POD_KIND), POLICY, None)
    assert decision.allowed
    running = copy.deepcopy(decision.obj)
    running.setdefault("metadata", {})["uid"] = "0e4d"
    running["status"] = {"phase": "Running"}
    for mode in (auditing.UNKNOWN_NAMESPACE, auditing.NamespaceMode(names.MODE_ENFORCE)):
        assert auditing.audit_object(decision.obj, mode, POLICY) == []
        assert auditing.audit_object(running, mode, POLICY) == []


def test_admission_audit_mode_accepts_what_enforce_mode_wrote():
    obj = {"kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]}}
    admitted = decisions.decide(decisions.Request(obj, names.POD_KIND), POLICY, None).obj
    again = decisions.decide(decisions.Request(admitted, names.POD_KIND, mode=names.MODE_AUDIT), POLICY, None)
    assert again.findings == []


def _device_class(name: str, resource: str | None) -> dict:
    spec = {"selectors": [{"cel": {"expression": f'device.driver == "{name}"'}}]}
    if resource is not None:
        spec["extendedResourceName"] = resource
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


def test_device_classes_are_findings_and_the_context_of_the_pods_beside_them():
    fraction = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": "ml"},
                "spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]}}
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "ml"},
             "spec": {"containers": [{"name": "w"}]}}
    node = {"kind": "Node", "metadata": {"name": "gpu-1", "annotations": {"x": "y"}}}
    objects = [auditing.Located(o, f"m.yaml#{i}") for i, o in enumerate([
        fraction, plain, _device_class("gpu.example.com", "gpushard.io/gpu"), node,
        _device_class("gpu.nvidia.com", "nvidia.com/gpu"), _device_class("fpga.example.com", "example.com/fpga"),
        {"kind": "DeviceClass", "metadata": "odd"}, _device_class(names.DRA_DEVICE_CLASS, None)])]
    items = auditing.audit(objects, POLICY)
    assert [(i.ref.kind, i.ref.name, i.finding.rule, i.finding.severity, i.source) for i in items] == [
        ("DeviceClass", "gpu.example.com", f.EXTENDED_RESOURCE_TAKEN, f.DENY, "m.yaml#2"),
        ("DeviceClass", "gpu.nvidia.com", f.EXTENDED_RESOURCE_SHARED, f.WARN, "m.yaml#4"),
        ("Pod", "train", f.EXTENDED_RESOURCE_TAKEN, f.DENY, "m.yaml#0")]
    assert items[0].fix == f.FIXES[f.EXTENDED_RESOURCE_TAKEN]
    assert str(items[0].ref) == "DeviceClass gpu.example.com"
    # Without the class taking gpushard's shares, the fraction is rewritten: the class serving its name warns.
    items = auditing.audit([o for o in objects if o.source != "m.yaml#2"], POLICY)
    assert [(i.ref.name, i.finding.rule) for i in items] == [("gpu.nvidia.com", f.EXTENDED_RESOURCE_SHARED),
                                                             ("train", f.EXTENDED_RESOURCE_SHARED)]
