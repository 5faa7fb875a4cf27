"""What the rules find in an object: denials, warnings and would-be changes, by rule id."""

from __future__ import annotations

from dataclasses import dataclass

DENY = "deny"
WARN = "warn"
CHANGE = "change"
# What gpushard decided, for the record: an audit annotation (the decision is on the object itself),
# never an admission warning. Warnings are for what needs the author's attention: kubectl prints
# them, --warnings-as-errors fails on them, and controllers log one for every pod they create.
NOTE = "note"

# Rule ids: stable, short, used as audit-annotation keys and in `gpushard audit`.
BAD_QUANTITY = "bad-quantity"
FRACTION_ABOVE_ONE = "fraction-above-one"
MULTI_CARD = "multi-card"
BOTH_FORMS = "both-forms"
REQUESTS_DIFFER = "requests-differ"
BAD_SHARES = "bad-shares"
CONFLICTING_PINS = "conflicting-pins"
BAD_CARD = "bad-card"
PIN_MISMATCH = "pin-mismatch"
POD_OVER_CARD = "pod-over-card"
MIXED_PASSTHROUGH = "mixed-passthrough"
UNREADABLE = "unreadable"
ROUNDED = "rounded"
VISIBLE_DEVICES_SET = "visible-devices-set"
UNHIDDEN = "unhidden"
FRACTION_UNREWRITTEN = "fraction-unrewritten"
NO_ROOM = "no-room"
NO_VIEW = "no-view"
NO_MATCHING_NODE = "no-matching-node"
# Memory asks (gpushard.io/memory): mixed with a fraction or shares; above every card's memory.
MIXED_MEMORY = "mixed-memory"
MEMORY_ABOVE_CARD = "memory-above-card"
MEMORY_SIZED = "memory-sized"  # what a memory ask became: shares of a card of some size (a note, for the record)
# Host access around the device plugin (core/hostaccess.py).
PRIVILEGED = "privileged"
ADDED_CAPABILITIES = "added-capabilities"
HOST_PID = "host-pid"
HOST_PATH = "host-path"
DEVICE_LIST_MOUNT = "device-list-mount"
DEVICE_ANNOTATION = "device-annotation"
VISIBLE_DEVICES_FROM = "visible-devices-from"
LIMIT_ENV_SET = "limit-env-set"
LIMIT_ENV_FROM = "limit-env-from"
# A DeviceClass of another driver that serves an extended resource (DRAExtendedResource, core/extended.py):
# one gpushard writes (denied), or the fraction name users write (warned).
EXTENDED_RESOURCE_TAKEN = "extended-resource-taken"
EXTENDED_RESOURCE_SHARED = "extended-resource-shared"

# What a user can do about each rule, for audit tables.
FIXES = {
    BAD_QUANTITY: "write a number such as 0.25, 250m or 1",
    FRACTION_ABOVE_ONE: "ask 1 whole card, or a fraction below 1",
    MULTI_CARD: "ask at most 1 card per pod, or run on a whole-GPU node pool",
    BOTH_FORMS: "use either the fraction or the shares resource, not both",
    REQUESTS_DIFFER: "set the same GPU value in requests and limits",
    BAD_SHARES: "ask a whole number of shares between 1 and sharesPerCard",
    BAD_CARD: "name a card as gpushard.io/card-<index>, e.g. gpushard.io/card-1, or leave the choice to gpushard",
    CONFLICTING_PINS: "pin every container of the pod to the same card, or to none",
    PIN_MISMATCH: "give the card resource the same number as the shares resource",
    POD_OVER_CARD: "lower the containers' GPU asks so the pod fits on one card",
    MIXED_PASSTHROUGH: "do not mix whole-card passthrough and fractional containers in one pod",
    UNREADABLE: "fix the object so that its containers and resources are well formed",
    ROUNDED: "ask a fraction that is a whole number of shares",
    VISIBLE_DEVICES_SET: "remove NVIDIA_VISIBLE_DEVICES from the container; gpushard owns it",
    UNHIDDEN: "opt the namespace in with gpushard.io/mode=enforce so GPU-less containers are hidden",
    FRACTION_UNREWRITTEN: "opt the namespace in with gpushard.io/mode=enforce, or ask a whole card",
    NO_ROOM: "wait for a card to free up, or ask for fewer shares",
    NO_VIEW: "check that the webhook can reach the Kubernetes API",
    NO_MATCHING_NODE: "check the pod's node selector, affinity and tolerations",
    MIXED_MEMORY: "ask GPU memory or a fraction (or shares) in a pod, not both",
    MEMORY_ABOVE_CARD: "ask at most the memory of the largest card",
    MEMORY_SIZED: "nothing to do: it says which card size the memory ask was sized for",
    PRIVILEGED: "drop privileged: true, or exempt the service account in policy.exempt",
    ADDED_CAPABILITIES: "drop SYS_ADMIN and ALL from capabilities.add, or exempt the service account",
    HOST_PID: "drop hostPID: true, or exempt the service account in policy.exempt",
    HOST_PATH: "use no hostPath of /dev, the kubelet's folders or the toolkit's device-list folder",
    DEVICE_LIST_MOUNT: "mount nothing under /var/run/nvidia-container-devices; the device plugin does",
    DEVICE_ANNOTATION: "remove the device or mount annotation; GPUs come from the device plugin",
    VISIBLE_DEVICES_FROM: "give the envFrom a prefix, or drop it, so it cannot set NVIDIA_VISIBLE_DEVICES",
    LIMIT_ENV_SET: "remove NVIDIA_GPU_MEMORY_* and CUDA_MPS_* from GPU containers; the device plugin sets them",
    LIMIT_ENV_FROM: "give the envFrom a prefix (e.g. APP_) so it cannot set NVIDIA_GPU_MEMORY_* or CUDA_MPS_*",
    EXTENDED_RESOURCE_TAKEN: "remove extendedResourceName from that DeviceClass, or give gpushard other resource names "
                             "in its config (resources)",
    EXTENDED_RESOURCE_SHARED: "keep that DeviceClass's driver off gpushard's nodes; fractions stay gpushard's, whole "
                              "cards passed through may go to it",
}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    message: str
    container: str | None = None

    @property
    def fix(self) -> str:
        return FIXES.get(self.rule, "")


class ObjectError(ValueError):
    """An object whose shape gpushard cannot read (answered with HTTP 400 semantics)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"gpushard: cannot read {field}: {problem}")
        self.field = field
