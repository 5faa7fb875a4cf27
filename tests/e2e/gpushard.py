"""gpushard's own processes in the end-to-end tier: the webhook and the agent, run as an operator would.

The webhook runs as ``gpushard serve`` on loopback with a token of its own ServiceAccount (so the
shipped RBAC is what it has), and the MutatingWebhookConfiguration that deploy/base installed is
pointed at it by ``clientConfig.url`` (Endpoints refuse loopback addresses). The agent runs as
``gpushard agent`` with a token bound to the pod its DaemonSet made on the kubelet's node (so the
own-node policy sees the node name in the token), the config from the shipped ConfigMap, and the
real pynvml over a fake libnvidia-ml.so.1 (tests/agent/fakenvml.c) whose cards a test controls.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.chart import helm as chart_helm
from tests.e2e import components

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "gpushard-system"
GPUSHARD = str(Path(sys.executable).with_name("gpushard"))
FAKE_NVML = ROOT / "tests" / "agent" / "fakenvml.c"
CHART = ROOT / "charts" / "gpushard"
# What the agent says while the kubelet still counts its count as a device plugin's (webhook/agent/dra/nodecount.py).
NODECOUNT_HELD = "still counts gpushard.io/gpu as a device plugin's"
KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"  # the kubelet's device manager's, in DEVICE_PLUGIN_DIR


def helm(plane: components.ControlPlane, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The pinned helm (tests/chart/helm.py) on ``plane``, in gpushard's namespace."""
    done = subprocess.run([chart_helm.binary(), f"--kubeconfig={plane.kubectl.config}", "-n", SYSTEM, *args],
                          capture_output=True, text=True, timeout=300)
    if check and done.returncode:
        raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def packaged_chart(folder: Path) -> Path:
    """The chart as `helm package` makes it (what a release ships, and make release does), in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([chart_helm.binary(), "package", str(CHART), "--destination", str(folder)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise AssertionError(f"helm package exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    found, = folder.glob("gpushard-*.tgz")
    return found


def release_objects(plane: components.ControlPlane) -> list[dict]:
    manifest = helm(plane, "get", "manifest", "gpushard").stdout
    return [d for d in yaml.safe_load_all(manifest) if d]


def mark_for_helm(kubectl: components.Kubectl, rendered: Path) -> None:
    """The objects of a Kustomize install (``rendered``: `kubectl kustomize` of what was applied) made release
    gpushard's, as docs/helm.md ("Taking a Kustomize install over with Helm") says: marked with Helm's ownership
    label and annotations, and their fields handed from kubectl's client-side apply to Helm's field manager."""
    kubectl.run("label", "-f", str(rendered), "app.kubernetes.io/managed-by=Helm", "--overwrite", timeout=180)
    kubectl.run("annotate", "-f", str(rendered), "meta.helm.sh/release-name=gpushard",
                f"meta.helm.sh/release-namespace={SYSTEM}", "--overwrite", timeout=180)
    kubectl.run("apply", "--server-side", "--field-manager=helm", "-f", str(rendered), timeout=180)


def leftovers(kubectl: components.Kubectl) -> set[tuple[str, str]]:
    """gpushard's objects still stored: those labelled part-of gpushard, in its namespace and cluster-wide."""
    kinds = ("configmaps,secrets,serviceaccounts,services,deployments,daemonsets,jobs,cronjobs,roles,rolebindings,"
             "poddisruptionbudgets,resourcequotas")
    cluster_kinds = ("clusterroles,clusterrolebindings,mutatingwebhookconfigurations,validatingadmissionpolicies,"
                     "validatingadmissionpolicybindings,deviceclasses,priorityclasses")
    found = set()
    for args in ((kinds, "-n", SYSTEM), (cluster_kinds,)):
        listed = kubectl.json("get", *args, "-l", "app.kubernetes.io/part-of=gpushard")["items"]
        found |= {(o["kind"], o["metadata"]["name"]) for o in listed}
    return found


def shipped_config(kubectl: components.Kubectl, folder: Path) -> Path:
    """The config file as the shipped ConfigMap holds it (what the pods mount)."""
    data = kubectl.json("get", "configmap", "gpushard-config", "-n", SYSTEM)["data"]["config.yaml"]
    path = folder / "config.yaml"
    path.write_text(data)
    return path


def client_config(plane: components.ControlPlane, url: str, hook: dict) -> dict:
    client = hook["clientConfig"]
    path = client["service"]["path"] if "service" in client else urllib.parse.urlparse(client["url"]).path
    return {"url": f"{url}{path}", "caBundle": base64.b64encode(plane.pki.ca_path.read_bytes()).decode()}


def point_configuration(plane: components.ControlPlane, url: str) -> None:
    """Every webhook of the shipped configuration, called at ``url`` (this machine), trusting the run's CA."""
    kubectl = plane.kubectl
    configuration = kubectl.json("get", "mutatingwebhookconfiguration", "gpushard")
    patch = [{"op": "replace", "path": f"/webhooks/{i}/clientConfig", "value": client_config(plane, url, hook)}
             for i, hook in enumerate(configuration["webhooks"])]
    kubectl.run("patch", "mutatingwebhookconfiguration", "gpushard", "--type=json", "-p", json.dumps(patch))


class Webhook:
    def __init__(self, plane: components.ControlPlane, work: Path):
        self.plane, self.work = plane, work
        self.folder = work / "webhook"
        self.folder.mkdir(exist_ok=True)
        self.port = components.free_port()
        self.process: components.Process | None = None
        self.cert, self.key = plane.pki.issue("webhook", "gpushard-webhook", dns=("localhost",), ips=("127.0.0.1",),
                                              server=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> Webhook:
        kubectl = self.plane.kubectl
        config = shipped_config(kubectl, self.folder)
        token = kubectl.token("gpushard-webhook", SYSTEM)
        kubeconfig = self.plane.token_config("webhook", token)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.process = components.Process("webhook", [
            GPUSHARD, "serve", f"--cert={self.cert}", f"--key={self.key}", f"--bind=127.0.0.1:{self.port}",
            f"--config={config}",
        ], self.work / "webhook.log", env=env).start()
        self.wait_ready()
        self.point_configuration()
        return self

    def wait_ready(self) -> None:
        context = ssl.create_default_context(cafile=str(self.plane.pki.ca_path))
        components.wait_for("the webhook's /readyz", lambda: urllib.request.urlopen(
            f"{self.url}/readyz", context=context, timeout=3).status == 200, timeout=60, explain=self.tail)

    def point_configuration(self) -> None:
        point_configuration(self.plane, self.url)

    def apply(self, kustomization: Path, *args: str, leave: frozenset = frozenset()) -> subprocess.CompletedProcess:
        """`kubectl apply -k` of a kustomization once the webhook runs here: its configuration keeps calling
        this process (on a cluster it calls the Service; a loopback URL is this tier's only change). ``leave``:
        (kind, name) of objects not applied (they stay as they are)."""
        kubectl = self.plane.kubectl
        documents = [d for d in yaml.safe_load_all(kubectl.run("kustomize", str(kustomization)).stdout)
                     if d and (d["kind"], d["metadata"]["name"]) not in leave]
        for document in documents:
            if document and document["kind"] == "MutatingWebhookConfiguration":
                for hook in document["webhooks"]:
                    hook["clientConfig"] = client_config(self.plane, self.url, hook)
        return kubectl.run("apply", "-f", "-", *args, input=yaml.safe_dump_all(documents), check=False, timeout=180)

    def stop(self) -> None:
        if self.process:
            self.process.stop()

    def restart(self) -> None:
        self.process.start()
        self.wait_ready()

    def reload(self) -> None:
        """Started again on the config the ConfigMap holds now (as a rollout after a config change)."""
        self.stop()
        shipped_config(self.plane.kubectl, self.folder)
        self.restart()

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace") if self.process else ""

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""


class Agent:
    def __init__(self, plane: components.ControlPlane, kubelet: components.Kubelet, work: Path):
        self.plane, self.kubelet, self.work = plane, kubelet, work
        self.folder = work / "agent"
        self.control = self.folder / "nvml"
        self.process: components.Process | None = None
        self.pod = ""
        # Where the agent writes its per-claim CDI specs: a container runtime with CDI reads them there.
        self.cdi_dir = self.folder / "cdi"
        self.extra_args: list[str] = []  # more of `gpushard agent`'s flags, for the next start
        self.started_at = 0  # where the log of the latest start begins

    def build_nvml(self) -> Path:
        lib = self.folder / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        self.control.mkdir(parents=True, exist_ok=True)
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise AssertionError("gpushard e2e: the agent tier needs a C compiler for the fake NVML library")
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"),
                        "-Wl,-soname,libnvidia-ml.so.1", str(FAKE_NVML)], check=True, timeout=60)
        self.put("cards", "2")
        return lib

    def put(self, name: str, text: str = "") -> None:
        tmp = self.control / f".{name}.tmp"
        tmp.write_text(text)
        tmp.rename(self.control / name)

    def daemonset_pod(self) -> str:
        kubectl = self.plane.kubectl
        kubectl.run("label", "node", components.NODE_NAME, "gpushard.io/shared-node=true", "--overwrite")
        # The shipped DaemonSet names RuntimeClass nvidia, which the GPU nodes' runtime provides.
        kubectl.apply(json.dumps({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                  "metadata": {"name": "nvidia"}, "handler": "nvidia"}))

        def bound_pod():
            # The pod of the DaemonSet's current template: after a change of it the old pod goes away, and a
            # token bound to it with it.
            generation = str(kubectl.json("get", "daemonset", "gpushard-agent", "-n", SYSTEM)["metadata"]["generation"])
            pods = kubectl.json("get", "pods", "-n", SYSTEM, "-l", "app.kubernetes.io/component=agent")["items"]
            return next((p["metadata"]["name"] for p in pods
                         if p["spec"].get("nodeName") == components.NODE_NAME
                         and not p["metadata"].get("deletionTimestamp")
                         and p["metadata"]["labels"].get("pod-template-generation") == generation), None)
        return components.wait_for("the agent DaemonSet's pod on the node", bound_pod, timeout=90,
                                   explain=self.plane.logs)

    def token_config(self) -> Path:
        token = self.plane.kubectl.token("gpushard-agent", SYSTEM, pod=self.pod)
        return self.plane.token_config("agent", token)

    def start(self, expect: dict | None = None, wait: bool = True) -> Agent:
        lib = self.folder / "lib" if (self.folder / "lib").exists() else self.build_nvml()
        self.pod = self.daemonset_pod()
        config = shipped_config(self.plane.kubectl, self.folder)
        env = {**os.environ, "KUBECONFIG": str(self.token_config()), "LD_LIBRARY_PATH": str(lib),
               "FAKE_NVML_DIR": str(self.control), "NODE_NAME": components.NODE_NAME}
        log = self.work / "agent.log"
        offset = log.stat().st_size if log.exists() else 0
        self.process = components.Process("agent", [
            GPUSHARD, "agent", f"--config={config}", f"--node-name={components.NODE_NAME}",
            f"--device-plugin-dir={components.DEVICE_PLUGIN_DIR}",
            f"--pod-resources-socket={self.kubelet.pod_resources_socket}",
            f"--kubelet-registry-dir={self.kubelet.registry_dir}", f"--kubelet-plugins-dir={self.kubelet.plugins_dir}",
            f"--cdi-dir={self.cdi_dir}", "--poll-interval=0.5", *self.extra_args,
        ], log, env=env).start()
        self.started_at = offset
        if not wait:
            return self
        expect = expect or {"gpushard.io/card-0": "100", "gpushard.io/card-1": "100", "gpushard.io/gpu": "200"}

        # The node's allocatable can still show the last agent's shares while the kubelet holds their devices
        # unhealthy (their plugin went away): a pod bound then is refused by the kubelet (UnexpectedAdmissionError).
        # Registered again, the devices are listed healthy at once. Under backend dra the count is no device plugin:
        # the agent writes it into the Node's status ("published ... at node").
        def registered():
            text = log.read_bytes()[offset:].decode(errors="replace")
            return all(f"registered {name} at" in text or f"published {name} at" in text for name in expect)
        components.wait_for(f"the agent registering {sorted(expect)}", registered, timeout=60, explain=self.tail)
        self.wait_allocatable(expect)
        return self

    def reload(self, expect: dict | None = None) -> None:
        """Started again on the ConfigMap's config now, with a token bound to the DaemonSet's current pod."""
        self.stop()
        self.start(expect)

    def since_start(self) -> str:
        log = self.work / "agent.log"
        return log.read_bytes()[self.started_at:].decode(errors="replace") if log.exists() else ""

    def reload_dra(self, count: str) -> None:
        """Started again on backend dra (the ConfigMap's config now) on a kubelet that ran the device-plugin
        backend. Its device manager still counts gpushard.io/gpu as that plugin's for five minutes (its checkpoint
        lists it; pkg/kubelet/cm/devicemanager), writing none allocatable: the agent must see that and leave the
        count alone (webhook/agent/dra/nodecount.py). Then the kubelet starts again without that checkpoint, as on a
        node that never ran the device-plugin backend, and the agent writes ``count``."""
        self.stop()
        self.start(wait=False)
        components.wait_for("the agent seeing the kubelet hold gpushard.io/gpu as a device plugin's",
                            lambda: NODECOUNT_HELD in self.since_start(), timeout=60, explain=self.tail)
        self.wait_allocatable({"gpushard.io/gpu": "0"}, timeout=60)
        assert "published gpushard.io/gpu at" not in self.since_start(), self.tail()
        self.kubelet.process.stop()
        (components.DEVICE_PLUGIN_DIR / KUBELET_CHECKPOINT).unlink(missing_ok=True)
        self.kubelet.process.start()
        components.wait_for(f"node {components.NODE_NAME} Ready", lambda: self.kubelet.ready(self.plane.kubectl),
                            timeout=90, explain=self.kubelet.tail)
        components.wait_for("the agent writing its count", lambda: "published gpushard.io/gpu at" in self.since_start(),
                            timeout=60, explain=self.tail)
        self.wait_allocatable({"gpushard.io/gpu": count})

    def allocatable(self) -> dict:
        return self.plane.kubectl.json("get", "node", components.NODE_NAME)["status"].get("allocatable", {})

    def wait_allocatable(self, want: dict, timeout: float = 60) -> None:
        components.wait_for(f"node allocatable {want}", lambda: all(
            self.allocatable().get(k) == v for k, v in want.items()), timeout=timeout,
            explain=lambda: f"allocatable now: {self.allocatable()}\n{self.tail()}\n{self.kubelet.tail(20)}")

    def stop(self) -> None:
        if self.process:
            self.process.stop()

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace") if self.process else ""

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""
