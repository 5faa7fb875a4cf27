"""One admission decision for one object: read, check, place, rewrite; shared by every front door."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from webhook.core import asks as req
from webhook.core import draclaims, draws, extended, hostaccess, isolation, names, placement, rewrite
from webhook.core import findings as f
from webhook.core import policy as policy_mod
from webhook.core.policy import Policy

# The API server's limits on what a webhook sends back (warnings; k8s.io/apiserver's webhook admission).
WARNING_MAX = 120
WARNINGS_TOTAL_MAX = 4000
AUDIT_KEY_MAX = 63


@dataclass(slots=True)  # not frozen: made for every admission, never changed (see placement.Ask)
class Request:
    obj: Any  # the object as sent: decide reads a mapping, and answers anything else as unreadable
    kind: str
    operation: str = "CREATE"
    mode: str = names.MODE_ENFORCE
    dry_run: bool = False
    old: object = None  # the object before an UPDATE
    sub_resource: str = ""
    namespace: str = ""  # the request's namespace, when the object does not say it
    seed: str = ""  # draws the card among the best few (the request's uid); "" picks the best
    # Extended resources that DeviceClasses of other drivers serve (core/extended.py): name -> who serves it.
    served: Mapping[str, extended.Served] = field(default_factory=lambda: extended.NONE)
    share: tuple[int, int] | None = None  # (rank, count) of this webhook replica: its cards first (peers)


@dataclass(slots=True)
class Decision:
    allowed: bool
    obj: dict | None = None  # the object as gpushard would admit it (enforce), else None
    code: int = 200
    message: str = ""
    findings: list[f.Finding] = field(default_factory=list)
    card: int | None = None
    node: str | None = None  # the node whose card placement chose, when one fitted
    shares: int = 0
    # A pod placed by its memory ask: the MiB it asked and the card size its shares are for (0 otherwise).
    memory_mib: int = 0
    card_memory_mib: int = 0

    @property
    def warnings(self) -> list[str]:
        # A denial's own message already says what a deny finding says.
        shown = self.findings if self.allowed else [x for x in self.findings if x.severity != f.DENY]
        return warnings_for(shown)

    @property
    def audit_annotations(self) -> dict[str, str]:
        return audit_annotations_for(self.findings)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def warnings_for(found: list[f.Finding]) -> list[str]:
    """Warnings short enough that the API server passes every one on intact; notes are none."""
    out, total = [], 0
    for finding in found:
        if finding.severity == f.NOTE:
            continue
        text = _clip(finding.message, WARNING_MAX)
        if total + len(text) > WARNINGS_TOTAL_MAX:
            out.append("gpushard: more findings were left out; run gpushard review for all")
            break
        out.append(text)
        total += len(text)
    return out


def audit_annotations_for(found: list[f.Finding]) -> dict[str, str]:
    """One audit annotation per rule (the key is a qualified-name part; the API server prefixes it)."""
    out: dict[str, list[str]] = {}
    for finding in found:
        out.setdefault(finding.rule[:AUDIT_KEY_MAX], []).append(finding.message)
    return {key: "; ".join(values) for key, values in out.items()}


def deny_message(found: list[f.Finding]) -> str:
    parts = [x.message.removeprefix("gpushard: ") for x in found if x.severity == f.DENY]
    return "gpushard: " + "; ".join(parts)


def spec_of(obj: dict, kind: str) -> dict | None:
    """The pod spec inside a Pod or a workload's template, or None for kinds gpushard ignores."""
    if kind == names.POD_KIND:
        spec = obj.get("spec")
    elif kind in names.TEMPLATE_PATHS:
        node: Any = obj
        where = []
        for key in names.TEMPLATE_PATHS[kind]:
            where.append(key)
            node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                return {}
            if not isinstance(node, dict):
                raise f.ObjectError(".".join(where), f"expected a mapping, got {type(node).__name__}")
        spec = node.get("spec")
    else:
        return None
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise f.ObjectError("spec", f"expected a mapping, got {type(spec).__name__}")
    return spec


def pod_rules(asks: list[req.ContainerAsk], policy: Policy) -> tuple[list[f.Finding], int, int | None]:
    """Pod-wide rules over readable asks: one card, one pin, no mixing. (findings, shares, pin)."""
    found: list[f.Finding] = []
    # One walk of the asks gathers what every rule below looks at.
    holders: list[req.ContainerAsk] = []
    passthrough = by_memory = by_share = None  # the first of each
    pins = set()
    for a in asks:
        if a.passthrough:
            if passthrough is None:
                passthrough = a
        elif a.holds_share:
            holders.append(a)
            if a.pin is not None:
                pins.add(a.pin)
            if a.memory_mib is not None:
                if by_memory is None:
                    by_memory = a
            elif by_share is None:
                by_share = a
    if holders and passthrough is not None:
        found.append(f.Finding(f.MIXED_PASSTHROUGH, f.DENY, (
            f"gpushard: container \"{passthrough.name}\" passes whole cards through while "
            f"\"{holders[0].name}\" holds shares; split them into separate pods"), passthrough.name))
    if len(pins) > 1:
        found.append(f.Finding(f.CONFLICTING_PINS, f.DENY, (
            f"gpushard: containers pin cards {', '.join(map(str, sorted(pins)))}; all GPU containers of a pod "
            "share one card"), None))
    if by_memory is not None and by_share is not None:
        found.append(f.Finding(f.MIXED_MEMORY, f.DENY, (
            f"gpushard: container \"{by_memory.name}\" asks {policy.resources.memory} {by_memory.memory_text} "
            f"while \"{by_share.name}\" asks a share of a card; ask GPU memory in every GPU container of the "
            "pod, or a fraction in every one"), by_memory.name))
    shares = req.held_shares(holders)
    spc = policy.shares_per_card
    if shares > spc:
        found.append(f.Finding(f.POD_OVER_CARD, f.DENY, (
            f"gpushard: the pod needs {shares} shares but a card has {spc}; all GPU containers of a pod "
            "share one card"), None))
    return found, shares, (pins.pop() if len(pins) == 1 else None)


def _shown(value: object) -> str:
    if value is None:
        return "''"
    return value if isinstance(value, str) else "(from a reference)"


def _visible_devices_findings(spec: dict, asks: list[req.ContainerAsk], card: int | None, mode: str,
                              policy: Policy) -> list[f.Finding]:
    """A user value for NVIDIA_VISIBLE_DEVICES that gpushard replaces (or would)."""
    found = []
    verb = "replaced" if mode == names.MODE_ENFORCE else "would replace"
    for ask in asks:
        if ask.passthrough:
            values = rewrite.env_value(spec[ask.list_key][ask.position], names.VISIBLE_DEVICES_ENV)
            if values:
                shown = _shown(values[0])
                removed = "removed" if mode == names.MODE_ENFORCE else "would remove"
                found.append(f.Finding(f.VISIBLE_DEVICES_SET, f.WARN, _clip(
                    f"gpushard: container \"{ask.name}\" sets {names.VISIBLE_DEVICES_ENV}={shown}; {removed} it, "
                    "so it sees only its own cards", WARNING_MAX), ask.name))
            continue
        if ask.holds_share:
            ours = str(card) if card is not None else None
        elif policy.hide_unrequested_gpus:
            ours = names.VISIBLE_NONE
        else:
            continue
        values = rewrite.env_value(spec[ask.list_key][ask.position], names.VISIBLE_DEVICES_ENV)
        if values and values != [ours]:
            shown = _shown(values[0])
            found.append(f.Finding(f.VISIBLE_DEVICES_SET, f.WARN, _clip(
                f"gpushard: container \"{ask.name}\" sets {names.VISIBLE_DEVICES_ENV}={shown}; {verb} "
                f"with {ours if ours is not None else 'its card'}", WARNING_MAX), ask.name))
    return found


def _audit_changes(spec: dict, asks: list[req.ContainerAsk], kind: str, policy: Policy) -> list[f.Finding]:
    """What enforce mode would change, said as findings for audit mode."""
    found = []
    res = policy.resources
    for ask in asks:
        if ask.holds_share and ask.fraction is not None and ask.fraction < 1:
            found.append(f.Finding(f.FRACTION_UNREWRITTEN, f.WARN, (
                f"gpushard: container \"{ask.name}\" asks {res.fraction} {ask.fraction_text}; the API server "
                f"rejects fractions unless gpushard enforces"), ask.name))
    if kind == names.POD_KIND and policy.hide_unrequested_gpus and any(a.holds_share for a in asks):
        for ask in asks:
            if ask.shares == 0 and not ask.passthrough:
                values = rewrite.env_value(spec[ask.list_key][ask.position], names.VISIBLE_DEVICES_ENV)
                if values != [names.VISIBLE_NONE]:
                    found.append(f.Finding(f.UNHIDDEN, f.WARN, (
                        f"gpushard: container \"{ask.name}\" asks no GPU but may see every card of the node"),
                        ask.name))
    return found


EPHEMERAL = "ephemeralcontainers"


def _placed_by_gpushard(obj: dict, pin: int) -> bool:
    meta = obj.get("metadata") or {}
    annotations = cast(dict, meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {})
    return annotations.get(names.CARD_ANNOTATION) == str(pin)


def _template_untouched(request: Request, spec: dict) -> bool:
    """An UPDATE that leaves the pod template alone, or one on an object being deleted.

    Such updates (labels, scaling, status, a finalizer removed) must pass even for a workload
    that predates the namespace's opt-in and breaks the rules, or it could never be deleted.
    """
    if request.kind == names.POD_KIND:
        return False
    meta = request.obj.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return True
    if not isinstance(request.old, dict):
        return False
    try:
        return spec_of(request.old, request.kind) == spec
    except f.ObjectError:
        return False


def _old_spec(request: Request) -> dict | None:
    try:
        return spec_of(request.old, names.POD_KIND) if isinstance(request.old, dict) else None
    except f.ObjectError:
        return None


def _namespace(request: Request) -> str:
    meta = request.obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return namespace if isinstance(namespace, str) and namespace else request.namespace


def _ephemeral(request: Request, spec: dict, audit: bool, policy: Policy) -> Decision:
    """Debug containers added to a running pod hold no share: hide the node's cards from them.

    Only the containers this UPDATE adds are judged and changed: the API server refuses any
    change to an ephemeral container that already exists.
    """
    obj = request.obj
    items = spec.get("ephemeralContainers")
    if items is None:
        return Decision(allowed=True, obj=None if audit else obj)
    if not isinstance(items, list) or not all(isinstance(c, dict) for c in items):
        raise f.ObjectError("spec.ephemeralContainers", "expected a list of mappings")
    added = hostaccess.added_ephemeral(spec, _old_spec(request))
    found = hostaccess.ephemeral_findings(spec, added, _namespace(request), policy)
    if found and not audit:
        return Decision(allowed=False, code=403, message=deny_message(found), findings=found)
    if not policy.hide_unrequested_gpus:
        return Decision(allowed=True, obj=None if audit else obj, findings=found)
    if audit:
        found += [f.Finding(f.UNHIDDEN, f.WARN, (
            f"gpushard: ephemeral container \"{items[i].get('name')}\" asks no GPU but may see every card of the node"),
            str(items[i].get("name"))) for i in added
            if rewrite.env_value(items[i], names.VISIBLE_DEVICES_ENV) != [names.VISIBLE_NONE]]
        return Decision(allowed=True, findings=found)
    return Decision(allowed=True, obj=rewrite.hide_ephemeral(obj, policy, added))


def _host_access(request: Request, spec: dict, asks: list[req.ContainerAsk], policy: Policy) -> list[f.Finding]:
    """Host access around the device plugin (core/hostaccess.py), in a Pod or a template."""
    if request.kind == names.POD_KIND:
        where, meta = "spec", request.obj.get("metadata") or {}
        meta_where = "metadata.annotations"
    else:
        path = names.TEMPLATE_PATHS[request.kind]
        template = rewrite.pod_template(request.obj, path)
        where, meta = ".".join(path) + ".spec", template.get("metadata")
        meta_where = ".".join(path) + ".metadata.annotations"
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    return hostaccess.pod_findings(spec, annotations, where, meta_where, _namespace(request), asks, policy)


def decide(request: Request, policy: Policy, view: placement.View | None) -> Decision:
    """The decision for one object, as /mutate and /audit answer and `gpushard review` prints."""
    kind, obj = request.kind, request.obj
    audit = request.mode == names.MODE_AUDIT
    try:
        if not isinstance(obj, dict):
            raise f.ObjectError("object", f"expected a mapping, got {type(obj).__name__}")
        if "metadata" in obj and not isinstance(obj["metadata"], dict):  # absent is fine, null is not
            raise f.ObjectError("metadata", f"expected a mapping, got {type(obj['metadata']).__name__}")
        spec = spec_of(obj, kind)
        if spec is None:
            return Decision(allowed=True, obj=None if audit else obj)
        if kind == names.POD_KIND and request.operation != "CREATE":
            if request.sub_resource == EPHEMERAL:
                return _ephemeral(request, spec, audit, policy)
            return Decision(allowed=True, obj=None if audit else obj)
        if request.operation == "UPDATE" and _template_untouched(request, spec):
            return Decision(allowed=True, obj=None if audit else obj)
        asks = req.read_spec(spec, policy)
        if not asks:  # no containers: nothing to decide, and the API server will say what is missing
            return Decision(allowed=True, obj=None if audit else obj)
        scheduling = placement.ask_from_spec(spec, 0, None) if kind == names.POD_KIND else None
    except f.ObjectError as exc:
        finding = f.Finding(f.UNREADABLE, f.DENY, str(exc))
        if audit:
            return Decision(allowed=True, findings=[finding])
        return Decision(allowed=False, code=400, message=str(exc), findings=[finding])

    found = []
    for a in asks:
        if a.findings:  # most asks have none
            found += a.findings
    found += _host_access(request, spec, asks, policy)
    denied = bool(found) and any(x.severity == f.DENY for x in found)
    shares, pin = 0, None
    if not denied:
        pod_found, shares, pin = pod_rules(asks, policy)
        found += pod_found
        denied = bool(pod_found)
    if not denied and request.served:
        # Never a rewrite into a resource another driver serves (core/extended.py).
        served_found = extended.pod_findings(asks, request.served, policy, request.mode)
        found += served_found
        denied = any(x.severity == f.DENY for x in served_found)
    if not denied:
        limit_found = isolation.env_findings(spec, asks, request.mode, policy)
        if limit_found:  # most pods write no limit variable: nothing to add or look at
            found += limit_found if kind == names.POD_KIND else [x for x in limit_found if x.severity == f.DENY]
            denied = any(x.severity == f.DENY for x in limit_found)
    if denied:
        if audit:
            return Decision(allowed=True, findings=found)
        return Decision(allowed=False, code=403, message=deny_message(found), findings=found)

    if audit:
        if policy.backend == policy_mod.DRA:
            found += draclaims.pin_findings(asks, policy)
            found += draclaims.claim_findings(spec, asks, shares) if kind == names.POD_KIND else []
        found += _visible_devices_findings(spec, asks, pin, request.mode, policy)
        found += _audit_changes(spec, asks, kind, policy)
        return Decision(allowed=True, findings=found, shares=shares)

    if kind != names.POD_KIND:
        new = rewrite.template(obj, names.TEMPLATE_PATHS[kind], asks, policy)
        return Decision(allowed=True, obj=new, findings=found, shares=shares)

    assert scheduling is not None  # read for every pod
    if policy.backend == policy_mod.DRA:
        return _dra_pod(request, obj, asks, shares, found, limit_found, scheduling, view, policy)

    card, node, sized = None, None, None
    if shares > 0 and pin is not None and _placed_by_gpushard(obj, pin):
        # A reinvocation (another webhook changed the pod after gpushard did): keep the card,
        # and neither place nor count the pod again.
        card = pin
    elif req.asks_memory(asks):
        decided = _place_memory(request, asks, scheduling, policy, view, found)
        if isinstance(decided, Decision):
            return decided
        card, node, shares, sized = decided
    elif shares > 0:
        # Built directly: dataclasses.replace costs more than the rest of this branch.
        ask = placement.Ask(shares, pin, scheduling.node_name, scheduling.node_selector,
                            scheduling.required_terms, scheduling.tolerations, scheduling.priority)
        choice = placement.choose(view, ask, policy.placement,
                                  draws.Draw(request.seed) if request.seed else None, request.share,
                                  policy.new_node_cards, policy.shares_per_card)
        card, node = choice.card, choice.node
        found += choice.findings
    found += _visible_devices_findings(spec, asks, card, request.mode, policy)
    new = rewrite.pod(obj, asks, card, shares, policy, node=node, sized=sized)
    if limit_found and any(x.rule == f.LIMIT_ENV_SET for x in limit_found):  # else strip_env has nothing to remove
        new = isolation.strip_env(new, asks)
    return Decision(allowed=True, obj=new, findings=found, card=card, node=node, shares=shares,
                    memory_mib=sized[1] if sized else 0, card_memory_mib=sized[0] if sized else 0)


def _place_memory(request: Request, asks: list[req.ContainerAsk], scheduling: placement.Ask, policy: Policy,
                  view: placement.View | None, found: list[f.Finding]
                  ) -> Decision | tuple[int, str | None, int, tuple[int, int]]:
    """A card size and a card for a pod that asks GPU memory: (card, node, shares, (card MiB, asked MiB)),
    or its denial. ``found`` gets placement's findings.

    Without a view the pod is denied: its shares depend on the size of the card it gets, and no
    guess is safe (too few shares cap the program below its ask under isolation, too many waste a
    card). The workload controllers create the pod again; a person sees why.
    """
    asked = req.memory_mib(asks)
    memory = policy.resources.memory
    if view is None:
        finding = f.Finding(f.NO_VIEW, f.DENY, (
            f"gpushard: the pod asks {memory} ({asked} MiB), and gpushard has no view of the cluster's cards "
            "yet to size it; try again shortly (gpushard review: give --cluster FILE)"))
        return Decision(allowed=False, code=403, message=finding.message, findings=[*found, finding])
    spc = policy.shares_per_card
    # Nodes to come are sized for the device-plugin backend alone, as in placement.choose (docs/autoscaling.md).
    new_cards = policy.new_node_cards if policy.backend != policy_mod.DRA else 0
    ask = placement.Ask(0, None, scheduling.node_name, scheduling.node_selector, scheduling.required_terms,
                        scheduling.tolerations)
    choice = placement.choose_sized(view, ask, lambda mib: req.size(asks, mib, spc), spc, policy.memory_size,
                                    policy.placement, draws.Draw(request.seed) if request.seed else None,
                                    asked_mib=asked, new_cards=new_cards, new_mib=policy.new_node_card_memory_mib)
    if choice.denied:
        found += choice.findings
        return Decision(allowed=False, code=403, message=deny_message(found), findings=found)
    found += choice.findings
    shares = req.size(asks, choice.size_mib, spc)
    # For the record (audit annotation); the pod's annotations carry the same decision.
    found.append(f.Finding(f.MEMORY_SIZED, f.NOTE, (
        f"gpushard: the pod asks {asked} MiB of GPU memory: {shares} shares of card {choice.card}, which has "
        f"{choice.size_mib} MiB ({isolation.memory_cap_mib(shares, choice.size_mib, spc)} MiB held)")))
    return choice.card, choice.node, shares, (choice.size_mib, asked)


def _dra_pod(request: Request, obj: dict, asks: list[req.ContainerAsk], shares: int, found: list[f.Finding],
             limit_found: list[f.Finding], scheduling: placement.Ask, view: placement.View | None,
             policy: Policy) -> Decision:
    """Backend dra: the pod's shares as a claim from a template; the scheduler chooses the card.

    With a view, placement's choice (binpack or spread, over the slices' cards and the claims'
    shares) becomes a preferred term for its node, as with the device plugin: the scheduler
    favours that node and its allocator takes a card with room there. The card is never fixed.
    """
    pinned = draclaims.pin_findings(asks, policy) + draclaims.claim_findings(obj["spec"], asks, shares)
    if pinned:
        found = found + pinned
        return Decision(allowed=False, code=403, message=deny_message(found), findings=found)
    node = card = None
    sized = None
    if req.asks_memory(asks):
        placed: list[f.Finding] = []
        decided = _place_memory(request, asks, scheduling, policy, view, placed)
        if isinstance(decided, Decision):
            return decided if decided.allowed else Decision(
                allowed=False, code=decided.code, message=decided.message, findings=[*found, *decided.findings])
        card, node, shares, sized = decided
        found = found + [x for x in placed if x.rule not in (f.NO_ROOM, f.NO_MATCHING_NODE)] + \
            draclaims.waiting_findings(tuple(placed), shares)
    new = draclaims.pod(obj, asks, shares, policy, sized=sized)
    spec = new["spec"]
    if sized is None and shares > 0 and view is not None and not spec.get("nodeName"):
        ask = placement.Ask(shares, None, scheduling.node_name, scheduling.node_selector,
                            scheduling.required_terms, scheduling.tolerations)
        choice = placement.choose(view, ask, policy.placement, draws.Draw(request.seed) if request.seed else None)
        if choice.fits:
            node, card = choice.node, choice.card
        else:
            found = found + draclaims.waiting_findings(choice.findings, shares)
    if node is not None and policy.node_affinity != "none" and not spec.get("nodeName") and (
            spec.get("affinity") is None or placement.preferred_node(spec) is None):
        rewrite.prefer_node(spec, node)
    if any(x.rule == f.LIMIT_ENV_SET for x in limit_found):
        new = isolation.strip_env(new, asks)
    return Decision(allowed=True, obj=new, findings=found, shares=shares, node=node, card=card,
                    memory_mib=sized[1] if sized else 0, card_memory_mib=sized[0] if sized else 0)
