"""The node of the runtime tier: containerd and runc, a CNI bridge, images and cards, all in one folder of its own.

The tier is handed a containerd binary (``GPUSHARD_E2E_CONTAINERD``) and starts it itself with a config it
writes: its root, state and socket in the run's folder, runc through a wrapper (below), the CNI bridge
plugin with a bridge and an address range the tier owns, CDI on where the runtime has it, and the sandbox
image made here. Nothing is pulled: the images are imported from archives (tests/runtime/images.py).

One deviation from a stock node: this VM refuses a negative ``oom_score_adj``, even to root, and the kubelet
asks -998 for every pod sandbox, so runc fails ("can't get final child's PID from pipe: EOF"). The runtime
is pointed (``BinaryName``) at a wrapper that raises a negative ``process.oomScoreAdj`` in the bundle's
config.json to 0 before it calls runc. Nothing else about the containers changes.

The cards are device nodes made in the run's folder with NVIDIA's names and major number (``nvidia<k>``
195:k, ``nvidiactl`` 195:255, ``nvidia-uvm``), described by a CDI spec in the shape ``nvidia-ctk cdi
generate`` writes (kind ``nvidia.com/gpu``, each card by index and by UUID), with the UUIDs of the fake
``libnvidia-ml.so.1`` the agent reads. A container that is given card k sees ``/dev/nvidia<k>`` with
minor k, which is what the tests read.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e import components
from tests.runtime import images

# Kept clear of the usual cluster ranges (10.244/16, 10.96/12, 10.0/24 is the tier's services).
POD_SUBNET = os.environ.get("GPUSHARD_E2E_POD_SUBNET", "10.203.0.0/24")
BRIDGE = "gpushard-e2e0"
# The node's own address: the bridge's, where the kubelet serves (the API server reaches it there for logs and
# exec, and a loopback node IP is refused) and the pods' gateway.
NODE_IP = str(next(ipaddress.ip_network(POD_SUBNET).hosts()))
NVIDIA_MAJOR = 195
CTL_MINOR = 255
UVM_MAJOR = 235  # the driver's nvidia-uvm major is given out at load; any free number serves here
CARDS = 4
# The hook NVIDIA's toolkit names in its CDI specs, at the path its specs give; the tier's stand-in records
# how the runtime ran it.
HOOK_NAME = "nvidia-cdi-hook"
NVIDIA_CDI_SPEC = "nvidia.yaml"


def uuid(card: int) -> str:
    """The UUID the fake NVML library gives card ``card`` (tests/agent/fakenvml.c)."""
    return f"GPU-fake-{card:04d}"


def version_of(binary: str) -> tuple[int, int, int]:
    """containerd's version from ``--version`` ("... 1.6.20~ds1 ..." or "... v2.4.0-beta ...")."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    match = re.search(r"\sv?(\d+)\.(\d+)\.(\d+)", done.stdout)
    if not match:
        raise AssertionError(f"gpushard e2e: cannot read a version from `{binary} --version`: {done.stdout!r}")
    return int(match[1]), int(match[2]), int(match[3])


RUNC_WRAPPER = """\
#!{python}
# runc, with a negative oom_score_adj raised to 0: this VM refuses negative values even to root. While {route}
# names another runtime (NVIDIA's, which calls runc itself), that one is run instead, with its environment.
import json, os, sys
args = sys.argv[1:]
if "create" in args or "run" in args:
    bundle = "."
    for i, arg in enumerate(args):
        if arg in ("--bundle", "-b") and i + 1 < len(args):
            bundle = args[i + 1]
        elif arg.startswith("--bundle="):
            bundle = arg.split("=", 1)[1]
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    process = spec.get("process") or {{}}
    if process.get("oomScoreAdj", 0) < 0:
        process["oomScoreAdj"] = 0
        with open(path, "w") as f:
            json.dump(spec, f)
try:
    with open({route!r}) as f:
        route = json.load(f)
except FileNotFoundError:
    route = None
if route:
    os.environ.update(route["env"])
    os.execv(route["binary"], [route["binary"]] + args)
os.execv({runc!r}, [{runc!r}] + args)
"""

# Records how the runtime ran the hook: its arguments and, from the bundle's OCI spec, the limit variables
# the real hook reads (NVIDIA's apply-cuda-memory-limits reads them there).
HOOK_STANDIN = """\
#!{python}
import json, os, sys
state = json.load(sys.stdin)
bundle = state.get("bundle", "")
env = {{}}
try:
    with open(os.path.join(bundle, "config.json")) as f:
        for item in json.load(f).get("process", {{}}).get("env", []):
            key, _, value = item.partition("=")
            if key.startswith("NVIDIA_GPU_MEMORY") or key == "GPUSHARD_FRACTION":
                env[key] = value
except OSError:
    pass
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv, "id": state.get("id"), "env": env}}) + "\\n")
"""


class Cards:
    """Device nodes named as NVIDIA's driver names them, and the CDI spec ``nvidia-ctk cdi generate`` would write."""

    def __init__(self, folder: Path, count: int = CARDS, memory_hook: bool = True):
        self.folder = folder
        self.dev = folder / "dev"
        self.specs = folder / "cdi-static"
        self.bin = folder / "bin"
        self.hook_log = folder / "hook.log"
        self.count = count
        self.memory_hook = memory_hook

    @property
    def hook(self) -> Path:
        return self.bin / HOOK_NAME

    def make(self) -> Cards:
        for path in (self.dev, self.specs, self.bin):
            path.mkdir(parents=True, exist_ok=True)
        nodes = {f"nvidia{k}": (NVIDIA_MAJOR, k) for k in range(self.count)}
        nodes.update({"nvidiactl": (NVIDIA_MAJOR, CTL_MINOR), "nvidia-uvm": (UVM_MAJOR, 0)})
        for name, (major, minor) in nodes.items():
            path = self.dev / name
            if not path.exists():
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        self.hook.write_text(HOOK_STANDIN.format(python=sys.executable, log=str(self.hook_log)))
        self.hook.chmod(0o755)
        (self.specs / NVIDIA_CDI_SPEC).write_text(json.dumps(self.spec(), indent=1))
        return self

    def node(self, name: str) -> dict:
        return {"path": f"/dev/{name}", "hostPath": str(self.dev / name)}

    def spec(self) -> dict:
        """The node's NVIDIA CDI spec in the shape ``nvidia-ctk cdi generate`` writes (toolkit v1.20.0,
        ``cmd/nvidia-ctk/cdi/generate/generate_test.go``): each card by index and by UUID (the command's
        default ``--device-name-strategy``) and ``all``; the control nodes and ``NVIDIA_VISIBLE_DEVICES=void``
        for every container given any of them. Hooks point at the tier's stand-in, not /usr/bin/nvidia-cdi-hook."""
        devices = []
        for k in range(self.count):
            edits: dict = {"deviceNodes": [self.node(f"nvidia{k}")]}
            if self.memory_hook:
                # The toolkit's memory-limit hook, per full GPU, as its cuda-memory-limits branch writes it
                # (docs/isolation.md): a createRuntime hook that reads the limits from the container's OCI spec.
                edits["hooks"] = [{"hookName": "createRuntime", "path": str(self.hook),
                                   "args": [HOOK_NAME, "apply-cuda-memory-limits", "--driver-root", "/",
                                            "--gpu-id", uuid(k)]}]
            for name in (str(k), uuid(k)):
                devices.append({"name": name, "containerEdits": edits})
        devices.append({"name": "all", "containerEdits": {
            "deviceNodes": [self.node(f"nvidia{k}") for k in range(self.count)]}})
        return {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices,
                "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"],
                                   "deviceNodes": [self.node("nvidia-uvm"), self.node("nvidiactl")]}}


class Containerd:
    """containerd started by the tier with its own config, state and socket; runc through the wrapper."""

    def __init__(self, binary: str, work: Path, cards: Cards):
        self.binary = str(Path(binary).resolve())
        self.folder = work / "containerd"
        self.cards = cards
        self.version = version_of(self.binary)
        self.socket = self.folder / "containerd.sock"
        self.process: components.Process | None = None
        self.cni_conf = self.folder / "net.d"
        self.cdi_dynamic = self.folder / "cdi-dynamic"
        runc = shutil.which("runc") or "/usr/sbin/runc"
        self.runc = runc
        self.ctr = str(Path(self.binary).with_name("ctr")) if Path(self.binary).with_name("ctr").exists() else (
            shutil.which("ctr") or "ctr")

    @property
    def label(self) -> str:
        return f"containerd {'.'.join(map(str, self.version))}"

    @property
    def cdi(self) -> bool:
        """Whether this runtime resolves CDI devices: containerd 2.0 and later, where it is on by default."""
        return self.version >= (2, 0, 0)

    @property
    def endpoint(self) -> str:
        return str(self.socket)

    def _wrapper(self) -> Path:
        path = self.folder / "runc"
        path.write_text(RUNC_WRAPPER.format(python=sys.executable, runc=self.runc, route=str(self.route)))
        path.chmod(0o755)
        return path

    @property
    def route(self) -> Path:
        return self.folder / "runtime-route.json"

    def route_through(self, binary: str | None, env: dict[str, str] | None = None) -> None:
        """Every handler's containers created through ``binary`` from now on (NVIDIA's runtime, which runs runc
        itself), or through runc again with None. Containers already running keep what they were given."""
        if binary is None:
            self.route.unlink(missing_ok=True)
            return
        tmp = self.route.with_suffix(".tmp")
        tmp.write_text(json.dumps({"binary": binary, "env": env or {}}))
        tmp.rename(self.route)

    def _cni(self) -> None:
        self.cni_conf.mkdir(parents=True, exist_ok=True)
        conf = {"cniVersion": "1.0.0", "name": "gpushard-e2e", "plugins": [
            # The bridge's address is each pod's default route: pods reach the node (and the API server's Service
            # address routed there) through it; nothing leaves the machine (no masquerade).
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "isDefaultGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                      "dataDir": str(self.folder / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}
        (self.cni_conf / "10-gpushard-e2e.conflist").write_text(json.dumps(conf, indent=1))

    def config(self) -> str:
        wrapper = self._wrapper()
        runc_root = self.folder / "runc-root"
        common = {"root": self.folder / "root", "state": self.folder / "state", "socket": self.socket,
                  "wrapper": wrapper, "runc_root": runc_root, "sandbox": images.SANDBOX, "conf": self.cni_conf,
                  "opt": self.folder / "opt"}
        if self.version >= (2, 0, 0):
            dirs = json.dumps([str(self.cards.specs), str(self.cdi_dynamic)])
            return CONFIG_V3.format(cdi_dirs=dirs, **common)
        return CONFIG_V2.format(**common)

    def start(self) -> Containerd:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.route.unlink(missing_ok=True)
        self.cdi_dynamic.mkdir(exist_ok=True)
        make_bridge()
        self._cni()
        config = self.folder / "config.toml"
        config.write_text(self.config())
        # containerd finds its shim next to itself first: containerd 2 needs its own.
        env = {**os.environ, "PATH": f"{Path(self.binary).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.process = components.Process("containerd", [self.binary, f"--config={config}", "--log-level=info"],
                                          self.folder.parent / "containerd.log", env=env).start()
        components.wait_for(f"{self.label} serving", lambda: self.ctr_run("version").returncode == 0,
                            timeout=60, explain=self.process.tail)
        return self

    def ctr_run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.ctr, f"--address={self.socket}", "-n", "k8s.io", *args], capture_output=True,
                              text=True, timeout=timeout)

    def import_image(self, archive: Path) -> None:
        done = self.ctr_run("images", "import", "--all-platforms", str(archive), timeout=300)
        if done.returncode:
            raise AssertionError(f"ctr images import {archive}: {done.stdout}{done.stderr}")

    def images(self) -> set[str]:
        return set(self.ctr_run("images", "list", "-q").stdout.split())

    def restart(self) -> None:
        self.process.stop()
        self.process.start()
        components.wait_for(f"{self.label} serving again", lambda: self.ctr_run("version").returncode == 0,
                            timeout=60, explain=self.process.tail)

    def stop(self) -> None:
        """Every container and shim of this runtime gone, then the runtime; mounts, bridge and address range freed."""
        if self.process and self.process.alive():
            for task in self.ctr_run("tasks", "list", "-q", timeout=30).stdout.split():
                self.ctr_run("tasks", "kill", "-s", "SIGKILL", "--all", task, timeout=30)
            time.sleep(1)
            for task in self.ctr_run("tasks", "list", "-q", timeout=30).stdout.split():
                self.ctr_run("tasks", "delete", "--force", task, timeout=30)
            for container in self.ctr_run("containers", "list", "-q", timeout=30).stdout.split():
                self.ctr_run("containers", "delete", container, timeout=30)
            self.process.stop()
        self._kill_shims()
        self._unmount()
        remove_bridge()

    def power_cut(self) -> None:
        """What a reboot leaves of this runtime: every container's process, the shims and containerd itself gone at
        once, their mounts and state (a tmpfs on a node) with them; its root (images, the records of containers and
        sandboxes) and the CNI plugin's address records kept, as on disk. ``start()`` boots it again."""
        if self.process and self.process.alive():
            for task in self.ctr_run("tasks", "list", "-q", timeout=30).stdout.split():
                self.ctr_run("tasks", "kill", "-s", "SIGKILL", "--all", task, timeout=30)
            os.killpg(self.process.proc.pid, signal.SIGKILL)
            self.process.proc.wait(10)
        self._kill_shims()
        self._unmount()
        for volatile in ("state", "runc-root"):
            shutil.rmtree(self.folder / volatile, ignore_errors=True)

    def _kill_shims(self) -> None:
        # A shim outlives containerd by design; ours name our socket on their command line.
        marker = str(self.socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker in cmdline and b"shim" in cmdline:
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _unmount(self) -> None:
        unmount_under(self.folder)

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""


def make_bridge() -> None:
    """The bridge with the node's address, made before the kubelet (which serves there) and the CNI plugin (which
    adopts it)."""
    prefix = ipaddress.ip_network(POD_SUBNET).prefixlen
    for argv in (["ip", "link", "add", BRIDGE, "type", "bridge"],
                 ["ip", "addr", "replace", f"{NODE_IP}/{prefix}", "dev", BRIDGE],
                 ["ip", "link", "set", BRIDGE, "up"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode and "File exists" not in done.stderr:
            raise AssertionError(f"gpushard e2e: {' '.join(argv)}: {done.stderr}")


def remove_bridge() -> None:
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, timeout=30)


class ServiceRoute:
    """What kube-proxy does for one Service address, as a DNAT rule: pods told to reach the API server at the
    kubernetes Service's address (10.0.0.1:443) reach it where it serves on the node. With ``masquerade`` the
    routed connections leave with the node's address too, for a target on the pods' own bridge: it would
    otherwise answer the pod straight over the bridge, from an address the pod never dialled."""

    def __init__(self, service: str, port: int, target: str, masquerade: bool = False):
        self.rule = ["-d", f"{service}/32", "-p", "tcp", "--dport", str(port), "-j", "DNAT",
                     "--to-destination", target, "-m", "comment", "--comment", "gpushard-e2e"]
        host, _, target_port = target.rpartition(":")
        self.masquerade = ["-d", f"{host}/32", "-p", "tcp", "--dport", target_port, "-m", "conntrack",
                           "--ctstate", "DNAT", "--ctorigdst", service, "-j", "MASQUERADE", "-m", "comment",
                           "--comment", "gpushard-e2e"] if masquerade else None

    def _iptables(self, action: str, chain: str, rule: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(["iptables", "-t", "nat", action, chain, *rule], capture_output=True, text=True,
                              timeout=30)

    def _rules(self) -> list[tuple[str, list[str]]]:
        # From pods on the bridge, and from the host's own network.
        rules = [("PREROUTING", self.rule), ("OUTPUT", self.rule)]
        return rules + ([("POSTROUTING", self.masquerade)] if self.masquerade else [])

    def add(self) -> ServiceRoute:
        for chain, rule in self._rules():
            done = self._iptables("-A", chain, rule)
            if done.returncode:
                raise AssertionError(f"gpushard e2e: iptables -t nat -A {chain}: {done.stderr}")
        return self

    def remove(self) -> None:
        for chain, rule in self._rules():
            self._iptables("-D", chain, rule)


def unmount_under(folder: Path) -> None:
    """Every mount below ``folder`` undone, deepest first (a kubelet's volumes, a runtime's rootfs and netns)."""
    prefix = str(folder) + "/"
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix) or point == str(folder):
            points.add(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


CONFIG_V2 = """\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox}"
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{wrapper}"
        Root = "{runc_root}"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
        BinaryName = "{wrapper}"
        Root = "{runc_root}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{conf}"
"""

CONFIG_V3 = """\
version = 3
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.snapshotter.v1.erofs"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins.'io.containerd.internal.v1.opt']
  path = "{opt}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{sandbox}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = {cdi_dirs}
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{wrapper}"
        Root = "{runc_root}"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]
        BinaryName = "{wrapper}"
        Root = "{runc_root}"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{conf}"
"""
