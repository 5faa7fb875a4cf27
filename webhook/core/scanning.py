"""JSON read without recursion, for the documents the standard parser gives up on.

The API server stores and sends objects nested far deeper than Python's parser goes (a pod's
``managedFields`` as sent to admission, a ResourceClaim's opaque parameters): such a document is
valid JSON that ``json.loads`` refuses with RecursionError. What gpushard still needs of it is
found here by a flat scan of its tokens, never a parse: the uid of an AdmissionReview (to answer
it rather than fail the call), where its nesting goes too deep (to say so), and the items of a
listed page (to parse each on its own and skip only the one that cannot be).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

# One token: a string (unrolled, so a megabyte of plain characters is one match), a structural
# character, or a run of anything else (a number, true, false, null, or garbage).
_TOKEN = re.compile(rb'\s*(?:("[^"\\]*(?:\\.[^"\\]*)*")|([{}\[\]:,])|([^\s{}\[\]:,"]+))', re.S)
# How deep a path in a message goes, and how long a key in it may be.
_PATH_PARTS = 8
_KEY_MAX = 40


class Unreadable(ValueError):
    """The scan met something that is no JSON token (or a document cut short)."""


def _tokens(data: bytes) -> Iterator[tuple[bytes, int, int]]:
    """(kind, start, end) of each token: kind is b'"' for a string, the character itself for
    structure, and b'x' for any other run."""
    pos, size = 0, len(data)
    match = _TOKEN.match
    while pos < size:
        m = match(data, pos)
        if m is None:
            if data[pos:].strip():
                raise Unreadable(f"not JSON at byte {pos}")
            return
        if m.group(1) is not None:
            yield b'"', m.start(1), m.end(1)
        elif m.group(2) is not None:
            yield m.group(2), m.start(2), m.end(2)
        elif m.group(3) is not None:
            yield b"x", m.start(3), m.end(3)
        else:  # trailing white space
            return
        pos = m.end()


def _events(data: bytes) -> Iterator[tuple[str, list, int, int]]:
    """("open" | "close" | "scalar", path, start, end) for each value, in document order.

    ``path`` is the list of keys and indexes down to the value (shared and changed as the scan
    goes on: copy what you keep). A container's "close" carries the start of its "open".
    """
    path: list = []
    stack: list[list] = []  # per open container: [kind, start, expecting a key, next index]
    key: object = None
    for kind, start, end in _tokens(data):
        if kind in (b",", b":"):
            if kind == b"," and stack and stack[-1][0] == b"{":
                stack[-1][2] = True
            continue
        top = stack[-1] if stack else None
        if top is not None and top[0] == b"{" and top[2] and kind == b'"':
            key = _string(data, start, end)
            top[2] = False
            continue
        if kind in (b"}", b"]"):
            if top is None:
                raise Unreadable(f"unbalanced {kind.decode()} at byte {start}")
            stack.pop()
            yield "close", path, top[1], end
            if path:
                path.pop()
            continue
        # A value: where it stands.
        if top is not None:
            if top[0] == b"[":
                path.append(top[3])
                top[3] += 1
            else:
                path.append(key)
        if kind in (b"{", b"["):
            stack.append([kind, start, kind == b"{", 0])
            yield "open", path, start, end
        else:
            yield "scalar", path, start, end
            if path:
                path.pop()


def _string(data: bytes, start: int, end: int) -> str:
    try:
        value = json.loads(data[start:end])
    except ValueError:
        value = data[start + 1:end - 1].decode("utf-8", "replace")
    return value if isinstance(value, str) else str(value)


def review_uid(prefix: bytes) -> str | None:
    """The ``request.uid`` of an AdmissionReview from the first bytes of its body, or None.

    The API server writes the request's uid before its object (its Go struct's field order), so
    the start of a body too large or too deep to parse still names the review it answers.
    """
    try:
        for event, path, start, end in _events(prefix):
            if event == "scalar" and len(path) == 2 and path[0] == "request" and path[1] == "uid":
                value = _string(prefix, start, end) if prefix[start:start + 1] == b'"' else None
                return value or None
            if event == "close" and not path:
                return None
    except Unreadable:
        return None
    return None


def too_deep(data: bytes, limit: int) -> str | None:
    """The path at which ``data`` first nests deeper than ``limit`` levels, as text; None if it never does."""
    try:
        for event, path, _start, _end in _events(data):
            if event == "open" and len(path) >= limit:
                return path_text(path)
    except Unreadable:
        return None
    return None


def path_text(path: list) -> str:
    """``request.object.metadata.managedFields[0].fieldsV1.f:a...``: its first parts, keys cut short."""
    out = []
    for part in path[:_PATH_PARTS]:
        if isinstance(part, int):
            out.append(f"[{part}]")
        else:
            text = part if len(part) <= _KEY_MAX else part[:_KEY_MAX - 3] + "..."
            out.append(("." if out else "") + text)
    if len(path) > _PATH_PARTS:
        out.append("...")
    return "".join(out)


def list_items(page: bytes) -> tuple[bytes, list[bytes]]:
    """A listed page (``{"metadata": {...}, "items": [...]}``) cut into its metadata and each item's bytes.

    Raises Unreadable when the page is no JSON object of that form.
    """
    metadata = b"{}"
    items: list[bytes] = []
    for event, path, start, end in _events(page):
        if event == "close" and not path:
            return metadata, items
        if len(path) == 1 and path[0] == "metadata" and event in ("close", "scalar"):
            metadata = page[start:end]
        elif len(path) == 2 and path[0] == "items" and event in ("close", "scalar"):
            items.append(page[start:end])
    raise Unreadable("the page ends before its object does")
