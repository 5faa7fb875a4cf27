"""We test, through the admission app as the API server calls it, host access in gpushard namespaces:
- each way around the device plugin (privileged, also in init and debug containers; any capability
  beyond Pod Security's baseline; hostPID; hostPath of /dev, /proc, /sys, the kubelet's folders, the
  container runtimes' sockets, CDI specs, the toolkit's folders and its device-list folder, and
  /dev/null mounted under it, even at a path that only starts like it; any other hostPath the
  operator did not allow; device-injecting annotations, NVIDIA's and GKE's included; envFrom in
  passthrough containers) is a 403 whose message names the container (or volume, annotation) and
  the field;
- audit mode reports the same as warnings and audit annotations, and allows;
- an exempt service account or namespace (policy.exempt) is let through, nobody else;
- a debug container added next to an older one: only the new one is changed, and the patch
  applies to the stored pod (the API server refuses changes to existing ephemeral containers);
- each of kubectl debug's profiles as it writes its ephemeral container: general (SYS_PTRACE), baseline,
  restricted and netadmin (NET_ADMIN, NET_RAW) are admitted with the cards hidden, sysadmin (privileged)
  is denied; those capabilities stay denied in every other kind of container, and a debug container
  adding more is told what it may add.
"""

from __future__ import annotations

import copy

import pytest

from tests.admission import objects
from tests.admission.test_app import post
from webhook import settings as settings_mod
from webhook.admission import app as app_mod


def _gpu_pod(**spec_extra) -> dict:
    obj = objects.pod(objects.container("train", "0.5"), objects.container("sidecar"))
    obj["spec"].update(spec_extra)
    return obj


def _denied(client, obj: dict, path: str = "/mutate") -> str:
    response = post(client, path, objects.review(obj))
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    return response["status"]["message"]


def test_a_privileged_init_container_is_denied(client):
    obj = _gpu_pod()
    obj["spec"]["initContainers"] = [objects.container("setup", securityContext={"privileged": True})]
    message = _denied(client, obj)
    assert message == ('gpushard: init container "setup" is privileged '
                       '(spec.initContainers[0].securityContext.privileged), so it would see every card of the node')


@pytest.mark.parametrize("cap", ["SYS_ADMIN", "CAP_SYS_ADMIN", "ALL", "all"])
def test_sys_admin_or_all_capabilities_are_denied(client, cap):
    obj = _gpu_pod()
    obj["spec"]["containers"][1]["securityContext"] = {"capabilities": {"add": ["NET_RAW", cap]}}
    message = _denied(client, obj)
    assert f'container "sidecar" adds capability {cap} (spec.containers[1].securityContext.capabilities.add)' in message


def test_host_pid_is_denied(client):
    assert "(spec.hostPID)" in _denied(client, _gpu_pod(hostPID=True))


@pytest.mark.parametrize("path,exposes", [
    ("/dev", "the node's device files"),
    ("/dev/nvidia0", "the node's device files"),
    ("/dev/null", "the node's device files"),
    ("/var/lib/kubelet/device-plugins", "the kubelet's folders"),
    ("/var/lib/kubelet/pod-resources/", "the kubelet's folders"),
    ("//var/lib/./kubelet", "the kubelet's folders"),
    ("/var/run/nvidia-container-devices", "the toolkit's device-list folder"),
    ("/", "a folder holding /dev"),
    ("/var/lib", "a folder holding /var/lib/kubelet"),
])
def test_host_paths_that_reach_devices_are_denied(client, path, exposes):
    obj = _gpu_pod(volumes=[{"name": "host", "hostPath": {"path": path}}])
    message = _denied(client, obj)
    assert '"host" is hostPath' in message and "(spec.volumes[0].hostPath.path)" in message
    assert exposes in message


def test_dev_null_mounted_under_the_device_list_folder_is_denied(client):
    # The toolkit (with volume mounts accepted) reads /dev/null at <root>/<id> as a request for <id>.
    obj = _gpu_pod(volumes=[{"name": "null", "hostPath": {"path": "/dev/null", "type": "CharDevice"}}])
    obj["spec"]["containers"][1]["volumeMounts"] = [
        {"name": "null", "mountPath": "/var/run/nvidia-container-devices/all"}]
    message = _denied(client, obj)
    assert '"null" is hostPath /dev/null' in message
    assert ('container "sidecar" mounts volume "null" at /var/run/nvidia-container-devices/all '
            "(spec.containers[1].volumeMounts[0].mountPath)") in message


@pytest.mark.parametrize("key", ["cdi.k8s.io/gpus", "devices.crio.io", "io.kubernetes.cri-o.Devices",
                                 "devices.noderesource.dev/container.train", "cdi-devices.nri.io/pod",
                                 # NVIDIA's NRI plugin, NRI's CDI injector, GKE's device injector.
                                 "nvidia.cdi.k8s.io/container.main", "nvidia.cdi.k8s.io/container.*",
                                 "nvidia.cdi.k8s.io/pod", "nvidia.cdi.k8s.io",
                                 "cdi.nri.io/container.main", "devices.gke.io/container.main",
                                 # Host network devices, NRI's device-injector and network-device-injector.
                                 "network-devices.noderesource.dev/pod", "netdevice.noderesource.dev",
                                 "netdevices.nri.containerd.io/pod"])
def test_device_injecting_annotations_are_denied(client, key):
    obj = _gpu_pod()
    # A device named by its numbers alone: nothing in the value says which vendor's it is.
    obj["metadata"]["annotations"] = {key: "- {path: /dev/x, type: c, major: 195, minor: 255}"}
    message = _denied(client, obj)
    assert f'annotation "{key}" (metadata.annotations) makes the container runtime inject devices' in message


@pytest.mark.parametrize("key", ["mounts.noderesource.dev/container.train", "mounts.noderesource.dev/pod",
                                 "mounts.noderesource.dev", "mounts.nri.io/container.sidecar", "mounts.nri.io"])
def test_mount_injecting_annotations_are_denied_and_audited(client, key):
    obj = _gpu_pod()
    obj["metadata"]["annotations"] = {
        key: "- {source: /dev/null, destination: /var/run/nvidia-container-devices/all, type: bind}",
        "io-priority.noderesource.dev/container.train": "{class: IOPRIO_CLASS_BE}"}
    message = _denied(client, obj)
    assert f'annotation "{key}" (metadata.annotations) makes the container runtime inject mounts' in message
    assert "io-priority" not in message
    audited = post(client, "/audit", objects.review(obj))
    assert audited["allowed"] is True
    assert any(f'annotation "{key}"' in warning for warning in audited["warnings"])


def test_the_same_holds_in_templates(client):
    obj = objects.deployment(objects.container("train", "0.5", securityContext={"privileged": True}))
    obj["spec"]["template"]["metadata"]["annotations"] = {"cdi.k8s.io/x": "nvidia.com/gpu=all"}
    message = _denied(client, obj)
    assert "(spec.template.spec.containers[0].securityContext.privileged)" in message
    assert "(spec.template.metadata.annotations)" in message


@pytest.fixture
def passthrough_client(view):
    settings = settings_mod.from_mapping({"policy": {"wholeCards": "passthrough"}})
    return app_mod.create_app(settings, view).test_client()


@pytest.mark.parametrize("prefix,denied", [(None, True), ("", True), ("NVIDIA_", True), ("APP_", False),
                                           ("NVIDIA_VISIBLE_DEVICES_", False)])
def test_env_from_in_a_passthrough_container(passthrough_client, prefix, denied):
    source = {"configMapRef": {"name": "settings"}}
    if prefix is not None:
        source["prefix"] = prefix
    obj = objects.pod(objects.container("train", "1", envFrom=[source]))
    response = post(passthrough_client, "/mutate", objects.review(obj))
    assert response["allowed"] is not denied
    if denied:
        assert ('container "train" takes env from configMap "settings"' in response["status"]["message"])
        assert "(spec.containers[0].envFrom[0])" in response["status"]["message"]


def test_env_from_in_a_container_that_holds_shares_is_harmless(client):
    # gpushard's own env entry wins over envFrom there.
    obj = objects.pod(objects.container("train", "0.5", envFrom=[{"secretRef": {"name": "s"}}]))
    response = post(client, "/mutate", objects.review(obj))
    assert response["allowed"] is True
    new = objects.patched(obj, response)
    assert objects.env_of(new["spec"]["containers"][0])["NVIDIA_VISIBLE_DEVICES"] == "0"


def test_audit_mode_reports_the_same_and_allows(client):
    obj = _gpu_pod(hostPID=True)
    obj["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    response = post(client, "/audit", objects.review(obj))
    assert response["allowed"] is True and "patch" not in response
    assert set(response["auditAnnotations"]) >= {"privileged", "host-pid"}
    assert any('container "train" is privileged' in w for w in response["warnings"])


def _exempting(view, **exempt):
    settings = settings_mod.from_mapping({"policy": {"exempt": exempt}})
    return app_mod.create_app(settings, view).test_client()


@pytest.mark.parametrize("cap", ["SYS_MODULE", "DAC_READ_SEARCH", "SYS_RAWIO", "BPF", "PERFMON", " sys_ptrace"])
def test_capabilities_beyond_baseline_are_denied(client, cap):
    obj = _gpu_pod()
    obj["spec"]["containers"][1]["securityContext"] = {"capabilities": {"add": ["NET_BIND_SERVICE", "CHOWN", cap]}}
    message = _denied(client, obj)
    assert message.count("adds capability") == 1  # the baseline ones pass
    assert f'container "sidecar" adds capability {cap} (spec.containers[1].securityContext.capabilities.add)' in message


@pytest.mark.parametrize("path,exposes", [
    ("/proc/1/root/dev", "the node's processes and kernel controls"),
    ("/sys/bus/pci", "the node's processes and kernel controls"),
    ("/run/containerd/containerd.sock", "/run/containerd, which the container runtime"),
    ("/var/run/crio/crio.sock", "/var/run/crio, which the container runtime"),
    ("/var/run/nri/nri.sock", "/var/run/nri, which"),
    ("/etc/cdi", "/etc/cdi, which"),
    ("/usr/local/nvidia/toolkit", "/usr/local/nvidia, which"),
    ("/run/gpushard/mps", "/run/gpushard, which"),
])
def test_host_paths_that_reach_the_runtime_or_the_kernel_are_denied(client, path, exposes):
    message = _denied(client, _gpu_pod(volumes=[{"name": "host", "hostPath": {"path": path}}]))
    assert f'"host" is hostPath {path} (spec.volumes[0].hostPath.path), which exposes {exposes}' in message


def test_any_other_host_path_needs_the_operators_leave(view):
    obj = _gpu_pod(volumes=[{"name": "logs", "hostPath": {"path": "/var/log/pods"}}])
    message = _denied(_exempting(view), obj)
    assert message == ('gpushard: volume "logs" is hostPath /var/log/pods (spec.volumes[0].hostPath.path); pods '
                       'here mount only host paths the operator allows (policy.exempt.hostPaths)')
    assert post(_exempting(view, hostPaths=["/var/log"]), "/mutate", objects.review(obj))["allowed"] is True
    # Allowing a folder never allows what lies around the device plugin, even below or above it.
    assert "which exposes a folder holding /dev" in _denied(
        _exempting(view, hostPaths=["/"]), _gpu_pod(volumes=[{"name": "root", "hostPath": {"path": "/"}}]))
    # A symlink through another process's root is still /proc.
    assert "which exposes the node's processes" in _denied(_exempting(view, hostPaths=["/"]), _gpu_pod(
        volumes=[{"name": "null", "hostPath": {"path": "/proc/1/root/dev/null"}}]))


def test_a_mount_that_only_starts_like_the_device_list_folder_is_denied(client):
    # NVIDIA's toolkit takes every mount whose path starts with its folder, "/" or not: this one
    # reads as device "all", and /proc/1/root/dev/null resolves to /dev/null on the node.
    obj = _gpu_pod(volumes=[{"name": "null", "emptyDir": {}}])
    obj["spec"]["containers"][1]["volumeMounts"] = [
        {"name": "null", "mountPath": "/var/run/nvidia-container-devicesall"}]
    assert ('container "sidecar" mounts volume "null" at /var/run/nvidia-container-devicesall '
            "(spec.containers[1].volumeMounts[0].mountPath)") in _denied(client, obj)


def test_exempt_service_accounts_and_namespaces_pass(view):
    obj = _gpu_pod(hostPID=True, serviceAccountName="dcgm-exporter")
    assert post(_exempting(view, serviceAccounts=["ml/dcgm-exporter"]), "/mutate",
                objects.review(obj))["allowed"] is True
    assert post(_exempting(view, namespaces=["ml"]), "/mutate", objects.review(obj))["allowed"] is True
    # The same name in another namespace, or another account, is not exempt.
    assert post(_exempting(view, serviceAccounts=["monitoring/dcgm-exporter", "ml/other"]), "/mutate",
                objects.review(obj))["allowed"] is False
    no_account = _gpu_pod(hostPID=True)
    assert post(_exempting(view, serviceAccounts=["ml/dcgm-exporter"]), "/mutate",
                objects.review(no_account))["allowed"] is False


def _debug_review(old: dict, new: dict) -> dict:
    review = objects.review(new, operation="UPDATE")
    review["request"]["subResource"] = "ephemeralcontainers"
    review["request"]["oldObject"] = old
    return review


def test_a_sysadmin_debug_container_is_denied(client):
    # `kubectl debug --profile=sysadmin` asks privileged: true.
    old = _gpu_pod()
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [{"name": "debugger-x", "image": "busybox",
                                           "securityContext": {"privileged": True}}]
    response = post(client, "/mutate", _debug_review(old, new))
    assert response["allowed"] is False and response["status"]["code"] == 403
    assert response["status"]["message"] == (
        'gpushard: ephemeral container "debugger-x" is privileged '
        "(spec.ephemeralContainers[0].securityContext.privileged), so it would see every card of the node")


def test_a_second_debug_container_changes_only_itself(client):
    # The first was added before (here: by a cluster without gpushard, so it has no env at all).
    first = {"name": "debugger-a", "image": "busybox", "targetContainerName": "train"}
    old = _gpu_pod()
    old["spec"]["ephemeralContainers"] = [first]
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"].append({"name": "debugger-b", "image": "cuda"})
    response = post(client, "/mutate", _debug_review(old, new))
    assert response["allowed"] is True
    stored = objects.patched(new, response)
    assert stored["spec"]["ephemeralContainers"][0] == first, "an existing ephemeral container was changed"
    assert objects.env_of(stored["spec"]["ephemeralContainers"][1]) == {"NVIDIA_VISIBLE_DEVICES": "void"}
    # An older privileged debug container (from before the opt-in) does not block a new one.
    old["spec"]["ephemeralContainers"][0]["securityContext"] = {"privileged": True}
    new["spec"]["ephemeralContainers"][0]["securityContext"] = {"privileged": True}
    assert post(client, "/mutate", _debug_review(old, new))["allowed"] is True


# What each of kubectl debug's profiles writes into the ephemeral container it adds to a running pod
# (staging/src/k8s.io/kubectl/pkg/cmd/debug/profiles.go, the "ephemeral" style of each profile).
DEBUG_PROFILES = {
    "general": {"capabilities": {"add": ["SYS_PTRACE"]}},
    "baseline": None,
    "restricted": {"runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}, "allowPrivilegeEscalation": False,
                   "seccompProfile": {"type": "RuntimeDefault"}},
    "netadmin": {"capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}},
    "sysadmin": {"privileged": True},
}


@pytest.mark.parametrize("profile", sorted(DEBUG_PROFILES))
def test_each_kubectl_debug_profile(client, profile):
    # Every profile but sysadmin acts inside the pod's own namespaces: admitted, with the cards hidden.
    old = _gpu_pod()
    new = copy.deepcopy(old)
    debugger = {"name": "debugger", "image": "busybox", "targetContainerName": "train"}
    if DEBUG_PROFILES[profile] is not None:
        debugger["securityContext"] = DEBUG_PROFILES[profile]
    new["spec"]["ephemeralContainers"] = [debugger]
    response = post(client, "/mutate", _debug_review(old, new))
    if profile == "sysadmin":
        assert response["allowed"] is False and "is privileged" in response["status"]["message"]
        return
    assert response["allowed"] is True, response["status"]["message"]
    stored = objects.patched(new, response)
    assert objects.env_of(stored["spec"]["ephemeralContainers"][0]) == {"NVIDIA_VISIBLE_DEVICES": "void"}


@pytest.mark.parametrize("capability", ["SYS_PTRACE", "NET_ADMIN", "NET_RAW"])
def test_debug_capabilities_are_only_for_debug_containers(client, capability):
    obj = _gpu_pod()
    obj["spec"]["containers"][1]["securityContext"] = {"capabilities": {"add": [capability]}}
    assert f"adds capability {capability}" in _denied(client, obj)


def test_a_debug_container_adding_more_is_denied_naming_what_it_may_add(client):
    old = _gpu_pod()
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", "securityContext": {
        "capabilities": {"add": ["SYS_PTRACE", "SYS_ADMIN"]}}}]
    response = post(client, "/mutate", _debug_review(old, new))
    assert response["allowed"] is False
    assert response["status"]["message"] == (
        'gpushard: ephemeral container "debugger" adds capability SYS_ADMIN '
        "(spec.ephemeralContainers[0].securityContext.capabilities.add), beyond Pod Security's baseline and what a "
        "debug container may add here (SYS_PTRACE, NET_ADMIN, NET_RAW), so it could reach the node's devices")


def test_in_a_host_network_pod_a_debug_container_may_not_add_network_capabilities(client):
    # There the pod's network namespace is the node's: NET_ADMIN would administer the node's network.
    old = _gpu_pod(hostNetwork=True)
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", "securityContext": {
        "capabilities": {"add": ["NET_ADMIN"]}}}]
    response = post(client, "/mutate", _debug_review(old, new))
    assert response["allowed"] is False
    assert "adds capability NET_ADMIN" in response["status"]["message"]
    assert "what a debug container may add here (SYS_PTRACE)" in response["status"]["message"]
    new["spec"]["ephemeralContainers"][0]["securityContext"]["capabilities"]["add"] = ["SYS_PTRACE"]
    assert post(client, "/mutate", _debug_review(old, new))["allowed"] is True
