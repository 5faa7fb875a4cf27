"""Fixtures of the runtime tier: the real control plane and kubelet over a real containerd and runc.

Every test here is marked ``e2e`` and ``runtime``. It needs what the node tier of tests/e2e needs
(``KUBEBUILDER_ASSETS``, ``GPUSHARD_E2E_KUBELET``) and ``GPUSHARD_E2E_CONTAINERD``, a containerd binary
that the tier starts itself (its ``ctr`` and shim beside it, or on PATH), and root. Without them the
whole tier is left out with one line saying what to set. ``make e2e`` runs it once per containerd
named (``GPUSHARD_E2E_CONTAINERD=/usr/bin/containerd:/opt/containerd2/bin/containerd``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.e2e import components
from tests.e2e.conftest import _RUN, ASSETS, WHY_NOT, install, installed, kubectl, namespace, plane, work  # noqa: F401
from tests.runtime import images, node, seeing

KUBELET = os.environ.get("GPUSHARD_E2E_KUBELET", "")
CONTAINERD = os.environ.get("GPUSHARD_E2E_CONTAINERD", "")


def _why_not() -> str:
    if ASSETS is None:
        return WHY_NOT
    if not KUBELET:
        return "set GPUSHARD_E2E_KUBELET (a kubelet binary) for the runtime tier"
    if not CONTAINERD:
        return "set GPUSHARD_E2E_CONTAINERD (a containerd binary) for the runtime tier"
    if os.pathsep in CONTAINERD:
        return "GPUSHARD_E2E_CONTAINERD names one containerd per run here (make e2e runs each it names)"
    if not Path(CONTAINERD).exists():
        return f"GPUSHARD_E2E_CONTAINERD={CONTAINERD} does not exist"
    if os.geteuid() != 0:
        return "the runtime tier starts containerd and runc: run it as root"
    if not images.BUSYBOX.exists():
        return f"the runtime tier builds its images from {images.BUSYBOX} (Debian: apt-get install busybox-static)"
    if not shutil.which("runc") and not Path("/usr/sbin/runc").exists():
        return "the runtime tier needs runc (Debian: apt-get install runc)"
    return ""


WHY = _why_not()


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    ours = [item for item in items if here in Path(str(item.fspath)).parents]
    if WHY:
        if ours:
            config.hook.pytest_deselected(items=ours)
            keep = [item for item in items if item not in set(ours)]
            items[:] = keep
            _RUN["runtime-deselected"] = len(ours)
        return
    # The DRA backend changes the install for good: its tests go last.
    items.sort(key=lambda item: Path(str(item.fspath)).name.startswith("test_dra"))
    for item in ours:
        item.add_marker(pytest.mark.e2e)
        item.add_marker(pytest.mark.runtime)


def pytest_terminal_summary(terminalreporter):
    if _RUN.get("runtime-deselected"):
        terminalreporter.write_line(f"gpushard runtime tier: {_RUN['runtime-deselected']} tests not run: {WHY}")


def pytest_report_header(config):
    if WHY:
        return f"gpushard runtime tier: skipped: {WHY}"
    runtime = node.version_of(CONTAINERD)
    return (f"gpushard runtime tier: containerd {'.'.join(map(str, runtime))} ({CONTAINERD}), "
            f"runc {shutil.which('runc') or '/usr/sbin/runc'}, CDI {'on' if runtime >= (2, 0, 0) else 'absent'}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test shows the components' log tails that explain it, the runtime's among them."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _RUN.get("plane") is not None and not WHY:
        sections = [_RUN["plane"].logs(20)]
        for name in ("containerd", "kubelet", "webhook", "agent"):
            owner = _RUN.get(name)
            if owner is not None:
                sections.append(owner.tail(25))
        report.sections.append(("component logs", "\n".join(sections)))


@pytest.fixture(scope="session")
def cards(work) -> node.Cards:
    return node.Cards(work / "cards").make()


@pytest.fixture(scope="session")
def runtime(work, cards):
    containerd = node.Containerd(CONTAINERD, work, cards)
    _RUN["containerd"] = containerd
    try:
        containerd.start()
        for name, command, env in ((images.WORKLOAD, ["/bin/sh"], {"NVIDIA_VISIBLE_DEVICES": "all"}),
                                   (images.SANDBOX, images.SANDBOX_COMMAND, None)):
            archive = images.write_archive(work / f"{name.rsplit('/', 1)[1].replace(':', '-')}.tar", name, command,
                                           env)
            containerd.import_image(archive)
    except BaseException:
        print(containerd.tail(60), file=sys.stderr)
        containerd.stop()
        raise
    yield containerd
    containerd.stop()


@pytest.fixture(scope="session")
def quiet(kubectl, installed):
    """The shipped workloads whose image this tier does not import, stopped before the node joins (seeing.quiet)."""
    seeing.quiet(kubectl)


@pytest.fixture(scope="session")
def kubelet(plane, installed, quiet, runtime, work):
    kubelet = components.Kubelet(KUBELET, runtime.endpoint, plane, work, address=node.NODE_IP)
    _RUN["kubelet"] = kubelet
    try:
        kubelet.start()
    except BaseException:
        print(kubelet.tail(80), file=sys.stderr)
        kubelet.stop()
        raise
    yield kubelet
    # Pods first, so that the kubelet tears their sandboxes and networks down the runtime's own way.
    seeing.delete_all_pods(plane.kubectl, runtime)
    kubelet.stop()
    node.unmount_under(kubelet.root)


@pytest.fixture(scope="session")
def agent(plane, kubelet, runtime, work):
    """`gpushard agent` on the host over the fake NVML (four cards), its CDI specs where the runtime reads them."""
    agent = seeing.HostAgent(plane, kubelet, work, runtime)
    _RUN["agent"] = agent
    agent.start(expect=seeing.per_card(node.CARDS))
    yield agent
    agent.stop()
