"""The agent's own-node policy (deploy/base/agent-node-restriction.yaml), its CEL evaluated for real.

We test, with the policy and binding as deploy/base renders them (tests/deploy/admission_policy.py
evaluates the CEL as the API server would), for requests by the agent's ServiceAccount:
- a label or annotation change (what the agent's merge patch makes) on the Node its token
  names passes; on another Node it is denied, as it is with a token naming no node (no extra
  at all, an empty list, another key);
- a change to the Node's spec (a taint, unschedulable, podCIDR), on its own Node, is denied, but for
  gpushard's startup taint removed (by the patch its lifter sends too): adding it, removing another
  startup taint, or removing it together with another taint or beside a podCIDR change is denied;
- a status-only change passes, through the Node itself (spec unchanged) and through
  nodes/status (not matched: the policy's rule names only nodes);
- requests by anyone else (the kubelet, an admin, another ServiceAccount) are not matched;
- each way of breaking the policy (a validation dropped, any node name accepted, the spec left
  unchecked, the match condition widened to everyone) flips a verdict above;
- on its own Node the agent may add, change and remove only gpushard's own keys (the labels
  gpushard.io/cards and gpushard.io/card-<k>.memory-mib, the annotation gpushard.io/inventory, as
  webhook/core/names.py names them), and the patch its publisher sends passes; any other key it
  adds, changes or removes (node-restriction.kubernetes.io/tier, kubernetes.io/hostname,
  node-role.kubernetes.io/control-plane, another gpushard.io key, an own key of the wrong kind, a
  card label no card index reads) is denied with a message naming the key, even beside own keys;
  keys it leaves as they were are not judged; an owner or a finalizer added is denied;
- each way of breaking that part (the check dropped, removals or changes not counted, any
  gpushard.io key accepted, owners left unchecked) flips one of those verdicts.
"""

from __future__ import annotations

import copy
import re

import jsonpatch
import pytest

from tests.deploy import admission_policy, rendering
from tests.deploy.test_manifests import BASE
from webhook.agent.node import nvml, publishing, startuptaint
from webhook.core import names

AGENT = "system:serviceaccount:gpushard-system:gpushard-agent"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"


@pytest.fixture(scope="module")
def shipped():
    return admission_policy.shipped(rendering.render(BASE), "gpushard-agent-own-node")


def node(name: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {"podCIDR": "10.0.1.0/24", **spec},
            "status": {"capacity": {"cpu": "8"}, "conditions": [{"type": "Ready", "status": "True"}]}}


def relabelled(old: dict) -> dict:
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["gpushard.io/cards"] = "2"
    new["metadata"]["annotations"] = {"gpushard.io/inventory": "{}"}
    return new


def admit(policy_and_binding, new: dict, old: dict, username: str = AGENT, extra: dict | None = None,
          subresource: str = ""):
    user: dict = {"username": username}
    if extra is not None:
        user["extra"] = extra
    resource = "nodes" + (f"/{subresource}" if subresource else "")
    request = {"operation": "UPDATE", "name": new["metadata"]["name"],
               "kind": {"group": "", "version": "v1", "kind": "Node"},
               "resource": {"group": "", "version": "v1", "resource": resource}, "userInfo": user}
    # Nodes are cluster-scoped: no namespace, namespaceObject null.
    return admission_policy.evaluate(*policy_and_binding, request, new, old, None)


ON = {NODE_NAME_KEY: ["gpu-1"]}


def verdicts(policy_and_binding) -> dict[str, bool]:
    """Each case's verdict: admitted or not."""
    own = node("gpu-1")
    other = node("gpu-2")
    tainted = node("gpu-1", taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}])
    cordoned = node("gpu-1", unschedulable=True)
    moved = node("gpu-1", podCIDR="10.9.9.0/24")
    status = copy.deepcopy(own)
    status["status"]["capacity"]["gpushard.io/gpu"] = "200"
    startup = {"key": names.STARTUP_TAINT, "effect": "NoSchedule"}
    other_startup = {"key": "startup-taint.cluster-autoscaler.kubernetes.io/cni", "effect": "NoSchedule"}
    gpu = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    starting = node("gpu-1", taints=[gpu, startup])
    starting["metadata"]["resourceVersion"] = "7"
    lifted = jsonpatch.apply_patch(starting, startuptaint.lift_patch(starting))
    cases = {
        "own node relabelled": admit(policy_and_binding, relabelled(own), own, extra=ON),
        "own node, several names in the token": admit(policy_and_binding, relabelled(own), own,
                                                      extra={NODE_NAME_KEY: ["x", "gpu-1"]}),
        "other node relabelled": admit(policy_and_binding, relabelled(other), other, extra=ON),
        "no extra": admit(policy_and_binding, relabelled(own), own),
        "empty node name list": admit(policy_and_binding, relabelled(own), own, extra={NODE_NAME_KEY: []}),
        "another extra key": admit(policy_and_binding, relabelled(own), own,
                                   extra={"authentication.kubernetes.io/pod-name": ["gpu-1"]}),
        "own node tainted": admit(policy_and_binding, tainted, own, extra=ON),
        "own node cordoned": admit(policy_and_binding, cordoned, own, extra=ON),
        "own node podCIDR": admit(policy_and_binding, moved, own, extra=ON),
        "own node status only": admit(policy_and_binding, status, own, extra=ON),
        "own startup taint removed": admit(policy_and_binding, node("gpu-1", taints=[gpu]), starting, extra=ON),
        "own startup taint removed by the lifter's patch": admit(policy_and_binding, lifted, starting, extra=ON),
        "own last taint, the startup taint, removed": admit(policy_and_binding, own, node("gpu-1", taints=[startup]),
                                                            extra=ON),
        "own startup taint added": admit(policy_and_binding, starting, node("gpu-1", taints=[gpu]), extra=ON),
        "another startup taint removed": admit(policy_and_binding, node("gpu-1", taints=[startup]),
                                               node("gpu-1", taints=[startup, other_startup]), extra=ON),
        "startup taint removed with another startup taint": admit(policy_and_binding, own,
                                                                  node("gpu-1", taints=[startup, other_startup]),
                                                                  extra=ON),
        "startup taint removed with another": admit(policy_and_binding, own, starting, extra=ON),
        "startup taint removed, podCIDR changed": admit(policy_and_binding, node("gpu-1", podCIDR="10.9.9.0/24"),
                                                        node("gpu-1", taints=[startup]), extra=ON),
        "own node status via nodes/status": admit(policy_and_binding, status, own, extra=ON, subresource="status"),
        "kubelet taints a node": admit(policy_and_binding, tainted, own, username="system:node:gpu-1"),
        "admin relabels another node": admit(policy_and_binding, relabelled(other), other, username="admin",
                                             extra=ON),
        "another account relabels": admit(policy_and_binding, relabelled(other), other,
                                          username="system:serviceaccount:default:gpushard-agent", extra=ON),
    }
    for name, outcome in cases.items():
        assert not outcome.errored, (name, outcome.message)
    return {name: outcome for name, outcome in cases.items()}


EXPECTED = {
    "own node relabelled": True, "own node, several names in the token": True, "other node relabelled": False,
    "no extra": False, "empty node name list": False, "another extra key": False, "own node tainted": False,
    "own node cordoned": False, "own node podCIDR": False, "own node status only": True,
    "own startup taint removed": True, "own startup taint removed by the lifter's patch": True,
    "own last taint, the startup taint, removed": True, "own startup taint added": False,
    "another startup taint removed": False, "startup taint removed with another": False,
    "startup taint removed with another startup taint": False,
    "startup taint removed, podCIDR changed": False,
    "own node status via nodes/status": True, "kubelet taints a node": True, "admin relabels another node": True,
    "another account relabels": True,
}


def test_the_agent_changes_only_labels_and_annotations_of_its_own_node(shipped):
    outcomes = verdicts(shipped)
    assert {name: o.allowed for name, o in outcomes.items()} == EXPECTED
    for name in ("other node relabelled", "no extra", "empty node name list", "another extra key"):
        assert outcomes[name].message == "gpushard: the agent may change only the Node it runs on"
    for name in ("own node tainted", "own node cordoned", "own node podCIDR", "own startup taint added",
                 "another startup taint removed", "startup taint removed with another",
                 "startup taint removed with another startup taint",
                 "startup taint removed, podCIDR changed"):
        assert outcomes[name].message == "gpushard: the agent may change a Node's labels and annotations and " \
                                         "remove its startup taint, nothing else of its spec"
    # Who is not the agent is not matched at all (the match condition is false), nor is nodes/status.
    for name in ("kubelet taints a node", "admin relabels another node", "another account relabels",
                 "own node status via nodes/status"):
        assert not outcomes[name].matched


def _validation(policy: dict, needle: str) -> dict:
    found, = [v for v in policy["spec"]["validations"] if needle in v["expression"]]
    return found


def _any_node(p: dict) -> None:
    _validation(p, NODE_NAME_KEY)["expression"] = f'has(request.userInfo.extra) && "{NODE_NAME_KEY}" in ' \
                                                   "request.userInfo.extra"


def _spec_unchecked(p: dict) -> None:
    p["spec"]["validations"].remove(_validation(p, "object.spec"))


def _no_node_check(p: dict) -> None:
    p["spec"]["validations"].remove(_validation(p, NODE_NAME_KEY))


def _metadata_only(p: dict) -> None:
    # Compares metadata instead of spec: lets a spec change through and refuses the agent's own patch.
    _validation(p, "object.spec")["expression"] = "object.metadata.name == oldObject.metadata.name"


def _any_taint_removed(p: dict) -> None:
    rule = _validation(p, "object.spec")
    rule["expression"] = rule["expression"].replace(f"t.key != '{names.STARTUP_TAINT}'", "false")


def _startup_prefix(p: dict) -> None:
    # Any startup taint, not gpushard's own: another component's would go too.
    rule = _validation(p, "object.spec")
    rule["expression"] = rule["expression"].replace(f"t.key != '{names.STARTUP_TAINT}'",
                                                    "!t.key.startsWith('startup-taint.cluster-autoscaler.kubernetes.io/')")


def _everyone(p: dict) -> None:
    p["spec"]["matchConditions"][0]["expression"] = "true"


@pytest.mark.parametrize("break_it", [_any_node, _spec_unchecked, _no_node_check, _metadata_only, _everyone,
                                      _any_taint_removed, _startup_prefix])
def test_each_break_of_the_policy_flips_a_verdict(shipped, break_it):
    """Breaks: any node name accepted; the spec check dropped; the node check dropped; the spec
    check comparing metadata instead; the match condition true for everyone. Each must change at
    least one verdict of the test above (which asserts exactly the shipped verdicts)."""
    policy, binding = shipped
    broken = copy.deepcopy(policy)
    break_it(broken)
    outcomes = verdicts((broken, binding))
    assert {name: o.allowed for name, o in outcomes.items()} != EXPECTED


OWN_KEYS = "gpushard: the agent may change only gpushard's own labels and annotations on its Node, not "
OWNERS = "gpushard: the agent may change a Node's labels and annotations, not its owners or finalizers"
TIER = "node-restriction.kubernetes.io/tier"


def changed(old: dict, labels: dict | None = None, annotations: dict | None = None, **metadata) -> dict:
    """``old`` with these labels and annotations set (None removes one) and these metadata fields."""
    new = copy.deepcopy(old)
    for field_name, values in (("labels", labels), ("annotations", annotations)):
        current = new["metadata"].setdefault(field_name, {})
        for key, value in (values or {}).items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
    new["metadata"].update(metadata)
    return new


def merged(target: dict, patch: dict) -> dict:
    """A JSON merge patch (RFC 7386) applied, as the API server applies the agent's."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


CARDS = [nvml.Card(0, "GPU-a", "NVIDIA H100", 81559), nvml.Card(12, "GPU-b", "NVIDIA H100", 81559)]


def key_verdicts(policy_and_binding) -> dict[str, admission_policy.Outcome]:
    own = node("gpu-1")
    published = changed(own, {names.CARDS_LABEL: "2", names.card_memory_label(0): "81559",
                              names.card_memory_label(1): "40960"}, {names.INVENTORY_ANNOTATION: "[]"})
    # A node that others labelled before: the agent leaves those keys alone.
    labelled = changed(own, {TIER: "secure", "topology.kubernetes.io/zone": "a"},
                       {"node.alpha.kubernetes.io/ttl": "0"})
    owner = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}]
    cases = {
        "the publisher's first patch": (merged(own, publishing.node_patch(CARDS)), own),
        "the publisher removes a card's label": (
            merged(published, publishing.node_patch(CARDS[:1], stale={names.card_memory_label(1)})), published),
        "own labels and annotation set": (published, own),
        "inventory changed": (changed(published, annotations={names.INVENTORY_ANNOTATION: "[{}]"}), published),
        "own keys removed": (changed(published, {names.CARDS_LABEL: None}, {names.INVENTORY_ANNOTATION: None}),
                             published),
        "others' keys left as they were": (changed(labelled, {names.CARDS_LABEL: "1"}), labelled),
        "tier label set": (changed(own, {TIER: "secure"}), own),
        "hostname changed": (changed(own, {names.HOSTNAME_LABEL: "gpu-2"}), own),
        "control-plane role set": (changed(own, {"node-role.kubernetes.io/control-plane": ""}), own),
        "hostname removed": (changed(own, {names.HOSTNAME_LABEL: None}), own),
        "tier label removed": (changed(labelled, {TIER: None}), labelled),
        "tier label beside own keys": (changed(own, {names.CARDS_LABEL: "2", TIER: "secure"},
                                               {names.INVENTORY_ANNOTATION: "[]"}), own),
        "foreign annotation set": (changed(own, annotations={"node.alpha.kubernetes.io/ttl": "5"}), own),
        "foreign annotation changed": (changed(labelled, annotations={"node.alpha.kubernetes.io/ttl": "5"}),
                                       labelled),
        "another gpushard.io label": (changed(own, {names.MODE_LABEL: "enforce"}), own),
        "own annotation key as a label": (changed(own, {names.INVENTORY_ANNOTATION: "x"}), own),
        "own label key as an annotation": (changed(own, annotations={names.CARDS_LABEL: "2"}), own),
        "card label of no card index": (changed(own, {"gpushard.io/card-01.memory-mib": "1"}), own),
        "owner added": (changed(published, ownerReferences=owner), published),
        "finalizer added": (changed(published, finalizers=["example.com/hold"]), published),
    }
    outcomes = {name: admit(policy_and_binding, new, old, extra=ON) for name, (new, old) in cases.items()}
    for name, outcome in outcomes.items():
        assert outcome.matched and not outcome.errored, (name, outcome.message)
    return outcomes


KEY_EXPECTED = {
    "the publisher's first patch": "", "the publisher removes a card's label": "", "own labels and annotation set": "",
    "inventory changed": "", "own keys removed": "", "others' keys left as they were": "",
    "tier label set": OWN_KEYS + f'"{TIER}"', "hostname changed": OWN_KEYS + '"kubernetes.io/hostname"',
    "control-plane role set": OWN_KEYS + '"node-role.kubernetes.io/control-plane"',
    "hostname removed": OWN_KEYS + '"kubernetes.io/hostname"', "tier label removed": OWN_KEYS + f'"{TIER}"',
    "tier label beside own keys": OWN_KEYS + f'"{TIER}"',
    "foreign annotation set": OWN_KEYS + '"node.alpha.kubernetes.io/ttl"',
    "foreign annotation changed": OWN_KEYS + '"node.alpha.kubernetes.io/ttl"',
    "another gpushard.io label": OWN_KEYS + '"gpushard.io/mode"',
    "own annotation key as a label": OWN_KEYS + '"gpushard.io/inventory"',
    "own label key as an annotation": OWN_KEYS + '"gpushard.io/cards"',
    "card label of no card index": OWN_KEYS + '"gpushard.io/card-01.memory-mib"',
    "owner added": OWNERS, "finalizer added": OWNERS,
}


def test_the_agent_changes_only_gpushard_s_own_keys_on_its_node(shipped):
    outcomes = key_verdicts(shipped)
    assert {name: "" if o.allowed else o.message for name, o in outcomes.items()} == KEY_EXPECTED


def test_the_policy_s_own_keys_are_those_the_agent_writes():
    """The keys gpushard's publisher may write, read from the policy text, agree with webhook/core/names.py."""
    policy, _ = admission_policy.shipped(rendering.render(BASE), "gpushard-agent-own-node")
    text = "\n".join(v["expression"] for v in policy["spec"]["variables"])
    assert f"k != '{names.CARDS_LABEL}'" in text and f"k != '{names.INVENTORY_ANNOTATION}'" in text
    pattern = re.search(r"k\.matches\('([^']+)'\)", text).group(1)
    for index in (0, 1, 9, 10, 123456789):
        assert re.fullmatch(pattern, names.card_memory_label(index))
    for key in ("gpushard.io/card-01.memory-mib", "gpushard.io/card-1234567890.memory-mib",
                "gpushard.io/card-.memory-mib", "gpushard.io/card-1.memory-mibx", "xgpushard.io/card-1.memory-mib",
                "gpushard.io/card-1"):
        assert not re.fullmatch(pattern, key) and names.card_memory_index(key) is None, key


def _foreign_unchecked(p: dict) -> None:
    p["spec"]["validations"] = [v for v in p["spec"]["validations"] if "variables.foreign" not in v["expression"]]


def _removals_uncounted(p: dict) -> None:
    for variable in p["spec"]["variables"]:
        variable["expression"] = re.sub(r" \+\s*variables\.old(Labels|Annotations)\.filter\(k, !\(k in variables\."
                                        r"(labels|annotations)\)\)", "", variable["expression"])


def _changes_uncounted(p: dict) -> None:
    for variable in p["spec"]["variables"]:
        variable["expression"] = re.sub(r" \|\|\s*variables\.old(Labels|Annotations)\[k\] != variables\."
                                        r"(labels|annotations)\[k\]", "", variable["expression"])


def _any_gpushard_key(p: dict) -> None:
    for variable in p["spec"]["variables"]:
        variable["expression"] = variable["expression"].replace("k != 'gpushard.io/cards' &&",
                                                                "!k.startsWith('gpushard.io/') &&")


def _owners_unchecked(p: dict) -> None:
    p["spec"]["validations"] = [v for v in p["spec"]["validations"] if "ownerReferences" not in v["expression"]]


@pytest.mark.parametrize("break_it", [_foreign_unchecked, _removals_uncounted, _changes_uncounted, _any_gpushard_key,
                                      _owners_unchecked])
def test_each_break_of_the_key_check_flips_a_verdict(shipped, break_it):
    policy, binding = shipped
    broken = copy.deepcopy(policy)
    break_it(broken)
    assert broken != policy, "the break must change the policy"
    outcomes = key_verdicts((broken, binding))
    assert {name: "" if o.allowed else o.message for name, o in outcomes.items()} != KEY_EXPECTED
