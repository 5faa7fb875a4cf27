"""JSONPatches (RFC 6902) from an object to the object gpushard admits, made by walking only what changed."""

from __future__ import annotations

import json

# jsonpatch.make_patch searches for the shortest edit of every list it meets; on a pod
# that costs ~0.35 ms, most of a review (bench/admission.py). The core's rewrite copies
# the object and changes a few leaves, so a walk that skips equal subtrees, recurses into
# lists of equal length, and appends to or replaces the rest is ~25 times cheaper. The
# tests apply every patch with jsonpatch and compare the result with the core's object.
#
# Python's == holds 1 == 1.0 == True where JSON does not: a subtree that == calls equal is
# confirmed by its JSON text (the C encoder, so still cheap) before it is skipped.

_encode = json.JSONEncoder(check_circular=False, separators=(",", ":")).encode


def _equal(a: object, b: object) -> bool:
    """Equal as JSON documents (True is not 1, 1 is not 1.0), or at worst reported unequal."""
    if type(a) is not type(b) or a != b:
        return False
    # Key order may differ between equal objects; then the caller looks inside, and finds nothing.
    return not isinstance(a, (dict, list)) or _encode(a) == _encode(b)


def escape(key: object) -> str:
    """A JSON Pointer reference token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def _diff(a: object, b: object, path: str, out: list[dict]) -> None:
    if _equal(a, b):
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key, value in a.items():
            where = f"{path}/{escape(key)}"
            if key not in b:
                out.append({"op": "remove", "path": where})
            else:
                _diff(value, b[key], where, out)
        for key, value in b.items():
            if key not in a:
                out.append({"op": "add", "path": f"{path}/{escape(key)}", "value": value})
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                _diff(x, y, f"{path}/{i}", out)
            return
        if len(b) > len(a) and _equal(a, b[: len(a)]):
            out.extend({"op": "add", "path": f"{path}/-", "value": v} for v in b[len(a):])
            return
    out.append({"op": "replace", "path": path, "value": b})


def make(original: object, new: object) -> list[dict]:
    """The operations that turn ``original`` into ``new``; empty when they are the same document."""
    out: list[dict] = []
    _diff(original, new, "", out)
    return out
