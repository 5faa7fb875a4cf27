"""AdmissionReview admission.k8s.io/v1 in and out: the request read, the core asked, the answer built."""

from __future__ import annotations

import binascii
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from webhook.admission import logs, patches
from webhook.core import decisions, extended, names, placement, scanning
from webhook.core import findings as f
from webhook.core import policy as policy_mod
from webhook.core.policy import Policy

log = logging.getLogger("gpushard.admission")

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
# Kinds with a metric label of their own; anything else is counted as "other" so that a
# stream of odd kinds cannot grow the metrics without bound.
KNOWN_KINDS = frozenset([names.POD_KIND, *names.TEMPLATE_PATHS])

ALLOWED = "allowed"
PATCHED = "patched"
DENIED = "denied"
INVALID = "invalid"
ERROR = "error"
OUTCOMES = (ALLOWED, PATCHED, DENIED, INVALID, ERROR)
# A denial message and an audit annotation quote what the user wrote, which may be a
# 10,000-character "quantity": past this they are cut, so kubectl and audit logs stay readable.
TEXT_MAX = 1024
OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")
# A body the parser gives up on is scanned for how deep it nests: past this many levels it is said to be too
# deep (the parser goes to about 1,000; no object of Kubernetes' own types comes near 100).
NESTING_SAID = 500


def _no_constant(name: str) -> None:
    # Python reads NaN and Infinity; JSON has neither, and no API server sends them.
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range")
    return value


# Built once: json.loads and json.dumps with options build a new decoder or encoder per call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)
# What gpushard writes holds parts of a parsed body and its own values: no cycles to look for.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)


def loads(body: bytes | str) -> object:
    """The document as JSON reads it (UTF-8, -16 or -32; no byte order mark, NaN or infinity): ValueError or
    RecursionError when it is not JSON."""
    if isinstance(body, (bytes, bytearray)):
        body = bytes(body).decode(json.detect_encoding(body), "surrogatepass")
    if body.startswith("\ufeff"):
        raise ValueError("unexpected UTF-8 BOM")
    return _DECODER.decode(body)


def dumps(value: object) -> bytes:
    """Compact JSON, ASCII only (NaN and infinities refused)."""
    return _ENCODER.encode(value).encode("ascii")


class View(Protocol):
    """What the admission server asks of a cluster view (webhook.cluster's views offer it)."""

    def snapshot(self) -> placement.View | None: ...

    def synced(self) -> bool: ...

    def remember(self, node: str | None, card: int, shares: int) -> None: ...


class Templates(Protocol):
    """Makes sure a namespace has the ResourceClaimTemplate of a share count (backend dra)."""

    def ensure(self, namespace: str, shares: int, size_mib: int = 0) -> str | None:
        """None once the template exists; else a warning for the pod. ``size_mib``: the card size a memory ask's
        shares were computed for (0: any card)."""


class Classes(Protocol):
    """What DeviceClasses of other drivers serve (webhook.cluster's device classes offer it)."""

    def served(self) -> Mapping[str, extended.Served]: ...

    def synced(self) -> bool: ...


class Peers(Protocol):
    """Which replica this is, (rank, count), for its share of the cards (webhook.cluster.peers offers it)."""

    def share(self) -> tuple[int, int] | None: ...

    def synced(self) -> bool: ...


class BadReview(ValueError):
    """A body that is no AdmissionReview: answered with HTTP 400 and this short reason."""


class Unparsed(BadReview):
    """A body the JSON parser gives up on: an AdmissionReview that still names its uid is answered by it."""


@dataclass(slots=True)
class Answer:
    """What one review led to: the AdmissionReview to send, and labels for the metrics."""

    review: dict
    outcome: str
    kind: str
    rules: tuple[str, ...] = ()  # the denying rules, for the log line of a denial
    memory: tuple[int, int] | None = None  # (card MiB, MiB asked) of a pod admitted by its memory ask


def parse(body: bytes) -> dict:
    """The ``request`` of an AdmissionReview body, checked just enough to answer it by uid."""
    try:
        review = loads(body)
    except RecursionError:
        raise Unparsed("gpushard: the body nests deeper than gpushard reads") from None
    except ValueError:
        # Bad UTF-8, bad JSON, NaN and infinities, and integers over Python's digit limit.
        raise Unparsed("gpushard: the body is not JSON") from None
    if not isinstance(review, dict):
        raise BadReview(f"gpushard: expected an AdmissionReview object, got a JSON {type(review).__name__}")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != KIND:
        raise BadReview(f"gpushard: expected apiVersion {API_VERSION} kind {KIND}, got "
                        f"{_short(review.get('apiVersion'))} {_short(review.get('kind'))}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReview("gpushard: the AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("gpushard: the AdmissionReview request has no uid")
    return request


def encode_patch(patch: list[dict]) -> str:
    """The ``patch`` field of a response: the JSONPatch as compact JSON, base64-encoded."""
    # What base64.b64encode returns, without its Python frame.
    return binascii.b2a_base64(dumps(patch), newline=False).decode("ascii")


def _short(value: object, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clip(text: str, limit: int = TEXT_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wrapped(response: dict) -> dict:
    """The AdmissionReview that carries ``response``."""
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}


def envelope(uid: str, **response: object) -> dict:
    return wrapped({"uid": uid, **response})


def denial(uid: str, code: int, message: str, **extra: object) -> dict:
    return envelope(uid, allowed=False, status={"code": code, "message": message}, **extra)


def request_kind(request: dict) -> object:
    """The request's kind.kind, whatever its type (None when there is none)."""
    kind = request.get("kind")
    return kind.get("kind") if isinstance(kind, dict) else None


def metric_kind(kind: object) -> str:
    """The metrics' label for a kind.kind: the kinds gpushard knows, else "other"."""
    return kind if isinstance(kind, str) and kind in KNOWN_KINDS else "other"


def answer(request: dict, mode: str, policy: Policy, view: View | None, templates: Templates | None = None,
           classes: Classes | None = None, peers: Peers | None = None) -> Answer:
    """Decide one parsed request and build the AdmissionReview that answers it.

    Never raises: an object gpushard cannot read is a 400 denial, and a fault of
    gpushard's own is an explicit denial in enforce mode (the webhook's failurePolicy is
    Fail, so the pod would be refused anyway; this way the user reads why) and an
    allowed answer with a warning in audit mode, which must never block anything.
    """
    uid = request["uid"]
    kind = request_kind(request)
    kind_label = metric_kind(kind)
    try:
        result = _answer(request, uid, kind, kind_label, mode, policy, view, templates, classes, peers)
        response = result.review["response"]
        if mode == names.MODE_AUDIT and not response["allowed"]:
            # Audit mode never blocks: a review it cannot read is said as a warning.
            result.review = envelope(uid, allowed=True, warnings=[_clip(response["status"]["message"],
                                                                         decisions.WARNING_MAX)])
        elif not response["allowed"]:
            logs.denied(request, mode, result.rules, response["status"]["code"], response["status"]["message"])
        return result
    except Exception as exc:
        logs.failed(request, mode, exc)
        message = f"gpushard: internal error while reviewing this object (review {uid}); see the webhook's log"
        if mode == names.MODE_AUDIT:
            return Answer(envelope(uid, allowed=True, warnings=[message[:decisions.WARNING_MAX]]), ERROR, kind_label)
        return Answer(denial(uid, 500, message), ERROR, kind_label)


def _snapshot(view: View | None) -> placement.View | None:
    """The view's current snapshot; without one, placement still admits (a card is chosen without a view)."""
    if view is None:
        return None
    try:
        return view.snapshot()
    except Exception:
        log.exception("gpushard: the cluster view failed; choosing a card without it")
        return None


def _served(classes: Classes | None) -> Mapping[str, extended.Served]:
    """What other drivers' DeviceClasses serve, as last seen; none when that cannot be read."""
    if classes is None:
        return extended.NONE
    try:
        return classes.served()
    except Exception:
        log.exception("gpushard: the DeviceClasses view failed; judging this object without it")
        return extended.NONE


UNKNOWN_CLASSES = ("gpushard: the cluster's DeviceClasses have not been read yet, and another driver's class may "
                   "serve the resource this pod would hold; try again shortly (the webhook's log says why they cannot "
                   "be read)")


def _classes_known(classes: Classes | None) -> bool:
    """Whether the DeviceClasses of other drivers have been read (or there is nothing to read them from)."""
    if classes is None:
        return True
    try:
        return bool(classes.synced())
    except Exception:
        log.exception("gpushard: the DeviceClasses view failed")
        return False


def _share(peers: Peers | None) -> tuple[int, int] | None:
    """This replica's (rank, count); None when it is alone or that cannot be read."""
    if peers is None:
        return None
    try:
        return peers.share()
    except Exception:
        log.exception("gpushard: the replica partition failed; choosing over every card alike")
        return None


def _answer(request: dict, uid: str, kind: object, kind_label: str, mode: str, policy: Policy, view: View | None,
            templates: Templates | None = None, classes: Classes | None = None, peers: Peers | None = None) -> Answer:
    if not isinstance(kind, str) or not kind:
        return Answer(denial(uid, 400, "gpushard: the AdmissionReview request has no kind.kind"), INVALID,
                      kind_label)
    operation = request.get("operation", "CREATE")
    if operation not in OPERATIONS:
        return Answer(denial(uid, 400, f"gpushard: unknown operation {_short(operation)}"), INVALID, kind_label)
    if operation not in ("CREATE", "UPDATE"):
        # DELETE and CONNECT carry no object to rewrite; gpushard has nothing to say.
        return Answer(envelope(uid, allowed=True), ALLOWED, kind_label)
    dry_run = request.get("dryRun") is True
    obj = request.get("object")
    try:
        sub_resource = request.get("subResource")
        namespace = request.get("namespace")
        decision = decisions.decide(decisions.Request(
            obj, kind, operation, mode, dry_run, old=request.get("oldObject"),
            sub_resource=sub_resource if isinstance(sub_resource, str) else "", seed=uid,
            namespace=namespace if isinstance(namespace, str) else "", served=_served(classes),
            share=_share(peers)), policy,
            _snapshot(view))
    except RecursionError:
        decision = decisions.Decision(allowed=False, code=400,
                                      message="gpushard: cannot read object: nested too deeply")
    except f.ObjectError as exc:
        decision = decisions.Decision(allowed=False, code=400, message=str(exc))
    if decision.allowed and decision.shares > 0 and mode == names.MODE_ENFORCE and not _classes_known(classes):
        # Another driver's DeviceClass may serve the very resource gpushard would rewrite this pod into; until
        # the classes are read, holding shares is refused rather than given twice (readiness waits only so long).
        decision = decisions.Decision(allowed=False, code=403, message=UNKNOWN_CLASSES)

    audit = mode == names.MODE_AUDIT
    if audit and not decision.allowed:
        # Audit mode never denies: what enforce would deny comes back as a finding.
        decision = decisions.Decision(allowed=True, findings=[f.Finding(f.UNREADABLE, f.DENY, decision.message)])
    # The response is built in place, its keys in the order the API server's answer has always had
    # (uid, allowed, status, auditAnnotations, warnings, patchType, patch): the same bytes on the wire.
    response: dict[str, Any]
    annotations = decision.audit_annotations
    if annotations:
        annotations = {key: _clip(value) for key, value in annotations.items()}
    if not decision.allowed and not audit:
        code = decision.code if decision.code in (400, 403) else 403
        message = decision.message or "gpushard: denied"
        if not message.startswith("gpushard:"):
            message = f"gpushard: {message}"
        response = {"uid": uid, "allowed": False, "status": {"code": code, "message": _clip(message)}}
        if annotations:
            response["auditAnnotations"] = annotations
        # The denial message already says every denying finding; warn only about the rest.
        warnings = decisions.warnings_for([x for x in decision.findings if x.severity != f.DENY])
        if warnings:
            response["warnings"] = warnings
        outcome = INVALID if code == 400 else DENIED
        rules = tuple(dict.fromkeys(x.rule for x in decision.findings if x.severity == f.DENY))
        return Answer(wrapped(response), outcome, kind_label,
                      rules or ((f.UNREADABLE,) if code == 400 else ()))

    response = {"uid": uid, "allowed": True}
    if annotations:
        response["auditAnnotations"] = annotations
    warnings = decision.warnings
    if warnings:
        response["warnings"] = warnings
    outcome = ALLOWED
    if not audit and decision.obj is not None and isinstance(obj, dict):
        patch = patches.make(obj, decision.obj)
        if patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = encode_patch(patch)
            outcome = PATCHED
    if outcome == PATCHED and not dry_run and kind == names.POD_KIND:
        if templates is not None and policy.backend == policy_mod.DRA and decision.shares > 0:
            # The pod's claim comes from a template in its namespace: make sure it is there before the pod is.
            warning = templates.ensure(request.get("namespace") or "", decision.shares, decision.card_memory_mib)
            if warning:
                response["warnings"] = [*response.get("warnings", ()), _clip(warning, decisions.WARNING_MAX)]
        # Only a pod gpushard just rewrote is new to the view: a reinvocation over its own output
        # (an empty patch) must not count the same pod twice. A pod that fits nowhere (node None) is
        # counted as waiting on its card where the view keeps such (policy.newNodeCards).
        if decision.card is not None and decision.shares > 0 and view is not None:
            try:
                view.remember(decision.node, decision.card, decision.shares)
            except Exception:
                # Packing gets a little worse until the view catches up; the answer stays right.
                log.exception("gpushard: the cluster view could not record a placement")
    memory = (decision.card_memory_mib, decision.memory_mib) \
        if outcome == PATCHED and not dry_run and decision.memory_mib else None
    return Answer(wrapped(response), outcome, kind_label, memory=memory)


def review(body: bytes, mode: str, policy: Policy, view: View | None, templates: Templates | None = None,
           classes: Classes | None = None, peers: Peers | None = None) -> Answer:
    """Parse a body and answer it; raises BadReview for a body that is no AdmissionReview.

    A review the parser gives up on (nested deeper than it goes) is still the API server's: it is
    answered by its uid with a denial that says where, not with an error that a failurePolicy of
    Ignore would turn into an admission without the hiding.
    """
    try:
        request = parse(body)
    except Unparsed as exc:
        uid = scanning.review_uid(body[:_UID_PREFIX])
        if uid is None:
            raise
        path = scanning.too_deep(body, NESTING_SAID)
        if path is not None:
            return unreadable(uid, mode, f"gpushard: cannot read this object: over {NESTING_SAID} levels deep at "
                                         f"{path.removeprefix('request.object.')}")
        return unreadable(uid, mode, f"{exc}; this object cannot be judged")
    return answer(request, mode, policy, view, templates, classes, peers)


# Where the API server's review has its uid: the start of the body.
_UID_PREFIX = 64 * 1024


def oversized(prefix: bytes, size: int, limit: int, mode: str) -> Answer:
    """The answer to a review body of ``size`` bytes, over ``limit``, of which ``prefix`` is the start."""
    uid = scanning.review_uid(prefix)
    if uid is None:
        raise BadReview(f"gpushard: the body is over {limit // (1024 * 1024)} MiB and names no review uid")
    return unreadable(uid, mode, f"gpushard: this object is {size / (1024 * 1024):.1f} MiB as the API server sends "
                                 f"it, over the {limit // (1024 * 1024)} MiB gpushard reads (more than etcd stores); "
                                 "it cannot be judged")


def unreadable(uid: str, mode: str, message: str) -> Answer:
    """A review gpushard cannot read: denied in enforce mode (the hide entry included), a warning in audit."""
    if mode == names.MODE_AUDIT:
        return Answer(envelope(uid, allowed=True, warnings=[_clip(message, decisions.WARNING_MAX)]), INVALID, "other")
    log.warning("gpushard: denied review %s: %s", uid, message)
    return Answer(denial(uid, 400, _clip(message)), INVALID, "other", rules=(f.UNREADABLE,))
