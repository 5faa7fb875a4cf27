"""One structured log line per denial and per internal error, so operators can find who was refused and why."""

from __future__ import annotations

import json
import logging
from typing import cast

log = logging.getLogger("gpushard.admission.decisions")

DENIED = "denied"
INVALID = "invalid"
ERROR = "error"
# A message quotes what the user wrote; the log keeps a bounded part of it.
MESSAGE_MAX = 300


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def fields(event: str, request: dict, mode: str, rules: tuple[str, ...] = (), code: int | None = None,
           message: str = "") -> dict:
    """The line's fields, from the AdmissionReview request as sent (the object may be unreadable)."""
    obj = cast(dict, request.get("object") if isinstance(request.get("object"), dict) else {})
    meta = cast(dict, obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {})
    kind = cast(dict, request.get("kind") if isinstance(request.get("kind"), dict) else {})
    out = {
        "event": event,
        "mode": mode,
        "uid": _text(request.get("uid")),
        "operation": _text(request.get("operation")),
        "kind": _text(kind.get("kind")),
        # A pod created by a controller has no name yet, only generateName; the request's
        # namespace is set even when the object omits it.
        "namespace": _text(request.get("namespace")) or _text(meta.get("namespace")),
        "name": _text(request.get("name")) or _text(meta.get("name")) or _text(meta.get("generateName")),
        "rule": ",".join(rules) or None,
        "code": code,
        "message": message[:MESSAGE_MAX] if message else None,
    }
    return {key: value for key, value in out.items() if value is not None}


# Built once: json.dumps with options builds a new encoder on every call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def line(values: dict) -> str:
    """One JSON object on one line: the message never breaks the line (json escapes newlines)."""
    return _ENCODER.encode(values)


def denied(request: dict, mode: str, rules: tuple[str, ...], code: int, message: str) -> None:
    event = INVALID if code == 400 else DENIED
    log.warning(line(fields(event, request, mode, rules, code, message)))


def failed(request: dict, mode: str, exc: BaseException) -> None:
    """An internal error: the structured line, and the traceback only when debugging is on."""
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    log.error(line(fields(ERROR, request, mode, code=500, message=reason)),
              exc_info=exc if log.isEnabledFor(logging.DEBUG) else None)
