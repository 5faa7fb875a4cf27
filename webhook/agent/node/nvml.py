"""The agent's small window on the node's GPUs: NVML, a fake inventory file, or nothing at all."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from webhook import settings

log = logging.getLogger(__name__)

# Xids that an application causes (bad kernel, page fault, channel errors, ...): the card is
# fine, so NVIDIA's own device plugin ignores them, and so do we.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def is_critical_xid(xid: int) -> bool:
    """Whether an Xid from NVML's critical-error events says the card itself is in trouble."""
    return xid not in APPLICATION_XIDS


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised on this node."""


class InventoryError(ValueError):
    """A fake inventory file gpushard cannot use; the message names the entry."""


class DeviceError(RuntimeError):
    """A card refused a query or a setting (no permission, not supported, gone); the message says which."""


# Compute modes, by NVML's numbers (nvmlComputeMode_t). MPS needs EXCLUSIVE_PROCESS while it runs:
# then only the MPS server holds a context on the card, and every client goes through it.
COMPUTE_DEFAULT = 0
COMPUTE_PROHIBITED = 2
COMPUTE_EXCLUSIVE_PROCESS = 3
COMPUTE_MODE_NAMES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}

# The NVML call behind the container toolkit's apply-cuda-memory-limits hook: a driver whose NVML
# exports it can cap a container's memory on its cgroup.
MEMORY_LIMITS_SYMBOL = "nvmlDeviceSetMemoryLimits_v1"


@dataclass(frozen=True)
class Card:
    index: int
    uuid: str
    model: str
    memory_mib: int


@dataclass(frozen=True)
class HealthEvent:
    """A change in one card's state: ``present`` False means the card is gone from the node."""

    uuid: str
    healthy: bool
    present: bool = True
    reason: str = ""


MIB = 1024 * 1024


@dataclass(frozen=True)
class Process:
    """One process NVML lists on a card; ``pid`` is in the host's PID namespace (the driver knows no other)."""

    pid: int
    used_bytes: int | None  # None where NVML cannot tell
    sm_percent: float | None = None  # its share of the card's SM time lately; None where not reported


@dataclass(frozen=True)
class Usage:
    """What one card is doing right now, as NVML reports it."""

    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int | None  # None where the card does not report it
    processes: tuple[Process, ...] = ()
    xid_errors: int = 0  # critical Xids seen on this card since the agent started
    process_utilization: bool = False  # whether the processes' sm_percent was reported (0 when idle)


def idle_usage(card: Card) -> Usage:
    """An idle card: nothing used, no process."""
    return Usage(memory_used_bytes=0, memory_total_bytes=card.memory_mib * MIB, utilization_percent=0)


class Devices(Protocol):
    """What the agent needs to know about the GPUs; the rest of the agent sees nothing else."""

    def cards(self) -> list[Card]:
        """The cards found at start, ordered by index."""

    def wait_event(self, timeout: float) -> HealthEvent | None:
        """The next health change, or None when ``timeout`` seconds pass without one."""

    def usage(self) -> dict[str, Usage]:
        """Each answering card's usage by UUID; a card that does not answer is left out."""

    def close(self) -> None:
        """Release the backend; no call follows."""

    def driver_version(self) -> str:
        """The driver's version as NVML reports it ("" when there is no driver)."""

    def mig_enabled(self, uuid: str) -> bool:
        """Whether the card runs in MIG mode (then it cannot run CUDA as a whole card)."""

    def compute_mode(self, uuid: str) -> int:
        """The card's compute mode (COMPUTE_*); DeviceError when NVML cannot tell."""

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        """Set the card's compute mode; DeviceError when NVML refuses (it needs root)."""

    def memory_limits_supported(self) -> bool:
        """Whether the driver can cap a cgroup's memory on a card (the toolkit's memory-limit hook needs it)."""


# --- null --------------------------------------------------------------------------------------

class NullDevices:
    """A node without GPUs: no cards, no events."""

    def __init__(self) -> None:
        self._closed = threading.Event()

    def cards(self) -> list[Card]:
        return []

    def usage(self) -> dict[str, Usage]:
        return {}

    def wait_event(self, timeout: float) -> HealthEvent | None:
        self._closed.wait(timeout)
        return None

    def close(self) -> None:
        self._closed.set()

    def driver_version(self) -> str:
        return ""

    def mig_enabled(self, uuid: str) -> bool:
        return False

    def compute_mode(self, uuid: str) -> int:
        raise DeviceError(f"no card {uuid} on a node without GPUs")

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        raise DeviceError(f"no card {uuid} on a node without GPUs")

    def memory_limits_supported(self) -> bool:
        return False


# --- fake inventory ----------------------------------------------------------------------------

def _card_entry(where: str, entry: Any) -> tuple[Card, bool]:
    if not isinstance(entry, dict):
        raise InventoryError(f"{where}: must be a mapping with index, uuid, model and memoryMiB, got {entry!r}")
    unknown = sorted(set(entry) - {"index", "uuid", "model", "memoryMiB", "healthy"})
    if unknown:
        raise InventoryError(f"{where}.{unknown[0]}: unknown key (expected index, uuid, model, memoryMiB, healthy)")
    index, uuid = entry.get("index"), entry.get("uuid")
    model, memory = entry.get("model", "fake GPU"), entry.get("memoryMiB", 0)
    healthy = entry.get("healthy", True)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InventoryError(f"{where}.index: must be a whole number 0 or more, got {index!r}")
    if not isinstance(uuid, str) or not uuid or len(uuid) > 128:
        raise InventoryError(f"{where}.uuid: must be a non-empty string, got {uuid!r}")
    if not isinstance(model, str):
        raise InventoryError(f"{where}.model: must be a string, got {model!r}")
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
        raise InventoryError(f"{where}.memoryMiB: must be a whole number of MiB, got {memory!r}")
    if not isinstance(healthy, bool):
        raise InventoryError(f"{where}.healthy: must be true or false, got {healthy!r}")
    return Card(index=index, uuid=uuid, model=model, memory_mib=memory), healthy


def parse_inventory(data: Any, source: str = "<inventory>") -> dict[str, tuple[Card, bool]]:
    """Cards (with their health) from a parsed inventory: ``{cards: [...]}`` or a bare list."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"cards"})
        if unknown:
            raise InventoryError(f"{source}: {unknown[0]}: unknown key (expected cards)")
        data = data.get("cards")
    if data is None:
        data = []
    if not isinstance(data, list):
        raise InventoryError(f"{source}: cards must be a list, got {type(data).__name__}")
    found: dict[str, tuple[Card, bool]] = {}
    indices: set[int] = set()
    for i, entry in enumerate(data):
        card, healthy = _card_entry(f"{source}: cards[{i}]", entry)
        if card.uuid in found or card.index in indices:
            raise InventoryError(f"{source}: cards[{i}]: index {card.index} or uuid {card.uuid!r} appears twice")
        indices.add(card.index)
        found[card.uuid] = (card, healthy)
    return found


def load_inventory(path: str | Path) -> dict[str, tuple[Card, bool]]:
    """Read an inventory file (YAML or JSON)."""
    path = Path(path)
    data = settings.read_yaml(path, "inventory file", InventoryError, formats="YAML or JSON")
    return parse_inventory(data, str(path))


class FakeDevices:
    """Cards read from an inventory file, for nodes and laptop clusters without GPUs.

    Editing the file while the agent runs plays health changes: a card marked
    ``healthy: false`` turns Unhealthy, a card removed from the file is lost. Cards
    added later are ignored, as the real backend ignores hot-plugged cards.
    Tests can also ``inject`` events directly.
    """

    def __init__(self, cards: list[Card], path: str | Path | None = None, poll: float = 0.5,
                 mig: frozenset[str] = frozenset(), driver: str = "fake", memory_limits: bool = False) -> None:
        self._cards = sorted(cards, key=lambda c: c.index)
        self._mig = frozenset(mig)
        self._driver = driver
        self._memory_limits = memory_limits
        self.compute_modes = {c.uuid: COMPUTE_DEFAULT for c in cards}  # what set_compute_mode left, per UUID
        self._path = Path(path) if path is not None else None
        self._poll = poll
        self._events: queue.Queue[HealthEvent] = queue.Queue()
        self._stamp = self._file_stamp()
        # What the file said last, so that a re-read reports only changes.
        self._seen = {c.uuid: (True, True) for c in self._cards}
        self._usage = {c.uuid: idle_usage(c) for c in self._cards}

    @classmethod
    def from_file(cls, path: str | Path, poll: float = 0.5) -> FakeDevices:
        entries = load_inventory(path)
        devices = cls([card for card, _ in entries.values()], path=path, poll=poll)
        devices._replay(entries)
        return devices

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _replay(self, entries: dict[str, tuple[Card, bool]]) -> None:
        for card in self._cards:
            present = card.uuid in entries
            healthy = present and entries[card.uuid][1]
            if self._seen[card.uuid] != (healthy, present):
                self._seen[card.uuid] = (healthy, present)
                reason = "inventory file" if present else "card removed from the inventory file"
                self._events.put(HealthEvent(card.uuid, healthy=healthy, present=present, reason=reason))

    def _reread(self) -> None:
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return
        self._stamp = stamp
        assert self._path is not None  # a stamp comes from a file
        try:
            entries = load_inventory(self._path)
        except InventoryError as exc:
            # A half-written file is normal while someone edits it: keep the last good state.
            log.warning("gpushard: ignoring the inventory file for now: %s", exc)
            return
        self._replay(entries)

    def cards(self) -> list[Card]:
        return list(self._cards)

    def inject(self, event: HealthEvent) -> None:
        self._events.put(event)

    def driver_version(self) -> str:
        return self._driver

    def mig_enabled(self, uuid: str) -> bool:
        return uuid in self._mig

    def compute_mode(self, uuid: str) -> int:
        if uuid not in self.compute_modes:
            raise DeviceError(f"no card {uuid}")
        return self.compute_modes[uuid]

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        if uuid not in self.compute_modes:
            raise DeviceError(f"no card {uuid}")
        self.compute_modes[uuid] = mode

    def memory_limits_supported(self) -> bool:
        return self._memory_limits
    def set_usage(self, uuid: str, usage: Usage) -> None:
        """What ``usage`` reports for one card from now on (tests and demos play workloads with it)."""
        if uuid not in self._usage:
            raise KeyError(f"gpushard: no card {uuid!r} in this inventory")
        self._usage[uuid] = usage

    def usage(self) -> dict[str, Usage]:
        # A card removed from the file does not answer, as a lost card does not answer NVML.
        return {uuid: usage for uuid, usage in self._usage.items() if self._seen[uuid][1]}

    def wait_event(self, timeout: float) -> HealthEvent | None:
        deadline = time.monotonic() + timeout
        while True:
            self._reread()
            remaining = deadline - time.monotonic()
            try:
                return self._events.get(timeout=max(0.0, min(remaining, self._poll)))
            except queue.Empty:
                if remaining <= self._poll:
                    return None

    def close(self) -> None:
        pass


# --- real NVML ---------------------------------------------------------------------------------

def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlDevices:
    """The real backend: pynvml discovery, Xid events, and a probe that notices lost cards."""

    def __init__(self, probe_interval: float = 5.0) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"the nvidia-ml-py package is not installed ({exc})") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc)) from None
        self._probe_interval = probe_interval
        self._next_probe = time.monotonic() + probe_interval
        self._pending: list[HealthEvent] = []
        self._lock = threading.Lock()
        try:
            self._cards = self._discover()
            self._state = {c.uuid: {"lost": False, "xid": False} for c in self._cards}
            self._xids = {c.uuid: 0 for c in self._cards}
            self._seen_sample: dict[str, int] = {}  # per card: the newest process-utilization sample seen
            self._closed = False
            self._events = self._register_events()
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable(f"NVML loaded but could not list the cards: {exc}") from None

    def _discover(self) -> list[Card]:
        nv = self._nvml
        cards = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            cards.append(Card(index=index, uuid=_text(nv.nvmlDeviceGetUUID(handle)),
                              model=_text(nv.nvmlDeviceGetName(handle)),
                              memory_mib=int(memory.total) // (1024 * 1024)))
        return cards

    def _register_events(self):
        nv = self._nvml
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("gpushard: no NVML event set (%s); health comes from probing the cards only", exc)
            return None
        for card in self._cards:
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(card.uuid)
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
            except nv.NVMLError as exc:
                # Some cards (and vGPU guests) do not report Xid events; the probe still watches them.
                log.warning("gpushard: card %d (%s) gives no Xid events: %s", card.index, card.uuid, exc)
        return event_set

    def cards(self) -> list[Card]:
        return list(self._cards)

    def _set(self, uuid: str, reason: str, *, lost: bool | None = None, xid: bool | None = None) -> None:
        state = self._state[uuid]
        before = (not state["lost"] and not state["xid"], not state["lost"])
        if lost is not None:
            state["lost"] = lost
        if xid is not None:
            state["xid"] = xid
        after = (not state["lost"] and not state["xid"], not state["lost"])
        if after != before:
            self._pending.append(HealthEvent(uuid, healthy=after[0], present=after[1], reason=reason))

    def _probe(self) -> None:
        """Ask every card; the only place that marks a card lost or brings one back."""
        nv = self._nvml
        self._next_probe = time.monotonic() + self._probe_interval
        for card in self._cards:
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(card.uuid)
                nv.nvmlDeviceGetMemoryInfo(handle)
            except nv.NVMLError as exc:
                self._set(card.uuid, f"card does not answer NVML: {exc}", lost=True)
                continue
            if self._state[card.uuid]["lost"]:
                # This card was seen silent and answers again, so it has been reset, which also
                # clears an earlier Xid. A card never seen silent keeps its Xid.
                self._set(card.uuid, "card answers NVML again", lost=False, xid=False)

    def _wait_xid(self, timeout: float) -> None:
        nv = self._nvml
        if self._events is None:
            time.sleep(timeout)
            return
        try:
            data = nv.nvmlEventSetWait(self._events, max(1, int(timeout * 1000)))
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == nv.NVML_ERROR_TIMEOUT:
                return
            if getattr(exc, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                # NVML does not say which card. Marking them all lost would pull every card out of
                # service, and the living ones coming back would wrongly clear their Xids; ask each.
                pending = len(self._pending)
                self._probe()
                if len(self._pending) == pending:
                    time.sleep(timeout)  # the set keeps answering at once; do not spin on it
                return
            log.warning("gpushard: waiting for NVML events failed: %s", exc)
            time.sleep(timeout)
            return
        if data.eventType != nv.nvmlEventTypeXidCriticalError:
            return
        xid = int(data.eventData)
        if not is_critical_xid(xid):
            return
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(data.device))
        except nv.NVMLError:
            uuid = None
        targets = [uuid] if uuid in self._state else [c.uuid for c in self._cards]
        for target in targets:
            self._xids[target] += 1
            self._set(target, f"critical Xid {xid}", xid=True)

    def wait_event(self, timeout: float) -> HealthEvent | None:
        with self._lock:
            deadline = time.monotonic() + timeout
            while not self._pending:
                now = time.monotonic()
                if now >= self._next_probe:
                    self._probe()
                    continue
                remaining = deadline - now
                if remaining <= 0:
                    return None
                self._wait_xid(min(remaining, self._next_probe - now))
            return self._pending.pop(0)

    def driver_version(self) -> str:
        try:
            return _text(self._nvml.nvmlSystemGetDriverVersion())
        except self._nvml.NVMLError as exc:
            log.warning("gpushard: NVML gives no driver version: %s", exc)
            return ""

    def _handle(self, uuid: str):
        try:
            return self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        except self._nvml.NVMLError as exc:
            raise DeviceError(f"card {uuid}: {exc}") from None

    def mig_enabled(self, uuid: str) -> bool:
        nv = self._nvml
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(self._handle(uuid))
        except nv.NVMLError:
            return False  # a card without MIG support answers NOT_SUPPORTED: a whole card
        return current == nv.NVML_DEVICE_MIG_ENABLE

    def compute_mode(self, uuid: str) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetComputeMode(self._handle(uuid)))
        except self._nvml.NVMLError as exc:
            raise DeviceError(f"card {uuid}: cannot read the compute mode: {exc}") from None

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        try:
            self._nvml.nvmlDeviceSetComputeMode(self._handle(uuid), mode)
        except self._nvml.NVMLError as exc:
            raise DeviceError(f"card {uuid}: cannot set the compute mode to "
                              f"{COMPUTE_MODE_NAMES.get(mode, mode)}: {exc}") from None

    def memory_limits_supported(self) -> bool:
        # The same soname NVML already loaded, so this opens the very library in use.
        try:
            return hasattr(ctypes.CDLL("libnvidia-ml.so.1"), MEMORY_LIMITS_SYMBOL)
        except OSError:
            return False
    def _processes(self, handle, card_uuid: str) -> tuple[tuple[Process, ...], bool]:
        nv = self._nvml
        found: dict[int, int | None] = {}
        for lister in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                listed = lister(handle)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED:
                    continue
                raise
            for proc in listed:
                used = proc.usedGpuMemory
                # A process using compute and graphics is listed twice with the same memory.
                if proc.pid not in found or (used is not None and used > (found[proc.pid] or 0)):
                    found[int(proc.pid)] = None if used is None else int(used)
        sm, supported = self._process_utilization(handle, card_uuid)
        return tuple(Process(pid, used, sm.get(pid, 0.0) if supported else None)
                     for pid, used in sorted(found.items())), supported

    def _process_utilization(self, handle, card_uuid: str) -> tuple[dict[int, float], bool]:
        """Each process's mean SM utilization over the samples since the last scrape, and whether the card
        reports it at all. NVML keeps a short buffer of samples; asking from the last seen timestamp
        gives this scrape's window."""
        nv = self._nvml
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(handle, self._seen_sample.get(card_uuid, 0))
        except nv.NVMLError as exc:
            value = getattr(exc, "value", None)
            if value == nv.NVML_ERROR_NOT_FOUND:  # no sample since then: nothing ran
                return {}, True
            if value == nv.NVML_ERROR_NOT_SUPPORTED:
                return {}, False
            raise
        per_pid: dict[int, list[int]] = {}
        for sample in samples:
            per_pid.setdefault(int(sample.pid), []).append(int(sample.smUtil))
            self._seen_sample[card_uuid] = max(self._seen_sample.get(card_uuid, 0), int(sample.timeStamp))
        return {pid: sum(v) / len(v) for pid, v in per_pid.items()}, True

    def _card_usage(self, card: Card) -> Usage:
        nv = self._nvml
        handle = nv.nvmlDeviceGetHandleByUUID(card.uuid)
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization: int | None = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != nv.NVML_ERROR_NOT_SUPPORTED:
                raise
            utilization = None
        processes, per_process = self._processes(handle, card.uuid)
        return Usage(memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total),
                     utilization_percent=utilization, processes=processes, xid_errors=self._xids[card.uuid],
                     process_utilization=per_process)

    def usage(self) -> dict[str, Usage]:
        # No lock: NVML's queries are thread-safe, and the health thread holds the lock while it
        # waits for events; a scrape must not wait behind it.
        found = {}
        for card in self._cards:
            if self._closed:
                break
            try:
                found[card.uuid] = self._card_usage(card)
            except self._nvml.NVMLError as exc:
                log.debug("gpushard: card %d (%s) gave no usage: %s", card.index, card.uuid, exc)
        return found

    def close(self) -> None:
        nv = self._nvml
        self._closed = True
        with self._lock:
            try:
                if self._events is not None:
                    nv.nvmlEventSetFree(self._events)
                    self._events = None
                nv.nvmlShutdown()
            except nv.NVMLError as exc:
                log.warning("gpushard: NVML shutdown: %s", exc)


def open_devices(fake_inventory: str | Path | None = None, allow_no_gpus: bool = False) -> Devices:
    """The backend the flags ask for: the fake inventory, else NVML, else (if allowed) nothing."""
    if fake_inventory is not None:
        return FakeDevices.from_file(fake_inventory)
    try:
        return NvmlDevices()
    except NvmlUnavailable:
        if allow_no_gpus:
            return NullDevices()
        raise

