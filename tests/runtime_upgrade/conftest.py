"""Fixtures of the upgrade tier: the version before (GPUSHARD_PREVIOUS of e2e/versions.env) installed as pods, then
upgraded to this one and rolled back, the Kustomize way and with Helm.

The node, the control plane and this version's image are those of the shipped-install tier (tests/runtime_install),
which this tier takes its fixtures from. ``GPUSHARD_E2E_PREVIOUS`` names the version before, built as this one is
(e2e/run.py): its tree in ``tree/`` (its deploy/base and its chart) and its image as an OCI archive, ``image.tar``,
imported under ``PREVIOUS_IMAGE``. The tier starts from the version before's deploy/base, its image named by an
overlay as a user names their registry's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e import tiers
from tests.runtime import node
from tests.runtime_install import conftest as shipped
from tests.runtime_install.conftest import (  # noqa: F401,E501
    advertised,
    dns,
    installed,
    kubectl,
    kubelet,
    namespace,
    nvml,
    plane,
    runtime,
    usual_paths,
    work,
)

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = Path(os.environ.get("GPUSHARD_E2E_PREVIOUS") or "/nonexistent")
PREVIOUS_TREE = PREVIOUS / "tree"
REPOSITORY = shipped.SHIPPED_IMAGE.rpartition(":")[0]
PREVIOUS_TAG = "previous"
PREVIOUS_IMAGE = f"{REPOSITORY}:{PREVIOUS_TAG}"
CURRENT_IMAGE = shipped.SHIPPED_IMAGE


def _why_not() -> str:
    why = shipped._why_not()
    if why:
        return why
    if not (PREVIOUS / "image.tar").is_file() or not (PREVIOUS_TREE / "deploy" / "base").is_dir():
        return ("set GPUSHARD_E2E_PREVIOUS to the version before (a folder with its tree in tree/ and its image as "
                "image.tar; e2e/run.py builds it from GPUSHARD_PREVIOUS) for the upgrade tier")
    return ""


TIER = tiers.Tier("gpushard upgrade tier", Path(__file__).parent, _why_not(), markers=("e2e", "runtime"))


def pytest_collection_modifyitems(config, items):
    TIER.collect(config, items)


# The steps' rows (tests/runtime_upgrade/test_upgrade.py), printed as docs/upgrade.md's table at the end.
ROWS: list[tuple[str, ...]] = []
COLUMNS = ("step", "creates sent", "refused", "cards over their shares", "running pods restarted", "seconds",
           "longest create (ms)")


def pytest_terminal_summary(terminalreporter):
    TIER.summary(terminalreporter)
    if ROWS:
        terminalreporter.write_line("gpushard upgrade table:")
        for row in (COLUMNS, tuple("---" for _ in COLUMNS), *ROWS):
            terminalreporter.write_line("| " + " | ".join(row) + " |")


def pytest_report_header(config):
    return TIER.header(lambda: f"containerd {'.'.join(map(str, node.version_of(shipped.CONTAINERD)))}, "
                               f"from {PREVIOUS} as {PREVIOUS_IMAGE} to {shipped.IMAGE} as {CURRENT_IMAGE}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    TIER.report(item, outcome.get_result(), lines=30)


TIER.extra.append(shipped._cluster)


@pytest.fixture(scope="session")
def previous_image(runtime) -> str:  # noqa: F811 (the shipped tier's fixture)
    """The version before's image, imported and tagged as a user's registry would serve it."""
    shipped.import_as(runtime, PREVIOUS / "image.tar", PREVIOUS_IMAGE)
    return PREVIOUS_IMAGE


def overlay(folder: Path, base: Path, tag: str | None = None) -> Path:
    """A kustomization over ``base``, naming the image's tag as docs/install.md's own overlay does."""
    folder.mkdir(parents=True, exist_ok=True)
    images = f"images:\n- name: {REPOSITORY}\n  newTag: {tag}\n" if tag else ""
    # kustomize takes a base by a relative path only.
    (folder / "kustomization.yaml").write_text("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                                               f"resources:\n- {os.path.relpath(base, folder)}\n{images}")
    return folder


@pytest.fixture(scope="session")
def versions(work, previous_image) -> dict[str, Path]:  # noqa: F811
    """Each version's install as a Kustomize overlay: the version before's deploy/base with its image, and this
    one's deploy/base as shipped."""
    return {"previous": overlay(work / "previous", PREVIOUS_TREE / "deploy" / "base", PREVIOUS_TAG),
            "current": overlay(work / "current", ROOT / "deploy" / "base")}


@pytest.fixture(scope="session")
def install(versions) -> Path:
    """What the tier installs first: the version before."""
    return versions["previous"]

