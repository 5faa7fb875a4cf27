"""`gpushard review`: the webhook's decision, offline, for manifests on disk."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import IO, Any, cast

import yaml

from webhook import kubectlflags
from webhook import settings as settings_mod
from webhook.core import asks as req
from webhook.core import auditing, decisions, extended, names
from webhook.core import findings as f
from webhook.core.policy import Policy

# `--mode none`: the namespace did not opt in, so the webhook never sees the object.
OUTSIDE = "none"
MODES = (*names.MODES, OUTSIDE)


class ManifestError(ValueError):
    """A manifest file that cannot be read; the message names the file."""


def documents(paths: list[str]) -> Iterator[tuple[str, int, object]]:
    """(file, document number, object) for every YAML document; List kinds are opened up."""
    for path in paths:
        try:
            text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        except OSError as exc:
            raise ManifestError(f"gpushard: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ManifestError(f"gpushard: cannot read {path}: not UTF-8 text") from None
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            raise ManifestError(f"gpushard: {path} is not valid YAML: {exc}") from None
        for number, doc in enumerate(docs, start=1):
            if doc is None:
                continue
            if isinstance(doc, dict) and str(doc.get("kind", "")).endswith("List") and isinstance(
                    doc.get("items"), list):
                for item in doc["items"]:
                    yield path, number, item
            else:
                yield path, number, doc


def describe(obj: object) -> str:
    if not isinstance(obj, dict):
        return "object"
    meta = cast(dict, obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {})
    name = meta.get("name") or meta.get("generateName") or "(no name)"
    ns = meta.get("namespace")
    return f"{obj.get('kind', '?')} {ns + '/' if ns else ''}{name}"


def summary(decision: decisions.Decision, mode: str) -> str:
    """One line saying what gpushard did (or would do) with an object."""
    if not decision.allowed:
        return f"denied ({decision.code}): {decision.message}"
    if mode == names.MODE_AUDIT:
        return f"allowed unchanged, {len(decision.findings)} finding(s)"
    if decision.card is not None:
        where = f" on node {decision.node}" if decision.node else ""
        return f"admitted: {decision.shares} shares of card {decision.card}{where}"
    if decision.shares:
        return f"admitted: each pod will ask {decision.shares} shares of one card"
    return "admitted"


def _namespace_modes(items: list[tuple[str, int, object]]) -> dict[str, auditing.NamespaceMode]:
    """The mode of every Namespace among the manifests, read as the webhook's selector reads the label."""
    modes = {}
    for _path, _number, obj in items:
        if isinstance(obj, dict) and obj.get("kind") == auditing.NAMESPACE_KIND:
            ref = auditing.ref_of(obj)
            meta = cast(dict, obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {})
            modes[ref.name] = auditing.namespace_mode(ref.name, meta.get("labels"))
    return modes


def _mode_for(obj: object, modes: dict[str, auditing.NamespaceMode], default: str) -> tuple[str, str]:
    """(mode, why) for an object: its Namespace among the manifests decides, else ``default``."""
    if not isinstance(obj, dict):
        return default, ""
    namespace = auditing.ref_of(obj).namespace or "default"
    ns = modes.get(namespace)
    if ns is None:
        why = f"review ran with --mode {OUTSIDE}" if default == OUTSIDE else ""
        return default, why
    if ns.problem:
        return OUTSIDE, f"namespace \"{namespace}\" has a {names.MODE_LABEL} value the webhook does not act on"
    if ns.mode is None:
        return OUTSIDE, f"namespace \"{namespace}\" has no {names.MODE_LABEL} label"
    return ns.mode, ""


def _asks_gpushard(obj: dict, kind: str, policy: Policy) -> str | None:
    """The first container that names the shares or a card resource, as the opt-in guard checks it."""
    try:
        spec = decisions.spec_of(obj, kind)
        listed = req.containers(spec) if spec else []
    except f.ObjectError:
        return None
    res = policy.resources
    for _key, _i, container in listed:
        resources = cast(dict, container.get("resources") if isinstance(container.get("resources"), dict) else {})
        for part in ("limits", "requests"):
            asked = cast(dict, resources.get(part) if isinstance(resources.get(part), dict) else {})
            if any(str(k) == res.shares or str(k).startswith(res.card_prefix) for k in asked):
                return str(container.get("name") or "")
    return None


def _outside(obj: Any, kind: str, why: str, policy: Policy) -> decisions.Decision:
    """An object in a namespace that did not opt in: nothing rewrites it; the opt-in guard may deny it."""
    name = _asks_gpushard(obj, kind, policy) if isinstance(obj, dict) else None
    if name is not None:
        return decisions.Decision(allowed=False, code=403, message=(
            f"gpushard: container \"{name}\" asks {names.DOMAIN}/* resources in a namespace that does not enforce "
            f"gpushard ({why}); the opt-in policy denies it: label the namespace {names.MODE_LABEL}=enforce"))
    return decisions.Decision(allowed=True, obj=obj, message=f"not rewritten: {why}, so the webhook never sees it")


def _name(obj: object) -> str:
    """kubectl's ``-o name`` form of an object (``pod/web``, ``deployment.apps/train``)."""
    kind = obj.get("kind") if isinstance(obj, dict) else None
    meta = cast(dict, obj.get("metadata") if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict) else {})
    name = meta.get("name") or meta.get("generateName") or "(no name)"
    return kubectlflags.resource_name(kind if isinstance(kind, str) and kind else "object", str(name))


def _decisions(items: list[tuple[str, int, object]], settings: settings_mod.Settings, view,
               mode: str, served=None) -> Iterator[tuple[str, int, object, decisions.Decision, str]]:
    """(file, document, object, decision, one-line summary) for each manifest, in order.

    A Namespace among the manifests sets the mode of the objects in it (``mode`` is for the
    rest): without the label, nothing is rewritten, and the summary says so.
    """
    modes = _namespace_modes(items)
    for path, number, obj in items:
        kind = obj.get("kind", "") if isinstance(obj, dict) else ""
        kind = kind if isinstance(kind, str) else ""
        here, why = _mode_for(obj, modes, mode)
        if here == OUTSIDE:
            decision = _outside(obj, kind, why or "the namespace did not opt in", settings.policy)
        else:
            request = decisions.Request(obj, kind, mode=here, served=served or extended.NONE)
            decision = decisions.decide(request, settings.policy, view.snapshot() if view else None)
        if decision.allowed and decision.card is not None and decision.shares > 0 and view is not None:
            view.remember(decision.node, decision.card, decision.shares)
        line = decision.message if here == OUTSIDE and decision.allowed else summary(decision, here)
        yield path, number, obj, decision, line


def review_files(paths: list[str], settings: settings_mod.Settings, view, mode: str, out: IO[str],
                 output: str = kubectlflags.YAML, served=None) -> int:
    """Print each object as gpushard admits it, or its denial. Exit 1 if any is denied, 2 if unreadable.

    ``served``: the extended resources DeviceClasses of other drivers serve (a cluster file's), if any.

    ``output`` yaml: the objects, each after a comment with the decision; json: a v1 List of the
    admitted objects, decisions on stderr; name: ``kind/name`` of each admitted object, decisions
    on stderr.
    """
    try:
        items = list(documents(paths))
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return kubectlflags.USAGE
    denied, admitted = False, []
    for i, (path, number, obj, decision, line) in enumerate(_decisions(items, settings, view, mode, served)):
        denied = denied or not decision.allowed
        heading = f"gpushard: {describe(obj)} ({path}, document {number}): {line}"
        if output != kubectlflags.YAML:
            print(heading, file=sys.stderr)
            if decision.allowed:
                admitted.append(decision.obj if decision.obj is not None else obj)
            continue
        if i:
            out.write("---\n")
        out.write(f"# {heading}\n")
        for warning in decision.warnings:
            out.write(f"# warning: {warning}\n")
        for note in (x.message for x in decision.findings if x.severity == f.NOTE):
            out.write(f"# note: {note}\n")
        if decision.allowed and decision.obj is not None:
            out.write(yaml.safe_dump(decision.obj, sort_keys=False, default_flow_style=False))
    if output == kubectlflags.JSON:
        out.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": admitted}, indent=2) + "\n")
    elif output == kubectlflags.NAME:
        out.write("".join(_name(obj) + "\n" for obj in admitted))
    return kubectlflags.FOUND if denied else kubectlflags.OK
