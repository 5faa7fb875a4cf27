"""NVIDIA's own components on the runtime tier's node: its device plugin and its container runtime, real binaries.

``make e2e`` builds both from their Go modules (e2e/build.py ``--nvidia``: k8s-device-plugin and
nvidia-container-toolkit at the versions of e2e/versions.env) and hands them to the tier as
``GPUSHARD_E2E_NVIDIA_PLUGIN`` (the plugin's binary) and ``GPUSHARD_E2E_NVIDIA_TOOLKIT`` (the folder of
nvidia-container-runtime, nvidia-ctk and nvidia-cdi-hook).

- ``Plugin`` runs ``nvidia-device-plugin`` on the host as its DaemonSet's container would, over the same fake
  ``libnvidia-ml.so.1`` and cards the agent reads (tests/agent/fakenvml.c answers the calls the plugin makes
  beyond the agent's: minor number, PCI info, compute capability), with a config file in the format of its
  ConfigMap. Its health checks are off (``DP_DISABLE_HEALTHCHECKS=all``): they wait on NVML events of a driver.
  Device discovery is named ``nvml``: ``auto`` looks for the driver's files under the driver root first.
- ``Toolkit`` puts ``nvidia-container-runtime`` between containerd's shim and runc, for every handler (the GPU
  Operator's default: NVIDIA's runtime is the node's default runtime), in its ``cdi`` mode: no driver and no
  NVML; it turns the devices a container asks for into CDI names of kind ``nvidia.com/gpu`` and resolves them
  from the node's spec (tests/runtime/node.py ``Cards``, the shape ``nvidia-ctk cdi generate`` writes). Its
  config file is the toolkit's own format (``NVIDIA_CTK_CONFIG_FILE_PATH``), hardened or at the defaults.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.e2e import components
from tests.runtime import node

PLUGIN = os.environ.get("GPUSHARD_E2E_NVIDIA_PLUGIN", "")
TOOLKIT = os.environ.get("GPUSHARD_E2E_NVIDIA_TOOLKIT", "")
RESOURCE = "nvidia.com/gpu"
REPLICAS = 100  # the seed's ConfigMap
# Tables the tests fill in as they run, by title: (header, rows); the tier prints them after its summary
# (tests/runtime/conftest.py).
RESULTS: dict[str, tuple[tuple[str, ...], list[tuple]]] = {}


def record(title: str, header: tuple[str, ...], *rows: tuple) -> None:
    RESULTS.setdefault(title, (header, []))[1].extend(rows)


def tables() -> list[str]:
    out = []
    for title, (header, rows) in RESULTS.items():
        lines = [title, "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out.append("\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]))
    return out


def why_not() -> str:
    if not PLUGIN or not Path(PLUGIN).exists():
        return ("set GPUSHARD_E2E_NVIDIA_PLUGIN to NVIDIA's nvidia-device-plugin (make e2e builds it: "
                "python3 e2e/build.py build --nvidia)")
    if not TOOLKIT or not (Path(TOOLKIT) / "nvidia-container-runtime").exists():
        return ("set GPUSHARD_E2E_NVIDIA_TOOLKIT to the folder of NVIDIA's nvidia-container-runtime (make e2e "
                "builds it: python3 e2e/build.py build --nvidia)")
    return ""


def version(binary: str) -> str:
    import subprocess
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    words = (done.stdout + done.stderr).split()
    found = [w for w in words if w[:2] in ("v0", "v1")]
    return found[0] if found else "?"


def seed_config(fail_requests_greater_than_one: bool = False, strategy: str = "envvar") -> dict:
    """The seed's ConfigMap: one resource, nvidia.com/gpu, 100 time-slicing replicas of every card."""
    time_slicing: dict = {"resources": [{"name": RESOURCE, "replicas": REPLICAS}]}
    if fail_requests_greater_than_one:
        time_slicing["failRequestsGreaterThanOne"] = True
    return {"version": "v1", "flags": {"migStrategy": "none", "plugin": {"deviceListStrategy": [strategy]}},
            "sharing": {"timeSlicing": time_slicing}}


class Plugin:
    """NVIDIA's device plugin on the host, over the agent's fake NVML library and cards."""

    def __init__(self, work: Path, agent, kubectl: components.Kubectl):
        self.folder = work / "nvidia-plugin"
        self.agent = agent
        self.kubectl = kubectl
        self.process: components.Process | None = None

    def start(self, config: dict) -> Plugin:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "config.yaml"
        path.write_text(json.dumps(config, indent=1))  # YAML is a superset of JSON
        env = {**os.environ, "LD_LIBRARY_PATH": str(self.agent.folder / "lib"), "FAKE_NVML_DIR": str(
            self.agent.control), "DP_DISABLE_HEALTHCHECKS": "all", "NODE_NAME": components.NODE_NAME}
        argv = [PLUGIN, f"--config-file={path}", "--device-discovery-strategy=nvml", "--fail-on-init-error=true"]
        self.process = components.Process("nvidia-device-plugin", argv, self.folder.parent / "nvidia-plugin.log",
                                          env=env).start()
        want = str(REPLICAS * node.CARDS)
        components.wait_for(f"{RESOURCE} {want} allocatable", lambda: self.allocatable() == want, timeout=90,
                            explain=self.tail)
        return self

    def allocatable(self) -> str | None:
        return self.kubectl.json("get", "node", components.NODE_NAME)["status"].get("allocatable", {}).get(RESOURCE)

    def stop(self) -> None:
        if self.process:
            self.process.stop()
            self.process = None

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""


class Toolkit:
    """nvidia-container-runtime as every handler's runtime of the tier's containerd, in its cdi mode."""

    def __init__(self, work: Path, runtime: node.Containerd, cards: node.Cards):
        self.folder = work / "nvidia-toolkit"
        self.runtime = runtime
        self.cards = cards
        self.config = self.folder / "config.toml"
        self.log = self.folder / "nvidia-container-runtime.log"

    def install(self, hardened: bool) -> Toolkit:
        """The toolkit's config: ``hardened`` as docs/install.md's node setup has it (the variable ignored for
        unprivileged containers, the device-list mounts read), else the toolkit's defaults (neither key set)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lines = []
        if hardened:
            lines += ["accept-nvidia-visible-devices-envvar-when-unprivileged = false",
                      "accept-nvidia-visible-devices-as-volume-mounts = true", ""]
        dirs = json.dumps([str(self.cards.specs), str(self.runtime.cdi_dynamic)])
        lines += ["[nvidia-container-runtime]", f'debug = "{self.log}"', 'log-level = "debug"', 'mode = "cdi"',
                  f'runtimes = ["{self.runtime.runc}"]', "", "[nvidia-container-runtime.modes.cdi]",
                  'default-kind = "nvidia.com/gpu"', 'annotation-prefixes = ["cdi.k8s.io/"]', f"spec-dirs = {dirs}", ""]
        self.config.write_text("\n".join(lines))
        self.runtime.route_through(str(Path(TOOLKIT) / "nvidia-container-runtime"), {
            "NVIDIA_CTK_CONFIG_FILE_PATH": str(self.config)})
        return self

    def remove(self) -> None:
        self.runtime.route_through(None)

    def calls(self) -> int:
        """How many containers NVIDIA's runtime has created (it logs each create command it modifies)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.count("Create command detected")

    def errors(self) -> list[str]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [line for line in text.splitlines() if '"level":"error"' in line or "level=error" in line][-5:]
