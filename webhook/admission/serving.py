"""Running the admission app under gunicorn over TLS, tuned for an API server as the only client."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import shutil
import ssl
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import gunicorn.app.base
import gunicorn.glogging
import gunicorn.http
import gunicorn.sock
import gunicorn.workers.gthread

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
    # What a list of the live view built lives until the next list: moved out of the collector's sight, so that
    # the full collections set off by admissions' garbage walk only newer objects (a worker-wide choice, made
    # here, for this process).
    view = cluster_mod.open_view(cluster, settings.policy.shares_per_card, settings, after_list=gc.freeze)
    # Started with the view, from the same source: which extended resources other drivers' DeviceClasses serve.
    classes = cluster_mod.open_device_classes(cluster, settings.policy.shares_per_card, settings)
    templates = cluster_mod.open_templates(settings) if cluster is None else None
    # Which card indexes this replica tries first: --replica, or its rank among the Service's ready pods.
    peers = cluster_mod.open_peers(cluster, settings)
    return app_mod.create_app(settings, view, certfile=os.environ.get(CERT_ENV) or None, templates=templates,
                              classes=classes, peers=peers, reviewer=_metrics_reviewer(cluster))


def _metrics_reviewer(cluster: str | None):
    """Who may read /metrics from the network: tokens the API server allows get /metrics; with a cluster file
    (no API server) or no credentials, nobody (a port-forward, on the pod's loopback, still does)."""
    if cluster is not None:
        return None
    from webhook import authorizing
    from webhook.kubeapi import connecting

    try:
        return authorizing.Reviewer(connecting.client().api, authorizing.METRICS_URL)
    except connecting.ConfigError as exc:
        log.warning("%s; /metrics is served to port-forwards only", exc)
        return None


def app_from_env() -> flask.Flask:
    """The app as `webhook.wsgi` builds it: $GPUSHARD_CONFIG and $GPUSHARD_CLUSTER, both optional."""
    return build_app(os.environ.get(CONFIG_ENV) or None, os.environ.get(CLUSTER_ENV) or None)


class _BoundedSSLSocket(ssl.SSLSocket):
    """A TLS socket whose blocking mode (a thread's turn with one request) lasts at most ``io_timeout`` in all.

    A thread reads a request only once it is whole (``Worker``); what may still block it is a body over
    the read-ahead bound, sent slowly, and a client that does not read its answer. Every read and write of
    the turn waits only for what is left of it, so trickling a byte now and then does not keep the thread.
    """

    io_timeout: float | None = CLIENT_TIMEOUT
    _deadline: float | None = None

    def setblocking(self, flag: bool) -> None:
        super().setblocking(flag)
        if flag and self.io_timeout is not None:
            self._deadline = time.monotonic() + self.io_timeout
            self.settimeout(self.io_timeout)

    def _left(self) -> None:
        if self._deadline is not None and self.gettimeout():
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"gpushard: the request took over the {self.io_timeout:g} s client timeout")
            self.settimeout(left)

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        self._left()
        return super().recv(buflen, flags)

    def recv_into(self, buffer, nbytes: int | None = 0, flags: int = 0) -> int:
        self._left()
        return super().recv_into(buffer, nbytes, flags)


class _GunicornLog(gunicorn.glogging.Logger):
    """gunicorn's logger, except that a client's read or write timeout is no error.

    gunicorn logs every socket error but a reset or a broken pipe with its traceback at ERROR.
    """

    def exception(self, msg, *args, **kwargs) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, TimeoutError):
            self.debug("%s %s", msg % args if args else msg, exc)
            return
        super().exception(msg, *args, **kwargs)


def server_context(certfile: str, keyfile: str, io_timeout: float | None = CLIENT_TIMEOUT) -> ssl.SSLContext:
    """A TLS 1.2+ server context for a certificate and its key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.sslsocket_class = type("BoundedSSLSocket", (_BoundedSSLSocket,), {"io_timeout": io_timeout})
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=certfile, keyfile=keyfile)
    return context


# What a connection may send before a thread takes it: a request's head, and a body up to the admission app's
# limit. A request past this (a body over that limit) goes to a thread once its head came, and the thread
# reads the rest, each read bounded by the client timeout.
_HEAD_MAX = 64 * 1024
_READ = 256 * 1024
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d{1,12})[ \t]*(?:\r\n|$)")
_STALLED = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 45\r\n"
            b"Connection: close\r\n\r\ngpushard: the request body could not be read\n")


class _Arrival:
    """The part of a request that came so far (its head's end and its body's length once the head came), and when
    it must be whole."""

    __slots__ = ("data", "deadline", "head", "size")

    def __init__(self, deadline: float):
        self.data = bytearray()
        self.deadline = deadline
        self.head = -1  # where the body starts; -1 while the head has not come
        self.size = 0  # the body's Content-Length; -1 for a chunked body

    def whole(self, body_max: int) -> bool:
        """Whether the request may go to a thread: it is whole, or past what is read ahead (its head came and its
        body is longer than ``body_max``, or its head alone is too long)."""
        data = self.data
        if self.head < 0:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                return len(data) > _HEAD_MAX
            self.head = end + 4
            head = bytes(data[:end]).lower()
            if b"\r\ntransfer-encoding:" in head:
                self.size = -1
            else:
                length = _LENGTH.search(head)
                self.size = int(length.group(1)) if length else 0
        if self.size < 0:
            # Chunked (the API server never sends it): whole at the last chunk, or once past the bound.
            return data.find(b"0\r\n\r\n", self.head) >= 0 or len(data) > body_max + _HEAD_MAX
        return self.size > body_max or len(data) - self.head >= self.size


class Worker(gunicorn.workers.gthread.ThreadWorker):
    """gunicorn's threaded worker, except that a thread takes a request only once it has come whole.

    The TLS handshake and the request's bytes are read without blocking, each time the poller says the
    connection is readable; until the request is whole the connection waits on the poller, not in a thread.
    A request that is not whole within the client timeout (from the connection's first moment, or from a
    kept-alive connection's next byte) is given up: a 400 once its head came, else the connection is closed.
    So clients that stall or trickle, on as many connections as gunicorn takes (worker_connections), hold
    no thread while the API server's reviews are answered.
    """

    _client_timeout: float | None = None

    def handle(self, conn):
        arrival = getattr(conn, "gpushard_arrival", None)
        if arrival is None:
            arrival = conn.gpushard_arrival = _Arrival(time.monotonic() + self._timeout())
        try:
            state = self._arrive(conn, arrival)
        except (ssl.SSLError, OSError) as exc:
            self.log.debug("gpushard: closed a connection from %s: %s", _peer(conn), exc)
            conn.gpushard_arrival = None
            return False
        if state is None:  # the client left before sending a request
            conn.gpushard_arrival = None
            return False
        if not state:
            return gunicorn.workers.gthread._DEFER
        conn.gpushard_arrival = None
        return super().handle(conn)

    def _timeout(self) -> float:
        """The client timeout, as the serving context says it (read once: a new certificate keeps it)."""
        if self._client_timeout is None:
            context = gunicorn.sock.ssl_context(self.cfg)
            self._client_timeout = getattr(context.sslsocket_class, "io_timeout", None) or CLIENT_TIMEOUT
        return self._client_timeout

    def _arrive(self, conn, arrival: _Arrival) -> bool | None:
        """Read what is there without blocking: True once the request may go to a thread, False while more must
        come, None when the client closed the connection before its request began."""
        if not conn.initialized:
            if not isinstance(conn.sock, ssl.SSLSocket):
                conn.sock.setblocking(False)
                # The context of the certificate on disk now: a new connection gets a renewed one.
                context = gunicorn.sock.ssl_context(self.cfg)
                conn.sock = context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            try:
                conn.sock.do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False
            conn.parser = gunicorn.http.get_parser(self.cfg, conn.sock, conn.client)
            conn.initialized = True
        conn.sock.setblocking(False)
        arrival.data += conn.parser.unreader.take_buffered()
        body_max = _body_max()
        while not arrival.whole(body_max):
            try:
                chunk = conn.sock.recv(_READ)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                return False
            if not chunk:
                if not arrival.data:
                    return None
                break  # cut short: gunicorn's parser says so
            arrival.data += chunk
        conn.parser.unreader.unread(bytes(arrival.data))
        return True

    def finish_request(self, conn, fs):
        super().finish_request(conn, fs)
        arrival = getattr(conn, "gpushard_arrival", None)
        if arrival is not None and self.pending_conns and self.pending_conns[-1] is conn:
            # Waiting for the rest of its request: until its deadline, not gunicorn's keep-alive time.
            conn.timeout = arrival.deadline

    def murder_pending(self):
        now = time.monotonic()
        for conn in self.pending_conns:
            if conn.timeout > now:
                break
            arrival = getattr(conn, "gpushard_arrival", None)
            if arrival is not None and b"\n" in arrival.data:
                log.warning("gpushard: gave up on a request from %s: %d bytes of it came, then nothing within the "
                            "client timeout; the client or a proxy in between stalled (raise --client-timeout if "
                            "it is slow but sound)", _peer(conn), len(arrival.data))
                if arrival.head >= 0:  # its body stalled: say so
                    try:
                        conn.sock.send(_STALLED)
                    except OSError:
                        pass
            else:
                log.debug("gpushard: closed a connection from %s that sent no request line within the client "
                          "timeout", _peer(conn))
        super().murder_pending()


def _body_max() -> int:
    from webhook.admission import app as app_mod

    return app_mod.MAX_BODY


def _peer(conn) -> str:
    client = conn.client
    return f"{client[0]}:{client[1]}" if isinstance(client, tuple) and len(client) >= 2 else "a client"


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
        "worker_class": "webhook.admission.serving.Worker",
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
