"""The wiring of `gpushard agent`: backend, health watcher, plugin servers, kubelet keeper, publisher."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from webhook import settings as settings_mod
from webhook.agent import allocation, deviceplugin, exporting, health, kubelet, nvml, publishing
from webhook.core import policy as policy_mod

log = logging.getLogger(__name__)

EXIT_SERVE = 1
EXIT_USAGE = 2
EXIT_NO_NVML = 3
EXIT_NO_API = 4


class Agent:
    """Everything the agent runs, startable and stoppable in one process (tests use it directly)."""

    def __init__(self, devices: nvml.Devices, policy: policy_mod.Policy, directory: str,
                 publisher: Callable[[Callable[[], list[nvml.Card]]], publishing.Publisher] | None = None,
                 poll: float = 1.0, tick: float = 1.0, register_timeout: float = 5.0) -> None:
        self.devices = devices
        self.policy = policy
        self.cards = devices.cards()
        self.board = health.Board(self.cards)
        self.resources = allocation.resources(self.cards, policy)
        self.plugins = [deviceplugin.PluginServer(directory, r, self.cards, self.board, policy.shares_per_card, tick)
                        for r in self.resources]
        self.keeper = kubelet.Keeper(directory, self.plugins, poll=poll, timeout=register_timeout)
        self.publisher = publisher(self.present_cards) if publisher is not None else None
        self.tick = tick
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def present_cards(self) -> list[nvml.Card]:
        present = self.board.snapshot().present
        return [c for c in self.cards if present.get(c.index, False)]

    def _thread(self, name: str, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self) -> None:
        self.keeper.start()
        on_change = self.publisher.changed if self.publisher is not None else None
        self._thread("gpushard-health", health.watch, self.devices, self.board, self._stop, on_change,
                     min(self.tick, 0.5))
        self._thread("gpushard-kubelet", self.keeper.run, self._stop)
        if self.publisher is not None:
            self._thread("gpushard-publish", self.publisher.run, self._stop)

    def stop(self) -> None:
        """Stop polling, end the streams, remove our sockets, release NVML."""
        self._stop.set()
        if self.publisher is not None:
            self.publisher.changed()  # wakes it to see the stop
        for thread in self._threads:
            thread.join(timeout=10)
        self.keeper.close()
        self.board.close()
        self.devices.close()


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
        return _fail(EXIT_USAGE, f"gpushard: bad inventory file: {exc}")

    publisher = None
    api = None
    if not args.no_publish:
        try:
            api = publishing.api_client()
        except Exception as exc:  # kubernetes.config raises several unrelated types
            devices.close()
            return _fail(EXIT_NO_API, f"gpushard: no Kubernetes API credentials ({exc}); run in a pod with a "
                                      "service account, set KUBECONFIG, or pass --no-publish")

        def publisher(cards):
            return publishing.Publisher(api, node_name, cards)

    agent = Agent(devices, settings.policy, args.device_plugin_dir, publisher, poll=args.poll_interval)
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
        log.info("gpushard: %d card(s); serving %s in %s", len(agent.cards),
                 ", ".join(r.name for r in agent.resources), args.device_plugin_dir)
        try:
            metrics = exporting.serve(args, settings, agent.cards, agent.devices, agent.board, api, node_name)
        except OSError as exc:
            return _fail(EXIT_SERVE, f"gpushard: cannot serve metrics on port {args.metrics_port}: {exc}")
        while not stop.wait(1.0):
            pass
    finally:
        if metrics is not None:
            metrics.close()
        agent.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    log.info("gpushard: agent stopped")
    return 0
