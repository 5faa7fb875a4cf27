"""We test the MPS supervision against a stand-in `nvidia-cuda-mps-control` on PATH (tests/agent/mpsstandin.py):
- one daemon per card, run with -f, CUDA_VISIBLE_DEVICES set to that card's UUID and its own pipe and log
  folders under the root; the card is exclusive-process while it runs;
- a daemon that dies holds its card Unhealthy on the board (and only that card), and is started again after
  its backoff, which grows while starts keep failing;
- stop sends "quit" and restores the compute mode the card had before, also after an agent that died
  left the card exclusive;
- a card whose compute mode cannot be set is held Unhealthy with NVML's reason;
- the states the inventory publishes.
"""

import os
import signal
import time

import pytest

from tests.agent import mpsstandin
from tests.polling import eventually
from webhook.agent.node import containerlimits, health, mps, nvml

CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559), nvml.Card(1, "GPU-bbbb", "NVIDIA L4", 22491)]


@pytest.fixture
def standin(tmp_path, monkeypatch):
    bin_dir, log = mpsstandin.install(tmp_path / "standin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("MPS_STANDIN_LOG", str(log))
    return log


@pytest.fixture
def root(tmp_path):
    return containerlimits.MpsRoot(str(tmp_path / "mps"))


def supervisor(devices, board, root, changes=None, backoff=(0.2, 0.8)):
    on_change = (lambda: changes.append(1)) if changes is not None else None
    return mps.Supervisor(devices, CARDS, board, root, on_change=on_change, interval=0.05, backoff=backoff,
                          command_timeout=5)


def test_one_daemon_per_card_with_its_card_and_folders(standin, root):
    devices = nvml.FakeDevices(CARDS)
    board = health.Board(CARDS)
    sup = supervisor(devices, board, root)
    sup.start()
    try:
        starts = [c for c in mpsstandin.calls(standin) if c["call"] == "-f"]
        assert [(c["gpu"], c["pipe"], c["log"]) for c in starts] == [
            (card.uuid, root.pipe_dir(card), root.log_dir(card)) for card in CARDS]
        assert root.pipe_dir(CARDS[0]) == os.path.join(root.path, "GPU-aaaa", "pipe")
        assert os.path.isdir(root.shm_dir)
        assert devices.compute_modes == {c.uuid: nvml.COMPUTE_EXCLUSIVE_PROCESS for c in CARDS}
        assert all(d.running for d in sup.daemons.values())
        assert board.snapshot().healthy == {0: True, 1: True}
        assert sup.states() == {0: {"running": True}, 1: {"running": True}}
    finally:
        sup.stop()
    assert [c["call"] for c in mpsstandin.calls(standin)].count("quit") == 2
    assert devices.compute_modes == {c.uuid: nvml.COMPUTE_DEFAULT for c in CARDS}
    assert not any(mpsstandin.alive(c["pid"]) for c in mpsstandin.calls(standin) if c["call"] == "-f")


def test_a_dead_daemon_holds_its_card_unhealthy_until_restarted(standin, root):
    devices = nvml.FakeDevices(CARDS)
    board = health.Board(CARDS)
    changes = []
    sup = supervisor(devices, board, root, changes)
    sup.start()
    try:
        first = mpsstandin.daemon_pid(root.pipe_dir(CARDS[1]))
        os.kill(first, signal.SIGKILL)
        sup.check_once()
        assert board.snapshot().healthy == {0: True, 1: False}
        assert sup.states()[1] == {"running": False, "problem": "MPS control daemon exited with status -9"}
        assert changes
        eventually(lambda: (sup.check_once(), board.snapshot().healthy[1])[1], "card 1 healthy after the restart",
                   timeout=10.0, interval=0.05)
        second = mpsstandin.daemon_pid(root.pipe_dir(CARDS[1]))
        assert second != first and mpsstandin.alive(second)
        assert sup.daemons[1].restarts == 1 and sup.daemons[0].restarts == 0
        assert devices.compute_modes["GPU-bbbb"] == nvml.COMPUTE_EXCLUSIVE_PROCESS
    finally:
        sup.stop()


def test_failing_starts_back_off_and_recover(standin, root):
    devices = nvml.FakeDevices(CARDS[:1])
    board = health.Board(CARDS[:1])
    fail = standin.parent / "fail-start"
    fail.write_text("")
    sup = mps.Supervisor(devices, CARDS[:1], board, root, interval=0.05, backoff=(0.1, 0.4), command_timeout=5)
    sup.start()
    try:
        daemon = sup.daemons[0]
        assert not daemon.running and "-f exited 1" in daemon.problem
        assert board.snapshot().healthy == {0: False}
        # The stimulus, not a wait: a check every 20 ms for 1.5 s, the window the backoff is counted in.
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            sup.check_once()
            time.sleep(0.02)
        tries = [c for c in mpsstandin.calls(standin) if c["call"] == "-f"]
        # 0.1 + 0.2 + 0.4 + 0.4 ...: a handful of tries in 1.5 s, not one per check.
        assert 2 <= len(tries) <= 6, len(tries)
        fail.unlink()
        eventually(lambda: (sup.check_once(), daemon.running)[1], "the daemon running once starts succeed",
                   timeout=10.0, interval=0.05)
        assert board.snapshot().healthy == {0: True}
    finally:
        sup.stop()


def test_stop_restores_the_mode_the_card_had_even_after_a_crash(standin, root):
    devices = nvml.FakeDevices(CARDS[:1])
    devices.set_compute_mode("GPU-aaaa", nvml.COMPUTE_PROHIBITED)
    crashed = mps.Supervisor(devices, CARDS[:1], health.Board(CARDS[:1]), root, interval=0.05)
    crashed.start()
    crashed.daemons[0]._kill()  # the agent died without stopping: the card stays exclusive
    assert devices.compute_modes["GPU-aaaa"] == nvml.COMPUTE_EXCLUSIVE_PROCESS
    again = mps.Supervisor(devices, CARDS[:1], health.Board(CARDS[:1]), root, interval=0.05)
    again.start()
    again.stop()
    assert devices.compute_modes["GPU-aaaa"] == nvml.COMPUTE_PROHIBITED


class RefusingDevices(nvml.FakeDevices):
    def set_compute_mode(self, uuid, mode):
        raise nvml.DeviceError(f"card {uuid}: cannot set the compute mode to Exclusive_Process: "
                               "Insufficient Permissions")


def test_a_card_whose_mode_cannot_be_set_is_held_with_the_reason(standin, root):
    devices = RefusingDevices(CARDS[:1])
    board = health.Board(CARDS[:1])
    sup = mps.Supervisor(devices, CARDS[:1], board, root, interval=0.05)
    sup.start()
    try:
        assert sup.states()[0]["problem"] == ("MPS daemon did not start: card GPU-aaaa: cannot set the compute "
                                              "mode to Exclusive_Process: Insufficient Permissions")
        assert board.snapshot().healthy == {0: False}
        assert not [c for c in mpsstandin.calls(standin) if c["call"] == "-f"]
    finally:
        sup.stop()


def test_a_missing_control_binary_is_a_problem_not_a_crash(root, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    board = health.Board(CARDS[:1])
    sup = mps.Supervisor(nvml.FakeDevices(CARDS[:1]), CARDS[:1], board, root, interval=0.05)
    sup.start()
    try:
        assert "nvidia-cuda-mps-control" in sup.states()[0]["problem"]
        assert board.snapshot().healthy == {0: False}
    finally:
        sup.stop()
