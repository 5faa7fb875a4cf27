"""Every label, annotation, resource and environment name gpushard reads or writes."""

# Resource names (defaults; the config file may rename the three resources).
FRACTION_RESOURCE = "nvidia.com/gpu"
SHARES_RESOURCE = "gpushard.io/gpu"
CARD_PREFIX = "gpushard.io/card-"
# A container's GPU memory ask (a quantity of bytes, as for memory: 12Gi).
MEMORY_RESOURCE = "gpushard.io/memory"

DOMAIN = "gpushard.io"

# Namespace opt-in.
MODE_LABEL = "gpushard.io/mode"
MODE_ENFORCE = "enforce"
MODE_AUDIT = "audit"
MODES = (MODE_ENFORCE, MODE_AUDIT)

# What gpushard writes on a pod.
CARD_ANNOTATION = "gpushard.io/card"
SHARES_ANNOTATION = "gpushard.io/shares"
SHARED_LABEL = "gpushard.io/shared"
SHARED_LABEL_VALUE = "true"
# On a pod placed by its memory ask: the MiB it asked (counted as Kubernetes counts requests), and the
# memory in MiB of the card size its shares were computed for (its card has that size).
MEMORY_ANNOTATION = "gpushard.io/memory-mib"
CARD_MEMORY_ANNOTATION = "gpushard.io/card-memory-mib"

# What the agent writes on its Node.
INVENTORY_ANNOTATION = "gpushard.io/inventory"
# The key of each card's inventory entry that says what the node's NVIDIA container toolkit does with an
# unprivileged container's NVIDIA_VISIBLE_DEVICES, as the agent read it (webhook/agent/node/toolkitcheck.py).
INVENTORY_TOOLKIT = "toolkit"
CARDS_LABEL = "gpushard.io/cards"
# Each card's memory in MiB (NVML's total), one label per card: gpushard.io/card-3.memory-mib=81559.
# A label key's name part is at most 63 characters of [A-Za-z0-9._-] and a value at most 63
# alphanumerics, so a per-card key with the size as its value fits; a required node affinity on
# it keeps a pod sized for one card size off a smaller card with the same index.
CARD_MEMORY_LABEL_PREFIX = "gpushard.io/card-"
CARD_MEMORY_LABEL_SUFFIX = ".memory-mib"

# What an operator writes on a Node (`gpushard cordon NODE CARD`; never the agent): card <k> takes no new
# pod, while pods on it keep it. One annotation per card, gpushard.io/card-<k>.cordoned, so that cordons
# of different cards are different keys: two operators cordoning cards 1 and 3 at once each merge-patch
# their own key, where one list ("1,3") would need a read, a change and a write that can lose the other's.
# Its value is JSON {"reason": ..., "by": ..., "at": ...}; any value at all, even one that is no JSON,
# cordons the card (the strict reading of what an operator wrote by hand).
CARD_CORDON_ANNOTATION_PREFIX = "gpushard.io/card-"
CARD_CORDON_ANNOTATION_SUFFIX = ".cordoned"
# The Events `gpushard cordon` and `gpushard uncordon` record on the Node: reasons and source.
CORDONED_REASON = "GpushardCardCordoned"
UNCORDONED_REASON = "GpushardCardUncordoned"
CORDON_COMPONENT = "gpushard-cordon"

# Container environment.
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
FRACTION_ENV = "GPUSHARD_FRACTION"
VISIBLE_NONE = "void"

# Where NVIDIA's container toolkit reads a device list from mounts of /dev/null, and the CDI
# kind its `nvidia-ctk cdi generate` names the cards by (nvidia.com/gpu=<uuid>).
DEVICE_LIST_MOUNT_ROOT = "/var/run/nvidia-container-devices"
DEVICE_LIST_MOUNT_SOURCE = "/dev/null"
NVIDIA_CDI_KIND = "nvidia.com/gpu"

# Host folders that reach cards around the device plugin, or what starts containers: device
# nodes, /proc and /sys (other processes' devices, the driver's controls), the kubelet's folders
# (device-plugin and pod-resources sockets), the container runtimes' sockets and state, NRI's
# socket, CDI specs, the NVIDIA toolkit's and driver's folders, the toolkit's device-list folder,
# and gpushard's own MPS folders. An enforce namespace mounts no host path at all unless the
# operator allows it (policy.exempt.hostPaths), and never one at, under or above these.
HOST_DEVICE_PATHS = ("/dev", "/proc", "/sys", "/var/lib/kubelet", "/etc/kubernetes",
                     DEVICE_LIST_MOUNT_ROOT, "/run/nvidia-container-devices",
                     "/run/containerd", "/var/run/containerd", "/var/lib/containerd", "/run/crio", "/var/run/crio",
                     "/var/lib/containers", "/run/docker.sock", "/var/run/docker.sock", "/var/lib/docker",
                     "/run/nri", "/var/run/nri", "/etc/cdi", "/run/cdi", "/var/run/cdi",
                     "/etc/nvidia-container-runtime", "/etc/nvidia-container-toolkit", "/usr/local/nvidia",
                     "/run/nvidia", "/var/run/nvidia", "/run/gpushard", "/var/run/gpushard")
# Mount paths under which NVIDIA's toolkit reads a device list (it matches the bare prefix, so
# ".../nvidia-container-devicesall" counts too).
DEVICE_LIST_MOUNT_ROOTS = (DEVICE_LIST_MOUNT_ROOT, "/run/nvidia-container-devices")
# Pod annotation families that a container runtime or one of its NRI plugins reads to inject
# devices or mounts into containers. They are judged by key, never by value: the plugins parse
# the value as YAML or as a list of CDI names (a device can be named by major:minor alone, a CDI
# name without its kind gets the runtime's default kind), so no look at the text is safe. A key
# is in a family when it is the family's name, or the name followed by "/" (NRI's
# "<family>/container.<name>" and "<family>/pod", CDI's "cdi.k8s.io/<anything>"): every form the
# plugins read. The sources of each name and key form: docs/security.md.
DEVICE_ANNOTATION_FAMILIES = (
    "cdi.k8s.io",  # CDI: containerd, CRI-O, NVIDIA's runtime (annotation-prefixes)
    "nvidia.cdi.k8s.io",  # NVIDIA's NRI plugin (nvidia-ctk-installer)
    "devices.crio.io", "io.kubernetes.cri-o.Devices",  # CRI-O's allowed device annotation, new and old
    "devices.noderesource.dev", "devices.nri.io",  # NRI's device-injector: device nodes
    "cdi-devices.noderesource.dev", "cdi-devices.nri.io",  # NRI's device-injector: CDI devices
    "cdi.nri.io", "cdi.noderesource.dev",  # the NRI CDI device injector
    "network-devices.noderesource.dev", "network-devices.nri.io",  # NRI's device-injector: host network devices
    "netdevice.noderesource.dev", "netdevices.nri.containerd.io",  # NRI's network-device-injector
    "devices.gke.io",  # GKE's NRI device injector
)
MOUNT_ANNOTATION_FAMILIES = ("mounts.noderesource.dev", "mounts.nri.io")  # NRI's device-injector: mounts
INJECTING_ANNOTATION_FAMILIES = DEVICE_ANNOTATION_FAMILIES + MOUNT_ANNOTATION_FAMILIES
# The capabilities Pod Security's baseline profile lets a container add; any other (SYS_ADMIN,
# SYS_MODULE, SYS_RAWIO, DAC_READ_SEARCH, BPF, ...) can reach the node's devices or kernel.
BASELINE_CAPABILITIES = ("AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT")
# What a debug (ephemeral) container may add beyond those: kubectl debug's `general` profile (its default)
# adds SYS_PTRACE and `netadmin` NET_ADMIN and NET_RAW. Each acts inside the pod's own namespaces (hostPID
# stays denied; gpushard does not judge hostNetwork, which Pod Security's baseline denies): ptrace reaches the
# pod's own processes, which already hold the pod's card, and the network ones its own network namespace;
# none opens a device (docs/security.md, "Debug containers").
DEBUG_CAPABILITIES = ("SYS_PTRACE", "NET_ADMIN", "NET_RAW")
# Of those, the ones that act on the network namespace: the node's own in a hostNetwork pod, so not there.
HOST_NETWORK_CAPABILITIES = ("NET_ADMIN", "NET_RAW")
# Isolation: the limits the card-k device plugin hands each container (see docs/isolation.md).
# Read by NVIDIA's container toolkit's apply-cuda-memory-limits CDI hook, in whole MiB. The hook's
# first revision reads the plural names first and falls back to the singular ones; later revisions
# read only the singular ones. The agent sets all four to the same figure, so an image's own plural
# cannot win over its cap whichever revision runs (docs/isolation.md).
GPU_MEMORY_LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"
GPU_MEMORY_REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
GPU_MEMORY_LIMITS_ENV = "NVIDIA_GPU_MEMORY_LIMITS"
GPU_MEMORY_REQUESTS_ENV = "NVIDIA_GPU_MEMORY_REQUESTS"
# Read by the CUDA driver in an MPS client.
MPS_PIPE_DIRECTORY_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_LOG_DIRECTORY_ENV = "CUDA_MPS_LOG_DIRECTORY"
MPS_THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PINNED_MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
CUDA_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# Names a container author may not set in a GPU container: they would override the plugin's limits
# (older toolkit builds also read the plural NVIDIA_GPU_MEMORY_LIMITS/_REQUESTS, hence a prefix).
LIMIT_ENV_PREFIXES = ("NVIDIA_GPU_MEMORY_", "CUDA_MPS_")
# Where an MPS client finds its card's daemon inside the container.
MPS_CLIENT_PIPE_DIR = "/run/gpushard/mps/pipe"
MPS_CLIENT_SHM_DIR = "/dev/shm"

# Well-known Kubernetes labels and taints the placement honours.
HOSTNAME_LABEL = "kubernetes.io/hostname"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
# The taint an autoscaled node group puts on its new nodes, which the agent removes once the Node advertises
# its cards (webhook/agent/node/startuptaint.py). cluster-autoscaler counts a node with a taint of this prefix
# as still starting; Karpenter waits for a NodePool's startupTaints to go before it calls a node initialized.
STARTUP_TAINT = "startup-taint.cluster-autoscaler.kubernetes.io/gpushard"

# Kinds whose pod template gpushard rewrites, with the path to the pod spec's parent.
TEMPLATE_PATHS = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
    "PodTemplate": ("template",),
}
POD_KIND = "Pod"


def card_resource(prefix: str, index: int) -> str:
    """The per-card resource name for card ``index``."""
    return f"{prefix}{index}"


def card_memory_label(index: int) -> str:
    """The node label that holds card ``index``'s memory in MiB."""
    return f"{CARD_MEMORY_LABEL_PREFIX}{index}{CARD_MEMORY_LABEL_SUFFIX}"


def card_memory_index(key: str) -> int | None:
    """The card index a card-memory label key names, or None if it is not one."""
    return _card_key_index(key, CARD_MEMORY_LABEL_PREFIX, CARD_MEMORY_LABEL_SUFFIX)


def card_cordon_annotation(index: int) -> str:
    """The node annotation that cordons card ``index``."""
    return f"{CARD_CORDON_ANNOTATION_PREFIX}{index}{CARD_CORDON_ANNOTATION_SUFFIX}"


def card_cordon_index(key: str) -> int | None:
    """The card index a cordon annotation key names, or None if it is not one."""
    return _card_key_index(key, CARD_CORDON_ANNOTATION_PREFIX, CARD_CORDON_ANNOTATION_SUFFIX)


def _card_key_index(key: str, prefix: str, suffix: str) -> int | None:
    """The card index between ``prefix`` and ``suffix`` of ``key``: digits, no leading zero."""
    if not key.startswith(prefix) or not key.endswith(suffix) or len(key) <= len(prefix) + len(suffix):
        return None
    middle = key[len(prefix):-len(suffix)]
    if not (middle.isascii() and middle.isdigit()) or len(middle) > 9 or (len(middle) > 1 and middle[0] == "0"):
        return None
    return int(middle)

# Re-placement (`gpushard replace`): its Lease, and what its Events on evicted pods say, and on the pods the
# kubelet refused at admission (core/refusals.py).
REPLACER_LEASE = "gpushard-replacer"
REPLACER_COMPONENT = "gpushard-replacer"
REPLACED_REASON = "GpushardReplaced"
REFUSED_AT_ADMISSION_REASON = "GpushardRefusedAtAdmission"
# Downward-API env of the replacer's pod: its identity in the Lease and the Lease's namespace.
POD_NAME_ENV = "POD_NAME"
POD_NAMESPACE_ENV = "POD_NAMESPACE"

# The DRA backend (resource.k8s.io/v1): gpushard's driver, its DeviceClass, the consumable capacity
# each card offers, the pod-level claim the webhook writes and the templates it comes from, and
# the CDI kind of the per-claim device that carries a claim's limits.
DRA_API_VERSION = "resource.k8s.io/v1"
DRA_DRIVER = "gpu.gpushard.io"
DRA_DEVICE_CLASS = "gpu.gpushard.io"
DRA_SHARES_CAPACITY = "shares"
DRA_REQUEST = "gpu"
DRA_POD_CLAIM = "gpushard-gpu"
DRA_TEMPLATE_PREFIX = "gpushard-shares-"
DRA_TEMPLATE_SIZE_INFIX = "-mib-"  # gpushard-shares-<n>-mib-<card MiB>: a memory ask's claim
DRA_CDI_KIND = "gpushard.io/claim"
# With DRAExtendedResource every DeviceClass is also the extended resource <prefix><class name>.
DRA_EXTENDED_PREFIX = "deviceclass.resource.kubernetes.io/"

# The install's own objects, as `gpushard status` and `gpushard audit` check them (core/installation.py):
# the namespace and Service of the webhook, its MutatingWebhookConfiguration and the entries of enforce
# namespaces, the prefix of every admission policy and binding gpushard ships, and the ConfigMap an earlier
# version's device policies read their lists from (none reads it now).
SYSTEM_NAMESPACE = "gpushard-system"
WEBHOOK_SERVICE = "gpushard"
WEBHOOK_CONFIGURATION = "gpushard"
ENFORCE_WEBHOOK = "enforce.gpushard.io"
HIDE_WEBHOOK = "hide.gpushard.io"
POLICY_PREFIX = "gpushard-"
OLD_DEVICE_POLICY_CONFIG_MAP = "gpushard-device-policy"
