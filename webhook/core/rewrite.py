"""Building the rewritten pod or template: new objects out, the input never touched."""

from __future__ import annotations

from typing import Any, cast

from webhook.core import asks as req
from webhook.core import names, placement, quantities
from webhook.core.policy import Policy

# The rewrite copies only the path to what it changes and shares every untouched subtree with
# the input (which it never changes). The admission server's patch walk (admission/patches.py)
# then skips shared subtrees by identity, so a review costs what gpushard changes, not the size
# of the pod.


def _own(holder: dict, key: str) -> dict:
    """Give ``holder`` its own shallow copy of the mapping under ``key`` (a new one if absent)."""
    value = holder.get(key)
    value = dict(value) if isinstance(value, dict) else {}
    holder[key] = value
    return value


def _own_spec(holder: dict) -> dict:
    spec = _own(holder, "spec")
    for key, _group in req.CONTAINER_LISTS:
        if isinstance(spec.get(key), list):
            spec[key] = list(spec[key])
    return spec


def _own_container(spec: dict, ask: req.ContainerAsk) -> dict:
    container = dict(spec[ask.list_key][ask.position])
    spec[ask.list_key][ask.position] = container
    return container


def env_value(container: dict, name: str) -> list[object]:
    """Every value the container's env list gives ``name`` (a valueFrom counts as its dict)."""
    env = container.get("env")
    if not isinstance(env, list):
        return []  # no env, or one that is no list (set_env replaces it)
    return [e.get("value", e.get("valueFrom")) for e in env if isinstance(e, dict) and e.get("name") == name]


def set_env(container: dict, name: str, value: str) -> None:
    """Make ``name=value`` the container's only entry for ``name``; a correct lone entry stays put."""
    env = container.get("env")
    env = env if isinstance(env, list) else []
    same = [e for e in env if isinstance(e, dict) and e.get("name") == name]
    entry = {"name": name, "value": value}
    if same == [entry]:
        return
    container["env"] = [e for e in env if not (isinstance(e, dict) and e.get("name") == name)] + [entry]


def remove_env(container: dict, name: str) -> None:
    env = container.get("env")
    if isinstance(env, list):
        container["env"] = [e for e in env if not (isinstance(e, dict) and e.get("name") == name)]


def hide_ephemeral(obj: dict, policy: Policy, only: list[int] | None = None) -> dict:
    """The pod with NVIDIA_VISIBLE_DEVICES=void in its ephemeral (debug) containers (those at ``only``)."""
    new = dict(obj)
    spec = _own(new, "spec")
    spec["ephemeralContainers"] = list(spec["ephemeralContainers"])
    for i, container in enumerate(spec["ephemeralContainers"]):
        if only is None or i in only:
            container = spec["ephemeralContainers"][i] = dict(container)
            set_env(container, names.VISIBLE_DEVICES_ENV, names.VISIBLE_NONE)
    return new


def _set_resources(container: dict, policy: Policy, wanted: dict[str, str]) -> None:
    """Replace every GPU resource in limits and requests by ``wanted``, keeping the rest in their order."""
    res = policy.resources
    resources = _own(container, "resources")
    for part in ("limits", "requests"):
        was = resources.get(part)
        kept = {key: value for key, value in was.items()
                if key not in res.gpu_names and not (isinstance(key, str) and key.startswith(res.card_prefix)
                                                     and res.card_index(key) is not None)} \
            if isinstance(was, dict) else {}
        resources[part] = {**kept, **wanted}


def pod(obj: dict, asks: list[req.ContainerAsk], card: int | None, pod_shares: int, policy: Policy,
        node: str | None = None, sized: tuple[int, int] | None = None) -> dict:
    """The pod as gpushard admits it: shares pinned to ``card``, env owned, metadata marked.

    ``node``, when placement found room there, becomes a soft preference: the scheduler may
    still pick any node whose card ``card`` has room, but packing follows the choice.
    ``sized`` (card MiB, asked MiB), for a pod that asked GPU memory: its memory asks become the
    shares the asks carry, a required node affinity keeps it on card ``card`` of that size, and
    annotations record what it asked and the card size its shares are for.
    """
    new = dict(obj)
    spec = _own_spec(new)
    if sized is not None and card is not None:
        _require_card_memory(spec, card, sized[0])
    # Without an affinity there is no preferred term to look for (most pods).
    if node is not None and policy.node_affinity != "none" and not spec.get("nodeName") and (
            spec.get("affinity") is None or placement.preferred_node(spec) is None):
        prefer_node(spec, node, required=policy.node_affinity == "required")
    res = policy.resources
    card_text = card_resource = None  # the same for every container that holds a share
    for ask in asks:
        if ask.holds_share:
            if card_text is None or card_resource is None:  # set together, on the first container
                assert card is not None  # a pod whose asks hold shares has its card chosen
                card_text, card_resource = str(card), res.card(card)
            container = _own_container(spec, ask)
            count = str(ask.shares)
            _set_resources(container, policy, {res.shares: count, card_resource: count})
            set_env(container, names.VISIBLE_DEVICES_ENV, card_text)
            set_env(container, names.FRACTION_ENV, quantities.fraction_text(ask.shares, policy.shares_per_card))
        elif ask.passthrough:
            # Whole cards from another device plugin: its value must reach the container, not a
            # user's "all" (the container's own env wins over the plugin's).
            if env_value(spec[ask.list_key][ask.position], names.VISIBLE_DEVICES_ENV):
                remove_env(_own_container(spec, ask), names.VISIBLE_DEVICES_ENV)
        elif policy.hide_unrequested_gpus:
            set_env(_own_container(spec, ask), names.VISIBLE_DEVICES_ENV, names.VISIBLE_NONE)
    if card is not None and policy.runtime_class_name and not spec.get("runtimeClassName"):
        # The author's runtime class is kept: they may run a runtime of their own that also hands out GPUs.
        spec["runtimeClassName"] = policy.runtime_class_name
    if card is not None:
        meta = _own(new, "metadata")
        annotations, labels = meta.get("annotations"), meta.get("labels")  # as in meta_was, when a mapping
        ours = {names.CARD_ANNOTATION: str(card), names.SHARES_ANNOTATION: str(pod_shares)}
        if sized is not None:
            ours[names.MEMORY_ANNOTATION] = str(sized[1])
            ours[names.CARD_MEMORY_ANNOTATION] = str(sized[0])
        meta["annotations"] = {**annotations, **ours} if isinstance(annotations, dict) else {**ours}
        meta["labels"] = {**labels, **_SHARED} if isinstance(labels, dict) else {**_SHARED}
    return new


_SHARED = {names.SHARED_LABEL: names.SHARED_LABEL_VALUE}  # read, never changed


def prefer_node(spec: dict, node: str, required: bool = False) -> None:
    """Name ``node`` in a preferred term (and, with ``required``, AND it into the required terms)."""
    affinity = spec.get("affinity")
    affinity = affinity if isinstance(affinity, dict) else None
    node_aff = affinity.get("nodeAffinity") if affinity is not None else None
    node_aff = node_aff if isinstance(node_aff, dict) else None
    key = "preferredDuringSchedulingIgnoredDuringExecution"
    terms = node_aff.get(key) if node_aff is not None else None
    terms = terms if isinstance(terms, list) else None
    term = placement.preferred_affinity_term(node)
    new_aff = {**(node_aff or {}), key: [*(terms or ()), term]}
    if required:
        new_aff[REQUIRED] = _with_required_node(new_aff.get(REQUIRED), node)
    spec["affinity"] = {**(affinity or {}), "nodeAffinity": new_aff}


REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def _require_card_memory(spec: dict, card: int, size_mib: int) -> None:
    """AND ``card``'s memory label ``In [size_mib]`` into the pod's required node affinity.

    The shares were computed for that card size; without this the scheduler could bind the pod to
    a node whose card ``card`` is smaller (the same index, a different model), where the shares
    hold less memory than the pod asked.
    """
    affinity = spec.get("affinity")
    affinity = affinity if isinstance(affinity, dict) else {}
    node_aff = affinity.get("nodeAffinity")
    node_aff = node_aff if isinstance(node_aff, dict) else {}
    expression = placement.card_memory_expression(card, size_mib)
    required = node_aff.get(REQUIRED)
    found = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(found, list) or not found or not all(isinstance(t, dict) for t in found):
        kept = required if isinstance(required, dict) else {}
        new_required = {**kept, "nodeSelectorTerms": [{"matchExpressions": [expression]}]}
    else:
        terms = []
        for t in found:
            exprs = t.get("matchExpressions")
            terms.append({**t, "matchExpressions": [*(exprs if isinstance(exprs, list) else ()), expression]})
        new_required = {**cast(dict, required), "nodeSelectorTerms": terms}
    spec["affinity"] = {**affinity, "nodeAffinity": {**node_aff, REQUIRED: new_required}}


def _with_required_node(required: Any, node: str) -> dict:
    """The required node affinity with ``metadata.name In [node]`` ANDed into each of its terms.

    Terms are ORed and a term's expressions ANDed, so the expression goes into every term; the node
    satisfies at least one of them, since placement chose it among the nodes the pod may run on.
    Without terms, one term holds the expression alone.
    """
    expression = placement.required_node_expression(node)
    found = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(found, list) or not found or not all(isinstance(t, dict) for t in found):
        kept = required if isinstance(required, dict) else {}
        return {**kept, "nodeSelectorTerms": [{"matchFields": [expression]}]}
    terms = []
    for t in found:
        fields = t.get("matchFields")
        terms.append({**t, "matchFields": [*(fields if isinstance(fields, list) else ()), expression]})
    return {**required, "nodeSelectorTerms": terms}


def template(obj: dict, path: tuple[str, ...], asks: list[req.ContainerAsk], policy: Policy) -> dict:
    """The workload with fractional asks turned into integer shares, so the API server accepts it."""
    new = dict(obj)
    holder = new
    for key in path:
        holder = _own(holder, key)
    spec = _own_spec(holder)
    for ask in asks:
        if ask.memory_mib is not None:
            _memory_in_limits(spec, ask, policy)
            continue
        if ask.holds_share and ask.fraction is not None and ask.fraction < 1:
            wanted = {policy.resources.shares: str(ask.shares)}
            if ask.pin is not None:  # an explicit pin stays: every pod of the workload keeps it
                wanted[policy.resources.card(ask.pin)] = str(ask.shares)
            _set_resources(_own_container(spec, ask), policy, wanted)
    return new


def _memory_in_limits(spec: dict, ask: req.ContainerAsk, policy: Policy) -> None:
    """A template's memory ask stays as written (an integer quantity the API server takes for an
    extended resource); one written in requests alone is copied to limits, since the API server
    requires a limit for an extended resource. Each pod's CREATE turns it into shares."""
    name = policy.resources.memory
    resources: Any = spec[ask.list_key][ask.position].get("resources") or {}
    limits, requests = resources.get("limits"), resources.get("requests")
    if isinstance(limits, dict) and name in limits:
        return
    container = _own_container(spec, ask)
    resources = _own(container, "resources")
    _own(resources, "limits")[name] = requests[name]
    resources["requests"] = dict(requests)


def pod_template(obj: dict, path: tuple[str, ...]) -> dict:
    node: Any = obj
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return {}
    return node
