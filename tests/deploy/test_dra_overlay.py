"""We test the dra overlay (deploy/overlays/dra), as kubectl kustomize renders it:
- it renders (kubectl where installed, else the test renderer) and its config selects backend dra for webhook
  and agent, with the replacer off;
- its DeviceClass is the one gpushard's code describes, and passes the API's rules;
- the agent mounts the kubelet's plugin-registration and plugins folders and the CDI folder at the paths its
  flags default to, which are the kubelet's and the runtime's own;
- RBAC lets the agent write ResourceSlices and read claims and pods, the webhook create templates, and no more; the
  auditor role (`gpushard status`) reads slices and claims;
- the enforce webhook declares NoneOnDryRun (it makes templates on real requests only);
- the policy keeps an agent to its own node's slice of gpushard's driver, evaluated with a CEL library.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import admission_policy, rendering
from webhook import cli
from webhook import settings as settings_mod
from webhook.agent.dra import cdi, kubeletplugin
from webhook.core import draobjects, names

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy/overlays/dra"
AGENT = "system:serviceaccount:gpushard-system:gpushard-agent"


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return rendering.render(OVERLAY)


def find(objects, kind, name=None):
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, (kind, name, len(hits))
    return hits[0]


def test_kubectl_renders_it():
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], check=True, capture_output=True, text=True).stdout
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out) if d}
    assert ("DeviceClass", names.DRA_DEVICE_CLASS) in kinds
    assert ("ValidatingAdmissionPolicy", "gpushard-agent-own-slice") in kinds


def test_the_config_selects_dra(objects):
    config = find(objects, "ConfigMap", "gpushard-config")["data"]["config.yaml"]
    loaded = settings_mod.from_mapping(yaml.safe_load(config))
    assert loaded.policy.backend == "dra" and loaded.replacement.enabled is False


def test_the_device_class_is_gpushards(objects):
    found = find(objects, "DeviceClass", names.DRA_DEVICE_CLASS)
    assert {k: found[k] for k in ("apiVersion", "kind", "spec")} == {
        k: draobjects.device_class()[k] for k in ("apiVersion", "kind", "spec")}
    assert draobjects.check_device_class(found) == []


def test_the_agent_mounts_the_plugin_and_cdi_folders(objects):
    pod = find(objects, "DaemonSet", "gpushard-agent")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounted = {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host}
    args = cli.build_parser().parse_args(container["args"])
    for flag, default in ((args.kubelet_registry_dir, kubeletplugin.REGISTRY_DIR),
                          (args.kubelet_plugins_dir, kubeletplugin.PLUGINS_DIR), (args.cdi_dir, cdi.DEFAULT_DIR)):
        assert flag == default and mounted.get(flag) == default
    read_only = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
    assert not read_only & {kubeletplugin.REGISTRY_DIR, kubeletplugin.PLUGINS_DIR, cdi.DEFAULT_DIR}


def rules_of(objects, account):
    bound = [b["roleRef"]["name"] for b in objects if b["kind"] == "ClusterRoleBinding"
             and any(s.get("name") == account for s in b["subjects"])]
    return {(g, r, v) for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] in bound
            for rule in o["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_rbac(objects):
    agent = {x for x in rules_of(objects, "gpushard-agent") if x[0] == "resource.k8s.io"}
    # list: every agent looks for another DRA driver offering its node's cards (the base grants it).
    assert agent == {("resource.k8s.io", "resourceslices", v) for v in ("get", "list", "create", "update")} | {
        ("resource.k8s.io", "resourceclaims", "get")}
    # get: the pod a claim is reserved for, whose shares the claim must consume (the base grants both).
    assert {x for x in rules_of(objects, "gpushard-agent") if x[:2] == ("", "pods")} == {
        ("", "pods", "list"), ("", "pods", "get")}
    webhook = {x for x in rules_of(objects, "gpushard-webhook") if x[0] == "resource.k8s.io"}
    # list and watch: the view's cards (gpushard's slices) and shares held (the claims), for the node hint;
    # DeviceClasses: the base grants them (another driver's class may serve gpushard's names).
    assert webhook == {("resource.k8s.io", "resourceclaimtemplates", "create")} | {
        ("resource.k8s.io", r, v) for r in ("resourceslices", "resourceclaims", "deviceclasses")
        for v in ("list", "watch")}


def test_the_auditor_role_reads_slices_and_claims(objects):
    role = find(objects, "ClusterRole", "gpushard-auditor")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert {x for x in granted if x[0] == "resource.k8s.io"} == {
        ("resource.k8s.io", r, v) for r in ("resourceslices", "resourceclaims") for v in ("get", "list")} | {
        ("resource.k8s.io", "deviceclasses", "list")}  # the base's, for the audit


def test_the_enforce_webhook_has_side_effects_only_off_dry_run(objects):
    configuration = find(objects, "MutatingWebhookConfiguration")
    effects = {w["name"]: w["sideEffects"] for w in configuration["webhooks"]}
    # The hide entry sees only pods that hold no shares, for which gpushard makes no template.
    assert effects == {"enforce.gpushard.io": "NoneOnDryRun", "hide.gpushard.io": "None", "audit.gpushard.io": "None"}


def slice_request(user, node, operation="CREATE"):
    return {"resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceslices"},
            "operation": operation, "userInfo": {"username": user, "extra": {
                "authentication.kubernetes.io/node-name": [node]}}}


@pytest.mark.parametrize("user,node,slice_node,driver,allowed", [
    (AGENT, "node-a", "node-a", names.DRA_DRIVER, True),
    (AGENT, "node-a", "node-b", names.DRA_DRIVER, False),
    (AGENT, "node-a", "node-a", "gpu.nvidia.com", False),
    ("system:serviceaccount:kube-system:other", "node-a", "node-b", "gpu.nvidia.com", True),  # not ours to judge
])
def test_an_agent_writes_only_its_own_nodes_slice(objects, user, node, slice_node, driver, allowed):
    policy = find(objects, "ValidatingAdmissionPolicy", "gpushard-agent-own-slice")
    binding = find(objects, "ValidatingAdmissionPolicyBinding", "gpushard-agent-own-slice")
    obj = draobjects.resource_slice(slice_node, [draobjects.CardFacts(0, "GPU-0", "m", 1)], 100, 0, driver)
    request = slice_request(user, node)
    namespace = admission_policy.namespace_object("")
    # The evaluator applies the match conditions, which leave other users alone, as the API server does.
    outcome = admission_policy.evaluate(policy, binding, request, obj, None, namespace)
    assert not outcome.errored, outcome.message  # a denial must come from the rule, not a failing expression
    assert outcome.allowed is allowed, outcome.message
