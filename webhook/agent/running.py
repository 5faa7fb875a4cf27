"""The wiring of `gpushard agent`: backend, health watcher, plugin servers, kubelet keeper, publisher, cordons,
startup taint."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

from webhook import settings as settings_mod
from webhook.agent.deviceplugin import backend as dpbackend
from webhook.agent.deviceplugin import holders
from webhook.agent.dra import backend as drabackend
from webhook.agent.dra import nodecount, runtimechecking
from webhook.agent.metrics import exporting
from webhook.agent.node import (
    containerlimits,
    cordonwatching,
    health,
    mps,
    nvml,
    otherdrivers,
    otherplugins,
    podresources,
    publishing,
    sockets,
    startuptaint,
    toolkitcheck,
)
from webhook.core import names
from webhook.core import policy as policy_mod
from webhook.kubeapi import connecting

log = logging.getLogger(__name__)

EXIT_SERVE = 1
EXIT_USAGE = 2
EXIT_NO_NVML = 3
EXIT_NO_API = 4
# How long a probe waits for each of the agent's gRPC servers to take a connection.
PROBE_TIMEOUT_S = 1.0


class Backend(Protocol):
    """What the agent asks of its one backend (``deviceplugin.backend`` or ``dra.backend``)."""

    # (namespace, pod) -> card index, where PodResources names no card (the metrics'), or None.
    cards_by_pod: Callable[[], Mapping[tuple[str, str], int]] | None
    # Given the agent's Node each time it is read or watched, or None.
    seen_node: Callable[[dict | None], None] | None
    # Set by the agent, called by the backend when its card_details change.
    on_change: Callable[[], None] | None

    def start(self, threads: Callable[[str, Callable[[threading.Event], None]], None]) -> None:
        """Serve the kubelet (OSError when it cannot), its loops run on ``threads(name, target)``."""

    def stop(self) -> None: ...

    def changed(self) -> None:
        """The cards' health, their cordons or the node's facts changed."""

    def card_details(self) -> dict:
        """What the backend adds to every card's entry of the Node's inventory."""

    def sockets(self) -> list[sockets.Server]: ...

    def advertised(self, cards: frozenset[int]) -> list[str]:
        """The resources the Node's allocatable shows once the backend serves ``cards`` (card indexes)."""

    def unready(self) -> list[str]:
        """Why the kubelet cannot use the backend yet; empty once it can."""

    def describe(self) -> str:
        """What it serves, for the log."""


class Agent:
    """Everything the agent runs, startable and stoppable in one process (tests use it directly).

    ``backend`` makes the one backend from the agent's node pieces; without it, the device-plugin backend
    serves in ``directory``."""

    def __init__(self, devices: nvml.Devices, policy: policy_mod.Policy, directory: str,
                 publisher: Callable[[Callable[[], list[nvml.Card]]], publishing.Publisher] | None = None,
                 poll: float = 1.0, tick: float = 1.0, register_timeout: float = 5.0,
                 mps_root: str = containerlimits.DEFAULT_MPS_ROOT, mps_options: dict | None = None,
                 backend: Callable[[Agent], Backend] | None = None,
                 conflicts: Callable[[Callable[[], list[nvml.Card]]], otherdrivers.Watcher] | None = None,
                 pod_resources: podresources.Client | None = None,
                 holders_refresh: float = holders.REFRESH_S,
                 cordons: Callable[[], cordonwatching.Watcher] | None = None,
                 toolkit: toolkitcheck.Checker | None = None, toolkit_interval: float = 60.0,
                 foreign_interval: float = otherplugins.INTERVAL_S,
                 startup: Callable[[Callable[[], list[str]]], startuptaint.Lifter] | None = None) -> None:
        self.devices = devices
        self.policy = policy
        self.cards, self.excluded = _whole_cards(devices)
        self.board = health.Board(self.cards)
        self.mps_root = containerlimits.MpsRoot(mps_root)
        # The cards an operator cordoned on this Node (read, never written): their shares are not offered.
        self.cordons = cordons() if cordons is not None else None
        if self.cordons is not None:
            self.cordons.on_change = self._cordons_changed
        self.pod_resources = pod_resources
        # Cards another device plugin handed to containers that still run (a node moved from NVIDIA's plugin):
        # withheld from new pods, as a cordoned card is, until none holds one. Read from PodResources.
        self.foreign = otherplugins.Watcher(pod_resources.list, policy, self.cards, foreign_interval) \
            if pod_resources is not None else None
        if self.foreign is not None:
            self.foreign.on_change = self._foreign_changed
        if backend is None:
            def backend(agent: Agent) -> Backend:
                return dpbackend.DevicePluginBackend(directory, agent.cards, agent.board, agent.policy,
                                                     agent.mps_root, agent.cordoned, agent.pod_resources,
                                                     poll=poll, tick=tick, register_timeout=register_timeout,
                                                     holders_refresh=holders_refresh)
        self.backend = backend(self)
        self.backend.on_change = self._inventory_changed
        # Removes the autoscaler's startup taint once the Node advertises the offered cards; it reads the
        # Node the cordon watch follows.
        self.startup = startup(self.advertised) if startup is not None and self.cordons is not None else None
        if self.cordons is not None:
            self.cordons.on_node = self._seen_node
        self.publisher = publisher(self.present_cards) if publisher is not None else None
        if self.publisher is not None:
            self.publisher.details = self.inventory_details
        # Another DRA driver offering this node's cards: reported in the inventory, a metric and the log.
        self.conflicts = conflicts(lambda: list(self.cards)) if conflicts is not None else None
        if self.conflicts is not None:
            self.conflicts.on_change = self._changed
        self.mps = mps.Supervisor(devices, self.cards, self.board, self.mps_root, self._changed,
                                  **(mps_options or {})) if policy.isolation == "mps" else None
        self.driver = devices.driver_version()
        self.memory_limits = devices.memory_limits_supported()
        self.tick = tick
        # The node's NVIDIA container toolkit: whether it keeps outsiders' NVIDIA_VISIBLE_DEVICES from the cards.
        self.toolkit = toolkit
        self.toolkit_interval = toolkit_interval
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _seen_node(self, node: dict | None) -> None:
        if self.backend.seen_node is not None:
            self.backend.seen_node(node)
        if self.startup is not None:
            self.startup.seen(node)

    def advertised(self) -> list[str]:
        """What the Node's allocatable shows once the kubelet took the cards offered now: present, healthy and
        not cordoned (a card withheld shows 0 and must not keep the node tainted)."""
        healthy = self.board.snapshot().healthy
        offered = frozenset(c.index for c in self.present_cards() if healthy.get(c.index, False)) - self.cordoned()
        return self.backend.advertised(offered)

    def present_cards(self) -> list[nvml.Card]:
        present = self.board.snapshot().present
        return [c for c in self.cards if present.get(c.index, False)]

    def cordoned(self) -> frozenset[int]:
        """The card indexes whose shares are not offered: those an operator cordoned on this Node, as last
        read, and those another device plugin's containers hold."""
        return self.operator_cordoned() | (self.foreign.withheld if self.foreign is not None else frozenset())

    def operator_cordoned(self) -> frozenset[int]:
        """The card indexes an operator cordoned on this Node, as last read."""
        return self.cordons.cordoned if self.cordons is not None else frozenset()

    def _foreign_changed(self) -> None:
        self._cordons_changed()
        if self.publisher is not None:
            self.publisher.changed()

    def _cordons_changed(self) -> None:
        # The card-k plugin's stream lists again (it withdraws or offers its shares), the slice is published
        # again; health is untouched.
        self.board.touch()
        self.backend.changed()
        if self.startup is not None:
            self.startup.changed()

    def _changed(self) -> None:
        self._inventory_changed()
        self.backend.changed()
        if self.startup is not None:
            self.startup.changed()

    def _inventory_changed(self) -> None:
        if self.publisher is not None:
            self.publisher.changed()

    def inventory_details(self) -> dict:
        """What the Node's inventory says beyond each card's identity: isolation, and cards left out."""
        states = self.mps.states() if self.mps is not None else {}
        per_card = {}
        for card in self.cards:
            given = {"mode": self.policy.isolation, "driver": self.driver, "memoryLimits": self.memory_limits}
            if card.index in states:
                given["mps"] = states[card.index]
            per_card[card.index] = {"isolation": given}
        if self.conflicts is not None:
            for index, found in self.conflicts.card_details().items():
                per_card.setdefault(index, {}).update(found)
        refused = self.backend.card_details()
        for card in self.cards:
            per_card[card.index].update(refused)
        if self.foreign is not None:
            for index, found in self.foreign.card_details().items():
                per_card.setdefault(index, {}).update(found)
        if self.toolkit is not None:
            # On every card: the toolkit decides for all of them (the Node's three keys stay the agent's only ones).
            verdict = (self.toolkit.verdict or self.toolkit.check()).as_json()
            for card in self.cards:
                per_card[card.index][names.INVENTORY_TOOLKIT] = verdict
        return {"cards": per_card, "excluded": list(self.excluded)}

    def _watch_toolkit(self, stop: threading.Event) -> None:
        """The toolkit's config read again every ``toolkit_interval``: an operator who fixes it is seen."""
        assert self.toolkit is not None  # the thread runs only with a toolkit checker
        while not stop.wait(self.toolkit_interval):
            before = self.toolkit.verdict
            if self.toolkit.check() != before:
                self._changed()

    def _thread(self, name: str, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def ended_loops(self) -> list[str]:
        """The names of the agent's loops that ended while it runs. Each runs until stop, so one that ended
        failed in a way it could not survive (its traceback is in the log): the agent is no longer whole."""
        if self._stop.is_set():
            return []
        return [thread.name for thread in self._threads if not thread.is_alive()]

    def liveness(self) -> list[str]:
        """What keeps this agent from serving (its /healthz): a loop that ended, a gRPC server whose socket is
        gone or not answering. Empty while it is whole. A socket a restarting kubelet removed is served again
        by the next poll, well within the probe's failure threshold; one that stays gone is a failure."""
        found = [f"its {name} loop ended" for name in self.ended_loops()]
        for socket in self.backend.sockets():
            if not socket.is_ours():
                found.append(f"its gRPC server on {socket.path} is not serving (the socket is gone or replaced)")
            elif not socket.answers(PROBE_TIMEOUT_S):
                found.append(f"its gRPC server on {socket.path} does not answer")
        return found

    def readiness(self) -> list[str]:
        """Why the kubelet cannot use this agent's cards yet (its /readyz); empty once it can."""
        return self.liveness() + self.backend.unready()

    def start(self) -> None:
        if self.cordons is not None:
            # First, so that the Node's cordons are usually read before the kubelet first lists the shares.
            self._thread("gpushard-cordons", self.cordons.run, self._stop)
        if self.mps is not None:
            # Daemons first: the kubelet may allocate as soon as a plugin registers.
            self.mps.start()
            self._thread("gpushard-mps", self.mps.run, self._stop)
        if self.foreign is not None:
            # Before the plugins register: a card another plugin's pods hold is never offered, not even at first.
            self.foreign.check()
        self.backend.start(lambda name, target: self._thread(name, target, self._stop))
        self._thread("gpushard-health", health.watch, self.devices, self.board, self._stop, self._changed,
                     min(self.tick, 0.5))
        if self.publisher is not None:
            self._thread("gpushard-publish", self.publisher.run, self._stop)
        if self.startup is not None:
            self._thread("gpushard-startup-taint", self.startup.run, self._stop)
        if self.conflicts is not None:
            self._thread("gpushard-dra-conflicts", self.conflicts.run, self._stop)
        if self.toolkit is not None:
            self.toolkit.check()
            self._thread("gpushard-toolkit", self._watch_toolkit, self._stop)
        if self.foreign is not None:
            self._thread("gpushard-foreign", self.foreign.run, self._stop)

    def stop(self) -> None:
        """Stop polling, end the streams, remove our sockets, release NVML."""
        self._stop.set()
        if self.cordons is not None:
            self.cordons.close()
        if self.publisher is not None:
            self.publisher.changed()  # wakes it to see the stop
        for thread in self._threads:
            thread.join(timeout=10)
        self.backend.stop()
        if self.mps is not None:
            self.mps.stop()
        self.board.close()
        if self.pod_resources is not None:
            self.pod_resources.close()
        self.devices.close()


def _whole_cards(devices: nvml.Devices) -> tuple[list[nvml.Card], list[tuple[nvml.Card, str]]]:
    """The cards shared as whole cards, and those left out with the reason."""
    kept, excluded = [], []
    for card in devices.cards():
        if devices.mig_enabled(card.uuid):
            # A card in MIG mode runs CUDA only inside its MIG instances, so a whole-card share could not
            # run anything; MPS cannot run on it either.
            reason = "MIG mode is on: not shared as a whole card (turn MIG off to share it)"
            log.warning("gpushard: card %d (%s) left out: %s", card.index, card.uuid, reason)
            excluded.append((card, reason))
        else:
            kept.append(card)
    return kept, excluded


def _fail(code: int, message: str) -> int:
    print(message, file=sys.stderr)
    return code


def run(args: argparse.Namespace, settings: settings_mod.Settings) -> int:
    """`gpushard agent`: run until SIGTERM or SIGINT, then clean up and return the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not args.poll_interval > 0:
        return _fail(EXIT_USAGE, f"gpushard: --poll-interval must be a positive number of seconds, "
                                 f"got {args.poll_interval}")
    if not 0 <= args.metrics_port <= 65535:
        return _fail(EXIT_USAGE, "gpushard: --metrics-port must be a port number (0 for none), "
                                 f"got {args.metrics_port}")
    node_name = args.node_name or os.environ.get("NODE_NAME")
    if not args.no_publish and not node_name:
        return _fail(EXIT_USAGE, "gpushard: no node name to publish the inventory on: pass --node-name, "
                                 "set NODE_NAME (the downward API's spec.nodeName), or pass --no-publish")
    try:
        devices = nvml.open_devices(args.fake_inventory, allow_no_gpus=args.allow_no_gpus)
    except nvml.NvmlUnavailable as exc:
        return _fail(EXIT_NO_NVML, f"gpushard: cannot load NVML ({exc}); run on a node with the NVIDIA driver "
                                   "and libnvidia-ml.so.1 visible to the agent, pass --fake-inventory FILE "
                                   "to advertise cards from a file, or --allow-no-gpus to advertise none")
    except nvml.InventoryError as exc:
        return _fail(EXIT_USAGE, f"gpushard: bad inventory file: {' '.join(str(exc).split())}; check the file "
                                 "given to --fake-inventory")

    publisher = None
    api = None
    timeout = settings.agent.request_timeout  # every API request of the agent's own loops
    if settings.policy.backend == policy_mod.DRA and args.no_publish:
        devices.close()
        return _fail(EXIT_USAGE, "gpushard: backend dra needs the API server (the agent publishes the node's "
                                 "ResourceSlice and reads each claim it prepares); drop --no-publish")
    if not args.no_publish:
        try:
            api = publishing.api_client()
        except Exception as exc:  # kubernetes.config raises several unrelated types
            devices.close()
            return _fail(EXIT_NO_API, f"gpushard: no Kubernetes API credentials ({connecting.config_reason(exc)}); "
                                      "run in a pod with a "
                                      "service account, set KUBECONFIG to a kubeconfig file, or pass --no-publish")

        def publisher(cards):
            return publishing.Publisher(api, node_name, cards, timeout=timeout)

    conflicts = None
    cordons = None
    startup = None
    if api is not None:
        def conflicts(cards):
            return otherdrivers.Watcher(api, node_name, cards, timeout=timeout)

        def cordons():
            return cordonwatching.Watcher(api, node_name)

        def startup(advertised):
            return startuptaint.Lifter(api, node_name, advertised, timeout=timeout)

    # The one place that picks the backend.
    if settings.policy.backend == policy_mod.DRA:
        folders = drabackend.Folders(
            registry=getattr(args, "kubelet_registry_dir", None) or drabackend.Folders.registry,
            plugins=getattr(args, "kubelet_plugins_dir", None) or drabackend.Folders.plugins,
            cdi=getattr(args, "cdi_dir", None) or drabackend.Folders.cdi)

        def count(resource, shares):
            return nodecount.Keeper(api, node_name, resource, shares, timeout=timeout,
                                    device_plugin_dir=args.device_plugin_dir)

        def backend(agent):
            runtime = runtimechecking.Checker(api, node_name, settings.agent.runtime_cdi, timeout=timeout)
            return drabackend.DraBackend(api, node_name, agent.devices, agent.cards, agent.board, agent.policy,
                                         folders, agent.mps_root, poll=args.poll_interval, timeout=timeout,
                                         runtime=runtime, cordoned=agent.cordoned, count=count)
    else:
        def backend(agent):
            return dpbackend.DevicePluginBackend(args.device_plugin_dir, agent.cards, agent.board, agent.policy,
                                                 agent.mps_root, agent.cordoned, agent.pod_resources,
                                                 poll=args.poll_interval)
    agent = Agent(devices, settings.policy, args.device_plugin_dir, publisher, poll=args.poll_interval,
                  mps_root=getattr(args, "mps_root", None) or containerlimits.DEFAULT_MPS_ROOT, backend=backend,
                  conflicts=conflicts, cordons=cordons, startup=startup,
                  toolkit=toolkitcheck.Checker(getattr(args, "toolkit_config", None) or toolkitcheck.CONFIG_PATHS),
                  pod_resources=podresources.Client(getattr(args, "pod_resources_socket", None) or podresources.SOCKET))
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("gpushard: %s received; shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    metrics = None
    try:
        try:
            agent.start()
        except OSError as exc:
            return _fail(EXIT_SERVE, f"gpushard: cannot serve the device plugins in {args.device_plugin_dir}: "
                                     f"{exc} (the agent needs that host folder mounted read-write)")
        log.info("gpushard: %d card(s); %s", len(agent.cards), agent.backend.describe())
        try:
            metrics = exporting.serve(args, settings, agent.cards, agent.devices, agent.board, api, node_name,
                                      conflicts=agent.conflicts, cordoned=agent.operator_cordoned,
                                      toolkit=agent.toolkit, withheld=agent.foreign,
                                      cards_by_pod=agent.backend.cards_by_pod,
                                      probes={"/healthz": agent.liveness, "/readyz": agent.readiness})
        except OSError as exc:
            return _fail(EXIT_SERVE, f"gpushard: cannot serve metrics on port {args.metrics_port}: {exc}; pick a "
                                     "free --metrics-port")
        while not stop.wait(1.0):
            ended = agent.ended_loops()
            if ended:
                # The kubelet restarts the container: a fresh agent serves again, where this one would serve
                # stale health, shares or slices for ever.
                return _fail(EXIT_SERVE, f"gpushard: the agent's {', '.join(ended)} loop ended (its error is logged "
                                         "above); exiting so that the kubelet starts the agent again")
    finally:
        if metrics is not None:
            metrics.close()
        agent.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    log.info("gpushard: agent stopped")
    return 0
