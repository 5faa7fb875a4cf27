"""The admission server as a Flask app: one blueprint each for admission, health and metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

import flask
import werkzeug.exceptions

from webhook import authorizing
from webhook.admission import metrics as metrics_mod
from webhook.admission import reviews
from webhook.core import names
from webhook.settings import Settings

# The largest body read whole. etcd stores an object of at most 1.5 MiB, and the API server writes each
# of its bytes as at most 6 in JSON (it escapes <, > and & as \u003c); an UPDATE review carries the
# object twice. 32 MiB holds every review of an object the API server can store. A larger body is read
# to its end and answered with a denial that says so, never an error: the hide entry's failurePolicy
# (Ignore) would turn an error into an admission without the hiding.
MAX_BODY = 32 * 1024 * 1024
# What is kept of a body over MAX_BODY: enough to find the review's uid, which the API server writes first.
PREFIX = 64 * 1024
_CHUNK = 1024 * 1024
# How long /readyz waits for the cluster view. Correctness never depends on the view, only
# packing does; a webhook that could never sync (no route to the API server) and so never
# became ready would, with failurePolicy Fail, stop every pod creation in enforce namespaces.
SYNC_GRACE_S = 30.0


def create_app(settings: Settings, view: reviews.View | None = None, sync_grace: float = SYNC_GRACE_S,
               clock: Callable[[], float] = time.monotonic, certfile: str | None = None,
               templates: reviews.Templates | None = None, classes: reviews.Classes | None = None,
               peers: reviews.Peers | None = None, reviewer: authorizing.Reviewer | None = None) -> flask.Flask:
    """The admission app for ``settings``, choosing cards over ``view`` (None: no view), and judging pods by
    the extended resources ``classes`` says other drivers' DeviceClasses serve (None: none), trying first this
    replica's share of the cards, as ``peers`` says (None: every card alike).

    /readyz turns ready when the view has synced, or ``sync_grace`` seconds after the app was
    built, whichever comes first, and says which. /metrics reports ``certfile``'s expiry, if given, to the pod's own
    loopback (a port-forward) and to bearer tokens ``reviewer`` allows (None: nobody else).
    """
    app = flask.Flask("gpushard")
    app.extensions["gpushard"] = {"settings": settings, "view": view, "metrics": metrics_mod.Metrics(view, certfile),
                                  "ready_by": clock() + sync_grace, "clock": clock, "templates": templates,
                                  "classes": classes, "peers": peers, "reviewer": reviewer}
    app.register_blueprint(admission_blueprint())
    app.register_blueprint(health_blueprint())
    app.register_blueprint(metrics_blueprint())

    @app.errorhandler(400)
    def unreadable(_exc):
        # werkzeug's answer when the client stops sending the body it announced.
        return _text("gpushard: the request body could not be read\n", 400)

    @app.errorhandler(404)
    def not_found(_exc):
        return _text("gpushard: no such endpoint (POST /mutate or /audit; GET /healthz, /readyz, /metrics)\n", 404)

    @app.errorhandler(405)
    def not_allowed(_exc):
        return _text("gpushard: method not allowed here\n", 405)

    @app.errorhandler(500)
    def internal(_exc):
        # Reviews never get here (reviews.answer answers every fault); this is for the rest.
        return _text("gpushard: internal error; see the webhook's log\n", 500)

    return app


def _state() -> dict:
    return flask.current_app.extensions["gpushard"]


def _text(body: str, status: int) -> flask.Response:
    return flask.Response(body, status=status, mimetype="text/plain")


def _review(state: dict, body: bytes, size: int, mode: str) -> tuple[int, bytes]:
    """The status and body that answer one review body of ``size`` bytes (``body`` holds only its start when
    ``size`` is over MAX_BODY); counts it in the metrics."""
    metrics = state["metrics"]
    try:
        if size > MAX_BODY:
            result = reviews.oversized(body, size, MAX_BODY, mode)
        else:
            result = reviews.review(body, mode, state["settings"].policy, state["view"], state["templates"],
                                    state["classes"], state["peers"])
    except reviews.BadReview as exc:
        metrics.admitted(reviews.INVALID, "unknown", mode)
        return 400, f"{exc}\n".encode()
    metrics.admitted(result.outcome, result.kind, mode)
    if result.memory is not None:
        metrics.memory_ask(*result.memory)
    return 200, reviews.dumps(result.review)


def _read_body(stream) -> tuple[bytes, int]:
    """The body and its size; past MAX_BODY only its first PREFIX bytes are kept and the rest is read away.

    The socket's per-request deadline (serving.py) bounds how long a client may keep sending.
    """
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := stream.read(_CHUNK):
            size += len(chunk)
            if size <= MAX_BODY:
                chunks.append(chunk)
            elif len(chunks) != 1 or len(chunks[0]) > PREFIX:
                chunks = [b"".join(chunks)[:PREFIX]]
    except (OSError, ValueError):
        # A read that timed out or failed (the client stalled past its deadline, or left).
        raise werkzeug.exceptions.BadRequest() from None
    return b"".join(chunks), size


_JSON = "application/json"


def admission_blueprint() -> flask.Blueprint:
    bp = flask.Blueprint("admission", __name__)

    def handle(mode: str) -> flask.Response:
        state = _state()
        started = time.perf_counter()
        try:
            body, size = _read_body(flask.request.stream)
            status, data = _review(state, body, size, mode)
            return flask.Response(data, status=status, mimetype=_JSON if status == 200 else "text/plain")
        finally:
            state["metrics"].observe(mode, time.perf_counter() - started)

    @bp.post("/mutate")
    def mutate():
        return handle(names.MODE_ENFORCE)

    @bp.post("/audit")
    def audit():
        return handle(names.MODE_AUDIT)

    return bp


def health_blueprint() -> flask.Blueprint:
    bp = flask.Blueprint("health", __name__)

    @bp.get("/healthz")
    def healthz():
        return _text("ok\n", 200)

    @bp.get("/readyz")
    def readyz():
        view = _state()["view"]
        if view is None:
            return _text("ok: no cluster view; cards are chosen without one\n", 200)
        classes = _state()["classes"]
        try:
            # The DeviceClasses are part of the view: before their first list a pod could be rewritten into
            # a resource another driver serves.
            synced = view.synced() and (classes is None or classes.synced())
        except Exception:
            synced = False
        if synced:
            return _text("ok: cluster view synced\n", 200)
        state = _state()
        if state["clock"]() >= state["ready_by"]:
            return _text("ok: the cluster view has not synced; cards are chosen without it until it does\n", 200)
        return _text("gpushard: not ready: the cluster view has not synced yet\n", 503)

    return bp


def metrics_blueprint() -> flask.Blueprint:
    bp = flask.Blueprint("metrics", __name__)

    @bp.get("/metrics")
    def metrics():
        # Per-card free shares and the certificate's expiry are not for every pod that reaches the port.
        verdict = authorizing.check(flask.request.remote_addr or "", flask.request.headers.get("Authorization"),
                                    _state()["reviewer"])
        if not verdict.allowed:
            if verdict.status == 403:
                flask.current_app.logger.info("%s (from %s)", verdict.reason, flask.request.remote_addr)
            response = _text(verdict.reason + "\n", verdict.status)
            if verdict.status == 401:
                response.headers["WWW-Authenticate"] = 'Bearer realm="gpushard"'
            return response
        body, content_type = _state()["metrics"].exposition()
        return flask.Response(body, status=200, content_type=content_type)

    return bp
