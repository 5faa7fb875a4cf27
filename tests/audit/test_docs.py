"""docs/audit.md shows real output: its samples are what the commands print for the test fixtures.

We test:
- the `gpushard audit` and `gpushard status` samples equal the output for tests/audit/world.py's
  cluster, and the `-f` sample the output for two golden manifests, at 100 columns;
- every rule id appears in the docs' rule tables.
"""

from __future__ import annotations

import pathlib

import pytest

from tests import test_golden
from webhook import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
DOC = ROOT / "docs" / "audit.md"


def sample(command: str) -> str:
    """The fenced block that follows the line `$ COMMAND` in the docs."""
    text = DOC.read_text()
    start = text.index(f"```\n$ {command}\n") + len(f"```\n$ {command}\n")
    return text[start:text.index("```", start)]


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")


@pytest.mark.parametrize("command", ["audit", "status"])
def test_cluster_samples(command, kubeconfig, capsys):
    cli.main([command, "--kubeconfig", kubeconfig])
    assert capsys.readouterr().out == sample(f"gpushard {command}")


def test_manifest_sample(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the sample names the files as given, relative to the repository
    files = ["tests/golden/unpinned.fail.yaml", "tests/golden/fraction-above-one.fail.yaml"]
    cli.main(["audit", "-f", files[0], "-f", files[1]])
    assert capsys.readouterr().out == sample(f"gpushard audit -f {files[0]} -f {files[1]}")


def test_every_rule_is_documented():
    text = DOC.read_text()
    for rule in test_golden.ADMISSION_RULES + test_golden.AUDIT_RULES + sorted(test_golden.PLACEMENT_RULES):
        assert f"| `{rule}` |" in text
