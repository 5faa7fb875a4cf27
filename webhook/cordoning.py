"""`gpushard cordon` and `gpushard uncordon`: an operator takes one card of a node out of new placements, and back.

A cordon is the annotation gpushard.io/card-<k>.cordoned on the Node (webhook.core.names), one per
card, written here by a JSON merge patch of that one key, so that operators cordoning two cards of
one node at once never undo each other. Its value records why, who (the API server's own answer
to a SelfSubjectReview, as `kubectl auth whoami` asks it) and when. The webhook reads it and places
no new pod on the card; the node's agent reads it and stops offering the card's shares; pods on
the card keep running. Each change is also told by a core/v1 Event on the Node, which
`kubectl describe node` shows.

Who may cordon is who may patch nodes (and create events): the `gpushard-cordoner` ClusterRole
(deploy/base/rbac-cordon.yaml) grants exactly that, bound to nobody by the install.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import uuid
from typing import IO, Any

from webhook import kubectlflags
from webhook.core import names, objects
from webhook.kubeapi import connecting

MERGE_PATCH = "application/merge-patch+json"
# Where Events about cluster-scoped objects go, as client-go's recorder puts a Node's.
EVENT_NAMESPACE = "default"
MAX_REASON = 512
EVENT_MESSAGE_LIMIT = 1024  # what the API server keeps of an Event's message


class CordonError(Exception):
    """Bad input (exit 2): the message starts with gpushard: and says what to do."""


def card_index(text: str) -> int:
    """The CARD argument: a card's index, as `gpushard status` lists it."""
    value = text.strip()
    if not (value.isascii() and value.isdigit()) or len(value) > 9:
        raise CordonError(f"gpushard: card {text!r} is not a card index; give the card's number, e.g. 0 or 3 "
                          "(gpushard status lists each node's cards)")
    return int(value)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _node(core, conn: connecting.Client, name: str) -> dict:
    # A list of the one Node by name, as the agent reads its own (RBAC: list on nodes).
    with connecting.reaching(conn.target, f"read node {name!r}"):
        response = core.list_node(field_selector=f"metadata.name={name}", _preload_content=False,
                                  _request_timeout=conn.timeout)
        items = json.loads(response.data).get("items") or []
    if not items:
        raise CordonError(f"gpushard: no node {name!r} in the cluster at {conn.target.host} (context "
                          f"{conn.target.context}); kubectl get nodes lists them")
    return items[0]


def whoami(conn: connecting.Client) -> str:
    """The user the API server takes these credentials for (a SelfSubjectReview); "" where it will not say."""
    import kubernetes

    # Any: the client takes a manifest for its model, and answers raw (_preload_content=False) with the HTTP response.
    review: Any = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    with connecting.reaching(conn.target, "ask who this account is (selfsubjectreviews)"):
        try:
            response: Any = kubernetes.client.AuthenticationV1Api(conn.api).create_self_subject_review(
                review, _preload_content=False, _request_timeout=conn.timeout)
        except kubernetes.client.ApiException as exc:
            if exc.status == 401:
                raise
            return ""  # an API server before 1.28, or a role without it: the cordon is recorded without a name
        body = json.loads(response.data)
    user = objects.mapping(objects.mapping(body.get("status")).get("userInfo"))
    return str(user.get("username") or "")


def _card_words(index: int, inventory: dict[int, dict]) -> str:
    entry = inventory.get(index) or {}
    known = ", ".join(str(entry[k]) for k in ("uuid", "model") if entry.get(k))
    return f"card {index}" + (f" ({known})" if known else "")


def _event(core, conn: connecting.Client, node: dict, reason: str, action: str, message: str) -> None:
    meta = objects.meta(node)
    name = str(meta.get("name") or "")
    stamp = _now()
    body = {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": EVENT_NAMESPACE},
            # kubectl describe node finds a Node's events by its name, kind and uid.
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": str(meta.get("uid") or name)},
            "reason": reason, "message": message[:EVENT_MESSAGE_LIMIT], "type": "Normal", "action": action,
            "count": 1, "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": names.CORDON_COMPONENT},
            "reportingComponent": names.CORDON_COMPONENT, "reportingInstance": socket.gethostname()[:128]}
    with connecting.reaching(conn.target, f"create an Event in namespace {EVENT_NAMESPACE!r}"):
        core.create_namespaced_event(EVENT_NAMESPACE, body, _preload_content=False, _request_timeout=conn.timeout)


def change(conn: connecting.Client, node_name: str, index: int, cordon: bool, reason: str = "",
           out: IO[str] | None = None) -> None:
    """Cordon (or uncordon) card ``index`` of ``node_name`` and record it; raises CordonError on bad input and
    connecting.ApiError when the API cannot be reached or forbids a call."""
    import kubernetes

    out = out or sys.stdout
    core = kubernetes.client.CoreV1Api(conn.api)
    node = _node(core, conn, node_name)
    annotations = objects.mapping(objects.meta(node).get("annotations"))
    inventory = objects.read_inventory(annotations.get(names.INVENTORY_ANNOTATION))
    cordons = objects.read_cordons(annotations)
    key = names.card_cordon_annotation(index)
    where = f"node/{node_name} card {index}"
    if index not in inventory and not (not cordon and index in cordons):
        if names.INVENTORY_ANNOTATION not in annotations:
            raise CordonError(f"gpushard: node {node_name!r} has no gpushard inventory (annotation "
                              f"{names.INVENTORY_ANNOTATION}): no agent publishes its cards there, so it has no card "
                              "to cordon")
        listed = ", ".join(map(str, inventory)) or "none"
        raise CordonError(f"gpushard: node {node_name!r} has no card {index}: its agent lists cards {listed} "
                          f"(annotation {names.INVENTORY_ANNOTATION})")
    if cordon and index in cordons:
        print(f"{where} already cordoned ({cordons[index].said()})", file=out)
        return
    if not cordon and index not in cordons:
        print(f"{where} already uncordoned", file=out)
        return
    by = whoami(conn)
    card = _card_words(index, inventory)
    patch: dict[str, Any]
    if cordon:
        record = objects.Cordon(reason=reason, by=by, at=_now())
        patch = {"metadata": {"annotations": {key: objects.write_cordon(record)}}}
        message = (f"gpushard: {card} cordoned{f' by {by}' if by else ''}{f': {reason}' if reason else ''}; no new "
                   "pod is placed on it, and the pods on it keep running")
    else:
        patch = {"metadata": {"annotations": {key: None}}}
        message = (f"gpushard: {card} uncordoned{f' by {by}' if by else ''}; it takes new pods again (it was "
                   f"cordoned {cordons[index].said()})")
    with connecting.reaching(conn.target, f"patch node {node_name!r}"):
        core.patch_node(node_name, patch, _content_type=MERGE_PATCH, _preload_content=False,
                        _request_timeout=conn.timeout)
    if cordon:
        print(f"{where} cordoned: no new pod is placed on it; the pods on it keep running (gpushard status "
              "shows them)", file=out)
    else:
        print(f"{where} uncordoned: it takes new pods again", file=out)
    try:
        _event(core, conn, node, names.CORDONED_REASON if cordon else names.UNCORDONED_REASON,
               "Cordon" if cordon else "Uncordon", message)
    except connecting.ApiError as exc:
        raise connecting.ApiError(f"gpushard: {where} is {'cordoned' if cordon else 'uncordoned'}, but its Event was "
                                  f"not recorded: {str(exc).removeprefix('gpushard: ')}", exc.status) from None


def run(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """`gpushard cordon NODE CARD` (``args.cordon``) or `gpushard uncordon NODE CARD`: the exit status."""
    import kubernetes

    out, err = out or sys.stdout, err or sys.stderr
    command = "cordon" if args.cordon else "uncordon"
    try:
        index = card_index(args.card)
        reason = " ".join(str(getattr(args, "reason", "") or "").split())
        if len(reason) > MAX_REASON:
            raise CordonError(f"gpushard: --reason is {len(reason)} characters; keep it to {MAX_REASON} (it is "
                              "stored on the Node)")
        conn = kubectlflags.client_for(args)
        change(conn, args.node, index, args.cordon, reason, out)
    except (CordonError, connecting.ConfigError) as exc:
        print(exc, file=err)
        return kubectlflags.USAGE
    except connecting.ApiError as exc:
        print(exc, file=err)
        return kubectlflags.UNREACHABLE
    except kubernetes.client.ApiException as exc:
        print(f"gpushard: {command} failed: the Kubernetes API answered {connecting.failure_text(exc)}", file=err)
        return kubectlflags.USAGE
    return kubectlflags.OK
