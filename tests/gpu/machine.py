"""What the GPU tests need of the machine, and the one place that decides a test may skip for want of it.

A GPU test skips only for what the machine lacks: the NVML library or a driver (NVML cannot be
loaded or initialised), a card outside MIG mode, the rights to set a card's compute mode (MPS
needs exclusive-process; NVML answers "Insufficient Permissions" to others than root), the CUDA
driver library, the MPS control binary. Anything else (NVML loaded but unable to list the cards,
a compute mode refused for another reason, the MPS daemon failing where all this is present) is a
fault the test must report, so it propagates.
"""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable

from webhook.agent.node import mps, nvml

# pynvml's text for NVML_ERROR_NO_PERMISSION, which DeviceError carries.
NO_PERMISSION = "Insufficient Permissions"
CUDA_LIBRARY = "libcuda.so.1"


class Lacking(Exception):
    """What this machine lacks for a GPU test; the test skips with this message."""


def open_nvml(factory: Callable[[], nvml.NvmlDevices] = nvml.NvmlDevices) -> nvml.NvmlDevices:
    try:
        return factory()
    except nvml.NvmlUnavailable as exc:
        # Loaded and initialised, then unable to list the cards: a broken node or a regression.
        if str(exc).startswith("NVML loaded"):
            raise
        raise Lacking(f"NVML cannot load here: {exc}") from None


def whole_card(devices: nvml.NvmlDevices) -> nvml.Card:
    cards = devices.cards()
    if not cards:
        raise Lacking("NVML lists no card")
    whole = [c for c in cards if not devices.mig_enabled(c.uuid)]
    if not whole:
        raise Lacking("no card outside MIG mode")
    return whole[0]


def may_set_compute_mode(devices: nvml.NvmlDevices, card: nvml.Card) -> None:
    """Set the card's compute mode to what it is: refused for want of rights is a lack, else a fault."""
    current = devices.compute_mode(card.uuid)
    try:
        devices.set_compute_mode(card.uuid, current)
    except nvml.DeviceError as exc:
        if NO_PERMISSION in str(exc):
            raise Lacking(f"no rights to set the compute mode (MPS needs root): {exc}") from None
        raise


def cuda_and_mps(load: Callable[[str], object] = ctypes.CDLL,
                 which: Callable[[str], str | None] = shutil.which) -> None:
    try:
        load(CUDA_LIBRARY)
    except OSError as exc:
        raise Lacking(f"{CUDA_LIBRARY} cannot load here: {exc}") from None
    if which(mps.CONTROL) is None:
        raise Lacking(f"{mps.CONTROL} is not on PATH")
