"""When a GPU test skips (tests/gpu/machine.py), decided on the real pynvml backend against the fake NVML library.

We test (no GPU needed; each check runs in a child process with the fake libnvidia-ml.so.1 of
tests/agent/fakenvml.c on LD_LIBRARY_PATH):
- ready: the first card outside MIG mode, and the rights probe leaves its compute mode as it was;
- a lack, so a skip: NVML cannot load (no library), NVML lists no card, every card in MIG mode,
  setting the compute mode refused for want of rights, libcuda missing, the MPS binary missing;
- a fault, so a failure: NVML loaded but unable to list the cards (a card lost), a compute mode
  refused for another reason (not supported, an unknown error; on a stand-in card).

Breaks tried: `open_nvml` treating every NvmlUnavailable as a lack, and `may_set_compute_mode`
skipping on any DeviceError (the old "any problem that mentions compute mode"): each makes a fault
case here read as a lack, and fails.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from tests.agent.conftest import fake_nvml  # noqa: F401 (a fixture, shared with the agent tests)
from tests.agent.test_nvml_backend import ROOT, put
from tests.gpu import machine
from webhook.agent.node import mps, nvml

DECIDE = """
import json
from tests.gpu import machine
try:
    devices = machine.open_nvml()
    card = machine.whole_card(devices)
    before = devices.compute_mode(card.uuid)
    machine.may_set_compute_mode(devices, card)
    out = {"verdict": "ready", "card": card.index, "modes": [before, devices.compute_mode(card.uuid)]}
except machine.Lacking as exc:
    out = {"verdict": "lacking", "why": str(exc)}
except Exception as exc:
    out = {"verdict": "fault", "why": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""


def decide(env: dict, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", DECIDE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("files,expected", [
    ({"cards": "2"}, {"verdict": "ready", "card": 0, "modes": [0, 0]}),
    ({"cards": "2", "compute-0": "2"}, {"verdict": "ready", "card": 0, "modes": [2, 2]}),
    ({"cards": "2", "mig-0": ""}, {"verdict": "ready", "card": 1, "modes": [0, 0]}),
    ({"cards": "0"}, {"verdict": "lacking", "why": "NVML lists no card"}),
    ({"cards": "2", "mig-0": "", "mig-1": ""}, {"verdict": "lacking", "why": "no card outside MIG mode"}),
    ({"cards": "1", "no-permission": ""}, {
        "verdict": "lacking", "why": "no rights to set the compute mode (MPS needs root): card GPU-fake-0000: "
                                     "cannot set the compute mode to Default: Insufficient Permissions"}),
])
def test_what_the_machine_has_or_lacks(fake_nvml, files, expected):  # noqa: F811
    env, control = fake_nvml
    for name, text in files.items():
        put(control, name, text)
    assert decide(env) == expected


def test_a_card_lost_at_discovery_is_a_fault(fake_nvml):  # noqa: F811
    env, control = fake_nvml
    put(control, "cards", "2")
    put(control, "lost-1")
    out = decide(env)
    assert out["verdict"] == "fault" and out["why"].startswith("NvmlUnavailable: NVML loaded but could not list")


class Refusing:
    """A card whose compute mode reads but cannot be set, for the reason given (NVML's words)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def compute_mode(self, uuid: str) -> int:
        return nvml.COMPUTE_DEFAULT

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        raise nvml.DeviceError(f"card {uuid}: cannot set the compute mode to Default: {self.reason}")


def test_a_compute_mode_refused_for_another_reason_is_a_fault():
    card = nvml.Card(0, "GPU-x", "x", 1024)
    with pytest.raises(nvml.DeviceError, match="Not Supported"):
        machine.may_set_compute_mode(Refusing("Not Supported"), card)
    with pytest.raises(nvml.DeviceError, match="Unknown Error"):
        machine.may_set_compute_mode(Refusing("Unknown Error"), card)
    with pytest.raises(machine.Lacking, match="Insufficient Permissions"):
        machine.may_set_compute_mode(Refusing(machine.NO_PERMISSION), card)


def test_no_nvml_library_is_a_lack(fake_nvml):  # noqa: F811
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        pytest.skip("this machine has a real NVML library, so it cannot play its absence")
    except OSError:
        pass
    env, _control = fake_nvml
    env = {k: v for k, v in env.items() if k != "LD_LIBRARY_PATH"}
    out = decide(env)
    assert out["verdict"] == "lacking" and out["why"].startswith("NVML cannot load here: ")


def test_libcuda_and_the_mps_binary():
    def load(name):
        raise OSError(f"{name}: cannot open shared object file")

    with pytest.raises(machine.Lacking, match=r"^libcuda.so.1 cannot load here: libcuda.so.1: cannot open"):
        machine.cuda_and_mps(load=load, which=lambda _: "/usr/bin/x")
    with pytest.raises(machine.Lacking, match=f"^{mps.CONTROL} is not on PATH$"):
        machine.cuda_and_mps(load=lambda _: None, which=lambda _: None)
    machine.cuda_and_mps(load=lambda _: None, which=lambda name: os.path.join("/usr/bin", name))
