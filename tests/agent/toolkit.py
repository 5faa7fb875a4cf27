"""What a container sees on a node, worked out as the kubelet and NVIDIA's container toolkit do it.

The rules restated from their sources, for `make test`, where no runtime runs. `make e2e` holds them
against the real nvidia-container-runtime (v1.20.2, its cdi mode) on containerd 1.6 and 2.4: for every
device-list strategy, with the toolkit hardened and at its defaults, the cards each container holds are what
this model predicts (tests/runtime/test_nvidia.py). Not modelled: the toolkit takes devices from
``cdi.k8s.io/`` annotations before everything else, which no gpushard strategy uses.
- The kubelet: the env of every device-plugin allocation first, then the container's own env;
  the runtime keeps the last value of a name (the image's env comes before both). Mounts and
  CDI devices of every allocation are added as they are.
- NVIDIA's container toolkit (nvidia-container-toolkit internal/config/image/cuda_image.go,
  CUDA.VisibleDevices): device requests from mounts of /dev/null under
  /var/run/nvidia-container-devices/ first, when accept-nvidia-visible-devices-as-volume-mounts
  is on; otherwise NVIDIA_VISIBLE_DEVICES, honoured only for privileged containers or when
  accept-nvidia-visible-devices-envvar-when-unprivileged is on (its default); "void", "none" and
  an empty value name nothing, "all" every card.
- CDI devices named by the CRI field are injected by the runtime itself (containerd 2, CRI-O), after the
  env: NVIDIA's spec (`nvidia-ctk cdi generate`) sets NVIDIA_VISIBLE_DEVICES=void for every container given
  one of its devices, which replaces the container's value. A runtime without CDI (containerd 1.6; 1.7 with
  enable_cdi off) drops the names without a word, and a node without NVIDIA's hook (a CDI-only node) leaves
  the env and the mounts as data. Both seen in running containers (tests/runtime, docs/e2e.md).
- The toolkit's apply-cuda-memory-limits CDI hook (cmd/nvidia-cdi-hook/apply-cuda-memory-limits):
  its first revision (commit 5ab636a2) reads NVIDIA_GPU_MEMORY_REQUESTS/_LIMITS and falls back to
  the singular names; later revisions (e.g. 064024a7) read only NVIDIA_GPU_MEMORY_REQUEST/_LIMIT.
  Both want both values, as decimal whole MiB, request <= limit, and do nothing when one is missing.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

ROOT = "/var/run/nvidia-container-devices"


@dataclass(frozen=True)
class Node:
    """The toolkit's two settings that decide whose word counts."""

    accept_envvar_unprivileged: bool = True  # the toolkit's default
    accept_volume_mounts: bool = False  # the toolkit's default
    cdi_kind: str = "nvidia.com/gpu"
    hook: bool = True  # NVIDIA's runtime hook acts on the env and the mounts
    runtime_cdi: bool = True  # the runtime injects CDI devices


DEFAULT_NODE = Node()
HARDENED_NODE = Node(accept_envvar_unprivileged=False, accept_volume_mounts=True)
CDI_ONLY_NODE = Node(hook=False)  # containerd 2 with NVIDIA's CDI spec and no hook (GPU Operator 26's CDI path)
NO_CDI_NODE = Node(runtime_cdi=False)  # the hook on containerd 1.6, or 1.7 with enable_cdi off


@dataclass
class Container:
    """What the runtime is asked to create: env in order, mounts (host, container), CDI names."""

    env: list[tuple[str, str]]
    mounts: list[tuple[str, str]]
    cdi_devices: list[str]
    privileged: bool = False


def container(allocations, own_env: dict[str, str] | None = None, image_env: dict[str, str] | None = None,
              privileged: bool = False) -> Container:
    """The container the kubelet asks for, from Allocate's ContainerAllocateResponses (protobuf messages)."""
    env = list((image_env or {}).items())
    mounts, cdi = [], []
    for response in allocations:
        env += sorted(response.envs.items())
        mounts += [(m.host_path, m.container_path) for m in response.mounts]
        cdi += [d.name for d in response.cdi_devices]
    env += list((own_env or {}).items())
    return Container(env, mounts, cdi, privileged)


def _from_mounts(mounts: list[tuple[str, str]]) -> list[str]:
    found = []
    for host, path in mounts:
        path = posixpath.normpath(path)
        if posixpath.normpath(host) == "/dev/null" and path.startswith(ROOT + "/"):
            found.append(path[len(ROOT) + 1:])
    return found


def _last_env(env: list[tuple[str, str]], name: str) -> str | None:
    value = None
    for key, text in env:
        if key == name:
            value = text
    return value


def requested(c: Container, node: Node) -> list[str]:
    """The device names the toolkit acts on for this container (before resolving them to cards)."""
    if node.accept_volume_mounts:
        from_mounts = _from_mounts(c.mounts)
        if from_mounts:
            return from_mounts
    value = _last_env(c.env, "NVIDIA_VISIBLE_DEVICES")
    if value is None:
        return []
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names or "void" in names or "none" in names:
        return []
    return names if (c.privileged or node.accept_envvar_unprivileged) else []


def visible_cards(c: Container, node: Node, cards: list[tuple[int, str]]) -> set[str]:
    """UUIDs of the cards the container sees; ``cards`` is the node's (index, uuid) list."""
    by_name = {str(i): uuid for i, uuid in cards} | {uuid: uuid for _, uuid in cards}
    seen = set()
    injected = c.cdi_devices if node.runtime_cdi else []
    if any(name.startswith(node.cdi_kind + "=") for name in injected):
        c = Container(c.env + [("NVIDIA_VISIBLE_DEVICES", "void")], c.mounts, c.cdi_devices, c.privileged)
    for name in requested(c, node) if node.hook else []:
        if name == "all":
            seen |= {uuid for _, uuid in cards}
        elif name in by_name:
            seen.add(by_name[name])
        else:
            raise ValueError(f"the toolkit fails the container: unknown device {name!r}")
    prefix = node.cdi_kind + "="
    for name in injected:
        if not name.startswith(prefix) or name[len(prefix):] not in by_name:
            raise ValueError(f"the runtime fails the container: unresolvable CDI device {name!r}")
        seen.add(by_name[name[len(prefix):]])
    return seen


PLURAL_FIRST = "plural-first"  # the hook's first revision
SINGULAR = "singular"  # later revisions
HOOK_REVISIONS = (PLURAL_FIRST, SINGULAR)


def memory_limits(c: Container, revision: str) -> tuple[int, int] | None:
    """(request, limit) in MiB that the toolkit's memory hook applies to the container, or None."""
    def read(singular: str) -> str | None:
        if revision == PLURAL_FIRST:
            plural = _last_env(c.env, singular + "S")
            if plural is not None:
                return plural
        return _last_env(c.env, singular)

    request, limit = read("NVIDIA_GPU_MEMORY_REQUEST"), read("NVIDIA_GPU_MEMORY_LIMIT")
    if request is None or limit is None:
        return None
    if not (request.isdigit() and limit.isdigit()) or int(request) > int(limit):
        raise ValueError(f"the hook fails the container: request {request!r}, limit {limit!r}")
    return int(request), int(limit)
