"""Building the rewritten pod or template: new objects out, the input never touched."""

from __future__ import annotations

from webhook.core import names, placement, quantities
from webhook.core import requests as req
from webhook.core.policy import Policy

# The rewrite copies only the path to what it changes and shares every untouched subtree with
# the input (which it never changes). The admission server's patch walk then skips shared
# subtrees by identity, so a review costs what gpushard changes, not the size of the pod.


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
    if not isinstance(env, list):
        env = []
    same = [e for e in env if isinstance(e, dict) and e.get("name") == name]
    if not same:  # the usual case: nothing to drop, one walk of the list
        container["env"] = [*env, {"name": name, "value": value}]
        return
    if len(same) == 1 and same[0] == {"name": name, "value": value}:
        return
    container["env"] = [e for e in env if not (isinstance(e, dict) and e.get("name") == name)]
    container["env"].append({"name": name, "value": value})


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
    """Replace every GPU resource in limits and requests by ``wanted``, keeping the rest."""
    res = policy.resources
    resources = _own(container, "resources")
    for part in ("limits", "requests"):
        current = resources.get(part)
        current = dict(current) if isinstance(current, dict) else {}
        for key in list(current):
            if key in (res.fraction, res.shares) or (
                    isinstance(key, str) and key.startswith(res.card_prefix) and res.card_index(key) is not None):
                del current[key]
        current.update(wanted)
        resources[part] = current


def pod(obj: dict, asks: list[req.ContainerAsk], card: int | None, pod_shares: int, policy: Policy,
        node: str | None = None) -> dict:
    """The pod as gpushard admits it: shares pinned to ``card``, env owned, metadata marked.

    ``node``, when placement found room there, becomes a soft preference: the scheduler may
    still pick any node whose card ``card`` has room, but packing follows the choice.
    """
    new = dict(obj)
    spec = _own_spec(new)
    if node is not None and not spec.get("nodeName") and placement.preferred_node(spec) is None:
        _prefer_node(spec, node)
    res = policy.resources
    for ask in asks:
        if ask.holds_share:
            container = _own_container(spec, ask)
            count = str(ask.shares)
            _set_resources(container, policy, {res.shares: count, res.card(card): count})
            set_env(container, names.VISIBLE_DEVICES_ENV, str(card))
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
        annotations = meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {}
        labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
        meta["annotations"] = {**annotations, names.CARD_ANNOTATION: str(card),
                               names.SHARES_ANNOTATION: str(pod_shares)}
        meta["labels"] = {**labels, names.SHARED_LABEL: names.SHARED_LABEL_VALUE}
    return new


def _prefer_node(spec: dict, node: str) -> None:
    affinity = spec.get("affinity") if isinstance(spec.get("affinity"), dict) else {}
    node_aff = affinity.get("nodeAffinity") if isinstance(affinity.get("nodeAffinity"), dict) else {}
    key = "preferredDuringSchedulingIgnoredDuringExecution"
    terms = node_aff.get(key) if isinstance(node_aff.get(key), list) else []
    term = placement.preferred_affinity_term(node)
    spec["affinity"] = {**affinity, "nodeAffinity": {**node_aff, key: [*terms, term]}}


def template(obj: dict, path: tuple[str, ...], asks: list[req.ContainerAsk], policy: Policy) -> dict:
    """The workload with fractional asks turned into integer shares, so the API server accepts it."""
    new = dict(obj)
    holder = new
    for key in path:
        holder = _own(holder, key)
    spec = _own_spec(holder)
    for ask in asks:
        if ask.holds_share and ask.fraction is not None and ask.fraction < 1:
            wanted = {policy.resources.shares: str(ask.shares)}
            if ask.pin is not None:  # an explicit pin stays: every pod of the workload keeps it
                wanted[policy.resources.card(ask.pin)] = str(ask.shares)
            _set_resources(_own_container(spec, ask), policy, wanted)
    return new


def pod_template(obj: dict, path: tuple[str, ...]) -> dict:
    node = obj
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return {}
    return node
