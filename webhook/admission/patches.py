"""JSONPatches (RFC 6902) from an object to the object gpushard admits, made by walking only what changed."""

from __future__ import annotations

from typing import Any

# jsonpatch.make_patch searches for the shortest edit of every list it meets; on a pod
# that costs ~0.35 ms, most of a review (bench/admission.py). The core's rewrite shares every
# subtree it leaves alone with the original object and copies only the paths it changes, so
# a walk that skips shared subtrees by identity, recurses into the copied ones, and appends
# to or replaces the rest costs only what changed. The tests apply every patch with jsonpatch
# and compare the result with the core's object.
#
# Python's == holds 1 == 1.0 == True where JSON does not, so leaves compare by type too.


def pointer_token(key: object) -> str:
    """A JSON Pointer reference token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON documents (True is not 1, 1 is not 1.0)."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        return a.keys() == b.keys() and all(_same(value, b[key]) for key, value in a.items())
    if kind is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _diff(a: Any, b: Any, path: str, out: list[dict]) -> None:
    if a is b:
        return
    kind = type(a)
    if kind is dict and type(b) is dict:
        kept = 0
        for key, value in a.items():
            if key not in b:
                out.append({"op": "remove", "path": f"{path}/{pointer_token(key)}"})
                continue
            kept += 1
            if b[key] is not value:  # shared subtrees are the common case: skip them cheaply
                _diff(value, b[key], f"{path}/{pointer_token(key)}", out)
        if kept == len(b):
            return  # every key of b is one of a's: nothing to add
        for key, value in b.items():
            if key not in a:
                out.append({"op": "add", "path": f"{path}/{pointer_token(key)}", "value": value})
        return
    if kind is list and type(b) is list:
        if len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if x is not y:
                    _diff(x, y, f"{path}/{i}", out)
            return
        if len(b) > len(a) and _same(a, b[: len(a)]):
            out.extend({"op": "add", "path": f"{path}/-", "value": v} for v in b[len(a):])
            return
    elif kind is type(b) and kind is not dict and kind is not list and a == b:
        return
    out.append({"op": "replace", "path": path, "value": b})


def make(original: Any, new: Any) -> list[dict]:
    """The operations that turn ``original`` into ``new``; empty when they are the same document."""
    out: list[dict] = []
    _diff(original, new, "", out)
    return out
