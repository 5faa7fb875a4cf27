"""Real Kubernetes components for the end-to-end tier, each process owned by one object with its log.

The tier is handed binaries, never downloads or builds them (envtest's convention):
``KUBEBUILDER_ASSETS`` is a folder with etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kubectl; for the node tier ``GPUSHARD_E2E_KUBELET`` is a kubelet binary and
``GPUSHARD_E2E_CRI`` the unix socket of a CRI runtime already serving (a runtime that starts no
containers is enough: admission, the device manager, its checkpoint, PodResources and DRA are the
kubelet's own either way). Everything runs on loopback with fresh certificates and a fresh etcd.

Facts this rests on, seen running them: the kubelet's device-plugin folder is the constant
/var/lib/kubelet/device-plugins whatever ``--root-dir`` says, so one kubelet per machine; on a
cgroup v1 machine the kubelet needs ``failCgroupV1: false`` and no QoS cgroups; Endpoints refuse
loopback addresses, so the API server's own endpoint reconciler is off and webhooks on loopback
are reached by ``clientConfig.url``.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import oid

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
NODE_NAME = "e2e-node"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float = 60.0, interval: float = 0.5, explain=None):
    """Poll ``check`` until it returns something true; fail naming ``what`` (and ``explain()``'s text)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception as exc:  # a component still starting answers with errors
            last = exc
            value = None
        if value:
            return value
        time.sleep(interval)
    detail = f" (last error: {last})" if last else ""
    extra = f"\n{explain()}" if explain else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}{extra}")


class Process:
    """One component's process and its log file; ``tail()`` is what a failing test prints."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None):
        self.name, self.argv, self.log_path = name, argv, log
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> Process:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, cwd=self.cwd, start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"--- {self.name}: no log"
        return f"--- last {min(lines, len(text))} lines of {self.name}'s log ({self.log_path}):\n" + "\n".join(
            text[-lines:])


def _name(cn: str, groups: tuple[str, ...] = ()) -> x509.Name:
    parts = [x509.NameAttribute(oid.NameOID.ORGANIZATION_NAME, g) for g in groups]
    return x509.Name(parts + [x509.NameAttribute(oid.NameOID.COMMON_NAME, cn)])


class Pki:
    """A CA made for one run, and the certificates the components and their clients present."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        subject = _name("gpushard e2e CA")
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(hours=1))
                     .not_valid_after(now + datetime.timedelta(days=2))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                    critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_path = self._write("ca.crt", self.cert.public_bytes(serialization.Encoding.PEM))
        self._write("ca.key", self._key_pem(self.key))

    @staticmethod
    def _key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def _write(self, name: str, data: bytes) -> Path:
        path = self.folder / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    def issue(self, name: str, cn: str, groups: tuple[str, ...] = (), dns: tuple[str, ...] = (),
              ips: tuple[str, ...] = (), server: bool = False) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = oid.ExtendedKeyUsageOID.SERVER_AUTH if server else oid.ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder().subject_name(_name(cn, groups)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return (self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
                self._write(f"{name}.key", self._key_pem(key)))

    def service_account_keys(self) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
        return self._write("sa.key", self._key_pem(key)), self._write("sa.pub", public)


def kubeconfig(path: Path, server: str, ca: Path, cert: Path | None = None, key: Path | None = None,
               token: str | None = None) -> Path:
    user: dict = {}
    if cert:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user = {"token": token}
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "e2e", "user": user}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}],
    }
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


class Kubectl:
    """kubectl against one cluster as one user; ``run`` returns the completed process."""

    def __init__(self, binary: str, config: Path):
        self.binary, self.config = binary, config

    def run(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120,
            config: Path | None = None) -> subprocess.CompletedProcess:
        argv = [self.binary, f"--kubeconfig={config or self.config}", *args]
        done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def json(self, *args: str, config: Path | None = None) -> dict:
        return json.loads(self.run(*args, "-o", "json", config=config).stdout)

    def apply(self, manifest: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("apply", "-f", "-", *args, input=manifest, check=check)

    def token(self, account: str, namespace: str, pod: str | None = None, seconds: int = 7200) -> str:
        extra = ["--bound-object-kind=Pod", f"--bound-object-name={pod}"] if pod else []
        return self.run("create", "token", account, "-n", namespace, f"--duration={seconds}s",
                        *extra).stdout.strip()


def minor_of(binary: str) -> int:
    """The minor of a Kubernetes component, from its --version ("Kubernetes v1.34.4")."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
    version = next((w for w in done.stdout.split() if w.startswith("v1.")), "")
    if not version:
        raise RuntimeError(f"{binary} --version printed no v1.x version: {done.stdout!r}")
    return int(version.split(".")[1])


def own_plane(assets: Path, folder: Path):
    """A control plane of a module's own in ``folder`` (a generator for a fixture): its logs printed when it does not
    start, stopped afterwards."""
    folder.mkdir()
    plane = ControlPlane(assets, folder)
    try:
        plane.start()
    except BaseException:
        print(plane.logs(60))
        plane.stop()
        raise
    yield plane
    plane.stop()


class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler from ``assets``, on loopback."""

    def __init__(self, assets: Path, work: Path, node_lifecycle: bool = True, apiserver_flags: list[str] = (),
                 score_all_nodes: bool = False, address: str = "127.0.0.1", controller_flags: list[str] = ()):
        self.assets, self.work = assets, work
        # Where the API server serves: loopback, or an address pods reach (the runtime tier's bridge), for
        # gpushard's own pods to talk to it.
        self.address = address
        self.node_lifecycle = node_lifecycle
        self.apiserver_flags = list(apiserver_flags)
        self.controller_flags = list(controller_flags)
        # docs/install.md's advice for clusters past 100 nodes: kube-scheduler scores every feasible node.
        self.score_all_nodes = score_all_nodes
        self.processes: list[Process] = []
        self.pki = Pki(work / "pki")
        self.port = free_port()
        self.server = f"https://{address}:{self.port}"
        self.kubectl: Kubectl | None = None
        self.minor = minor_of(self.binary("kube-apiserver"))

    def binary(self, name: str) -> str:
        return str(self.assets / name)

    def admin_config(self) -> Path:
        cert, key = self.pki.issue("admin", "e2e-admin", ("system:masters",))
        return kubeconfig(self.work / "admin.kubeconfig", self.server, self.pki.ca_path, cert, key)

    def user_config(self, name: str, user: str, groups: tuple[str, ...] = ()) -> Path:
        cert, key = self.pki.issue(name, user, groups)
        return kubeconfig(self.work / f"{name}.kubeconfig", self.server, self.pki.ca_path, cert, key)

    def token_config(self, name: str, token: str) -> Path:
        return kubeconfig(self.work / f"{name}.kubeconfig", self.server, self.pki.ca_path, token=token)

    def _start(self, name: str, argv: list[str]) -> Process:
        process = Process(name, argv, self.work / f"{name}.log").start()
        self.processes.append(process)
        return process

    def logs(self, lines: int = 30) -> str:
        return "\n".join(p.tail(lines) for p in self.processes)

    def start(self) -> ControlPlane:
        etcd_port, peer_port = free_port(), free_port()
        etcd = self._start("etcd", [
            self.binary("etcd"), f"--data-dir={self.work / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}", "--unsafe-no-fsync", "--quota-backend-bytes=8589934592",
        ])
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        wait_for("etcd", lambda: urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2).status
                 == 200, timeout=30, explain=etcd.tail)
        serving = self.pki.issue("apiserver", "kube-apiserver", dns=("kubernetes", "kubernetes.default.svc",
                                                                        "localhost"),
                                  # 10.0.0.1: the kubernetes Service's address, which pods are told to use.
                                  ips=tuple(dict.fromkeys(("127.0.0.1", self.address, "10.0.0.1"))), server=True)
        sa_key, sa_pub = self.pki.service_account_keys()
        kubelet_client = self.pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                        ("system:masters",))
        apiserver = self._start("kube-apiserver", [
            self.binary("kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}", f"--secure-port={self.port}",
            f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={self.pki.ca_path}",
            # Aggregation is unused; naming its CA keeps every component from logging its absence.
            f"--requestheader-client-ca-file={self.pki.ca_path}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--kubelet-client-certificate={kubelet_client[0]}", f"--kubelet-client-key={kubelet_client[1]}",
            f"--kubelet-certificate-authority={self.pki.ca_path}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.0.0.0/24", "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction", "--allow-privileged=true",
            "--endpoint-reconciler-type=none", f"--cert-dir={self.work / 'apiserver-certs'}",
            "--profiling=false", "--v=1", *self.apiserver_flags,
        ])
        admin = self.admin_config()
        self.kubectl = Kubectl(self.binary("kubectl"), admin)
        wait_for("kube-apiserver /readyz", lambda: self.kubectl.run("get", "--raw", "/readyz", check=False,
                                                                     timeout=10).returncode == 0,
                 timeout=90, explain=apiserver.tail)
        cm_config = self.user_config("controller-manager", "system:kube-controller-manager")
        controllers = "*" if self.node_lifecycle else "*,-node-lifecycle-controller"
        self._start("kube-controller-manager", [
            self.binary("kube-controller-manager"), f"--kubeconfig={admin}",
            f"--authentication-kubeconfig={cm_config}", f"--authorization-kubeconfig={cm_config}",
            f"--service-account-private-key-file={sa_key}", f"--root-ca-file={self.pki.ca_path}",
            "--use-service-account-credentials=true", "--leader-elect=false", f"--controllers={controllers}",
            f"--cluster-signing-cert-file={self.pki.ca_path}",
            f"--cluster-signing-key-file={self.pki.folder / 'ca.key'}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--v=1", *self.controller_flags,
        ])
        sched_config = self.user_config("scheduler", "system:kube-scheduler")
        configured = [f"--kubeconfig={sched_config}", "--leader-elect=false"]
        if self.score_all_nodes:
            config = self.work / "scheduler.yaml"
            config.write_text(json.dumps({
                "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": str(sched_config)}, "leaderElection": {"leaderElect": False},
                "percentageOfNodesToScore": 100}))
            configured = [f"--config={config}"]
        self._start("kube-scheduler", [
            self.binary("kube-scheduler"), *configured,
            f"--authentication-kubeconfig={sched_config}", f"--authorization-kubeconfig={sched_config}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--v=1",
        ])
        # The default ServiceAccount appears once the controller manager runs: pods need it.
        wait_for("the default ServiceAccount", lambda: self.kubectl.run(
            "get", "serviceaccount", "default", "-n", "default", check=False, timeout=10).returncode == 0,
            timeout=60, explain=self.logs)
        return self

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def ready(self) -> bool:
        return self.kubectl.run("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


KUBELET_CONFIG = """\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {address}
port: {port}
readOnlyPort: 0
healthzPort: 0
containerRuntimeEndpoint: unix://{cri}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: Webhook}}
tlsCertFile: {cert}
tlsPrivateKeyFile: {key}
failCgroupV1: false
cgroupsPerQOS: false
cgroupDriver: cgroupfs
enforceNodeAllocatable: []
failSwapOn: false
resolvConf: ""
nodeStatusUpdateFrequency: 2s
nodeStatusReportFrequency: 10s
syncFrequency: 5s
evictionHard: {{}}
evictionPressureTransitionPeriod: 5s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
podLogsDir: {logs}
featureGates: {gates}
{dns}"""


class FakeCri:
    """Kubernetes' fake CRI runtime (e2e/fakecri) on a socket of the run's folder: it starts no container."""

    def __init__(self, binary: str, work: Path):
        self.socket = work / "fakecri.sock"
        self.process = Process("fakecri", [binary, f"--listen={self.socket}"], work / "fakecri.log")

    def start(self) -> FakeCri:
        self.process.start()
        wait_for(f"the fake CRI on {self.socket}", self.socket.exists, timeout=30, explain=self.process.tail)
        return self

    def stop(self) -> None:
        self.process.stop()

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines)


class Kubelet:
    """A real kubelet on this machine, registered as ``NODE_NAME``, over an already running CRI runtime."""

    def __init__(self, binary: str, cri: str, plane: ControlPlane, work: Path, gates: dict | None = None,
                 address: str = "127.0.0.1", root: Path | None = None, cluster_dns: str | None = None):
        self.binary, self.cri, self.plane = binary, cri, plane
        # The address pods with dnsPolicy ClusterFirst are told to ask (clusterDNS, domain cluster.local); None
        # leaves them without a nameserver, as the tiers that need no names run.
        self.cluster_dns = cluster_dns
        # The node's address, where it serves and where the API server reaches it (logs, exec): a loopback
        # address is refused as the node's IP (the kubelet then reports none), which only matters to those.
        self.address = address
        self.work = work
        # The kubelet's --root-dir: the run's folder, or /var/lib/kubelet where pods mount its folders by their
        # usual host paths (the agent's DaemonSet mounts pod-resources/ from there).
        self.root = root or work / "kubelet-root"
        self.process: Process | None = None
        self.gates = gates or {}

    @property
    def pod_resources_socket(self) -> Path:
        return self.root / "pod-resources" / "kubelet.sock"

    @property
    def registry_dir(self) -> Path:
        return self.root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.root / "plugins"

    def start(self) -> Kubelet:
        self.root.mkdir(parents=True, exist_ok=True)
        DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        cert, key = self.plane.pki.issue("kubelet-serving", NODE_NAME, dns=(NODE_NAME, "localhost"),
                                         ips=tuple(dict.fromkeys(("127.0.0.1", self.address))), server=True)
        client = self.plane.user_config("kubelet", f"system:node:{NODE_NAME}", ("system:nodes",))
        config = self.work / "kubelet.yaml"
        config.write_text(KUBELET_CONFIG.format(address=self.address, port=free_port(), cri=self.cri,
                                                ca=self.plane.pki.ca_path, cert=cert, key=key,
                                                logs=self.work / "pod-logs",
                                                gates=json.dumps(self.gates),
                                                dns=(f"clusterDNS: [{self.cluster_dns}]\nclusterDomain: cluster.local\n"
                                                     if self.cluster_dns else "")))
        self.process = Process("kubelet", [
            self.binary, f"--config={config}", f"--kubeconfig={client}", f"--root-dir={self.root}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={self.address}",
            f"--cert-dir={self.work / 'kubelet-certs'}", "--v=2",
        ], self.work / "kubelet.log").start()
        kubectl = self.plane.kubectl
        wait_for(f"node {NODE_NAME} Ready", lambda: self.ready(kubectl), timeout=90, explain=self.process.tail)
        return self

    @staticmethod
    def ready(kubectl: Kubectl) -> bool:
        done = kubectl.run("get", "node", NODE_NAME, "-o", "json", check=False, timeout=10)
        if done.returncode:
            return False
        conditions = json.loads(done.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def restart(self) -> None:
        self.process.stop()
        self.process.start()

    def stop(self) -> None:
        if self.process:
            self.process.stop()

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""


def tls_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def which_assets(environ: dict) -> tuple[Path | None, str]:
    """The assets folder, or None and the one line that says what is missing."""
    folder = environ.get("KUBEBUILDER_ASSETS")
    if not folder:
        return None, ("set KUBEBUILDER_ASSETS to a folder with " + ", ".join(CONTROL_PLANE)
                      + " (and GPUSHARD_E2E_KUBELET, GPUSHARD_E2E_CRI for the node tier) to run the e2e tier")
    path = Path(folder)
    missing = [b for b in CONTROL_PLANE if not (path / b).exists() and not shutil.which(b, path=str(path))]
    if missing:
        return None, f"KUBEBUILDER_ASSETS={folder} lacks {', '.join(missing)}"
    return path, ""
