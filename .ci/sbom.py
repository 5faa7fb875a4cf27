"""A CycloneDX bill of materials of one gpushard image (make release, .ci/release.sh).

Its Python packages come from cyclonedx-py (the cyclonedx-bom package on PyPI) run on the image's own virtual
environment, mounted on this machine: their versions and licenses as their metadata says. Its Debian packages
come from the image's dpkg database, each with the licenses its machine-readable copyright file names (Debian's
DEP-5); a package whose copyright file names none is listed without one. Both go into one CycloneDX 1.6 document.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

LICENSE_LINE = re.compile(r"^License:\s*(\S.*?)\s*$", re.M)


def python_components(python: str, version: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "cyclonedx_py", "environment", "--of", "JSON", "--sv", "1.6",
                           "--output-reproducible", "-o", "-", python], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"gpushard: sbom: cyclonedx-py failed on {python}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def debian_licenses(root: Path, package: str) -> list[str]:
    """The License: names of the package's machine-readable copyright file, in order, once each."""
    path = root / "usr/share/doc" / package / "copyright"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    if "Format:" not in text.split("\n\n", 1)[0]:
        return []  # not machine-readable: nothing reliable to read
    found: list[str] = []
    for name in LICENSE_LINE.findall(text):
        if name not in found:
            found.append(name)
    return found


def debian_components(root: Path, arch: str) -> list[dict]:
    listed = subprocess.run(["dpkg-query", f"--admindir={root / 'var/lib/dpkg'}", "-W", "-f",
                             "${Package}\t${Version}\t${Architecture}\t${db:Status-Abbrev}\n"],
                            capture_output=True, text=True, check=True).stdout
    components = []
    for line in sorted(listed.splitlines()):
        name, version, package_arch, status = line.split("\t")
        if not status.startswith("ii"):
            continue
        component = {"type": "library", "name": name, "version": version,
                     "bom-ref": f"pkg:deb/debian/{name}@{version}?arch={package_arch}",
                     "purl": f"pkg:deb/debian/{name}@{version}?arch={package_arch}&distro=debian-12"}
        licenses = debian_licenses(root, name)
        if licenses:
            component["licenses"] = [{"license": {"name": n}} for n in licenses]
        components.append(component)
    if not components:
        raise SystemExit(f"gpushard: sbom: no Debian package installed under {root} ({arch})")
    return components


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".ci/sbom.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the image's Python, as mounted here")
    parser.add_argument("--root", required=True, help="the image's root filesystem, mounted here")
    parser.add_argument("--arch", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    document = python_components(args.python, args.version)
    document.setdefault("components", []).extend(debian_components(Path(args.root), args.arch))
    metadata = document.setdefault("metadata", {})
    metadata["component"] = {"type": "container", "name": "gpushard", "version": args.version,
                             "bom-ref": f"gpushard-image-{args.version}-{args.arch}",
                             "properties": [{"name": "architecture", "value": args.arch}]}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    python = sum(1 for c in document["components"] if c.get("purl", "").startswith("pkg:pypi/"))
    debian = sum(1 for c in document["components"] if c.get("purl", "").startswith("pkg:deb/"))
    unlicensed = [c["name"] for c in document["components"] if not c.get("licenses")]
    print(f"gpushard: sbom: {args.out}: {python} Python and {debian} Debian packages; "
          f"{len(unlicensed)} without a license named{': ' + ', '.join(unlicensed[:8]) if unlicensed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
