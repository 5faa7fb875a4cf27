"""Whether a node's container runtime applies CDI devices, read from the runtime version its Node reports.

Under ``backend: dra`` a pod's card reaches its containers only as CDI devices: the kubelet hands the
runtime the names the agent prepared (``nvidia.com/gpu=<uuid>`` and gpushard's own edits), and the
runtime resolves them from its spec folders. A runtime without CDI drops those names without a word and
starts the container with no card (seen on containerd 1.6 under a real kubelet). So a node whose runtime
does not apply CDI must take no DRA claim.

What is known, from the runtimes' sources (docs/dra.md, "The container runtime"):
- containerd 1.6 and older: no CDI at all; its CRI API has no CDI field.
- containerd 1.7: CDI only with ``enable_cdi = true`` in its CRI plugin (off by default), which nothing
  outside the node can see; an operator who turned it on says so (``agent.runtimeCDI: true``).
- containerd 2.0 and later: CDI on by default.
Any other runtime: gpushard cannot tell, and says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AUTO = "auto"
DECLARED = (AUTO, "true", "false")
_VERSION = re.compile(r"^([A-Za-z0-9_.-]+)://v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class CdiSupport:
    """The verdict: ``applies`` True, False, or None (cannot tell), with the sentence that says why."""

    runtime: str
    applies: bool | None
    reason: str


def parse(runtime_version: str) -> tuple[str, tuple[int, int, int]] | None:
    """("containerd", (1, 6, 20)) from a Node's ``containerRuntimeVersion`` ("containerd://1.6.20~ds1"), or None."""
    match = _VERSION.match(runtime_version or "")
    if not match:
        return None
    return match[1].lower(), (int(match[2]), int(match[3]), int(match[4] or 0))


def cdi_support(runtime_version: str, declared: str = AUTO) -> CdiSupport:
    """Whether the runtime named by ``runtime_version`` applies CDI devices; ``declared`` is the operator's word."""
    runtime = runtime_version or "unknown"
    if declared == "true":
        return CdiSupport(runtime, True, f"agent.runtimeCDI is true: {runtime} is taken to apply CDI devices")
    if declared == "false":
        return CdiSupport(runtime, False, f"agent.runtimeCDI is false: {runtime} is taken not to apply CDI "
                                          "devices, so this node's cards take no DRA claim")
    parsed = parse(runtime_version)
    if parsed is None:
        return CdiSupport(runtime, None, f"the node reports no container runtime version gpushard can read "
                                         f"({runtime!r}); whether it applies CDI devices is not known")
    name, version = parsed
    if name != "containerd":
        return CdiSupport(runtime, None, f"gpushard cannot tell whether {runtime} applies CDI devices; a runtime "
                                         "that does not starts DRA pods without their card (set "
                                         "agent.runtimeCDI to true or false to say which)")
    if version < (1, 7, 0):
        return CdiSupport(runtime, False, f"{runtime} has no CDI: it would start DRA pods without their card, so "
                                          "this node's cards take no DRA claim (containerd 2.0 or later applies "
                                          "CDI by default)")
    if version < (2, 0, 0):
        return CdiSupport(runtime, False, f"{runtime} applies CDI devices only with enable_cdi = true in its CRI "
                                          "plugin (off by default), so this node's cards take no DRA claim; with "
                                          "it on, set agent.runtimeCDI: true")
    return CdiSupport(runtime, True, f"{runtime} applies CDI devices (on by default since containerd 2.0)")
