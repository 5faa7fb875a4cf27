"""gpushard's own CDI spec files, one per prepared claim: the claim's limits as container edits.

The container runtime reads every spec in its CDI folders (/etc/cdi, /var/run/cdi) when it
creates a container and applies the edits of each device the kubelet names. The card itself is
named by the node's NVIDIA spec (nvidia.com/gpu=<uuid>); this file only adds what gpushard owns.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from webhook.agent.node import allocation
from webhook.core import names

DEFAULT_DIR = "/var/run/cdi"
# Spec versions only get added to; 0.6.0 is the oldest that every runtime with DRA support reads.
CDI_VERSION = "0.6.0"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


class CdiError(ValueError):
    """A CDI device gpushard could not describe."""


@dataclass(frozen=True)
class Device:
    """One CDI device of gpushard's kind: its name and the edits it makes."""

    name: str
    answer: allocation.Allocation


def qualified(name: str, kind: str = names.DRA_CDI_KIND) -> str:
    """The fully qualified CDI device name the kubelet hands the runtime: vendor.com/class=name."""
    return f"{kind}={name}"


def _edits(answer: allocation.Allocation) -> dict:
    edits: dict = {}
    if answer.envs:
        edits["env"] = [f"{k}={v}" for k, v in sorted(answer.envs.items())]
    if answer.mounts:
        edits["mounts"] = [{"hostPath": m.host_path, "containerPath": m.container_path,
                            "options": ["rbind", "ro" if m.read_only else "rw"]} for m in answer.mounts]
    return edits


def spec(devices: Iterable[Device], kind: str = names.DRA_CDI_KIND) -> dict:
    """A CDI spec of ``kind`` listing ``devices``; CdiError for a name CDI would refuse or empty edits."""
    listed = []
    for device in devices:
        if not _NAME.match(device.name):
            raise CdiError(f"gpushard: {device.name!r} is not a CDI device name")
        edits = _edits(device.answer)
        if not edits:
            # The CDI parser rejects a device with no edits, which would fail the whole spec.
            raise CdiError(f"gpushard: CDI device {device.name!r} has no edits")
        listed.append({"name": device.name, "containerEdits": edits})
    return {"cdiVersion": CDI_VERSION, "kind": kind, "devices": listed}


def spec_path(directory: str, claim_uid: str, kind: str = names.DRA_CDI_KIND) -> str:
    """The claim's spec file: named for the kind and claim, as the CDI tooling names transient specs."""
    vendor, _, klass = kind.partition("/")
    return os.path.join(directory, f"{vendor}-{klass}_{claim_uid}.json")


def write(directory: str, claim_uid: str, content: Mapping) -> str:
    """Write the claim's spec atomically (a runtime never reads half a file); the path written."""
    path = spec_path(directory, claim_uid)
    write_json(path, content, indent=1, mode=0o644)
    return path


def write_json(path: str, content: Mapping, indent: int | None = None, mode: int | None = None) -> None:
    """Write ``content`` as JSON to ``path`` atomically and durably: a reader (a runtime, the agent
    after a crash) sees the old file or the whole new one, never half of it."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".gpushard-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(content, out, indent=indent, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def remove(directory: str, claim_uid: str) -> bool:
    """Remove the claim's spec; False when there was none (unprepare may come twice)."""
    try:
        os.unlink(spec_path(directory, claim_uid))
    except FileNotFoundError:
        return False
    return True
