"""What a fraction is held to: the limit arithmetic, and keeping authors from raising their own limits."""

from __future__ import annotations

from typing import TypeGuard, cast

from webhook.core import asks as req
from webhook.core import findings as f
from webhook.core import names
from webhook.core.policy import Policy

NONE = "none"
MEMORY = "memory"
MPS = "mps"

# Kubernetes puts a container's envFrom first and its env after it, and the kubelet passes the device
# plugin's env before both; the NVIDIA toolkit and the CUDA driver act on the last value. So any
# author-written limit variable beats the plugin's, and the webhook must own these names.


def memory_cap_mib(shares: int, card_mib: int, shares_per_card: int) -> int:
    """A container's memory cap: its shares of that card's memory, floored to whole MiB."""
    return shares * card_mib // shares_per_card


def thread_percentage(shares: int, shares_per_card: int) -> int:
    """A container's MPS active-thread percentage: its share of the SMs, floored, and at least 1."""
    return max(1, shares * 100 // shares_per_card)


def guarded(name: object) -> TypeGuard[str]:
    """Whether an env name is one the plugin owns in a GPU container."""
    return isinstance(name, str) and name.startswith(names.LIMIT_ENV_PREFIXES)


def _reaches_guarded(prefix: str) -> bool:
    # prefix + key is guarded for some key when the prefix is the start of a guarded prefix, or extends one.
    return any(p.startswith(prefix) or prefix.startswith(p) for p in names.LIMIT_ENV_PREFIXES)


def _source(entry: dict) -> str:
    for key, kind in (("configMapRef", "configMap"), ("secretRef", "secret")):
        ref = entry.get(key)
        if isinstance(ref, dict):
            return f"{kind} \"{ref.get('name', '')}\""
    return "a source"


def env_findings(spec: dict, asks: list[req.ContainerAsk], mode: str, policy: Policy) -> list[f.Finding]:
    """Limit variables an author wrote in GPU containers (removed), and envFrom that could write them.

    Each named variable is removed whatever the isolation mode: a memory request written by hand
    would reserve memory on a node whose toolkit applies it. An envFrom cannot be edited name by
    name, so with isolation on, one whose prefix could produce such a name is denied.
    """
    found: list[f.Finding] = []
    verb = "removed" if mode == names.MODE_ENFORCE else "would remove"
    for ask in asks:
        if not ask.holds_share:
            continue
        container = spec[ask.list_key][ask.position]
        env = container.get("env")
        written: set[str] | None = None
        if isinstance(env, list):
            # A loop, not a comprehension: env lists are short, and a comprehension is a call.
            for e in env:
                if isinstance(e, dict) and guarded(name := e.get("name")):
                    if written is None:
                        written = {name}
                    else:
                        written.add(name)
        if written:
            listed = sorted(written)
            shown = ", ".join(listed[:3]) + (", ..." if len(listed) > 3 else "")
            found.append(f.Finding(f.LIMIT_ENV_SET, f.WARN, (
                f"gpushard: container \"{ask.name}\" sets {shown}; {verb}: the device plugin sets GPU limits"),
                ask.name))
        sources = container.get("envFrom")
        if policy.isolation == NONE or not isinstance(sources, list):
            continue
        for entry in sources:
            if not isinstance(entry, dict):
                continue
            prefix = cast(str, entry.get("prefix") if isinstance(entry.get("prefix"), str) else "")
            if _reaches_guarded(prefix):
                said = f"prefix \"{prefix}\"" if prefix else "no prefix"
                found.append(f.Finding(f.LIMIT_ENV_FROM, f.DENY, (
                    f"gpushard: container \"{ask.name}\" takes env from {_source(entry)} with {said}, which "
                    "could set NVIDIA_GPU_MEMORY_* or CUDA_MPS_* over its GPU limits; give it a prefix such as "
                    "APP_"), ask.name))
                break
    return found


def strip_env(obj: dict, asks: list[req.ContainerAsk]) -> dict:
    """The pod without author-written limit variables in its GPU containers; the input is not touched."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return obj
    new, new_spec = obj, None
    for ask in asks:
        if not ask.holds_share:
            continue
        container = spec[ask.list_key][ask.position]
        env = container.get("env")
        if not isinstance(env, list) or not any(isinstance(e, dict) and guarded(e.get("name")) for e in env):
            continue
        if new_spec is None:
            new_spec = dict(spec)
            new = {**obj, "spec": new_spec}
        if new_spec[ask.list_key] is spec[ask.list_key]:
            new_spec[ask.list_key] = list(spec[ask.list_key])
        new_spec[ask.list_key][ask.position] = {
            **container, "env": [e for e in env if not (isinstance(e, dict) and guarded(e.get("name")))]}
    return new
