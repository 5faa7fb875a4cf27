"""Running one MPS control daemon per card: exclusive-process mode while it runs, restarts, its health.

Facts this rests on (NVIDIA's MPS documentation, and its device plugin's
cmd/mps-control-daemon/mps/daemon.go): `nvidia-cuda-mps-control` finds its pipe and log
folders in CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY and its cards in
CUDA_VISIBLE_DEVICES; commands are lines on its standard input in a second invocation with
the same pipe folder ("quit" ends it); it starts one MPS server per client UID.

We run the daemon in the foreground (`-f`) as our own child rather than with `-d`: a daemon
that forks away would be reparented to the container's init, so its death could only be
guessed from a pid file; our child's death is seen at once, and it is reaped.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable

from webhook.agent.node import containerlimits, health, nvml
from webhook.core import names

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
# Answered by a healthy control daemon; NVIDIA's device plugin uses the same query as its health check.
PROBE = "get_default_active_thread_percentage"
SAVED_MODE = "compute-mode-before-mps"


class CardDaemon:
    """The MPS control daemon of one card, started, watched and stopped by the supervisor."""

    def __init__(self, devices: nvml.Devices, card: nvml.Card, root: containerlimits.MpsRoot,
                 control: str = CONTROL, backoff: tuple[float, float] = (1.0, 60.0),
                 command_timeout: float = 10.0) -> None:
        self.devices = devices
        self.card = card
        self.root = root
        self.control = control
        self.backoff_min, self.backoff_max = backoff
        self.command_timeout = command_timeout
        self.proc: subprocess.Popen | None = None
        self.problem: str | None = "not started"
        self.restarts = 0
        self._delay = self.backoff_min
        self._next_start = 0.0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.problem is None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({names.CUDA_VISIBLE_DEVICES_ENV: self.card.uuid,
                    names.MPS_PIPE_DIRECTORY_ENV: self.root.pipe_dir(self.card),
                    names.MPS_LOG_DIRECTORY_ENV: self.root.log_dir(self.card)})
        return env

    def command(self, line: str) -> str:
        """Send one command to the running daemon; its answer, or DeviceError."""
        try:
            done = subprocess.run([self.control], input=line + "\n", env=self.env(), capture_output=True,
                                  text=True, timeout=self.command_timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise nvml.DeviceError(f"{self.control} {line!r}: {exc}") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            raise nvml.DeviceError(f"{self.control} {line!r} exited {done.returncode}"
                                   + (f": {said[-200:]}" if said else ""))
        return done.stdout

    def _saved_mode_path(self) -> str:
        return os.path.join(self.root.card_dir(self.card), SAVED_MODE)

    def _exclusive(self) -> None:
        # Keep the mode the card had before MPS on disk: if the agent dies without stopping, the
        # next agent finds the card already exclusive and must still restore the old mode at the end.
        path = self._saved_mode_path()
        if not os.path.exists(path):
            before = self.devices.compute_mode(self.card.uuid)
            with open(path + ".tmp", "w") as out:
                out.write(f"{before}\n")
            os.replace(path + ".tmp", path)
        self.devices.set_compute_mode(self.card.uuid, nvml.COMPUTE_EXCLUSIVE_PROCESS)

    def restore_mode(self) -> None:
        path = self._saved_mode_path()
        try:
            with open(path) as saved:
                before = int(saved.read().strip())
        except FileNotFoundError:
            return  # never made exclusive by us
        except (OSError, ValueError):
            before = nvml.COMPUTE_DEFAULT
        try:
            self.devices.set_compute_mode(self.card.uuid, before)
        except nvml.DeviceError as exc:
            log.error("gpushard: card %d: could not restore its compute mode: %s", self.card.index, exc)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def start(self) -> None:
        """Exclusive-process mode, then the daemon; on failure ``problem`` says why and a retry is scheduled."""
        try:
            for folder in (self.root.pipe_dir(self.card), self.root.log_dir(self.card), self.root.shm_dir):
                os.makedirs(folder, mode=0o755, exist_ok=True)
            self._exclusive()
            self.proc = subprocess.Popen([self.control, "-f"], env=self.env(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
            self._wait_answering()
        except (OSError, nvml.DeviceError) as exc:
            self._failed(f"MPS daemon did not start: {exc}")
            return
        self.problem = None
        log.info("gpushard: card %d (%s): MPS control daemon running (pid %d, pipe %s)", self.card.index,
                 self.card.uuid, self.proc.pid, self.root.pipe_dir(self.card))

    def _wait_answering(self, patience: float = 10.0) -> None:
        deadline = time.monotonic() + patience
        assert self.proc is not None  # start made it just before
        while True:
            if self.proc.poll() is not None:
                raise nvml.DeviceError(f"{self.control} -f exited {self.proc.returncode}")
            try:
                self.command(PROBE)
                return
            except nvml.DeviceError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _failed(self, problem: str) -> None:
        self._kill()
        self.problem = problem
        self._next_start = time.monotonic() + self._delay
        log.error("gpushard: card %d (%s): %s; trying again in %.0f s", self.card.index, self.card.uuid, problem,
                  self._delay)
        self._delay = min(self._delay * 2, self.backoff_max)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def check(self) -> None:
        """Notice a dead or deaf daemon, and start it again once its backoff has passed."""
        if self.problem is None:
            assert self.proc is not None  # no problem: a daemon was started
            if self.proc.poll() is not None:
                self._failed(f"MPS control daemon exited with status {self.proc.returncode}")
            else:
                try:
                    self.command(PROBE)
                except nvml.DeviceError as exc:
                    self._failed(f"MPS control daemon does not answer: {exc}")
                else:
                    self._delay = self.backoff_min  # a daemon that keeps answering earns a quick restart
            return
        if time.monotonic() >= self._next_start:
            self.restarts += 1
            self.start()

    def stop(self, grace: float = 10.0) -> None:
        """Ask the daemon to quit (it ends its servers), then restore the card's compute mode."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.command("quit")
                self.proc.wait(timeout=grace)
            except (nvml.DeviceError, subprocess.TimeoutExpired) as exc:
                log.warning("gpushard: card %d: MPS daemon did not quit (%s); killing it", self.card.index, exc)
        self._kill()
        self.problem = "stopped"
        self.restore_mode()


class Supervisor:
    """Every card's daemon, their checks, and their health on the board."""

    def __init__(self, devices: nvml.Devices, cards: list[nvml.Card], board: health.Board,
                 root: containerlimits.MpsRoot, on_change: Callable[[], None] | None = None, interval: float = 5.0,
                 **daemon_options) -> None:
        self.board = board
        self.on_change = on_change
        self.interval = interval
        self.daemons = {c.index: CardDaemon(devices, c, root, **daemon_options) for c in cards}
        self._lock = threading.Lock()

    def _report(self) -> None:
        changed = False
        for index, daemon in self.daemons.items():
            changed |= self.board.hold(index, daemon.problem)
        if changed and self.on_change is not None:
            self.on_change()

    def start(self) -> None:
        with self._lock:
            for daemon in self.daemons.values():
                daemon.start()
            self._report()

    def check_once(self) -> None:
        with self._lock:
            for daemon in self.daemons.values():
                daemon.check()
            self._report()

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                self.check_once()
            except Exception:  # one bad check must not end the supervision of every card
                log.exception("gpushard: checking the MPS daemons failed")

    def stop(self) -> None:
        with self._lock:
            for daemon in self.daemons.values():
                daemon.stop()

    def states(self) -> dict[int, dict[str, object]]:
        """Per card index: whether its daemon runs, and if not why (for the Node's inventory)."""
        with self._lock:
            return {index: ({"running": True} if d.problem is None else {"running": False, "problem": d.problem})
                    for index, d in self.daemons.items()}
