"""A stand-in `nvidia-cuda-mps-control` for tests: it records every call and can be told to fail or die.

`-f` runs a "daemon" in the foreground that writes its pid where the real one does
(nvidia-cuda-mps-control.pid in CUDA_MPS_PIPE_DIRECTORY); without flags it reads one command
from standard input, answers it only while that daemon lives, and ends the daemon on `quit`.
Every call is appended as a JSON line to $MPS_STANDIN_LOG. While the file `fail-start` sits next
to that log, `-f` exits 1 at once.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import sys

SCRIPT = r'''
import json, os, signal, sys, time
log = os.environ["MPS_STANDIN_LOG"]
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
pidfile = os.path.join(pipe, "nvidia-cuda-mps-control.pid")

def record(what):
    with open(log, "a") as out:
        out.write(json.dumps({"call": what, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "pipe": pipe,
                              "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY"), "pid": os.getpid()}) + "\n")

if sys.argv[1:] == ["-f"]:
    record("-f")
    if os.path.exists(os.path.join(os.path.dirname(log), "fail-start")):
        sys.exit(1)
    with open(pidfile, "w") as out:
        out.write(str(os.getpid()))

    def quit(*_):
        os.unlink(pidfile)
        sys.exit(0)

    signal.signal(signal.SIGTERM, quit)
    while True:
        time.sleep(1)  # the stand-in daemon's own life, not a wait: it runs until it is told to quit or killed
else:
    line = sys.stdin.read().strip()
    record(line)
    try:
        pid = int(open(pidfile).read())
        os.kill(pid, 0)
    except (OSError, ValueError):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    if line == "quit":
        os.kill(pid, signal.SIGTERM)
    elif line == "get_default_active_thread_percentage":
        print("100.0")
'''


def install(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Write the stand-in into ``folder``/bin; (the bin folder to put first on PATH, the call log)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-cuda-mps-control"
    path.write_text(f"#!{sys.executable}\n{SCRIPT}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir, folder / "calls.jsonl"


def calls(log: pathlib.Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def daemon_pid(pipe_dir: str) -> int:
    return int((pathlib.Path(pipe_dir) / "nvidia-cuda-mps-control.pid").read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
