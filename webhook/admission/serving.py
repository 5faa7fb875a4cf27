"""Running the admission app under gunicorn over TLS, tuned for an API server as the only client."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import ssl
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import gunicorn.app.base
import gunicorn.glogging

if TYPE_CHECKING:
    import flask

log = logging.getLogger("gpushard.serving")

# The API server keeps webhook connections open between reviews (Go's idle timeout is
# 90 s); holding them a little longer means gunicorn is never the side that closes a
# connection the API server is about to reuse.
KEEPALIVE = 100
# A client that stalls mid-request or mid-handshake gives its thread back after this: sooner than the
# API server gives up on a review (the entries' timeoutSeconds, 5): a thread a stalled client took is free
# again while the API server still waits for the reviews queued behind it.
CLIENT_TIMEOUT = 4.0
# Kubernetes sends SIGTERM, then SIGKILL after terminationGracePeriodSeconds (30 s by
# default): reviews in flight finish well before that.
GRACEFUL_TIMEOUT = 20
# The environment variables of the `webhook.wsgi` target.
CONFIG_ENV = "GPUSHARD_CONFIG"
CLUSTER_ENV = "GPUSHARD_CLUSTER"
CERT_ENV = "GPUSHARD_CERT"  # the serving certificate, whose expiry /metrics reports


def build_app(config: str | None, cluster: str | None) -> flask.Flask:
    """The app for one worker, with that worker's own view of the cluster."""
    # Imported here: prometheus_client must see PROMETHEUS_MULTIPROC_DIR, which serve()
    # sets in the master before any worker imports it.
    from webhook import cluster as cluster_mod
    from webhook import settings as settings_mod
    from webhook.admission import app as app_mod

    settings = settings_mod.load(config)
    view = cluster_mod.open_view(cluster, settings.policy.shares_per_card, settings)
    # Started with the view, from the same source: which extended resources other drivers' DeviceClasses serve.
    classes = cluster_mod.open_device_classes(cluster, settings.policy.shares_per_card, settings)
    templates = cluster_mod.open_templates(settings) if cluster is None else None
    # Which card indexes this replica tries first: --replica, or its rank among the Service's ready pods.
    peers = cluster_mod.open_peers(cluster, settings)
    return app_mod.create_app(settings, view, certfile=os.environ.get(CERT_ENV) or None, templates=templates,
                              classes=classes, peers=peers)


def app_from_env() -> flask.Flask:
    """The app as `webhook.wsgi` builds it: $GPUSHARD_CONFIG and $GPUSHARD_CLUSTER, both optional."""
    return build_app(os.environ.get(CONFIG_ENV) or None, os.environ.get(CLUSTER_ENV) or None)


class ClientTimeout(TimeoutError):
    """A client that did not finish its handshake or send its request within the client timeout.

    The socket that gives up logs it once, at the level it deserves (``_TimedSSLSocket``);
    gunicorn's own line for it is a debug line without a traceback (``_GunicornLog``).
    """


class _TimedSSLSocket(ssl.SSLSocket):
    """A TLS socket on which one request must arrive within ``io_timeout`` seconds.

    gunicorn's threaded worker puts a connection in blocking mode before it reads a
    request, so a client that sends half a request and stalls would hold a thread for
    ever, and one that trickles a byte now and then would too, however short each wait.
    Here "blocking" means "blocking until the request's deadline": each request (each
    switch to blocking mode, which gunicorn makes per request) has ``io_timeout`` seconds
    for all of its reads, and every read or write waits at most that long.

    A connection that reaches the deadline before its request line came is normal: the
    API server opens connections for its pool that it may never use, and load balancers
    check the port with a bare handshake. It is closed with a debug line. A request that
    started and then stalled is the client's or a proxy's fault, not the webhook's: one
    warning line, without a traceback.
    """

    io_timeout: float | None = CLIENT_TIMEOUT
    _deadline: float | None = None
    _received = 0  # bytes of the current request
    _request_line = False  # whether the current request's first line has come
    _gave_up = False  # the current request's deadline passed, and was logged

    def start_deadline(self) -> None:
        self._deadline = None if self.io_timeout is None else time.monotonic() + self.io_timeout
        self._received, self._request_line, self._gave_up = 0, False, False

    def setblocking(self, flag: bool) -> None:
        super().setblocking(flag)
        if flag:
            self.settimeout(self.io_timeout)
            self.start_deadline()

    def _peer(self) -> str:
        try:
            host, port = self.getpeername()[:2]
        except (OSError, ValueError):
            return "a client"
        return f"{host}:{port}"

    def _timed_out(self, stage: str = "request") -> ClientTimeout:
        """The exception for a passed deadline, logged once per request."""
        if not self._gave_up:
            self._gave_up = True
            if stage == "request" and self._request_line:
                log.warning("gpushard: gave up on a request from %s after %g s: %d bytes of it came, then "
                            "nothing; the client or a proxy in between stalled (raise --client-timeout if it is "
                            "slow but sound)", self._peer(), self.io_timeout, self._received)
            else:
                log.debug("gpushard: closed a connection from %s that sent no %s within %g s",
                          self._peer(), "complete handshake" if stage == "handshake" else "request line",
                          self.io_timeout)
        return ClientTimeout(f"gpushard: no {stage} within the {self.io_timeout:g} s client timeout")

    def _bounded(self, read, *args):
        """``read(*args)``, waiting no longer than the request's deadline allows."""
        current = self.gettimeout()
        if self._deadline is None or current == 0.0:  # non-blocking: the poller's business
            return read(*args)
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out()
        if current is not None and current <= remaining:
            # The caller's own shorter wait (gunicorn's lingering close): its timeout is its own.
            return read(*args)
        self.settimeout(remaining)
        try:
            return read(*args)
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            # Writes (the answer) keep the full timeout, however late the request came.
            self.settimeout(current)

    def _came(self, data) -> None:
        self._received += len(data)
        if not self._request_line and b"\n" in data:
            self._request_line = True

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        data = self._bounded(super().recv, buflen, flags)
        self._came(data)
        return data

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        count = self._bounded(super().recv_into, buffer, nbytes, flags)
        self._came(memoryview(buffer)[:count].tobytes() if count else b"")
        return count

    def do_handshake(self, *args, **kwargs) -> None:
        try:
            super().do_handshake(*args, **kwargs)
        except TimeoutError:
            raise self._timed_out("handshake") from None


class _GunicornLog(gunicorn.glogging.Logger):
    """gunicorn's logger, except that a client's timeout, which the socket logged, is no error.

    gunicorn logs every socket error but a reset or a broken pipe with its traceback at ERROR,
    the read timeout of a client that never sent a request included.
    """

    def exception(self, msg, *args, **kwargs) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, ClientTimeout):
            self.debug("%s %s", msg % args if args else msg, exc)
            return
        super().exception(msg, *args, **kwargs)


class _Context(ssl.SSLContext):
    """A server context that bounds the handshake as well as every later read and write."""

    io_timeout: float | None = CLIENT_TIMEOUT

    def wrap_socket(self, sock, *args, **kwargs):
        sock.settimeout(self.io_timeout)
        wrapped = super().wrap_socket(sock, *args, **kwargs)
        if isinstance(wrapped, _TimedSSLSocket):
            wrapped.start_deadline()  # the first request's deadline
        return wrapped


def server_context(certfile: str, keyfile: str, io_timeout: float | None = CLIENT_TIMEOUT) -> ssl.SSLContext:
    """A TLS 1.2+ server context for a certificate and its key."""
    timed = type("TimedSSLSocket", (_TimedSSLSocket,), {"io_timeout": io_timeout})
    context = _Context(ssl.PROTOCOL_TLS_SERVER)
    context.io_timeout = io_timeout
    context.sslsocket_class = timed
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=certfile, keyfile=keyfile)
    return context


class ReloadingContext:
    """gunicorn's ``ssl_context`` hook: the context for the files as they are on disk now.

    gunicorn asks for a context for each new connection. A Secret update replaces the
    files (through a symlink swap), so a change of either file's identity or mtime means
    a new certificate: it is loaded for the next connection, without a restart. A pair
    that does not load yet (the certificate written, its key not yet) leaves the last
    good context in use until it does.
    """

    def __init__(self, certfile: str, keyfile: str, io_timeout: float | None = CLIENT_TIMEOUT):
        self.certfile, self.keyfile, self.io_timeout = certfile, keyfile, io_timeout
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._context: ssl.SSLContext | None = None

    def _files_stamp(self) -> tuple | None:
        try:
            return tuple((s.st_ino, s.st_dev, s.st_mtime_ns, s.st_size)
                         for s in (os.stat(self.certfile), os.stat(self.keyfile)))
        except OSError:
            return None

    def current(self) -> ssl.SSLContext:
        stamp = self._files_stamp()
        context = self._context
        if context is not None and (stamp is None or stamp == self._stamp):
            return context
        with self._lock:
            if self._context is not None and stamp == self._stamp:
                return self._context
            try:
                fresh = server_context(self.certfile, self.keyfile, self.io_timeout)
            except (OSError, ssl.SSLError) as exc:
                if self._context is None:
                    raise
                log.warning("gpushard: keeping the current certificate: cannot load %s and %s yet: %s",
                            self.certfile, self.keyfile, exc)
                return self._context
            if self._context is not None:
                log.info("gpushard: serving the new certificate from %s", self.certfile)
            self._context, self._stamp = fresh, stamp
            return fresh

    def __call__(self, conf, default_ssl_context_factory) -> ssl.SSLContext:
        return self.current()


def check_tls_files(certfile: str, keyfile: str) -> None:
    """Fail with a message naming the file when the certificate or key cannot serve."""
    for label, path in (("certificate", certfile), ("key", keyfile)):
        try:
            with open(path, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise SystemExit(f"gpushard: cannot read the serving {label} {path}: {exc.strerror}") from None
    try:
        server_context(certfile, keyfile)
    except ssl.SSLError as exc:
        raise SystemExit(f"gpushard: {certfile} and {keyfile} are not a PEM certificate and its key: "
                         f"{exc.reason or exc}") from None


def check_bind(bind: str) -> None:
    """Fail with a message on a --bind that is no HOST:PORT (gunicorn would quietly add port 8000)."""
    _host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SystemExit(f"gpushard: --bind {bind!r} is not HOST:PORT")


class _Server(gunicorn.app.base.BaseApplication):
    def __init__(self, options: dict, config: str | None, cluster: str | None):
        self.options, self.config, self.cluster = options, config, cluster
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        # Called in each worker after the fork (no preload): a view's watch threads and
        # connections belong to the process that uses them.
        # gpushard's own messages (tracebacks of internal errors, certificate reloads, the view's and the
        # replica's news from the modules of the webhook package) go where gunicorn's go, in the same format.
        for name in ("gpushard", "webhook"):
            ours = logging.getLogger(name)
            if not ours.handlers:
                ours.handlers = list(logging.getLogger("gunicorn.error").handlers)
                ours.setLevel(logging.INFO)
                ours.propagate = False
        return build_app(self.config, self.cluster)


def _child_exit(server, worker) -> None:
    from webhook.admission import metrics

    metrics.worker_exited(worker.pid)


def _pre_fork(server, worker) -> None:
    """In the master, before a worker forks: the lowest worker index no live worker holds, so that a worker
    started again takes the part of the cards of the one it replaces (webhook/cluster/peers.py)."""
    from webhook.cluster import peers

    worker.gpushard_index = peers.next_worker_index({getattr(w, "gpushard_index", None)
                                                     for w in server.WORKERS.values()})


def _post_fork(server, worker) -> None:
    """In the worker, after the fork: its index among the replica's workers, for its part of the cards."""
    from webhook.cluster import peers

    if server.num_workers > 1:
        count = max(server.num_workers, worker.gpushard_index + 1)  # more workers by TTIN than configured
        os.environ[peers.WORKER_ENV] = f"{worker.gpushard_index}/{count}"


def gunicorn_options(args: argparse.Namespace, context: ReloadingContext) -> dict:
    """The gunicorn settings `gpushard serve` runs with."""
    return {
        "bind": [args.bind],
        "workers": args.workers,
        "worker_class": "gthread",
        "threads": args.threads,
        "timeout": args.timeout,
        "graceful_timeout": getattr(args, "graceful_timeout", None) or GRACEFUL_TIMEOUT,
        "keepalive": KEEPALIVE,
        "certfile": args.cert,
        "keyfile": args.key,
        "ssl_context": context,
        "preload_app": False,
        # Only HTTP/1.1: the API server speaks it to every webhook that is not on loopback.
        "http_protocols": "h1",
        "accesslog": None,
        "errorlog": "-",
        "logger_class": _GunicornLog,
        "loglevel": "info",
        "proc_name": "gpushard",
        "control_socket_disable": True,
        "child_exit": _child_exit,
        "pre_fork": _pre_fork,
        "post_fork": _post_fork,
        "worker_tmp_dir": "/dev/shm" if os.path.isdir("/dev/shm") else None,
    }


def serve(args: argparse.Namespace) -> int:
    """Run the webhook until SIGTERM or SIGINT; the exit status."""
    check_bind(args.bind)
    check_tls_files(args.cert, args.key)
    if args.workers < 1 or args.threads < 1 or args.timeout < 1:
        raise SystemExit("gpushard: --workers, --threads and --timeout must be at least 1")
    if args.cluster is not None:
        # A static file is checked before the fork, so a typo stops the program with a
        # message, not workers that fail to boot one after another.
        from webhook import settings as settings_mod
        from webhook.cluster import static

        try:
            static.load(args.cluster, settings_mod.load(args.config).policy.shares_per_card)
        except static.ViewFileError as exc:
            raise SystemExit(f"gpushard: bad cluster file: {exc}") from None
    client_timeout = getattr(args, "client_timeout", None) or CLIENT_TIMEOUT
    context = ReloadingContext(args.cert, args.key, client_timeout)
    # Loaded once in the master: every worker starts from a good pair, even one whose first
    # connection comes while a rotation is half done.
    context.current()
    prom_dir = tempfile.mkdtemp(prefix="gpushard-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
    os.environ[CERT_ENV] = os.path.abspath(args.cert)
    master = os.getpid()
    try:
        _Server(gunicorn_options(args, context), args.config, args.cluster).run()
    finally:
        # An exiting worker comes back through here too (gunicorn ends it with SystemExit): only
        # the master removes the folder, whose files of exited workers still count.
        if os.getpid() == master:
            shutil.rmtree(prom_dir, ignore_errors=True)
    return 0
