"""What a container sees, read from inside it: its GPU variables, its NVIDIA device nodes, its device-list mounts.

Every container the tier starts runs one script that prints those three and then waits; the tests read it
back with ``kubectl logs`` (or run it again with ``kubectl exec``). Only that proves what the runtime applied:
the pod spec says what was asked, the container says what was done.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import yaml

from tests.e2e import components, gpushard, objects
from tests.runtime import images, node

# Device nodes by number (hex, as stat prints them), so that card k is told by its minor number.
REPORT = ("echo @env; env; echo @dev; for f in /dev/nvidia*; do [ -e \"$f\" ] && echo \"$f $(stat -c '%t %T' "
          "\"$f\")\"; done; echo @lists; ls -1 /var/run/nvidia-container-devices 2>/dev/null; echo @end")
STANDIN = "gpushard-agent-host"
# The shipped workloads that run gpushard's image, which this tier does not import: the webhook runs on this
# machine (tests/e2e/gpushard.py), and a pod of them on the node would make the runtime ask a registry for it.
IMAGE_WORKLOADS = frozenset({("Deployment", "gpushard-webhook"), ("Deployment", "gpushard-replacer"),
                             ("Job", "gpushard-certs"), ("CronJob", "gpushard-certs-renew")})


@dataclass(frozen=True)
class Seen:
    """One container's view: its environment, its /dev/nvidia* nodes (name: (major, minor)), its device-list mounts."""

    env: dict = field(default_factory=dict)
    devices: dict = field(default_factory=dict)
    lists: tuple = ()

    @property
    def visible(self) -> str | None:
        return self.env.get("NVIDIA_VISIBLE_DEVICES")

    def cards(self) -> set[int]:
        """The cards whose device node the container has (nvidia<k>, NVIDIA's major, minor k)."""
        return {minor for name, (major, minor) in self.devices.items()
                if major == node.NVIDIA_MAJOR and minor != node.CTL_MINOR and name.startswith("/dev/nvidia")
                and name[len("/dev/nvidia"):].isdigit()}

    def no_card(self) -> bool:
        """Nothing of a card: no device node, no device-list mount, and a variable that names none."""
        return not self.devices and not self.lists and self.visible in ("void", None)


def parse(text: str) -> Seen | None:
    """The report's sections, or None while the container has not printed all of it yet."""
    if "@end" not in text:
        return None
    section, env, devices, lists = "", {}, {}, []
    for line in text.splitlines():
        if line.startswith("@"):
            section = line[1:]
            continue
        if section == "env" and "=" in line:
            key, _, value = line.partition("=")
            env[key] = value
        elif section == "dev" and line.strip():
            name, major, minor = line.split()
            devices[name] = (int(major, 16), int(minor, 16))
        elif section == "lists" and line.strip():
            lists.append(line.strip())
    return Seen(env, devices, tuple(sorted(lists)))


def container(name: str = "main", gpu: str | None = None, resource: str = "nvidia.com/gpu", env: dict | None = None,
              keep: bool = True, sidecar: bool = False) -> dict:
    """A container of the tier's image that reports what it sees (and then waits, unless ``keep`` is off)."""
    c = objects.container(name, gpu, resource, env, image=images.WORKLOAD)
    c["command"] = ["/bin/sh", "-c", REPORT + ("; exec sleep 100000" if keep else "")]
    c["imagePullPolicy"] = "Never"  # never a registry: the image was imported
    if sidecar:
        c["restartPolicy"] = "Always"
    return c


def pod(name: str, *containers: dict, init: list[dict] | None = None, **spec) -> str:
    manifest = json.loads(objects.pod(name, *containers, **spec))
    if init:
        manifest["spec"]["initContainers"] = init
    return json.dumps(manifest)


def running(kubectl: components.Kubectl, namespace: str, name: str, timeout: float = 120, explain=None) -> dict:
    def check():
        p = kubectl.json("get", "pod", name, "-n", namespace)
        statuses = p["status"].get("containerStatuses") or []
        return p if statuses and all(s.get("state", {}).get("running") for s in statuses) else None

    def why():
        text = kubectl.run("describe", "pod", name, "-n", namespace, check=False).stdout[-3000:]
        return text + ("\n" + explain() if explain else "")
    return components.wait_for(f"pod {namespace}/{name} running", check, timeout=timeout, explain=why)


def seen(kubectl: components.Kubectl, namespace: str, pod_name: str, container_name: str = "main",
         timeout: float = 60) -> Seen:
    """What the container printed of its view (its log)."""
    return components.wait_for(
        f"the report of {pod_name}/{container_name}", lambda: parse(kubectl.run(
            "logs", pod_name, "-c", container_name, "-n", namespace, check=False).stdout), timeout=timeout)


def seen_now(kubectl: components.Kubectl, namespace: str, pod_name: str, container_name: str = "main",
             timeout: float = 60) -> Seen:
    """What the container sees now, by running the report in it again (kubectl exec). A kubelet that has just
    restarted answers "pod does not exist" until it has read its pods back: that is retried."""
    def report():
        done = kubectl.run("exec", pod_name, "-c", container_name, "-n", namespace, "--", "/bin/sh", "-c", REPORT,
                           check=False)
        if done.returncode:
            raise AssertionError(done.stderr.strip())
        return parse(done.stdout)
    return components.wait_for(f"the report of {pod_name}/{container_name} by exec", report, timeout=timeout)


def clear(kubectl: components.Kubectl, timeout: float = 120) -> None:
    """Every pod of the tests' namespaces gone from the API (their namespaces are deleted without waiting), so
    that the shares they held are free for the scheduler."""
    def ours():
        return [p for p in kubectl.json("get", "pods", "-A")["items"]
                if p["metadata"]["namespace"].startswith("e2e-")]
    for pod in ours():
        kubectl.run("delete", "pod", pod["metadata"]["name"], "-n", pod["metadata"]["namespace"], "--grace-period=0",
                    "--force", "--wait=false", check=False)
    components.wait_for("the tests' pods gone", lambda: not ours(), timeout=timeout)


def clear_namespace(kubectl: components.Kubectl, namespace: str, timeout: float = 120) -> None:
    """Every pod of ``namespace`` deleted and gone, so that what they held is free for the next pods."""
    kubectl.run("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", "--wait=false",
                check=False)
    components.wait_for(f"the pods of {namespace} gone", lambda: not kubectl.json(
        "get", "pods", "-n", namespace)["items"], timeout=timeout)


def card_of(kubectl: components.Kubectl, namespace: str, pod_name: str) -> int:
    return int(kubectl.json("get", "pod", pod_name, "-n", namespace)["metadata"]["annotations"]["gpushard.io/card"])


def claim_card(kubectl: components.Kubectl, namespace: str, pod: str) -> tuple[dict, int]:
    """The pod's gpushard claim (backend dra) and the card it was allocated."""
    status = kubectl.json("get", "pod", pod, "-n", namespace)["status"].get("resourceClaimStatuses", [])
    name = next(s["resourceClaimName"] for s in status if s["name"] == "gpushard-gpu")
    claim = kubectl.json("get", "resourceclaim", name, "-n", namespace)
    result = claim["status"]["allocation"]["devices"]["results"][0]
    return claim, int(result["device"].removeprefix("card-"))


def per_card(cards: int, shares: int = 100) -> dict:
    want = {f"gpushard.io/card-{k}": str(shares) for k in range(cards)}
    want["gpushard.io/gpu"] = str(shares * cards)
    return want


def configure(kubectl: components.Kubectl, **changes) -> dict:
    """Change keys of the shipped ConfigMap's config.yaml (as an operator edits it); the config before."""
    configmap = kubectl.json("get", "configmap", "gpushard-config", "-n", gpushard.SYSTEM)
    before = yaml.safe_load(configmap["data"]["config.yaml"])
    after = dict(before)
    for key, value in changes.items():
        if value is None:
            after.pop(key, None)
        else:
            after[key] = value
    set_config(kubectl, after)
    return before


def set_config(kubectl: components.Kubectl, config: dict) -> None:
    patch = {"data": {"config.yaml": yaml.safe_dump(config, sort_keys=False)}}
    kubectl.run("patch", "configmap", "gpushard-config", "-n", gpushard.SYSTEM, "--type=merge", "-p",
                json.dumps(patch))


def delete_all_pods(kubectl: components.Kubectl, runtime: node.Containerd | None = None, timeout: float = 60) -> None:
    """Every pod deleted, so that the kubelet stops their containers and frees their networks its own way."""
    kubectl.run("delete", "pods", "--all", "-A", "--grace-period=0", "--force", "--wait=false", check=False,
                timeout=60)
    if runtime is None:
        time.sleep(5)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and runtime.ctr_run("containers", "list", "-q").stdout.split():
        time.sleep(1)


def quiet(kubectl: components.Kubectl) -> None:
    """Stop IMAGE_WORKLOADS: no pod of theirs is left, and none is made again (apply overlays with ``leave``)."""
    system = gpushard.SYSTEM
    kubectl.run("scale", "deployment", "gpushard-webhook", "gpushard-replacer", "-n", system, "--replicas=0")
    kubectl.run("patch", "cronjob", "gpushard-certs-renew", "-n", system, "-p", '{"spec": {"suspend": true}}')
    kubectl.run("delete", "job", "gpushard-certs", "-n", system, "--cascade=foreground", "--wait=true",
                "--ignore-not-found")
    components.wait_for("no pod of gpushard's own workloads", lambda: not [
        p for p in kubectl.json("get", "pods", "-n", system)["items"] if p["metadata"]["name"] != STANDIN],
        timeout=60)


def expect_card(view: Seen, card: int, strategy: tuple[str, ...], runtime: node.Containerd) -> None:
    """What a container that holds shares of ``card`` must see under ``strategy`` on ``runtime``, and no more."""
    injected = runtime.cdi and "cdi-cri" in strategy
    if injected:
        assert view.cards() == {card}, view.devices
        assert set(view.devices) == {f"/dev/nvidia{card}", "/dev/nvidiactl", "/dev/nvidia-uvm"}, view.devices
        # NVIDIA's spec sets void once it injected the devices itself: no hook may add any.
        assert view.visible == "void", view.env
    else:
        # No NVIDIA hook on this node: nothing turns the variable or the mount into a device node. They are what
        # the hook would act on, and they name card k only. The pod's value (the webhook's) wins over the agent's.
        assert view.devices == {}, view.devices
        assert view.visible == str(card), view.env
    if "volume-mounts" in strategy:
        assert view.lists == (node.uuid(card),), view.lists
    else:
        assert view.lists == (), view.lists
    assert view.env.get("GPUSHARD_FRACTION") in ("0.25", "0.6", "0.5"), view.env


class HostAgent(gpushard.Agent):
    """`gpushard agent` on the host, as the node tier runs it, over four fake cards; its CDI specs go where the
    runtime reads them. Its token is bound to a pod of its ServiceAccount on the node (as its DaemonSet's pod
    would have it, so the own-node policy reads the node's name in it); that pod only holds the binding."""

    def __init__(self, plane: components.ControlPlane, kubelet: components.Kubelet, work, runtime: node.Containerd):
        super().__init__(plane, kubelet, work)
        self.cdi_dir = runtime.cdi_dynamic
        # The toolkit config of this node's NVIDIA runtime, when the tier installs it (tests/runtime/nvidia.py).
        self.extra_args = [f"--toolkit-config={work / 'nvidia-toolkit' / 'config.toml'}"]

    def start(self, expect: dict | None = None, wait: bool = True) -> HostAgent:
        if not (self.folder / "lib").exists():
            self.build_nvml()
            self.put("cards", str(node.CARDS))
        super().start(expect or per_card(node.CARDS), wait=wait)
        return self

    def daemonset_pod(self) -> str:
        kubectl = self.plane.kubectl
        kubectl.apply(json.dumps({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": STANDIN, "namespace": gpushard.SYSTEM},
            "spec": {"serviceAccountName": "gpushard-agent", "nodeName": components.NODE_NAME,
                     "terminationGracePeriodSeconds": 0, "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "hold", "image": images.WORKLOAD, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", "exec sleep 100000"]}]}}))
        return STANDIN
