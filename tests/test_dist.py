"""The workstation install: `make dist` builds a wheel that gives both `gpushard` and `kubectl-gpushard`.

We test:
- the wheel `make dist` builds (the same pip command, into a temporary folder) carries the whole
  `webhook` package, the generated gRPC stubs included, and both console scripts;
- the command line's page (docs/cli.md) tells how to install from a clone or from that wheel, and no doc
  suggests an index package that does not exist.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_gives_both_commands(tmp_path):
    recipe = (ROOT / "Makefile").read_text().split("\ndist:\n", 1)[1].split("\n\n", 1)[0]
    assert "-m pip wheel -q --no-deps --wheel-dir dist ." in recipe
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(tmp_path), "."],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("gpushard-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "gpushard = webhook.cli:main" in entry_points
    assert "kubectl-gpushard = webhook.cli:plugin_main" in entry_points
    source = {str(p.relative_to(ROOT)) for p in (ROOT / "webhook").rglob("*.py")}
    assert source <= names, sorted(source - names)


def test_the_docs_install_from_a_clone_or_the_wheel():
    page = (ROOT / "docs" / "cli.md").read_text()
    assert "python3 -m pip install dist/gpushard-*.whl" in page and "python3 -m pip install ." in page
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        assert not re.search(r"pip install '?gpushard\[", doc.read_text()), doc
