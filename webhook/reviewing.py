"""`gpushard review`: the webhook's decision, offline, for manifests on disk."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import IO

import yaml

from webhook import kubectl
from webhook import settings as settings_mod
from webhook.core import decisions, names


class ManifestError(ValueError):
    """A manifest file that cannot be read; the message names the file."""


def documents(paths: list[str]) -> Iterator[tuple[str, int, object]]:
    """(file, document number, object) for every YAML document; List kinds are opened up."""
    for path in paths:
        try:
            text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        except OSError as exc:
            raise ManifestError(f"gpushard: cannot read {path}: {exc.strerror}") from None
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
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
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


def _name(obj: object) -> str:
    """kubectl's ``-o name`` form of an object (``pod/web``, ``deployment.apps/train``)."""
    kind = obj.get("kind") if isinstance(obj, dict) else None
    meta = obj.get("metadata") if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict) else {}
    name = meta.get("name") or meta.get("generateName") or "(no name)"
    return kubectl.resource_name(kind if isinstance(kind, str) and kind else "object", str(name))


def review_files(paths: list[str], settings: settings_mod.Settings, view, mode: str, out: IO[str],
                 output: str = kubectl.YAML) -> int:
    """Print each object as gpushard admits it, or its denial. Exit 1 if any is denied, 2 if unreadable.

    ``output`` yaml: the objects, each after a comment with the decision; json: a v1 List of the
    admitted objects, decisions on stderr; name: ``kind/name`` of each admitted object, decisions
    on stderr.
    """
    if output != kubectl.YAML:
        return _review_quietly(paths, settings, view, mode, out, output)
    denied = False
    try:
        items = list(documents(paths))
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return 2
    first = True
    for path, number, obj in items:
        kind = obj.get("kind", "") if isinstance(obj, dict) else ""
        request = decisions.Request(obj, kind if isinstance(kind, str) else "", mode=mode)
        decision = decisions.decide(request, settings.policy, view.snapshot() if view else None)
        if decision.allowed and decision.node is not None and view is not None:
            view.remember(decision.node, decision.card, decision.shares)
        denied = denied or not decision.allowed
        if not first:
            out.write("---\n")
        first = False
        out.write(f"# gpushard: {describe(obj)} ({path}, document {number}): {summary(decision, mode)}\n")
        for warning in decision.warnings:
            out.write(f"# warning: {warning}\n")
        if decision.allowed and decision.obj is not None:
            out.write(yaml.safe_dump(decision.obj, sort_keys=False, default_flow_style=False))
    return 1 if denied else 0


def _review_quietly(paths: list[str], settings: settings_mod.Settings, view, mode: str, out: IO[str],
                    output: str) -> int:
    import json

    try:
        items = list(documents(paths))
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return kubectl.USAGE
    admitted, denied = [], False
    for path, number, obj in items:
        kind = obj.get("kind", "") if isinstance(obj, dict) else ""
        request = decisions.Request(obj, kind if isinstance(kind, str) else "", mode=mode)
        decision = decisions.decide(request, settings.policy, view.snapshot() if view else None)
        if decision.allowed and decision.node is not None and view is not None:
            view.remember(decision.node, decision.card, decision.shares)
        denied = denied or not decision.allowed
        print(f"gpushard: {describe(obj)} ({path}, document {number}): {summary(decision, mode)}", file=sys.stderr)
        if decision.allowed:
            admitted.append(decision.obj if decision.obj is not None else obj)
    if output == kubectl.JSON:
        out.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": admitted}, indent=2) + "\n")
    else:
        out.write("".join(_name(obj) + "\n" for obj in admitted))
    return kubectl.FOUND if denied else kubectl.OK
