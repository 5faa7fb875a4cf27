"""Reaching the Kubernetes API: one kubeconfig loader in kubectl's order, and failures told plainly.

Every program of gpushard that talks to the API server (the command line, the certificate Job,
the node agent) gets its client here, so they all find their credentials the same way:

1. ``--kubeconfig FILE``, when given (the file must exist);
2. else ``$KUBECONFIG``, a list of files separated by ``:``, merged as kubectl merges them
   (files that do not exist are skipped; a list where none exists is an error);
3. else ``~/.kube/config``;
4. else the in-cluster service account (a pod's token and the ``KUBERNETES_SERVICE_*`` env).

``--context`` picks a context of the kubeconfig (the current context by default).

A request is tried once. The kubernetes client hands urllib3 its default of three retries,
each with the whole timeout again, so "--request-timeout 2s" waited 8 s and the 30 s default
two minutes against a server that accepts connections and never answers; here the timeout
bounds the whole request, as kubectl's does. The long-running components retry in their own
loops, with backoff; a command is run again by its operator.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import kubernetes
import urllib3
import yaml

DEFAULT_KUBECONFIG = "~/.kube/config"
IN_CLUSTER = "the in-cluster service account"
# kubectl's --request-timeout: a plain number is seconds, else a duration such as 1m30s; 0 is none.
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigError(Exception):
    """No usable kubeconfig or service account, or a bad flag; the message starts with gpushard:."""


class ApiError(Exception):
    """The API server could not be reached, refused the credentials, or forbade the call.

    ``status`` is the HTTP status (401, 403), or None when the server was not reached at all.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Target:
    """Where the client came from, for messages: the API address and the context (or in-cluster)."""

    host: str
    context: str
    source: str
    timeout: float | None = None  # the request timeout, for "no answer within ..."
    namespace: str | None = None  # the context's namespace, kubectl's default for -n
    # What grants the calls of the command that holds this client (a shipped role), told with a 403;
    # each command sets its own.
    rights: str | None = None

    @property
    def where(self) -> str:
        return f"the Kubernetes API at {self.host} (context {self.context})"


@dataclass
class Client:
    """A kubernetes ApiClient and where it points."""

    api: kubernetes.client.ApiClient
    target: Target
    timeout: float | None = None  # seconds per request; None waits for ever, as kubectl's 0


def parse_timeout(text: str | None, default: float | None = None) -> float | None:
    """kubectl's --request-timeout: ``30``, ``30s``, ``1m30s``, ``500ms``; ``0`` means no timeout."""
    if text is None:
        return default
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        parts = _DURATION.findall(value)
        if not parts or "".join(n + u for n, u in parts) != value:
            raise ConfigError(f"gpushard: --request-timeout {text!r} is not a duration "
                              "(a number of seconds, or e.g. 30s, 1m, 1m30s; 0 for none)") from None
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise ConfigError(f"gpushard: --request-timeout {text!r} must be a finite duration of 0 or more "
                          "(e.g. 30s; 0 waits for ever)")
    return seconds or None


def kubeconfig_files(kubeconfig: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The kubeconfig files to merge, in kubectl's order; empty means: use the in-cluster account."""
    environ = os.environ if environ is None else environ
    if kubeconfig:
        path = Path(kubeconfig).expanduser()
        if not path.is_file():
            raise ConfigError(f'gpushard: --kubeconfig "{kubeconfig}": no such file; pass the path of a kubeconfig '
                              "that exists, or leave the flag out to use $KUBECONFIG or ~/.kube/config")
        return [str(path)]
    listed = [p for p in (environ.get("KUBECONFIG") or "").split(os.pathsep) if p]
    if listed:
        found = [str(Path(p).expanduser()) for p in listed if Path(p).expanduser().is_file()]
        if not found:
            # Falling through to ~/.kube/config or the in-cluster account would talk to another cluster.
            raise ConfigError(f'gpushard: $KUBECONFIG names no file that exists ("{environ["KUBECONFIG"]}"); '
                              "fix or unset it, or pass --kubeconfig FILE")
        return found
    default = Path(DEFAULT_KUBECONFIG).expanduser()
    return [str(default)] if default.is_file() else []


def _configured(configuration: kubernetes.client.Configuration) -> kubernetes.client.Configuration:
    """One attempt per request (see the module's docstring); redirects are an API server's error too."""
    configuration.retries = urllib3.util.Retry(total=0, redirect=0, raise_on_redirect=True, raise_on_status=False)
    return configuration


def _contexts(files: list[str]) -> tuple[dict[str, dict], str | None]:
    """The contexts of the kubeconfig files (name -> context) and the current context, merged as kubectl
    merges them: the first file to name a context or to set current-context wins. Read here rather than
    by the kubernetes client, whose listing fails on a file without current-context even when --context
    names one."""
    contexts: dict[str, dict] = {}
    current = None
    for path in files:
        with open(path, encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
        if not isinstance(data, dict):
            continue
        for entry in data.get("contexts") or ():
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                contexts.setdefault(entry["name"], cast(dict, entry.get("context")
                                                        if isinstance(entry.get("context"), dict) else {}))
        if current is None and isinstance(data.get("current-context"), str) and data["current-context"]:
            current = data["current-context"]
    return contexts, current


def _named(names: list[str]) -> str:
    return ", ".join(f'"{name}"' for name in names)


def client(kubeconfig: str | None = None, context: str | None = None, request_timeout: float | None = None,
           environ: dict | None = None) -> Client:
    """A client for the API server, from the first source in kubectl's order that exists."""
    files = kubeconfig_files(kubeconfig, environ)
    if not files:
        if context:
            raise ConfigError(f'gpushard: --context "{context}": no kubeconfig found (--kubeconfig, $KUBECONFIG '
                              f"or {DEFAULT_KUBECONFIG}) to take it from; pass --kubeconfig FILE, or set KUBECONFIG")
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException as exc:
            reason = " ".join(str(exc).split()).rstrip(".")
            raise ConfigError(f"gpushard: cannot use {IN_CLUSTER} to reach the Kubernetes API: {reason}; outside a "
                              f"pod, pass --kubeconfig, set KUBECONFIG or write {DEFAULT_KUBECONFIG}") from None
        return Client(kubernetes.client.ApiClient(_configured(configuration)),
                      Target(configuration.host, "in-cluster", IN_CLUSTER, request_timeout), request_timeout)
    source = os.pathsep.join(files)
    try:
        contexts, current = _contexts(files)
        if context and context not in contexts:
            if not contexts:
                raise ConfigError(f'gpushard: --context "{context}": {source} names no context at all; fix it '
                                  "(kubectl config view shows it), or pass another file with --kubeconfig")
            raise ConfigError(f'gpushard: --context "{context}": no such context in {source}; use one of '
                              f"{_named(sorted(contexts))} (kubectl config get-contexts)")
        if not context and current is None and contexts:
            raise ConfigError(f"gpushard: {source} sets no current context; pass --context NAME with one of "
                              f"{_named(sorted(contexts))}, or set one (kubectl config use-context NAME)")
        chosen = context or current
        namespace = contexts.get(chosen or "", {}).get("namespace")
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=source, context=context, client_configuration=configuration,
                                           persist_config=False)
    except ConfigError:
        raise
    except (kubernetes.config.ConfigException, OSError, ValueError, TypeError, KeyError, AttributeError,
            yaml.YAMLError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"gpushard: cannot use {source} to reach the Kubernetes API: {reason}; fix the file "
                          "(kubectl config view shows it), or pass another with --kubeconfig") from None
    return Client(kubernetes.client.ApiClient(_configured(configuration)),
                  Target(configuration.host, str(chosen), source, request_timeout,
                         namespace if isinstance(namespace, str) and namespace else None),
                  request_timeout)


def config_reason(exc: BaseException) -> str:
    """A loader failure's reason alone, without the advice that names the command line's flags: for a
    program that takes none of them (the agent), which gives its own."""
    return " ".join(str(exc).split()).removeprefix("gpushard: ").split("; ")[0]


def transport_reason(exc: BaseException) -> str:
    """What failed on the wire, without urllib3's connection reprs and retry counts."""
    inner = getattr(exc, "reason", None) or exc
    text = " ".join(str(inner).split())
    # "<urllib3.connection.HTTPConnection object at 0x..>: Failed to establish a new connection: [Errno
    # 111] Connection refused" -> "connection refused"
    for needle, plain in (("Connection refused", "connection refused"),
                          ("Name or service not known", "no such host"),
                          ("nodename nor servname", "no such host"),
                          ("Temporary failure in name resolution", "no such host (DNS)"),
                          ("timed out", "timed out"),
                          ("CERTIFICATE_VERIFY_FAILED", "its TLS certificate is not trusted"),
                          ("No route to host", "no route to host"),
                          ("Connection reset", "the connection was reset"),
                          ("Remote end closed", "the connection was closed")):
        if needle in text:
            return plain
    head, sep, tail = text.partition(">: ")
    return tail if sep else text


def api_status_message(exc: kubernetes.client.ApiException) -> str:
    """The API server's own message (a Status object's message), or its HTTP reason."""
    import json

    try:
        body = json.loads(exc.body or "")
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            return body["message"]
    except (TypeError, ValueError):
        pass
    return exc.reason or ""


def is_transport_failure(exc: BaseException) -> bool:
    """The request never got an answer: refused, reset, timed out, no such host, TLS."""
    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


def failure_text(exc: BaseException) -> str:
    """A failed API call in a few plain words, for a log line: what an operator can act on."""
    if isinstance(exc, ApiError):
        return str(exc).removeprefix("gpushard: ")
    if isinstance(exc, kubernetes.client.ApiException):
        said = api_status_message(exc)
        return f"HTTP {exc.status}" + (f" ({said})" if said else "")
    if is_transport_failure(exc):
        return transport_reason(exc)
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def unreachable(where: str, exc: BaseException, timeout: float | None = None) -> ApiError:
    """A request that got no answer, told with what to check next."""
    reason = transport_reason(exc)
    check = "check that the cluster is up and that the context is the right one (kubectl config current-context)"
    if reason == "timed out" and timeout:
        reason = f"no answer within {timeout:g}s (--request-timeout)"
        check += ", or give it longer with --request-timeout"
    elif reason == "its TLS certificate is not trusted":
        check = ("check that the server is the right one and that the kubeconfig's certificate-authority-data "
                 "is its CA (kubectl config view --raw)")
    return ApiError(f"gpushard: cannot reach {where}: {reason}; {check}")


def unauthorized(where: str, what: str) -> ApiError:
    return ApiError(f"gpushard: {where} refused the credentials (401 Unauthorized) while trying to {what}; "
                    "log in again, or pick other credentials with --kubeconfig or --context", 401)


def forbidden(where: str, what: str, said: str, rights: str | None = None) -> ApiError:
    """A 403, told with the shipped role (``rights``) that grants what was refused."""
    return ApiError(f"gpushard: {where} forbids this account to {what} (403 Forbidden: {said}); "
                    f"{rights or 'ask the cluster administrators for that right'}", 403)


def answered(where: str, what: str, exc: kubernetes.client.ApiException) -> ApiError:
    """Any other refusal of the API server (not 401 or 403), told with what to do next."""
    said = api_status_message(exc)
    status = f"HTTP {exc.status}" + (f": {said}" if said else "")
    if exc.status is not None and 400 <= exc.status < 500:
        return ApiError(f"gpushard: {where} refused to {what} ({status}); fix what its message names, "
                        "then run this again", exc.status)
    return ApiError(f"gpushard: {where} failed to {what} ({status}); run this again, and if it fails again "
                    "read the API server's log", exc.status)


def explain(exc: BaseException, target: Target, what: str) -> ApiError | None:
    """An ApiError in plain words for a transport failure, 401 or 403; None for anything else."""
    if is_transport_failure(exc):
        return unreachable(target.where, exc, target.timeout)
    if isinstance(exc, kubernetes.client.ApiException):
        if exc.status == 401:
            return unauthorized(target.where, what)
        if exc.status == 403:
            return forbidden(target.where, what, api_status_message(exc), target.rights)
    return None


@contextlib.contextmanager
def reaching(target: Target, what: str) -> Iterator[None]:
    """Calls inside whose transport failure, 401 or 403 becomes an ApiError naming ``what`` was tried."""
    try:
        yield
    except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, kubernetes.client.ApiException) as exc:
        explained = explain(exc, target, what)
        if explained is None:
            raise
        raise explained from None


def finish_watch(response) -> None:
    """A watch response given up: its connection closed, never handed back to the pool open. A watch left
    early (a 410, an error event, a stop) has the rest of its chunked stream still to come on that
    connection, and the next request sent on it would read that as its status line
    (``BadStatusLine('0\\r\\n')``) and fail."""
    response.close()
    response.release_conn()


def watch_lines(response, stop: threading.Event) -> Iterator[bytes]:
    """The newline-separated events of a watch response (its raw stream), each as soon as it arrives."""
    buffer = b""
    while not stop.is_set():
        chunk = response.read1(65536)
        if not chunk:
            return
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
