"""`gpushard certs --install`: the serving certificate into a Secret, its CA into the webhook configuration."""

from __future__ import annotations

import base64
import contextlib
import datetime
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from cryptography import exceptions as crypto_exceptions
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from webhook import certificates, kubectlflags
from webhook.kubeapi import connecting

SECRET_TYPE = "kubernetes.io/tls"
# The keys of a kubernetes.io/tls Secret are the file names `gpushard certs` writes, so
# the Secret mounted as a folder gives `gpushard serve` its --cert and --key files.
SECRET_KEYS = (certificates.CA_FILE, certificates.CERT_FILE, certificates.KEY_FILE)
LABELS = {"app.kubernetes.io/name": "gpushard", "app.kubernetes.io/managed-by": "gpushard-certs"}
TIMEOUT = 30.0
# Exit statuses, as in webhook.kubectlflags.EXIT_CODES: the cluster refused or lacks something, or
# cannot be reached (3); the flags disagree or no credentials were found (2).
REFUSED = kubectlflags.UNREACHABLE
UNREACHABLE = kubectlflags.UNREACHABLE
USAGE = kubectlflags.USAGE
# What grants the calls of `certs --install`, told with a 403.
RIGHTS = ("the ServiceAccount gpushard-system/gpushard-certs has it (deploy/base/certs-job.yaml): run the certs Job, "
          "or bind its Role and ClusterRole to this account")


class InstallError(SystemExit):
    """The cluster refused, lacks something, or cannot be reached; a SystemExit, so that even uncaught it
    ends the program with the ``gpushard:`` message and no traceback. ``status`` is the exit status the
    command line gives for it."""

    def __init__(self, message: str, status: int = REFUSED):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Outcome:
    """What one run did, for the person or the Job log reading it."""

    namespace: str
    secret: str
    secret_action: str  # "created", "replaced" or "kept"
    why: str
    not_after: datetime.datetime
    webhook_config: str
    webhooks_updated: tuple[str, ...]
    webhooks: tuple[str, ...]

    def lines(self) -> list[str]:
        until = self.not_after.strftime("%Y-%m-%d %H:%M UTC")
        out = [f"gpushard: Secret {self.namespace}/{self.secret} {self.secret_action} ({self.why}); "
               f"the serving certificate is valid until {until}"]
        if self.webhooks_updated:
            out.append(f"gpushard: caBundle set in MutatingWebhookConfiguration {self.webhook_config} for "
                       f"{', '.join(self.webhooks_updated)}")
        else:
            out.append(f"gpushard: caBundle of MutatingWebhookConfiguration {self.webhook_config} already "
                       f"up to date for {', '.join(self.webhooks)}")
        return out


def client(kubeconfig: str | None = None, context: str | None = None,
           timeout: float | None = TIMEOUT) -> connecting.Client:
    """A client from the one kubeconfig loader (webhook.kubeapi.connecting, kubectl's order): --kubeconfig,
    else $KUBECONFIG, else ~/.kube/config, else the in-cluster service account (the Job)."""
    try:
        return connecting.client(kubeconfig, context, timeout)
    except connecting.ConfigError as exc:
        raise InstallError(str(exc), status=USAGE) from None


def api_client(kubeconfig: str | None = None, context: str | None = None) -> kubernetes.client.ApiClient:
    """As ``client``, the ApiClient alone."""
    return client(kubeconfig, context).api


@dataclass(frozen=True)
class _Reach:
    """Where the calls go, for messages, and how long each may take."""

    where: str
    timeout: float | None = TIMEOUT


def _api_error(what: str, exc: kubernetes.client.ApiException, reach: _Reach) -> InstallError:
    if exc.status == 401:
        told = connecting.unauthorized(reach.where, what)
    elif exc.status == 403:
        told = connecting.forbidden(reach.where, what, connecting.api_status_message(exc) or exc.reason or "", RIGHTS)
    else:
        told = connecting.answered(reach.where, what, exc)
    return InstallError(str(told))


@contextlib.contextmanager
def _reaching(reach: _Reach):
    """Transport failures of the API calls inside, as an InstallError naming the API server and context."""
    try:
        yield
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise InstallError(str(connecting.unreachable(reach.where, exc, reach.timeout)), status=UNREACHABLE) from None


def _pem_certificates(data: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        return []


def _decoded(data: dict | None, key: str) -> bytes:
    try:
        return base64.b64decode((data or {}).get(key) or "", validate=True)
    except ValueError:
        return b""


def _unusable(secret: kubernetes.client.V1Secret, service: str, namespace: str, now: datetime.datetime,
              renew_before: datetime.timedelta) -> str | None:
    """Why the Secret's certificate cannot be kept, or None when it can."""
    cas = _pem_certificates(_decoded(secret.data, certificates.CA_FILE))
    certs = _pem_certificates(_decoded(secret.data, certificates.CERT_FILE))
    if not cas or not certs:
        return "it holds no PEM ca.crt and tls.crt"
    cert = certs[0]
    try:
        key = serialization.load_pem_private_key(_decoded(secret.data, certificates.KEY_FILE), password=None)
    except (ValueError, TypeError):
        return "it holds no PEM tls.key"
    public = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*public) != cert.public_key().public_bytes(*public):
        return "tls.key is not the key of tls.crt"
    if not any(_issued_by(cert, ca) for ca in cas):
        return "tls.crt is not signed by ca.crt"
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "tls.crt names no DNS name"
    wanted = f"{service}.{namespace}.svc"
    if wanted not in names.get_values_for_type(x509.DNSName):
        return f"tls.crt is not for {wanted}"
    expiry = min([cert.not_valid_after_utc] + [ca.not_valid_after_utc for ca in cas])
    if expiry - now <= renew_before:
        return f"it expires on {expiry:%Y-%m-%d}, within {renew_before.days} days"
    return None


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, crypto_exceptions.InvalidSignature):
        return False
    return True


def _read_secret(core: kubernetes.client.CoreV1Api, namespace: str, name: str,
                 reach: _Reach) -> kubernetes.client.V1Secret | None:
    try:
        return core.read_namespaced_secret(name, namespace, _request_timeout=reach.timeout)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise _api_error(f"read Secret {namespace}/{name}", exc, reach) from None


def _read_config(admission: kubernetes.client.AdmissionregistrationV1Api,
                 name: str, reach: _Reach) -> kubernetes.client.V1MutatingWebhookConfiguration:
    try:
        config = admission.read_mutating_webhook_configuration(name, _request_timeout=reach.timeout)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            raise InstallError(f"gpushard: MutatingWebhookConfiguration {name} not found at {reach.where}; apply "
                               "deploy/ first (kubectl apply -k deploy/base), then run this again") from None
        raise _api_error(f"read MutatingWebhookConfiguration {name}", exc, reach) from None
    if not config.webhooks:
        raise InstallError(f"gpushard: MutatingWebhookConfiguration {name} has no webhooks to give a CA to; apply "
                           "deploy/ again (kubectl apply -k deploy/base), then run this again")
    return config


def _make_bundle(out: str | Path | None, service: str, namespace: str, days: int) -> dict[str, bytes]:
    if out is not None:
        certificates.write_bundle(out, service=service, namespace=namespace, days=days)
        return {key: (Path(out) / key).read_bytes() for key in SECRET_KEYS}
    # The key exists on disk only inside this folder, for as long as it takes to read it back.
    with tempfile.TemporaryDirectory(prefix="gpushard-certs-") as tmp:
        certificates.write_bundle(tmp, service=service, namespace=namespace, days=days)
        return {key: (Path(tmp) / key).read_bytes() for key in SECRET_KEYS}


def _patch_ca_bundle(admission: kubernetes.client.AdmissionregistrationV1Api,
                     config: kubernetes.client.V1MutatingWebhookConfiguration, bundle: bytes,
                     reach: _Reach) -> tuple[str, ...]:
    """Give every webhook the bundle; the names of the webhooks that changed."""
    encoded = base64.b64encode(bundle).decode()
    ops: list[dict] = []
    changed = []
    assert config.webhooks is not None  # _read_config refuses a configuration without webhooks
    for i, hook in enumerate(config.webhooks):
        if (hook.client_config.ca_bundle or "") == encoded:
            continue
        # The test makes the patch fail, rather than give a CA to the wrong webhook, when
        # someone reordered the list since we read it.
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook.name})
        ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": encoded})
        changed.append(hook.name)
    if ops:
        assert config.metadata is not None and config.metadata.name is not None  # as read from the API server
        name = config.metadata.name
        try:
            admission.patch_mutating_webhook_configuration(name, ops, _request_timeout=reach.timeout)
        except kubernetes.client.ApiException as exc:
            raise _api_error(f"patch the caBundle of MutatingWebhookConfiguration {name}", exc, reach) from None
    return tuple(changed)


def install(api: kubernetes.client.ApiClient, *, namespace: str = "gpushard-system", service: str = "gpushard",
            secret: str = "gpushard-tls", webhook_config: str = "gpushard", days: int = 365,
            renew_before: int = 30, force: bool = False, out: str | Path | None = None,
            now: datetime.datetime | None = None, target: connecting.Target | None = None,
            timeout: float | None = TIMEOUT) -> Outcome:
    """Make sure the Secret holds a good serving certificate and every webhook trusts its CA.

    A certificate good for more than ``renew_before`` days is kept (running this again
    changes nothing). A new one gets a new CA; the old CA, while still valid, stays in
    the caBundle next to the new one until the next run, because the webhook pods see
    the new Secret only after the kubelet refreshes their volume (about a minute).
    The caBundle is written before the Secret: a failure in between leaves the running
    webhook trusted.
    """
    if days <= renew_before:
        raise InstallError(f"gpushard: --days {days} must be more than --renew-before {renew_before}, or every "
                           "run would make a new certificate; raise --days or lower --renew-before", status=USAGE)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    where = f"the Kubernetes API at {target.host if target else api.configuration.host}" + (
        f" (context {target.context})" if target else "")
    reach = _Reach(where, timeout)
    core = kubernetes.client.CoreV1Api(api)
    admission = kubernetes.client.AdmissionregistrationV1Api(api)

    with _reaching(reach):
        config = _read_config(admission, webhook_config, reach)
        existing = _read_secret(core, namespace, secret, reach)
    assert config.webhooks is not None  # _read_config refuses a configuration without webhooks
    if existing is not None and existing.type != SECRET_TYPE:
        # Checked before the caBundle changes: a Secret's type cannot change, so the new
        # certificate could never be stored.
        raise InstallError(f"gpushard: Secret {namespace}/{secret} has type {existing.type!r}, not {SECRET_TYPE}, "
                           f"and a Secret's type cannot change; delete it (kubectl -n {namespace} delete secret "
                           f"{secret}) and run this again")
    why: str | None
    if existing is None:
        why = "there was none"
    elif force:
        why = "--force"
    else:
        why = _unusable(existing, service, namespace, now, datetime.timedelta(days=renew_before))

    if existing is not None and why is None:
        files = {key: _decoded(existing.data, key) for key in SECRET_KEYS}
        bundle = files[certificates.CA_FILE]
        action, why = "kept", "still valid"
    else:
        assert why is not None  # the reason for a new certificate
        files = _make_bundle(out, service, namespace, days)
        bundle = files[certificates.CA_FILE]
        if existing is not None:
            old = [ca for ca in _pem_certificates(_decoded(existing.data, certificates.CA_FILE))
                   if ca.not_valid_after_utc > now]
            bundle += b"".join(certificates.cert_pem(ca) for ca in old)
        action = "created" if existing is None else "replaced"

    with _reaching(reach):
        updated = _patch_ca_bundle(admission, config, bundle, reach)
        if action != "kept":
            _write_secret(core, namespace, secret, files, existing, reach)
    not_after = x509.load_pem_x509_certificate(files[certificates.CERT_FILE]).not_valid_after_utc
    return Outcome(namespace=namespace, secret=secret, secret_action=action, why=why, not_after=not_after,
                   webhook_config=webhook_config, webhooks_updated=updated,
                   webhooks=tuple(hook.name for hook in config.webhooks))


def _write_secret(core: kubernetes.client.CoreV1Api, namespace: str, name: str, files: dict[str, bytes],
                  existing: kubernetes.client.V1Secret | None, reach: _Reach) -> None:
    metadata: dict = {"name": name, "namespace": namespace, "labels": dict(LABELS)}
    # Any: a manifest, which the client takes for a V1Secret.
    body: Any = {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": SECRET_TYPE,
                 "data": {key: base64.b64encode(value).decode() for key, value in files.items()}}
    try:
        if existing is None:
            core.create_namespaced_secret(namespace, body, _request_timeout=reach.timeout)
            return
        # The resourceVersion makes the replace fail if someone changed the Secret since we read it.
        assert existing.metadata is not None  # as read from the API server
        metadata["resourceVersion"] = existing.metadata.resource_version
        metadata["labels"] = {**(existing.metadata.labels or {}), **LABELS}
        if existing.metadata.annotations:
            metadata["annotations"] = dict(existing.metadata.annotations)
        core.replace_namespaced_secret(name, namespace, body, _request_timeout=reach.timeout)
    except kubernetes.client.ApiException as exc:
        if exc.status == 409:
            raise InstallError(f"gpushard: Secret {namespace}/{name} changed while this ran; run it again") from None
        raise _api_error(f"write Secret {namespace}/{name}", exc, reach) from None
