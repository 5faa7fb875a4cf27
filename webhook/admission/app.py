"""The admission server as a Flask app: one blueprint each for admission, health and metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

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
               templates: reviews.Templates | None = None, classes: reviews.Classes | None = None,
               peers: reviews.Peers | None = None) -> flask.Flask:
    """The admission app for ``settings``, choosing cards over ``view`` (None: no view), and judging pods by
    the extended resources ``classes`` says other drivers' DeviceClasses serve (None: none), trying first this
    replica's share of the cards, as ``peers`` says (None: every card alike).

    /readyz turns ready when the view has synced, or ``sync_grace`` seconds after the app was
    built, whichever comes first, and says which. /metrics reports ``certfile``'s expiry, if given.
    """
    app = flask.Flask("gpushard")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    app.extensions["gpushard"] = {"settings": settings, "view": view, "metrics": metrics_mod.Metrics(view, certfile),
                                  "ready_by": clock() + sync_grace, "clock": clock, "templates": templates,
                                  "classes": classes, "peers": peers}
    # Reviews skip Flask's request machinery (the blueprint still answers what the fast path hands on).
    app.wsgi_app = ReviewFastPath(app.wsgi_app, app.extensions["gpushard"], app.logger)
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


def _review(state: dict, body: bytes, mode: str) -> tuple[int, bytes]:
    """The status and body that answer one review body; counts it in the metrics."""
    metrics = state["metrics"]
    try:
        result = reviews.review(body, mode, state["settings"].policy, state["view"], state["templates"],
                                state["classes"], state["peers"])
    except reviews.BadReview as exc:
        metrics.admitted(reviews.INVALID, "unknown", mode)
        return 400, f"{exc}\n".encode()
    metrics.admitted(result.outcome, result.kind, mode)
    if result.memory is not None:
        metrics.memory_ask(*result.memory)
    return 200, wirejson.dumps(result.review)


_MODES = {"/mutate": names.MODE_ENFORCE, "/audit": names.MODE_AUDIT}
_JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"
_UNREADABLE = b"gpushard: the request body could not be read\n"
_INTERNAL = b"gpushard: internal error; see the webhook's log\n"
_STATUS = {200: "200 OK", 400: "400 BAD REQUEST", 500: "500 INTERNAL SERVER ERROR"}


class ReviewFastPath:
    """WSGI middleware that answers POST /mutate and /audit itself, as the admission blueprint would.

    A review's answer is a few hundred microseconds of work; Flask's request and app contexts,
    routing, request and response objects cost a good part of that again. A POST to either path
    with a plain Content-Length within MAX_BODY (what the API server sends) is read and answered
    here with the same status, headers and body as the blueprint's; anything else (another method
    or path, a chunked body, a length over the limit or not a number) goes to Flask unchanged.
    """

    def __init__(self, wsgi_app: Callable, state: dict, logger: logging.Logger):
        self.wsgi_app, self.state, self.logger = wsgi_app, state, logger

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        mode = _MODES.get(environ.get("PATH_INFO")) if environ.get("REQUEST_METHOD") == "POST" else None
        length = environ.get("CONTENT_LENGTH") if mode is not None else None
        # Nine digits at most: int() refuses a string of thousands, and every length past the limit
        # that Flask must answer has eight or more.
        if (not length or len(length) > 9 or not length.isascii() or not length.isdigit()
                or (size := int(length)) > MAX_BODY or "HTTP_TRANSFER_ENCODING" in environ):
            return self.wsgi_app(environ, start_response)
        metrics = self.state["metrics"]
        started = time.perf_counter()
        try:
            body = _read(environ, size)
            if body is None:
                status, content_type, data = 400, _TEXT, _UNREADABLE
            else:
                status, data = _review(self.state, body, mode)
                content_type = _JSON if status == 200 else _TEXT
        except Exception:
            # As Flask logs and answers an exception in a view.
            self.logger.error("Exception on %s [POST]", environ.get("PATH_INFO"), exc_info=True)
            status, content_type, data = 500, _TEXT, _INTERNAL
        finally:
            metrics.observe(mode, time.perf_counter() - started)
        start_response(_STATUS[status], [("Content-Type", content_type), ("Content-Length", str(len(data)))])
        return [data]


def _read(environ: dict, length: int) -> bytes | None:
    """The body of ``length`` bytes; None when the client stops sending it before the end.

    A server that ends the body itself (gunicorn sets wsgi.input_terminated) hands over what
    came, as werkzeug reads it there; otherwise a short body is unreadable, as werkzeug says. A read
    that fails is unreadable too.
    """
    stream = environ["wsgi.input"]
    try:
        body = stream.read(length) if length else b""
        if len(body) < length:
            chunks = [body]
            got = len(body)
            while got < length:
                chunk = stream.read(length - got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            body = b"".join(chunks)
            if got < length and "wsgi.input_terminated" not in environ:
                return None
    except (OSError, ValueError):
        # A read that timed out or failed (serving.py bounds each request's reads): werkzeug's
        # stream says the client disconnected, and the blueprint answers 400.
        return None
    return body


def admission_blueprint() -> flask.Blueprint:
    bp = flask.Blueprint("admission", __name__)

    def handle(mode: str) -> flask.Response:
        state = _state()
        metrics = state["metrics"]
        started = time.perf_counter()
        try:
            # get_data() enforces MAX_CONTENT_LENGTH, also on chunked bodies (413).
            body = flask.request.get_data(cache=False)
            status, data = _review(state, body, mode)
            return flask.Response(data, status=status, mimetype=_JSON if status == 200 else "text/plain")
        finally:
            metrics.observe(mode, time.perf_counter() - started)

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
        body, content_type = _state()["metrics"].exposition()
        return flask.Response(body, status=200, content_type=content_type)

    return bp
