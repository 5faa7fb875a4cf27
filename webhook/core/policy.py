"""The policy knobs the core decides by: share count, resource names, and the four choices."""

from __future__ import annotations

from dataclasses import dataclass, field

from webhook.core import names

WHOLE_CARDS = ("share", "passthrough")
MULTI_CARD = ("deny", "passthrough")
PLACEMENTS = ("binpack", "spread")
# How the chosen node reaches the scheduler: a preferred term, or also a required one, or not at all.
# "none": the card alone (the scheduler picks the node; under backend dra, no node hint at all).
# Under backend dra "required" acts as "preferred": the scheduler alone keeps the card, so it must stay
# free to bind the pod elsewhere when the hinted node fills.
NODE_AFFINITIES = ("preferred", "required", "none")
# How the card-k device plugin names its card to the container runtime (NVIDIA's plugin's words).
ENVVAR = "envvar"
VOLUME_MOUNTS = "volume-mounts"
CDI_CRI = "cdi-cri"
DEVICE_LIST_STRATEGIES = (ENVVAR, VOLUME_MOUNTS, CDI_CRI)
# Works unchanged on a node with the toolkit's defaults (it reads the env) and on a hardened
# node (it reads the mounts first and ignores the env); CDI needs a spec on the node.
DEFAULT_DEVICE_LIST_STRATEGY = (ENVVAR, VOLUME_MOUNTS)
ISOLATIONS = ("none", "memory", "mps")
# Who keeps a card's shares: one device plugin per card (the webhook pins the card), or DRA with
# consumable capacity (Kubernetes 1.36+; the scheduler picks the card from a claim): docs/dra.md.
DEVICEPLUGIN = "deviceplugin"
DRA = "dra"
BACKENDS = (DEVICEPLUGIN, DRA)
# Which card size a memory ask tries first: the smallest that holds it (large cards stay free for
# large asks) or the largest (the most room left beside it).
MEMORY_SIZES = ("smallest", "largest")


@dataclass(frozen=True)
class Resources:
    fraction: str = names.FRACTION_RESOURCE
    shares: str = names.SHARES_RESOURCE
    card_prefix: str = names.CARD_PREFIX
    memory: str = names.MEMORY_RESOURCE
    # The three names above, for one set lookup per resource name when reading a container.
    gpu_names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_names", frozenset((self.fraction, self.shares, self.memory)))

    def card(self, index: int) -> str:
        return names.card_resource(self.card_prefix, index)

    def card_index(self, resource: object) -> int | None:
        """The card index named by a per-card resource, or None if it is not one."""
        if not isinstance(resource, str) or not resource.startswith(self.card_prefix):
            return None
        tail = resource[len(self.card_prefix):]
        # ASCII digits only ("³" is a digit to str.isdigit), and few of them: no card index is huge.
        if not (tail.isascii() and tail.isdigit()) or len(tail) > 9 or (len(tail) > 1 and tail.startswith("0")):
            return None
        return int(tail)


@dataclass(frozen=True)
class Exempt:
    """What an operator trusts with host access in enforce namespaces (default: nothing)."""

    service_accounts: frozenset[str] = frozenset()  # "namespace/name"
    namespaces: frozenset[str] = frozenset()
    # Host paths (and what lies below them) any pod of an enforce namespace may mount; never one
    # that reaches the folders of names.HOST_DEVICE_PATHS.
    host_paths: tuple[str, ...] = ()

    def covers(self, namespace: str, service_account: str) -> bool:
        return namespace in self.namespaces or f"{namespace}/{service_account}" in self.service_accounts


@dataclass(frozen=True)
class Policy:
    shares_per_card: int = 100
    resources: Resources = field(default_factory=Resources)
    whole_cards: str = "share"
    multi_card: str = "deny"
    placement: str = "binpack"
    # "required" also requires the chosen node, for schedulers that may leave it unscored
    # (kube-scheduler's node sampling in clusters of more than 100 nodes): docs/placement.md.
    node_affinity: str = "preferred"
    hide_unrequested_gpus: bool = True
    exempt: Exempt = field(default_factory=Exempt)
    device_list_strategy: tuple[str, ...] = DEFAULT_DEVICE_LIST_STRATEGY
    isolation: str = "none"  # none | memory | mps: what each container's fraction is held to
    # Set on pods that hold shares when their author named none: the runtime class whose
    # handler is the NVIDIA container runtime, where it is not the node's default runtime.
    runtime_class_name: str | None = None
    backend: str = DEVICEPLUGIN  # deviceplugin | dra
    memory_size: str = "smallest"  # MEMORY_SIZES: the card size a memory ask tries first
    # The cards of a node an autoscaler adds to the pool (0: none is added). A pod that fits nowhere then waits
    # on one of those card indexes, chosen so that the waiting pods fit on as few new nodes as a packing needs;
    # it is also what a pod waits on while no shared node exists yet (docs/autoscaling.md).
    new_node_cards: int = 0
    # The memory in MiB of each card of such a node, as its agent will publish it (label
    # gpushard.io/card-<k>.memory-mib): what a memory ask is sized for when no card has room now (0: unknown).
    new_node_card_memory_mib: int = 0
