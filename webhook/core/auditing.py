"""Audit findings over many objects at once, and card usage: the admission rules plus those needing context."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from webhook.core import asks as req
from webhook.core import decisions, extended, hostaccess, names, objects, quantities, replacement, rewrite
from webhook.core import findings as f
from webhook.core.policy import DRA, Policy

# Rule ids that only an audit can see: they need the namespace, the node or the pod's history.
NOT_OPTED_IN = "not-opted-in"
BAD_MODE_LABEL = "bad-mode-label"
UNPINNED = "unpinned"
NVIDIA_GPU_ON_SHARED_NODE = "nvidia-gpu-on-shared-node"
NVIDIA_PLUGIN_ON_SHARED_NODE = "nvidia-plugin-on-shared-node"
PIN_ENV_MISMATCH = "pin-env-mismatch"
ANNOTATION_MISMATCH = "annotation-mismatch"
NO_SUCH_CARD = "no-such-card"
CARD_OVERSUBSCRIBED = "card-oversubscribed"
TOOLKIT_ACCEPTS_ENVVAR = "toolkit-accepts-envvar"

FIXES = {
    NOT_OPTED_IN: "label the namespace gpushard.io/mode=enforce (or audit, to try it first)",
    BAD_MODE_LABEL: "set gpushard.io/mode to enforce or audit, or remove the label",
    UNPINNED: "recreate the pod in a namespace with gpushard.io/mode=enforce so that it is pinned to one card",
    NVIDIA_GPU_ON_SHARED_NODE: "recreate the pod in an enforced namespace, or move it to a node without gpushard",
    NVIDIA_PLUGIN_ON_SHARED_NODE: "keep NVIDIA's device plugin off nodes where the gpushard agent runs",
    PIN_ENV_MISMATCH: "recreate the pod without its own NVIDIA_VISIBLE_DEVICES; gpushard writes it",
    ANNOTATION_MISMATCH: "recreate the pod so that gpushard writes its card annotation and resources together",
    NO_SUCH_CARD: "recreate the pod without a card resource so that gpushard chooses a card the node has",
    CARD_OVERSUBSCRIBED: "move or delete pods on this card until its shares fit; check the card's health",
    TOOLKIT_ACCEPTS_ENVVAR: ("set accept-nvidia-visible-devices-envvar-when-unprivileged = false and "
                             "accept-nvidia-visible-devices-as-volume-mounts = true in the node's NVIDIA toolkit "
                             "config (GPU Operator: toolkit.env), then restart containerd (docs/install.md, "
                             "\"Prerequisites\")"),
}
RULES = tuple(FIXES)

# What enforce mode rewrites away on admission: in an enforced namespace these are no finding
# in templates and in Pods still to be created, which the webhook will see.
FIXED_BY_ENFORCE = frozenset({f.UNHIDDEN, f.FRACTION_UNREWRITTEN})
# Their fix in a Pod that already exists there: the namespace is opted in, the pod predates it.
RECREATE_FIX = "recreate the pod (delete it, or roll out its workload again) so that gpushard rewrites it"

NAMESPACE_KIND = "Namespace"
NODE_KIND = "Node"
DEVICE_CLASS_KIND = extended.KIND


def fix_for(rule: str) -> str:
    """What a user can do about a finding of ``rule``, for admission rules and audit rules alike."""
    return FIXES.get(rule) or f.FIXES.get(rule, "")


@dataclass(frozen=True)
class Ref:
    """The object a finding is about."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace + '/' if self.namespace else ''}{self.name}"


@dataclass(frozen=True)
class Item:
    """One finding about one object, with where the object came from (a file and document, or "")."""

    ref: Ref
    finding: f.Finding
    source: str = ""
    fix_here: str = ""  # a fix that fits this object better than the rule's own

    @property
    def fix(self) -> str:
        return self.fix_here or fix_for(self.finding.rule)


@dataclass(frozen=True)
class Located:
    """An object to audit and where it came from."""

    obj: dict
    source: str = ""


@dataclass(frozen=True)
class NamespaceMode:
    """How gpushard treats a namespace: mode None means the webhook never sees it."""

    mode: str | None
    known: bool = True  # False for manifests whose namespace is not among them
    problem: str = ""  # why a label value was not taken as written


UNKNOWN_NAMESPACE = NamespaceMode(names.MODE_ENFORCE, known=False)


def namespace_mode(name: str, labels: Mapping[str, object] | None) -> NamespaceMode:
    """A namespace's policy from its labels; a bad value falls back to the strictest reading."""
    labels = labels if isinstance(labels, Mapping) else {}
    if names.MODE_LABEL not in labels:
        return NamespaceMode(None)
    value = labels[names.MODE_LABEL]
    if value in names.MODES:
        return NamespaceMode(value)
    return NamespaceMode(names.MODE_ENFORCE, problem=(
        f"gpushard: namespace \"{name}\" has {names.MODE_LABEL}=\"{value}\", which is neither enforce nor audit; "
        "audited as enforce, but the webhook does not act on it"))


# --- reading objects -------------------------------------------------------------------------------

_meta = objects.meta
_dict = objects.mapping
# The one reading of Nodes and pods (webhook.core.objects), under the names audit has always offered.
NodeCards = objects.NodeCards
node_cards = objects.node_cards
card_shares = objects.card_shares
terminal = objects.terminal
TERMINAL_PHASES = objects.TERMINAL_PHASES


def ref_of(obj: dict) -> Ref:
    meta = _meta(obj)
    kind = obj.get("kind")
    return Ref(kind if isinstance(kind, str) else "", str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def existing_pod(obj: dict) -> bool:
    """A Pod the API server already holds (it has a uid, a node or a status), as opposed to a manifest.

    Admission acts only on CREATE, so enforce mode never rewrites such a pod again.
    """
    return obj.get("kind") == names.POD_KIND and bool(
        _meta(obj).get("uid") or _dict(obj.get("spec")).get("nodeName") or _dict(obj.get("status")))


def _asks_gpu(spec: dict, policy: Policy) -> bool:
    """Whether any container names a GPU resource with a value other than zero."""
    res = policy.resources
    for _key, _i, container in req.containers(spec):
        resources = _dict(container.get("resources"))
        for part in ("limits", "requests"):
            for key, value in _dict(resources.get(part)).items():
                if key in (res.fraction, res.shares) or res.card_index(str(key)) is not None:
                    try:
                        if quantities.parse(value) != 0:
                            return True
                    except quantities.QuantityError:
                        return True
    return False


# --- the rules -------------------------------------------------------------------------------------

def _warn(rule: str, message: str, container: str | None = None) -> f.Finding:
    return f.Finding(rule, f.WARN, message, container)


def _pin_env_rules(spec: dict, asks: list[req.ContainerAsk]) -> list[f.Finding]:
    """A pinned container whose own NVIDIA_VISIBLE_DEVICES names another card."""
    found = []
    for ask in asks:
        if not ask.holds_share or ask.pin is None:
            continue
        values = _env(spec, ask)
        if values and values != [str(ask.pin)]:
            # No value sets the variable empty; a valueFrom is known only when the pod starts.
            shown = values[0] if isinstance(values[0], str) else "''" if values[0] is None else "(from a reference)"
            found.append(_warn(PIN_ENV_MISMATCH, (
                f"gpushard: container \"{ask.name}\" holds card {ask.pin} but sets "
                f"{names.VISIBLE_DEVICES_ENV}={shown}, so it may see another card"), ask.name))
    return found


def _pod_rules(pod: dict, spec: dict, asks: list[req.ContainerAsk], policy: Policy,
               nodes: Mapping[str, NodeCards]) -> list[f.Finding]:
    """Rules about a pod's annotations and the node it runs on."""
    res = policy.resources
    found: list[f.Finding] = []
    holders = [a for a in asks if a.holds_share]
    pins = sorted({a.pin for a in holders if a.pin is not None})
    pin = pins[0] if len(pins) == 1 else None

    annotations = _dict(_meta(pod).get("annotations"))
    noted = annotations.get(names.CARD_ANNOTATION)
    if holders and noted is not None and (pin is None or str(noted) != str(pin)):
        holds = f"card {pin}" if pin is not None else "no card resource"
        found.append(_warn(ANNOTATION_MISMATCH, (
            f"gpushard: the pod is annotated {names.CARD_ANNOTATION}={noted} but holds {holds}")))

    node = nodes.get(str(spec.get("nodeName") or ""))
    if node is None or not node.shared:
        return found
    if any(a.fraction is not None and a.fraction != 0 and pin is None for a in asks):
        found.append(_warn(NVIDIA_GPU_ON_SHARED_NODE, (
            f"gpushard: the pod runs on shared node \"{node.name}\" with {res.fraction}, so NVIDIA's device plugin "
            "gave it a card that gpushard does not count")))
    elif holders and not pins:
        found.append(_warn(UNPINNED, (
            f"gpushard: the pod holds {res.shares} on shared node \"{node.name}\" but no {res.card_prefix}<k>, "
            "so no card is kept for it alone")))
    for k in pins:
        if k not in node.cards:
            have = ", ".join(map(str, node.cards)) or "none"
            found.append(_warn(NO_SUCH_CARD, (
                f"gpushard: the pod holds card {k} but node \"{node.name}\" offers cards {have}")))
    return found


def _ephemeral_names(spec: dict) -> list[str]:
    """Names of the pod's ephemeral (debug) containers; a list gpushard cannot read has none."""
    items = spec.get("ephemeralContainers")
    if not isinstance(items, list):
        return []
    return [str(c.get("name") or "") for c in items
            if isinstance(c, dict) and rewrite.env_value(c, names.VISIBLE_DEVICES_ENV) != [names.VISIBLE_NONE]]


def _unhidden_since_before(pod: dict, spec: dict, asks: list[req.ContainerAsk], ns: NamespaceMode,
                           policy: Policy, nodes: Mapping[str, NodeCards]) -> list[f.Finding]:
    """GPU-less containers of an existing pod that admission never hid: they may see every card.

    Admission judges a GPU pod's own containers (decide); what it never sees here is a pod that
    asks for no GPU at all, and the ephemeral containers added to a pod after it was created.
    """
    if not policy.hide_unrequested_gpus or ns.mode is None or not existing_pod(pod):
        return []
    node_name = str(spec.get("nodeName") or "")
    node = nodes.get(node_name)
    if any(a.holds_share for a in asks):
        hidden_here = []  # decide already reports the GPU pod's init, sidecar and app containers
    elif node is None or not node.shared or not ns.known or _asks_gpu(spec, policy):
        # Off shared nodes the cards are not gpushard's to hide; and a namespace not among the
        # manifests is no sign of opt-in for a GPU-less pod (kube-system would be flagged whole).
        return []
    else:
        hidden_here = [a.name for a in asks if a.shares == 0 and not a.passthrough
                       and _env(spec, a) != [names.VISIBLE_NONE]]
    where = (f"{'shared node' if node is not None and node.shared else 'node'} \"{node_name}\""
             if node_name else "its node")
    enforced = ns.mode == names.MODE_ENFORCE
    found = []
    for label, name in [("container", n) for n in hidden_here] + [("ephemeral container", n)
                                                                   for n in _ephemeral_names(spec)]:
        message = f"gpushard: {label} \"{name}\" asks no GPU but may see every card of {where}"
        if enforced and label == "container":
            message += "; the pod was created before gpushard hid GPUs there and must be recreated"
        elif enforced:
            message += "; it was added before gpushard hid GPUs there, so the pod must be recreated"
        found.append(f.Finding(f.UNHIDDEN, f.WARN, message, name))
    return found


def _env(spec: dict, ask: req.ContainerAsk) -> list[object]:
    # read_spec checked the container lists; the env is read as admission reads it (no list: none).
    return rewrite.env_value(spec[ask.list_key][ask.position], names.VISIBLE_DEVICES_ENV)


def _created_unfixed(obj: dict, ns: NamespaceMode) -> bool:
    """An existing Pod in an enforced namespace: what enforce mode rewrites stays as it is in it."""
    return ns.mode == names.MODE_ENFORCE and existing_pod(obj)


def _too_late(finding: f.Finding) -> f.Finding:
    """A finding enforce mode would have rewritten away, in a pod that was created without it."""
    return f.Finding(finding.rule, finding.severity, (
        f"{finding.message}; gpushard rewrites pods only when they are created, so this pod stays as it is "
        "until it is recreated"), finding.container)


def audit_object(obj: dict, ns: NamespaceMode, policy: Policy, nodes: Mapping[str, NodeCards] | None = None,
                 served: Mapping[str, extended.Served] = extended.NONE) -> list[f.Finding]:
    """Findings about one Pod or workload: the admission rules in audit mode (``served``: the extended
    resources DeviceClasses of other drivers serve, as the webhook knows them), then the context rules."""
    kind = obj.get("kind")
    if not isinstance(kind, str) or (kind != names.POD_KIND and kind not in names.TEMPLATE_PATHS):
        return []
    try:
        spec = decisions.spec_of(obj, kind) or {}
        gpu = _asks_gpu(spec, policy)
    except f.ObjectError:
        spec, gpu = None, True
    if ns.mode is None and not gpu:
        return []  # gpushard never sees it and it asks for no GPU: none of our business
    decision = decisions.decide(decisions.Request(obj, kind, "CREATE", names.MODE_AUDIT, served=served), policy, None)
    found = list(decision.findings)
    if _created_unfixed(obj, ns):
        found = [_too_late(x) if x.rule in FIXED_BY_ENFORCE else x for x in found]
    elif ns.mode == names.MODE_ENFORCE:
        found = [x for x in found if x.rule not in FIXED_BY_ENFORCE]
    if ns.mode is None:
        # Host access is gpushard's to judge only where a namespace opted in.
        found = [x for x in found if x.rule not in hostaccess.RULES]
        ref = ref_of(obj)
        found.insert(0, _warn(NOT_OPTED_IN, (
            f"gpushard: the {kind} asks for a GPU in namespace \"{ref.namespace or 'default'}\", which has no "
            f"{names.MODE_LABEL} label, so the webhook never sees it")))
    if spec is not None:
        try:
            asks = req.read_spec(spec, policy)
        except f.ObjectError:
            asks = []
        pinned = _pin_env_rules(spec, asks)
        # A pinned container whose env names another card gets the sharper finding only.
        mismatched = {x.container for x in pinned}
        found = [x for x in found if not (x.rule == f.VISIBLE_DEVICES_SET and x.container in mismatched)]
        found += pinned
        if kind == names.POD_KIND:
            found += _pod_rules(obj, spec, asks, policy, nodes or {})
            found += _unhidden_since_before(obj, spec, asks, ns, policy, nodes or {})
    return found


def _card_use(pods: Iterable[dict], policy: Policy) -> dict[tuple[str, int], list[tuple[Ref, int]]]:
    held: dict[tuple[str, int], list[tuple[Ref, int]]] = {}
    for pod in pods:
        if terminal(pod):
            continue
        spec = _dict(pod.get("spec"))
        node = spec.get("nodeName")
        if not node:
            continue
        for k, shares in card_shares(spec, policy).items():
            held.setdefault((str(node), k), []).append((ref_of(pod), shares))
    return held


def toolkit_problem(node: dict) -> str | None:
    """What the Node's agent found of NVIDIA's container toolkit (each card's inventory entry, key
    names.INVENTORY_TOOLKIT), when it breaks the shared node's promise: an unprivileged container's
    NVIDIA_VISIBLE_DEVICES is honoured there."""
    inventory = objects.read_inventory(_dict(_meta(node).get("annotations")).get(names.INVENTORY_ANNOTATION))
    found = next((e.get(names.INVENTORY_TOOLKIT) for e in inventory.values()
                  if isinstance(e.get(names.INVENTORY_TOOLKIT), dict)
                  and e[names.INVENTORY_TOOLKIT].get("hardened") is False), None)
    if found is None:
        return None
    name = _meta(node).get("name") or ""
    return (f"gpushard: on shared node \"{name}\" NVIDIA's container toolkit accepts NVIDIA_VISIBLE_DEVICES from "
            f"unprivileged containers ({found.get('config') or 'its config'}): a pod outside gpushard's enforce "
            "namespaces that writes NVIDIA_VISIBLE_DEVICES=all, or runs a CUDA image, sees every card of the node")


def held_by_others(node: dict) -> list[str]:
    """Each card the Node's agent withholds because another device plugin's containers hold it (``heldBy`` in
    its inventory entry: a node moved from NVIDIA's plugin, whose pods still run)."""
    inventory = objects.read_inventory(_dict(_meta(node).get("annotations")).get(names.INVENTORY_ANNOTATION))
    name = _meta(node).get("name") or ""
    found = []
    for index, entry in sorted(inventory.items()):
        held = entry.get("heldBy")
        if not isinstance(held, dict) or not held:
            continue
        who = "; ".join(f"{resource} ({', '.join(map(str, pods)) if isinstance(pods, list) else pods})"
                        for resource, pods in sorted(held.items()))
        found.append(f"gpushard: card {index} of node \"{name}\" is held by pods of another device plugin: {who}; "
                     "its shares are not offered to new pods until those end")
    return found


def starting(node: dict, policy: Policy) -> str | None:
    """Why a Node is still coming up for gpushard: it keeps gpushard's startup taint (its agent removes it once
    the Node advertises its cards), or, under the device-plugin backend, the card count its label gives is
    more than the card resources its allocatable lists. None for a node that is up (or no GPU node at all)."""
    name = _meta(node).get("name") or ""
    taints = _dict(node.get("spec")).get("taints")
    tainted = isinstance(taints, list) and any(isinstance(t, dict) and t.get("key") == names.STARTUP_TAINT
                                               for t in taints)
    allocatable = _dict(_dict(node.get("status")).get("allocatable"))
    listed = sum(1 for key in allocatable if isinstance(key, str) and key.startswith(policy.resources.card_prefix))
    label = _dict(_meta(node).get("labels")).get(names.CARDS_LABEL)
    expected = int(label) if isinstance(label, str) and label.isdigit() else 0
    short = policy.backend != DRA and listed < expected
    if not tainted and not short:
        return None
    shown = f"its allocatable lists {listed} of its {expected} cards" if expected else \
        f"its allocatable lists {listed} card{'s' if listed != 1 else ''}"
    if tainted:
        return (f"gpushard: node \"{name}\" is starting: it keeps the startup taint {names.STARTUP_TAINT} until "
                f"gpushard's agent there sees its cards advertised ({shown}); if it stays, read that agent's log")
    return (f"gpushard: node \"{name}\" is starting: {shown}; pods wait until the kubelet registers gpushard's "
            "agent there (if it stays, read that agent's log)")


def audit(objects: Iterable[Located], policy: Policy) -> list[Item]:
    """Every finding over a set of objects: a cluster's, or a set of manifests.

    Namespaces, Nodes, DeviceClasses and Pods among the objects give each other context; a Pod or
    workload whose namespace is not among them is audited as if its namespace enforced gpushard.
    """
    objects = [o for o in objects if isinstance(o.obj, dict)]
    by_kind: dict[str, list[Located]] = {}
    for located in objects:
        by_kind.setdefault(str(located.obj.get("kind") or ""), []).append(located)

    items: list[Item] = []
    modes: dict[str, NamespaceMode] = {}
    for located in by_kind.get(NAMESPACE_KIND, []):
        ref = ref_of(located.obj)
        mode = namespace_mode(ref.name, _meta(located.obj).get("labels"))
        modes[ref.name] = mode
        if mode.problem:
            items.append(Item(ref, _warn(BAD_MODE_LABEL, mode.problem), located.source))

    nodes: dict[str, NodeCards] = {}
    node: NodeCards | None
    for located in by_kind.get(NODE_KIND, []):
        node = node_cards(located.obj, policy)
        nodes[node.name] = node
        if node.shared and node.fraction_allocatable:
            items.append(Item(ref_of(located.obj), _warn(NVIDIA_PLUGIN_ON_SHARED_NODE, (
                f"gpushard: shared node \"{node.name}\" also advertises {node.fraction_allocatable} "
                f"{policy.resources.fraction}, so NVIDIA's device plugin still runs there")), located.source))
        problem = toolkit_problem(located.obj) if node.shared else None
        if problem:
            items.append(Item(ref_of(located.obj), _warn(TOOLKIT_ACCEPTS_ENVVAR, problem), located.source))

    # DeviceClasses of other drivers serving extended resources: each a finding, and the context of every pod.
    classes = by_kind.get(DEVICE_CLASS_KIND, [])
    for located in classes:
        for name, finding in extended.class_findings([located.obj], policy):
            items.append(Item(Ref(DEVICE_CLASS_KIND, "", name), finding, located.source))
    served = extended.served_by(o.obj for o in classes)

    pods = [o for o in by_kind.get(names.POD_KIND, []) if not terminal(o.obj)]
    workloads = [o for kind in names.TEMPLATE_PATHS for o in by_kind.get(kind, [])]
    for located in pods + workloads:
        ref = ref_of(located.obj)
        mode = modes.get(ref.namespace or "default", UNKNOWN_NAMESPACE)
        recreate = _created_unfixed(located.obj, mode)
        for finding in audit_object(located.obj, mode, policy, nodes, served):
            fix = RECREATE_FIX if recreate and finding.rule in FIXED_BY_ENFORCE else ""
            items.append(Item(ref, finding, located.source, fix))

    sources = {ref_of(o.obj): o.source for o in pods}
    for (node_name, k), holders in sorted(_card_use((o.obj for o in pods), policy).items()):
        node = nodes.get(node_name)
        if node is None or k not in node.cards:
            continue
        used = sum(shares for _ref, shares in holders)
        if used > node.cards[k]:
            items.append(Item(Ref(NODE_KIND, "", node_name), _warn(CARD_OVERSUBSCRIBED, (
                f"gpushard: card {k} of node \"{node_name}\" is held for {used} shares but offers "
                f"{node.cards[k]} (pods: {', '.join(f'{r.namespace}/{r.name}' for r, _ in holders)})")),
                sources.get(holders[0][0], "")))
    return sorted(items, key=_order)


_KIND_ORDER = {NAMESPACE_KIND: 0, NODE_KIND: 1, DEVICE_CLASS_KIND: 2}


def _order(item: Item) -> tuple:
    ref = item.ref
    return (_KIND_ORDER.get(ref.kind, 3), ref.namespace, ref.name, ref.kind)


# --- usage per card --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Holder:
    namespace: str
    name: str
    shares: int
    memory_asked_mib: int = 0  # what a pod placed by its memory ask asked (its annotation); 0 for a fraction
    sized_for_mib: int = 0  # the card size (MiB) such a pod's shares were computed for (its annotation)


@dataclass(frozen=True)
class CardUse:
    index: int
    capacity: int
    used: int
    holders: tuple[Holder, ...] = ()
    model: str = ""
    uuid: str = ""
    memory_mib: int = 0  # from the agent's inventory; 0 when unknown
    cordon: objects.Cordon | None = None  # an operator's cordon: no room for new pods, whatever is free

    @property
    def free(self) -> int:
        return 0 if self.cordon is not None else max(self.capacity - self.used, 0)


@dataclass(frozen=True)
class NodeUse:
    name: str
    cards: tuple[CardUse, ...]

    @property
    def capacity(self) -> int:
        return sum(c.capacity for c in self.cards)

    @property
    def used(self) -> int:
        return sum(c.used for c in self.cards)

    @property
    def free(self) -> int:
        return sum(c.free for c in self.cards)


@dataclass(frozen=True)
class Usage:
    nodes: tuple[NodeUse, ...]
    pending: tuple[tuple[Holder, int], ...] = ()  # pinned pods not yet bound to a node, with their card
    # Pending pods whose card has no room on any shared node while another card has room for
    # them, with their card and what to do (node constraints aside: the report reads no labels).
    stranded: tuple[tuple[Holder, int, str], ...] = ()

    @property
    def capacity(self) -> int:
        return sum(n.capacity for n in self.nodes)

    @property
    def used(self) -> int:
        return sum(n.used for n in self.nodes)

    @property
    def free(self) -> int:
        return sum(n.free for n in self.nodes)


def usage(nodes: Iterable[dict], pods: Iterable[dict], policy: Policy) -> Usage:
    """Shares used and free per shared node and card, and the non-terminal pods holding them.

    Cards come from the nodes' allocatable per-card resources; a card that pods hold but the
    node no longer offers (unhealthy, gone) shows with capacity 0 so that its holders stay visible.
    A card an operator cordoned carries its cordon and has no free shares.
    """
    pods = list(pods)
    held = _card_use(pods, policy)
    asked = {(r.namespace, r.name): mibs for r, mibs in map(_memory_asked, pods) if mibs[0]}
    pending, owners = [], {}
    for pod in pods:
        spec = _dict(pod.get("spec"))
        if terminal(pod) or spec.get("nodeName"):
            continue
        ref = ref_of(pod)
        owner = objects.controller(_meta(pod))
        owners[(ref.namespace, ref.name)] = owner.get("kind") if owner else None
        for k, shares in card_shares(spec, policy).items():
            mibs = asked.get((ref.namespace, ref.name), (0, 0))
            pending.append((Holder(ref.namespace, ref.name, shares, *mibs), k))
    out = []
    for raw in nodes:
        node = node_cards(raw, policy)
        if not node.shared:
            continue
        indexes = sorted(set(node.indexes) | {k for (n, k) in held if n == node.name})
        cards = []
        for k in indexes:
            holders = tuple(sorted((Holder(r.namespace, r.name, s, *asked.get((r.namespace, r.name), (0, 0)))
                                    for r, s in held.get((node.name, k), [])),
                                   key=lambda h: (h.namespace, h.name)))
            info = node.inventory.get(k, {})
            cards.append(CardUse(index=k, capacity=node.cards.get(k, 0), used=sum(h.shares for h in holders),
                                 holders=holders, model=str(info.get("model") or ""),
                                 uuid=str(info.get("uuid") or ""),
                                 memory_mib=objects.card_memory(info), cordon=node.cordoned.get(k)))
        out.append(NodeUse(node.name, tuple(cards)))
    pending.sort(key=lambda p: (p[0].namespace, p[0].name))
    return Usage(tuple(sorted(out, key=lambda n: n.name)), tuple(pending), _stranded(out, pending, owners))


def pods_of_namespace(use: Usage, namespace: str) -> Usage:
    """``use`` with only the pods of ``namespace`` shown: holders, pending and stranded.

    The cards' numbers stay those of every namespace: a card's free shares are what a pod of
    ``namespace`` can still have, whoever holds the rest.
    """
    def ours(holders):
        return tuple(h for h in holders if h.namespace == namespace)

    return Usage(
        nodes=tuple(NodeUse(n.name, tuple(CardUse(c.index, c.capacity, c.used, ours(c.holders), c.model, c.uuid,
                                                  c.memory_mib) for c in n.cards)) for n in use.nodes),
        pending=tuple(p for p in use.pending if p[0].namespace == namespace),
        stranded=tuple(s for s in use.stranded if s[0].namespace == namespace))


def _memory_asked(pod: dict) -> tuple[Ref, tuple[int, int]]:
    """The MiB a pod placed by its memory ask asked and the card size it was sized for, from gpushard's
    annotations (0 when none)."""
    return ref_of(pod), (objects.memory_asked_mib(pod), objects.sized_for_mib(pod))


def _stranded(nodes: list[NodeUse], pending: list[tuple[Holder, int]],
              owners: Mapping[tuple[str, str], str | None]) -> tuple[tuple[Holder, int, str], ...]:
    """Pending pods waiting on a full card while another card has room, and what to do about each."""
    free = [(c.index, c.free) for n in nodes for c in n.cards]
    out = []
    for holder, k in pending:
        if any(index == k and room >= holder.shares for index, room in free):
            continue
        if not any(room >= holder.shares for _index, room in free):
            continue
        kind = owners.get((holder.namespace, holder.name))
        if kind in replacement.RECREATING:
            hint = f"gpushard replace evicts it so that its {kind} recreates it"
            if kind == replacement.JOB:
                hint += " (if the Job's podFailurePolicy ignores DisruptionTarget)"
        else:
            pod = replacement.Waiting(uid="", namespace=holder.namespace, name=holder.name, card=k,
                                      shares=holder.shares, age=0, owner_kind=kind)
            why = replacement.judge(pod, None)
            assert why is not None  # without its owner a pod is never judged safe to evict
            hint = why.removeprefix("gpushard: ")
        out.append((holder, k, hint))
    return tuple(out)
