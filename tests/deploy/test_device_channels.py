"""The device-channel policy (deploy/base/device-channels.yaml), its CEL evaluated for real.

We test, with the policy and binding as deploy/base renders them (cel-python, as the API server
would evaluate them), in namespaces without the label, in audit and in enforce:
- a volume mounted under the toolkit's device-list folder (at <folder>/all, at <folder>all, at a
  path the runtime would clean to it) is denied in Pods, in init and debug containers, and in
  the template of every kind, with a message naming the container;
- device- and mount-injecting annotations are judged by key, in every key form the runtime and its
  plugins read (each family bare, /pod and /container.<name>; CDI's any suffix), whatever the value
  says: a YAML device list naming a card by major:minor alone, a CDI name without its kind, a
  mount of /dev/null under the toolkit's device-list folder. What the plugin would be handed is
  checked first (the lookup order of NRI's GetEffectiveAnnotation and the device-injector, the
  value parsed as YAML), then that the policy denies it, in Pods and templates, in every
  namespace, enforce included, on CREATE and on an UPDATE that adds or changes one; an UPDATE that
  keeps or removes an older one passes, and so do annotations of other families (NRI's I/O
  priority, CRI-O's seccomp profile, look-alikes in other domains);
- the families in the CEL are those of webhook/core/names.py, and the webhook's core judges every
  key as the policy does; docs/security.md names each family;
- namespaces and ServiceAccounts the operator lists (deploy/base/device-policy.yaml, set from an
  operator's overlay as docs/install.md says: tests/deploy/devicepolicy.py) are let through, and
  nobody else (a list written with commas or new lines trusts nobody); the policy reads no params
  object (no paramKind, no paramRef), so none can be missing, and a plain pod is not even judged;
- on a Pod UPDATE only the debug containers it adds are judged; a template UPDATE that leaves
  the spec as it was passes; the system namespaces are not matched.
"""

from __future__ import annotations

import copy

import celpy
import pytest
import yaml

from tests.deploy import admission_policy, devicepolicy, rendering
from tests.deploy.test_manifests import BASE
from tests.deploy.test_opt_in_guard import ENFORCED, NOT_OPTED_IN, RESOURCES, container, pod_spec, wrap
from webhook.core import hostaccess, names

NAMESPACES = [*NOT_OPTED_IN, ENFORCED]
IDS = ["no-label", "audit", "bad-label", "enforce"]
NULL = {"name": "null", "hostPath": {"path": "/dev/null"}}



@pytest.fixture(scope="module")
def rendered():
    return rendering.render(BASE)


@pytest.fixture(scope="module")
def policy(rendered):
    return admission_policy.shipped(rendered, "gpushard-device-channels")


def trusting(**lists: str) -> tuple[dict, dict]:
    """The policy and binding as an operator's overlay that sets these lists renders them."""
    return admission_policy.shipped(devicepolicy.render(BASE, **lists), "gpushard-device-channels")


def admit(policy, obj: dict, namespace: dict, operation: str = "CREATE", old: dict | None = None,
          sub: str = ""):
    group, resource = RESOURCES[obj["kind"]]
    request = {"operation": operation, "namespace": namespace["metadata"]["name"],
               "kind": {"group": group, "version": "v1", "kind": obj["kind"]},
               "resource": {"group": group, "version": "v1", "resource": resource + (f"/{sub}" if sub else "")},
               "userInfo": {"username": "alice"}}
    outcome = admission_policy.evaluate(*policy, request, obj, old, namespace)
    assert not outcome.errored, outcome.message  # a denial must come from the rule, not a failing expression
    return outcome


def mounting(path: str) -> dict:
    return container("app", volumeMounts=[{"name": "null", "mountPath": path}])


@pytest.mark.parametrize("namespace", NAMESPACES, ids=IDS)
@pytest.mark.parametrize("path", ["/var/run/nvidia-container-devices/all", "/var/run/nvidia-container-devicesall",
                                  "/run/nvidia-container-devices/GPU-1", "//var/run/./nvidia-container-devices/all"])
def test_device_list_mounts_are_denied_everywhere(policy, namespace, path):
    spec = {**pod_spec(mounting(path)), "volumes": [NULL]}
    outcome = admit(policy, wrap("Pod", spec), namespace)
    assert outcome.matched and not outcome.allowed
    assert outcome.message.startswith(
        'gpushard: container "app" mounts a volume under /var/run/nvidia-container-devices')


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_in_every_container_list_and_template(policy, kind):
    for spec in (pod_spec(container("main"), init=[mounting("/var/run/nvidia-container-devices/all")]),
                 {**pod_spec(container("main")), "ephemeralContainers": [mounting("/run/nvidia-container-devices/x")]}):
        assert not admit(policy, wrap(kind, {**spec, "volumes": [NULL]}), NOT_OPTED_IN[0]).allowed


# The lookups of the plugins that read a family per container, as their sources do them:
# NRI's GetEffectiveAnnotation (containerd/nri pkg/plugin/annotations.go, used by NVIDIA's NRI
# plugin), the device-injector's getAnnotation (new domain, then old, per form), the NRI CDI
# injector's, and GKE's (container form only).
def effective_key(annotations: dict, family: str, old_family: str | None, container_name: str) -> str | None:
    domains = [family] + ([old_family] if old_family else [])
    forms = [f"{domain}/container.{container_name}" for domain in domains]
    if family != "devices.gke.io":
        forms += [f"{domain}/pod" for domain in domains] + domains
    return next((key for key in forms if key in annotations), None)


# A device named by its numbers alone (195:255 is the NVIDIA driver's control device, 195:0 card 0):
# nothing in the text says "nvidia", and YAML lets it be written many ways.
BY_NUMBERS = ("- {path: /dev/x0, type: c, major: 195, minor: 0}\n"
              "- {path: /dev/x1, type: c, major: 0xc3, minor: 255}")
# /dev/null mounted where the toolkit reads device lists: every card on a hardened node.
NULL_AT_ALL = ("- source: /dev/null\n  destination: /var/run/nvidia-container-devices/all\n"
               "  type: bind\n  options: [bind, ro]")
# The device-injector's families (new domain, deprecated domain) and what their values parse to.
INJECTOR_FAMILIES = [("devices.noderesource.dev", "devices.nri.io", BY_NUMBERS),
                     ("mounts.noderesource.dev", "mounts.nri.io", NULL_AT_ALL),
                     ("cdi-devices.noderesource.dev", "cdi-devices.nri.io", "- example.com/card=0"),
                     ("network-devices.noderesource.dev", "network-devices.nri.io", "- {name: eth9}"),
                     ("nvidia.cdi.k8s.io", None, "mgmt.example/gpu=all"),
                     ("cdi.nri.io", None, "example.com/card=0"),
                     ("devices.gke.io", None, BY_NUMBERS)]


def _forms(family: str, old: str | None) -> list[str]:
    forms = [f"{family}/container.main"]
    if family != "devices.gke.io":
        forms += [f"{family}/pod", family]
    if old:
        forms += [f"{old}/container.main", f"{old}/pod", old]
    return forms


CASES = [(family, old, key, value) for family, old, value in INJECTOR_FAMILIES for key in _forms(family, old)]


@pytest.mark.parametrize("family,old,key,value", CASES, ids=[c[2] for c in CASES])
def test_injecting_annotations_are_judged_by_key(policy, family, old, key, value):
    annotations = {key: value, "team": "a"}
    # What the plugin is handed for container "main": this key, and a value naming a device or a
    # mount without the word "nvidia" in it.
    assert effective_key(annotations, family, old, "main") == key
    parsed = yaml.safe_load(value)
    assert "nvidia" not in value.lower() or family.startswith("mounts.")
    if family in ("devices.noderesource.dev", "devices.gke.io"):
        assert [(d["major"], d["minor"]) for d in parsed] == [(195, 0), (195, 255)]
    if family.startswith("mounts."):
        assert parsed[0]["destination"].startswith(names.DEVICE_LIST_MOUNT_ROOT)
    for namespace in NAMESPACES:
        obj = wrap("Pod", pod_spec(container("main")))
        obj["metadata"]["annotations"] = annotations
        outcome = admit(policy, obj, namespace)
        assert outcome.matched and not outcome.allowed, (key, namespace["metadata"]["name"])
        assert outcome.message.startswith(f'gpushard: annotation "{key}" makes the container runtime')
    job = wrap("CronJob", pod_spec(container("main")))
    job["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["annotations"] = annotations
    assert not admit(policy, job, ENFORCED).allowed


@pytest.mark.parametrize("key,value,devices", [
    # The CDI prefix: any key below it, the value split at ","; NVIDIA's runtime gives a name
    # without a kind its default kind, nvidia.com/gpu, so "all" alone is every card.
    ("cdi.k8s.io/anything", "all", ["all"]),
    ("cdi.k8s.io/x", "vendor.example/c=0,%6eidia.com/gpu=0", ["vendor.example/c=0", "%6eidia.com/gpu=0"]),
    # CRI-O's device annotation (new and old spelling), entries split at ",", then the host path
    # before the first ":" (a udev link names the same device as its /dev/nvidia* node).
    ("devices.crio.io", "/dev/gpu-by-bus/0:/dev/x:rwm", ["/dev/gpu-by-bus/0"]),
    ("io.kubernetes.cri-o.Devices", "/dev/gpu-by-bus/ctl", ["/dev/gpu-by-bus/ctl"])])
def test_cdi_and_crio_keys_are_judged_by_key(policy, key, value, devices):
    parsed = value.split(",") if key.startswith("cdi.") else [entry.split(":")[0] for entry in value.split(",")]
    assert parsed == devices and "nvidia" not in value
    obj = wrap("Pod", pod_spec(container("main")))
    obj["metadata"]["annotations"] = {key: value}
    for namespace in NAMESPACES:
        outcome = admit(policy, obj, namespace)
        assert not outcome.allowed and outcome.message.startswith(f'gpushard: annotation "{key}"')


def test_updates_judge_only_what_they_add(policy):
    ns = NOT_OPTED_IN[0]
    old = wrap("Pod", {**pod_spec(mounting("/var/run/nvidia-container-devices/all")), "volumes": [NULL]})
    old["metadata"]["annotations"] = {"nvidia.cdi.k8s.io/container.main": "nvidia.com/gpu=all"}
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "a"}
    assert admit(policy, relabelled, ns, "UPDATE", old).allowed  # a pod from before stays manageable
    changed = copy.deepcopy(old)
    changed["metadata"]["annotations"]["nvidia.cdi.k8s.io/container.main"] = "nvidia.com/gpu=1"
    assert not admit(policy, changed, ns, "UPDATE", old).allowed
    added = wrap("Pod", pod_spec(container("main")))
    later = copy.deepcopy(added)
    later["metadata"]["annotations"] = {"cdi.k8s.io/x": "nvidia.com/gpu=all"}
    assert not admit(policy, later, ns, "UPDATE", added).allowed
    # kubectl debug: a new debug container mounting the folder is denied; an older one is left alone.
    debugged = copy.deepcopy(added)
    debugged["spec"]["ephemeralContainers"] = [mounting("/var/run/nvidia-container-devices/all")]
    assert not admit(policy, debugged, ns, "UPDATE", added, sub="ephemeralcontainers").allowed
    again = copy.deepcopy(debugged)
    again["spec"]["ephemeralContainers"].append(container("debugger-2"))
    assert admit(policy, again, ns, "UPDATE", debugged, sub="ephemeralcontainers").allowed
    # A template left as it was (scaling) passes; one changed to mount the folder does not.
    deploy = wrap("Deployment", pod_spec(mounting("/var/run/nvidia-container-devices/all")))
    scaled = copy.deepcopy(deploy)
    scaled["spec"]["replicas"] = 3
    assert admit(policy, scaled, ns, "UPDATE", deploy).allowed
    clean = wrap("Deployment", pod_spec(container("app")))
    assert not admit(policy, deploy, ns, "UPDATE", clean).allowed


# Annotations of other families, and look-alikes of the injecting ones in other domains or names.
BENIGN = {"io-priority.noderesource.dev/container.app": "{class: IOPRIO_CLASS_BE, priority: 4}",
          "scheduling-policy.noderesource.dev/pod": "{policy: SCHED_OTHER}",
          "seccomp-profile.crio.io/app": "runtime/default", "prometheus.io/scrape": "true",
          "example.com/cdi.k8s.io": "a look-alike", "devices.noderesource.devx/pod": "another domain",
          "cdi.k8s.io.example.com/x": "another domain", "mydevices.crio.io": "another name",
          "kubectl.kubernetes.io/default-container": "app", "team": "a"}


@pytest.mark.parametrize("namespace", NAMESPACES, ids=IDS)
def test_ordinary_pods_pass(policy, namespace):
    spec = {**pod_spec(container("app", volumeMounts=[{"name": "d", "mountPath": "/var/run/nvidia-cache"}])),
            "volumes": [{"name": "d", "emptyDir": {}}]}
    obj = wrap("Pod", spec)
    obj["metadata"]["annotations"] = dict(BENIGN)
    assert admit(policy, obj, namespace).allowed
    gpu = wrap("Deployment", pod_spec(container("train", {"nvidia.com/gpu": "1"})))
    gpu["spec"]["template"]["metadata"]["annotations"] = dict(BENIGN)
    assert admit(policy, gpu, namespace).allowed


def test_an_update_that_adds_one_is_denied_even_in_enforce_namespaces(policy):
    running = wrap("Pod", pod_spec(container("main", {"nvidia.com/gpu": "1"})))
    running["metadata"]["annotations"] = {"gpushard.io/card": "0", "team": "a"}
    for key, value in [("devices.noderesource.dev", BY_NUMBERS), ("mounts.nri.io/pod", NULL_AT_ALL),
                       ("nvidia.cdi.k8s.io/container.main", "all"), ("cdi.k8s.io/x", "all")]:
        patched = copy.deepcopy(running)
        patched["metadata"]["annotations"][key] = value
        outcome = admit(policy, patched, ENFORCED, "UPDATE", running)
        assert not outcome.allowed and f'annotation "{key}"' in outcome.message
    # Other families, labels and the removal of an older injecting annotation stay possible.
    other = copy.deepcopy(running)
    other["metadata"]["annotations"].update(BENIGN)
    other["metadata"]["labels"] = {"stage": "2"}
    assert admit(policy, other, ENFORCED, "UPDATE", running).allowed
    older = copy.deepcopy(running)
    older["metadata"]["annotations"]["mounts.noderesource.dev/container.main"] = NULL_AT_ALL
    removed = copy.deepcopy(older)
    del removed["metadata"]["annotations"]["mounts.noderesource.dev/container.main"]
    assert admit(policy, removed, ENFORCED, "UPDATE", older).allowed
    # kubectl debug on a pod that carries none: the debug container passes.
    debugged = copy.deepcopy(running)
    debugged["spec"]["ephemeralContainers"] = [container("debugger-1", stdin=True, tty=True)]
    assert admit(policy, debugged, ENFORCED, "UPDATE", running, sub="ephemeralcontainers").allowed
    # Scaling a workload whose template carries an older one passes; changing its value does not.
    deploy = wrap("Deployment", pod_spec(container("main")))
    deploy["spec"]["template"]["metadata"]["annotations"] = {"devices.gke.io/container.main": BY_NUMBERS}
    scaled = copy.deepcopy(deploy)
    scaled["spec"]["replicas"] = 5
    assert admit(policy, scaled, ENFORCED, "UPDATE", deploy).allowed
    changed = copy.deepcopy(deploy)
    changed["spec"]["template"]["metadata"]["annotations"]["devices.gke.io/container.main"] = "[]"
    assert not admit(policy, changed, ENFORCED, "UPDATE", deploy).allowed


def _injecting_pod(namespace: str, service_account: str | None = None) -> dict:
    obj = wrap("Pod", {**pod_spec(mounting("/var/run/nvidia-container-devices/all")), "volumes": [NULL]}, namespace)
    obj["metadata"]["annotations"] = {"devices.noderesource.dev/pod": BY_NUMBERS}
    if service_account:
        obj["spec"]["serviceAccountName"] = service_account
    return obj


def test_what_the_operator_trusts_is_let_through(policy):
    listed = devicepolicy.local_config_map(BASE)
    assert listed["metadata"]["namespace"] == "gpushard-system"
    assert {k: v for k, v in listed["data"].items() if k.startswith("exempt")} == {
        "exemptNamespaces": "", "exemptServiceAccounts": ""}  # the default trusts nobody
    operator = admission_policy.namespace_object("gpu-operator")
    monitoring = admission_policy.namespace_object("gpu-monitoring")
    lab = NOT_OPTED_IN[0]
    trust = trusting(exemptNamespaces="other gpu-operator",
                     exemptServiceAccounts="gpu-monitoring/dcgm-exporter lab/builder")
    assert admit(trust, _injecting_pod("gpu-operator"), operator).allowed
    assert admit(trust, _injecting_pod("gpu-monitoring", "dcgm-exporter"), monitoring).allowed
    assert admit(trust, _injecting_pod("lab", "builder"), lab).allowed
    # Nobody else: another account of that namespace, the same account name elsewhere, the
    # default account, a namespace whose name only starts like a trusted one.
    for obj, namespace in [(_injecting_pod("gpu-monitoring", "other"), monitoring),
                           (_injecting_pod("gpu-monitoring"), monitoring),
                           (_injecting_pod("lab", "dcgm-exporter"), lab),
                           (_injecting_pod("gpu"), admission_policy.namespace_object("gpu")),
                           (_injecting_pod("gpu-operator-2"), admission_policy.namespace_object("gpu-operator-2"))]:
        assert not admit(trust, obj, namespace).allowed, obj["metadata"]["namespace"]
        assert not admit(policy, obj, namespace).allowed
    # A list written with commas or new lines trusts nobody rather than everybody.
    for written in ("gpu-operator,other", "other\ngpu-operator"):
        assert not admit(trusting(exemptNamespaces=written), _injecting_pod("gpu-operator"), operator).allowed
    wildcard = trusting(exemptNamespaces="*")
    assert not admit(wildcard, _injecting_pod("lab", "builder"), lab).allowed


def test_it_reads_no_params_and_judges_no_plain_pod(policy, rendered):
    # Nothing the policy needs can go missing: no paramKind, no paramRef, no ConfigMap in the install.
    found, binding = policy
    assert "paramKind" not in found["spec"] and "paramRef" not in binding["spec"]
    assert not [o for o in rendered if o["metadata"]["name"] == devicepolicy.CONFIG_MAP]
    plain = wrap("Pod", pod_spec(container("app")))
    for namespace in NAMESPACES:
        assert not admit(policy, plain, namespace).matched


def _cel_families(policy) -> list[str]:
    found, _ = policy
    expression, = [v["expression"] for v in found["spec"]["variables"] if v["name"] == "families"]
    env = celpy.Environment()
    return [str(f) for f in env.program(env.compile(expression)).evaluate({})]


def test_the_policy_and_the_core_judge_the_same_families(policy):
    assert _cel_families(policy) == list(names.INJECTING_ANNOTATION_FAMILIES)
    # Every key form of every family, near misses and other families: each judged alike.
    keys = [k for family in names.INJECTING_ANNOTATION_FAMILIES
            for k in (family, f"{family}/pod", f"{family}/container.main", f"{family}/", f"{family}x",
                      f"x{family}", f"{family}.main", f"{family.upper()}/pod", f"example.com/{family}")]
    keys += list(BENIGN)
    for key in keys:
        obj = wrap("Pod", pod_spec(container("main")))
        obj["metadata"]["annotations"] = {key: "x"}
        denied = not admit(policy, obj, NOT_OPTED_IN[0]).allowed
        assert denied == (hostaccess.injecting_family(key) is not None), key


@pytest.mark.parametrize("name", ["kube-system", "gpushard-system"])
def test_system_namespaces_are_not_matched(policy, name):
    spec = {**pod_spec(mounting("/var/run/nvidia-container-devices/all")), "volumes": [NULL]}
    outcome = admit(policy, wrap("Pod", spec, name), admission_policy.namespace_object(name))
    assert not outcome.matched


def test_it_covers_pods_debug_containers_and_every_template_kind(policy):
    found, _ = policy
    covered = {(g, r, op) for rule in found["spec"]["matchConstraints"]["resourceRules"]
               for g in rule["apiGroups"] for r in rule["resources"] for op in rule["operations"]}
    expected = {(RESOURCES[k][0], RESOURCES[k][1], op) for k in [*names.TEMPLATE_PATHS, "Pod"]
                for op in ("CREATE", "UPDATE")}
    expected |= {("", "pods/ephemeralcontainers", op) for op in ("CREATE", "UPDATE")}
    assert covered == expected
    assert found["spec"]["failurePolicy"] == "Fail"


def test_the_security_page_names_every_family_with_a_source():
    page = (BASE.parents[1] / "docs" / "security.md").read_text()
    table = page[page.index("### Annotation families"):page.index("### Dynamic Resource Allocation")]
    for family in names.INJECTING_ANNOTATION_FAMILIES:
        assert f"`{family}" in table, family
