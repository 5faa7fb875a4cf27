"""Which failed pods the kubelet refused at admission though they asked gpushard's shares, and what brings each back.

After a node reboot the kubelet admits every pod bound to the node again before gpushard's agent there has
registered its device plugins, so it refuses each GPU pod (phase Failed, reason ``UnexpectedAdmissionError``:
"cannot allocate unhealthy devices gpushard.io/card-0"). What happens next is the controller's: a ReplicaSet
has already made a new pod and leaves the Failed one behind, StatefulSet and DaemonSet controllers delete it
and make it again, and nothing makes a bare pod again. `gpushard status` names these pods and the replacer
records an Event on each (and deletes, where asked, those a controller makes again): both read them here, so
the two never disagree on which pods they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from webhook.core import objects
from webhook.core import policy as policy_mod

# What the kubelet records on a pod it refuses at admission, as after a node reboot before the agent registered.
KUBELET_REASON = "UnexpectedAdmissionError"
FAILED = "Failed"


@dataclass(frozen=True, slots=True)
class Refused:
    """One pod the kubelet refused at admission that asked gpushard's shares."""

    uid: str
    namespace: str
    name: str
    node: str  # the node whose kubelet refused it
    message: str  # the kubelet's, whole
    controller: str | None  # "ReplicaSet/web-7d9": what makes it again; None for a bare pod


def _asks_shares(spec: dict, policy: policy_mod.Policy) -> bool:
    res = policy.resources
    containers = [c for key in ("containers", "initContainers") if isinstance(spec.get(key), list)
                  for c in spec[key] if isinstance(c, dict)]
    asked = {str(r) for c in containers for r in objects.mapping(objects.mapping(c.get("resources")).get("limits"))}
    return any(r == res.shares or res.card_index(r) is not None for r in asked)


def read(pod: object, policy: policy_mod.Policy) -> Refused | None:
    """``pod`` as a refused pod; None for any other pod (running, failed for another reason, asking no shares)."""
    pod = objects.mapping(pod)
    status, meta, spec = (objects.mapping(pod.get(key)) for key in ("status", "metadata", "spec"))
    if status.get("phase") != FAILED or status.get("reason") != KUBELET_REASON or not _asks_shares(spec, policy):
        return None
    owner = objects.controller(meta)
    return Refused(uid=str(meta.get("uid") or ""), namespace=str(meta.get("namespace") or ""),
                   name=str(meta.get("name") or ""), node=str(spec.get("nodeName") or ""),
                   message=str(status.get("message") or ""),
                   controller=f"{owner.get('kind')}/{owner.get('name')}" if owner else None)


def found(pods: Iterable[object], policy: policy_mod.Policy) -> list[Refused]:
    """The refused pods among ``pods``, by node, namespace and name."""
    refused = (read(pod, policy) for pod in pods)
    return sorted((r for r in refused if r is not None), key=lambda r: (r.node, r.namespace, r.name))


# What brings a refused bare pod back. The failed pod goes first: a pod of the same name cannot be created
# while it exists.
BARE_POD_ADVICE = ("a bare pod: nothing makes it again; delete this one, then create it again from its own manifest "
                   "(not from kubectl get -o yaml: that one is pinned to the old card and node)")


def event_message(pod: Refused, deleted: bool = False) -> str:
    """What the replacer's Event on a refused pod says: where and why it was refused, and what brings it back."""
    told = (f"gpushard: the kubelet on node {pod.node} refused this pod at admission ({KUBELET_REASON}: "
            f"{pod.message}), as after a node reboot before gpushard's agent registered the node's cards; ")
    if pod.controller is None:
        return told + BARE_POD_ADVICE
    if deleted:
        return told + (f"deleted (replacement.cleanupRefused: true), so that the new pod its controller "
                       f"{pod.controller} makes is the one that runs")
    return told + (f"its controller {pod.controller} makes a new pod; this one stays, Failed, until deleted "
                   "(replacement.cleanupRefused: true has the replacer delete such pods)")
