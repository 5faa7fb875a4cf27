"""Every label, annotation, resource and environment name gpushard reads or writes."""

# Resource names (defaults; the config file may rename the three resources).
FRACTION_RESOURCE = "nvidia.com/gpu"
SHARES_RESOURCE = "gpushard.io/gpu"
CARD_PREFIX = "gpushard.io/card-"

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

# What the agent writes on its Node.
INVENTORY_ANNOTATION = "gpushard.io/inventory"
CARDS_LABEL = "gpushard.io/cards"

# Container environment.
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
FRACTION_ENV = "GPUSHARD_FRACTION"
VISIBLE_NONE = "void"

# Well-known Kubernetes labels and taints the placement honours.
HOSTNAME_LABEL = "kubernetes.io/hostname"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"

# Audit annotation keys are the name part of a qualified name: the API server
# prefixes them with the webhook's name, so they carry no "/" and stay short.
AUDIT_ANNOTATION_PREFIX = "finding-"

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

# Re-placement (`gpushard replace`): its Lease, and what its Events on evicted pods say.
REPLACER_LEASE = "gpushard-replacer"
REPLACER_COMPONENT = "gpushard-replacer"
REPLACED_REASON = "GpushardReplaced"
# Downward-API env of the replacer's pod: its identity in the Lease and the Lease's namespace.
POD_NAME_ENV = "POD_NAME"
POD_NAMESPACE_ENV = "POD_NAMESPACE"
