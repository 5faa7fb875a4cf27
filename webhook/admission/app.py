"""The admission server as a Flask app: one blueprint each for admission, health and metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

import flask

from webhook.admission import metrics as metrics_mod
from webhook.admission import reviews, wirejson
from webhook.core import names
from webhook.settings import Settings

# The API server refuses requests over 3 MiB, and an UPDATE review carries the object
# twice (object and oldObject) plus the request's metadata: 8 MiB admits every review
# the API server can send and still bounds what one request may make a worker hold.
MAX_BODY = 8 * 1024 * 1024
# How long /readyz waits for the cluster view. Correctness never depends on the view, only
# packing does; a webhook that could never sync (no route to the API server) and so never
# became ready would, with failurePolicy Fail, stop every pod creation in enforce namespaces.
SYNC_GRACE_S = 30.0


def create_app(settings: Settings, view: reviews.View | None = None, sync_grace: float = SYNC_GRACE_S,
               clock: Callable[[], float] = time.monotonic, certfile: str | None = None,
               templates: reviews.Templates | None = None) -> flask.Flask:
    """The admission app for ``settings``, choosing cards over ``view`` (None: no view).

    /readyz turns ready when the view has synced, or ``sync_grace`` seconds after the app was
    built, whichever comes first, and says which. /metrics reports ``certfile``'s expiry, if given.
    """
    app = flask.Flask("gpushard")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    app.extensions["gpushard"] = {"settings": settings, "view": view, "metrics": metrics_mod.Metrics(view, certfile),
                                  "ready_by": clock() + sync_grace, "clock": clock, "templates": templates}
    app.register_blueprint(admission_blueprint())
    app.register_blueprint(health_blueprint())
    app.register_blueprint(metrics_blueprint())

    @app.errorhandler(400)
    def unreadable(_exc):
        # werkzeug's answer when the client stops sending the body it announced.
        return _text("gpushard: the request body could not be read\n", 400)

    @app.errorhandler(413)
    def too_large(_exc):
        return _text(f"gpushard: the body is over {MAX_BODY // (1024 * 1024)} MiB\n", 413)

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


def admission_blueprint() -> flask.Blueprint:
    bp = flask.Blueprint("admission", __name__)

    def handle(mode: str) -> flask.Response:
        state = _state()
        metrics = state["metrics"]
        started = time.perf_counter()
        try:
            # get_data() enforces MAX_CONTENT_LENGTH, also on chunked bodies (413).
            body = flask.request.get_data(cache=False)
            try:
                result = reviews.review(body, mode, state["settings"].policy, state["view"], state["templates"])
            except reviews.BadReview as exc:
                metrics.admissions.labels(reviews.INVALID, "unknown", mode).inc()
                return _text(f"{exc}\n", 400)
            metrics.admissions.labels(result.outcome, result.kind, mode).inc()
            if result.memory is not None:
                card_mib, asked = result.memory
                metrics.memory_pods.labels(str(card_mib)).inc()
                metrics.memory_asked.labels(str(card_mib)).inc(asked)
            return flask.Response(wirejson.dumps(result.review), status=200,
                                  mimetype="application/json")
        finally:
            metrics.latency.labels(mode).observe(time.perf_counter() - started)

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
        try:
            synced = view.synced()
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
        body, content_type = _state()["metrics"].exposition()
        return flask.Response(body, status=200, content_type=content_type)

    return bp
