"""Runs gpushard's real-component tiers: builds what they need (e2e/build.py), runs each, prints one table.

    python3 e2e/run.py [--kubernetes 1.37 ...] [--tiers e2e,runtime,install] [--containerd debian,module]
                       [--matrix] [-- PYTEST_ARGS]

Tiers: ``e2e`` (tests/e2e: the control plane, and a kubelet over Kubernetes' fake CRI), ``runtime``
(tests/runtime: containers that really start, once per containerd, NVIDIA's device plugin and container runtime
among them), ``install`` (tests/runtime_install:
deploy/base as pods from gpushard's image, on Debian's containerd), ``install-dra`` (tests/runtime_install_dra:
deploy/overlays/dra as pods, on the module's containerd 2.x, which applies CDI devices), ``autoscaling``
(tests/autoscaling: fractional pods on a pool that real Karpenter scales, kwok playing its nodes' kubelets), ``kueue``
(tests/kueue: Jobs and plain pods of fractional asks under a ClusterQueue's quota in shares, real Kueue),
``upgrade`` (tests/runtime_upgrade: the version before, GPUSHARD_PREVIOUS, upgraded to this one and back).
``--matrix`` runs ``e2e`` on every pinned Kubernetes and the runtime tiers on the default one. The variables of
the tiers (``KUBEBUILDER_ASSETS``, ``GPUSHARD_E2E_KUBELET``, ``GPUSHARD_E2E_CRI``, ``GPUSHARD_E2E_CONTAINERD``,
``GPUSHARD_E2E_IMAGE``, ``GPUSHARD_E2E_PREVIOUS``, ``GPUSHARD_E2E_NVIDIA_PLUGIN``, ``GPUSHARD_E2E_NVIDIA_TOOLKIT``,
``GPUSHARD_E2E_KARPENTER``, ``GPUSHARD_E2E_KWOK``) still win: with them set, nothing of theirs is built.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (e2e/build.py, beside this file)

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"e2e": "tests/e2e", "runtime": "tests/runtime", "install": "tests/runtime_install",
         "install-dra": "tests/runtime_install_dra", "upgrade": "tests/runtime_upgrade",
         "autoscaling": "tests/autoscaling", "kueue": "tests/kueue"}
TIMEOUTS = {"e2e": 600, "runtime": 900, "install": 900, "install-dra": 900, "upgrade": 1200, "autoscaling": 900,
            "kueue": 600}
INSTALLS = ("install", "install-dra", "upgrade")
# What the runtime tiers take from Debian (containerd 1.6, runc, the CNI plugins, busybox for the images).
DEBIAN = {"containerd": "/usr/bin/containerd", "runc": "/usr/sbin/runc",
          "containernetworking-plugins": "/usr/lib/cni/bridge", "busybox-static": "/bin/busybox",
          "iptables": "/usr/sbin/iptables"}
IMAGE_ARCHIVE = ROOT / "build" / "gpushard-image.tar"
# Beside webhook/: what else goes into the image.
IMAGE_INPUTS = ("Dockerfile", "setup.cfg", "pyproject.toml", "README.md")


@dataclass
class Row:
    kubernetes: str
    runtime: str
    tier: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    why: str = ""  # why it did not run, or the skips' reasons
    reasons: list[str] = field(default_factory=list)

    @property
    def result(self) -> str:
        if self.why:
            return f"not run: {self.why}"
        parts = [f"{self.passed} passed"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.skipped:
            reasons = "; ".join(sorted(set(self.reasons)))[:240]
            parts.append(f"{self.skipped} skipped ({reasons})" if reasons else f"{self.skipped} skipped")
        return ", ".join(parts) + f" in {self.seconds:.0f} s"


def say(message: str) -> None:
    print(f"gpushard e2e: {message}", flush=True)


def debian_packages() -> str:
    """Installs what the runtime tiers take from Debian; returns why not, or ''."""
    missing = [name for name, path in DEBIAN.items() if not Path(path).exists()]
    if not missing:
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"needs Debian's {', '.join(missing)} (apt-get install, as root)"
    say(f"installing Debian's {', '.join(missing)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                *missing]):
        if subprocess.run(argv, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            return f"`{' '.join(argv)}` failed"
    # Debian starts the containerd it installs; the tiers start their own, each in its own folder.
    subprocess.run(["systemctl", "disable", "--now", "containerd"], capture_output=True)
    return ""


def image_sources() -> str:
    """What the image is built from (the Dockerfile, the package's metadata and sources): a digest."""
    digest = hashlib.sha256()
    paths = [ROOT / name for name in IMAGE_INPUTS]
    paths += sorted(p for p in (ROOT / "webhook").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in paths:
        if path.is_file():
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def image_archive() -> str:
    """gpushard's image as an OCI archive (make image-archive), made again when its sources changed since the
    archive was made (its digest beside it); returns why not, or ''."""
    if os.environ.get("GPUSHARD_E2E_IMAGE"):
        return ""
    stamp = IMAGE_ARCHIVE.with_name(IMAGE_ARCHIVE.name + ".sources")
    sources = image_sources()
    if IMAGE_ARCHIVE.exists() and stamp.exists() and stamp.read_text().strip() == sources:
        os.environ["GPUSHARD_E2E_IMAGE"] = str(IMAGE_ARCHIVE)
        return ""
    why = "its sources changed since" if IMAGE_ARCHIVE.exists() else "none yet"
    say(f"building gpushard's image for the shipped-install tier ({why}; make image-archive, a few minutes)")
    started = time.monotonic()
    if subprocess.run(["make", "--no-print-directory", "image-archive"], cwd=ROOT).returncode != 0:
        return "make image-archive failed (above)"
    stamp.write_text(sources + "\n")
    say(f"built {IMAGE_ARCHIVE} in {time.monotonic() - started:.0f} s")
    os.environ["GPUSHARD_E2E_IMAGE"] = str(IMAGE_ARCHIVE)
    return ""


def previous_version(found: dict[str, str]) -> str:
    """The version before this one (GPUSHARD_PREVIOUS of versions.env, a commit), built as this one is: its tree
    from git, its image by its own `make image-archive`, into the cache by commit; GPUSHARD_E2E_PREVIOUS names the
    folder (its tree in tree/, its image as image.tar). Returns why not, or ''."""
    if os.environ.get("GPUSHARD_E2E_PREVIOUS"):
        return ""
    commit = found["GPUSHARD_PREVIOUS"]
    folder = build.cache_root() / f"previous-{commit[:12]}"
    archive, tree = folder / "image.tar", folder / "tree"
    if not archive.exists():
        if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode != 0:
            return f"the version before, {commit[:12]} (GPUSHARD_PREVIOUS), is not in this clone's history"
        say(f"building the version before, {commit[:12]}: its tree and its image (make image-archive, a few "
            "minutes, once)")
        started = time.monotonic()
        shutil.rmtree(folder, ignore_errors=True)
        tree.mkdir(parents=True)
        packed = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True,
                                check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=packed, check=True)
        made = subprocess.run(["make", "--no-print-directory", "image-archive", f"IMAGE_ARCHIVE={archive}.part",
                               f"CHECK_IMAGE=localhost/gpushard:previous-{commit[:12]}",
                               # its own base: a base of other packages would be made again by each version
                               f"CHECK_BASE=localhost/gpushard-base:previous-{commit[:12]}"], cwd=tree)
        if made.returncode != 0:
            return f"make image-archive of the version before, {commit[:12]}, failed (above)"
        Path(f"{archive}.part").rename(archive)
        say(f"built the version before in {time.monotonic() - started:.0f} s")
    os.environ["GPUSHARD_E2E_PREVIOUS"] = str(folder)
    return ""


def counts(report: Path, row: Row) -> None:
    if not report.exists():
        row.failed += 1
        row.reasons.append("pytest wrote no report")
        return
    for case in ElementTree.parse(report).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            row.failed += 1
        elif (skip := case.find("skipped")) is not None:
            row.skipped += 1
            row.reasons.append((skip.get("message") or "").removeprefix("gpushard e2e: ").strip())
        else:
            row.passed += 1


def run_tier(row: Row, env: dict[str, str], pytest_args: list[str]) -> Row:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "e2e", "--timeout",
                str(TIMEOUTS[row.tier]), f"--junitxml={report}", TIERS[row.tier], *pytest_args]
        started = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, env=env)
        row.seconds = time.monotonic() - started
        counts(report, row)
        if done.returncode not in (0, 5) and not row.failed:
            row.failed, row.reasons = 1, [f"pytest exited {done.returncode}"]
        if done.returncode == 5 and not (row.passed or row.skipped):
            row.why = "the tier selected no test (its header above says why)"
    return row


def containerds(choice: list[str], found: dict[str, str]) -> list[tuple[str, str]]:
    """(label, binary) per containerd: GPUSHARD_E2E_CONTAINERD's, else Debian's 1.6 and the module's 2.x."""
    named = os.environ.get("GPUSHARD_E2E_CONTAINERD")
    if named:
        return [(Path(p).parent.as_posix(), p) for p in named.split(os.pathsep) if p]
    out = []
    if "debian" in choice:
        out.append(("containerd (Debian)", DEBIAN["containerd"]))
    if "module" in choice:
        out.append((f"containerd {found['CONTAINERD_2']}", build.paths(found["KUBERNETES_DEFAULT"], found)
                    ["GPUSHARD_E2E_CONTAINERD2"]))
    return out


def containerd_version(binary: str) -> str:
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
    except OSError:
        return ""
    words = [w for w in done.stdout.split() if w[:1] in "v0123456789" and "." in w]
    return words[0].removeprefix("v") if words else ""


def containerd_major(binary: str) -> int:
    version = containerd_version(binary)
    return int(version.split(".")[0]) if version[:1].isdigit() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubernetes", action="append", default=[], metavar="MINOR",
                        help="a pinned minor (default: KUBERNETES_DEFAULT of e2e/versions.env), or 'all'")
    parser.add_argument("--tiers", default="e2e,autoscaling,kueue,runtime,install,install-dra,upgrade",
                        help="e2e, autoscaling, kueue, runtime, install, install-dra, upgrade (comma-separated)")
    parser.add_argument("--containerd", default="debian,module", help="debian, module: the runtime tiers' runtimes")
    parser.add_argument("--matrix", action="store_true", help="e2e on every pinned minor, runtime tiers on the default")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest run")
    args = parser.parse_args(argv)
    found = build.pins()
    default = found["KUBERNETES_DEFAULT"]
    minors = args.kubernetes or [default]
    if args.matrix or "all" in minors:
        minors = sorted(build.kubernetes_minors(found), key=lambda m: tuple(map(int, m.split("."))))
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        print(f"gpushard e2e: unknown tier {', '.join(unknown)} (known: {', '.join(TIERS)})", file=sys.stderr)
        return 2
    given_assets = os.environ.get("KUBEBUILDER_ASSETS")
    if given_assets and len(minors) > 1:
        print("gpushard e2e: KUBEBUILDER_ASSETS names one Kubernetes; unset it for the matrix", file=sys.stderr)
        return 2
    rows: list[Row] = []
    started = time.monotonic()
    runtime_minors = [default] if args.matrix else minors
    for minor in minors:
        env = dict(os.environ)
        if not given_assets:
            build.build_kubernetes(minor, found)
            env.update({k: v for k, v in build.paths(minor, found).items() if k not in env})
        version = build.kubernetes_minors(found)[minor] if not given_assets else given_assets
        if "e2e" in tiers:
            if not env.get("GPUSHARD_E2E_CRI") and not os.environ.get("GPUSHARD_E2E_FAKECRI"):
                build.build_fakecri(found)
            rows.append(run_tier(Row(version, "fake CRI", "e2e"), env, args.pytest_args))
        if "autoscaling" in tiers and minor in runtime_minors:
            if not (os.environ.get("GPUSHARD_E2E_KARPENTER") and os.environ.get("GPUSHARD_E2E_KWOK")):
                build.build_autoscaling(found)
            rows.append(run_tier(Row(version, f"Karpenter {found['KARPENTER']}, kwok {found['KWOK']}", "autoscaling"),
                                 env, args.pytest_args))
        if "kueue" in tiers and minor in runtime_minors:
            if not os.environ.get("GPUSHARD_E2E_KUEUE"):
                build.build_kueue(found)
            if not env.get("GPUSHARD_E2E_CRI") and not os.environ.get("GPUSHARD_E2E_FAKECRI"):
                build.build_fakecri(found)
            rows.append(run_tier(Row(version, f"Kueue {found['KUEUE']}, fake CRI", "kueue"), env, args.pytest_args))
        if minor not in runtime_minors or not {"runtime", *INSTALLS} & set(tiers):
            continue
        why = debian_packages()
        choice = [c.strip() for c in args.containerd.split(",")]
        if "module" in choice and not os.environ.get("GPUSHARD_E2E_CONTAINERD"):
            build.build_containerd(found)
        if "runtime" in tiers and not os.environ.get("GPUSHARD_E2E_NVIDIA_PLUGIN"):
            build.build_nvidia(found)
        runtimes = containerds(choice, found)
        for label, binary in runtimes:
            label = f"containerd {containerd_version(binary) or '?'}" if Path(binary).exists() else label
            if "runtime" in tiers:
                row = Row(version, label, "runtime", why=why)
                rows.append(row if why else run_tier(row, dict(env, GPUSHARD_E2E_CONTAINERD=binary),
                                                     args.pytest_args))
        for tier in (t for t in INSTALLS if t in tiers and runtimes):
            # deploy/base (and the upgrade from the version before) on the first containerd (Debian's 1.6 unless
            # told); the DRA install where CDI is applied.
            label, binary = runtimes[0] if tier != "install-dra" else next(
                ((lab, b) for lab, b in runtimes if containerd_major(b) >= 2), runtimes[-1])
            label = f"containerd {containerd_version(binary) or '?'}" if Path(binary).exists() else label
            row = Row(version, label, tier, why=why or image_archive() or (
                tier == "upgrade" and previous_version(found)) or "")
            rows.append(row if row.why else run_tier(
                row, dict(env, GPUSHARD_E2E_CONTAINERD=binary,
                          GPUSHARD_E2E_IMAGE=os.environ.get("GPUSHARD_E2E_IMAGE", ""),
                          GPUSHARD_E2E_PREVIOUS=os.environ.get("GPUSHARD_E2E_PREVIOUS", "")), args.pytest_args))
    print_table(rows, time.monotonic() - started)
    return 1 if any(r.failed for r in rows) else 0


def print_table(rows: list[Row], seconds: float) -> None:
    header = ("Kubernetes", "runtime", "tier", "result")
    lines = [(r.kubernetes, r.runtime, TIERS[r.tier], r.result) for r in rows]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *lines, strict=True)]
    print(f"\ngpushard e2e summary ({seconds / 60:.1f} min):")
    for line in (header, *lines):
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    failed = sum(r.failed for r in rows)
    print(f"{sum(r.passed for r in rows)} passed, {failed} failed, {sum(r.skipped for r in rows)} skipped")


if __name__ == "__main__":
    sys.exit(main())
