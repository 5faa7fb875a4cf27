"""A private CA and a serving certificate for the webhook Service, so the API server can verify it."""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import oid

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

# The CA outlives many serving certificates: the caBundle in the webhook configuration
# then changes only when the whole bundle is made anew.
CA_DAYS = 3650
# Clocks of API servers and nodes disagree a little; a certificate valid from a few
# minutes ago is not refused by a peer whose clock runs behind.
BACKDATE = datetime.timedelta(minutes=5)
# Names a local run reaches the webhook by (port-forward, tests, `gpushard serve` on a
# laptop). They are harmless in a cluster: only the webhook's own CA vouches for them.
LOCAL_NAMES = ("localhost",)
LOCAL_ADDRESSES = ("127.0.0.1", "::1")


class CertificateError(SystemExit):
    """A bundle that cannot be written. A SystemExit, so the command line prints the
    ``gpushard:`` message and exits 1 without a traceback."""


def service_names(service: str, namespace: str) -> list[str]:
    """Every DNS name the API server may use for the Service, most specific last."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.cluster.local"]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(oid.NameOID.ORGANIZATION_NAME, "gpushard"),
                      x509.NameAttribute(oid.NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str = "gpushard webhook CA", days: int = CA_DAYS,
            now: datetime.datetime | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA that may sign serving certificates only (path length 0)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(common_name)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_serving(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, dns_names: Sequence[str],
                 ip_addresses: Sequence[str] = (), days: int = 365,
                 now: datetime.datetime | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A TLS server certificate for ``dns_names`` and ``ip_addresses``, signed by the CA."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns_names[0] if dns_names else "gpushard"))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically with ``mode``.

    The replacement is a rename, so a server reading the file for rotation never sees
    half a certificate, and a key is never readable by others, not even for an instant.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


MAX_DAYS = 3650
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def write_bundle(out: str | Path, service: str = "gpushard", namespace: str = "gpushard-system",
                 days: int = 365) -> list[Path]:
    """Make ``ca.crt``, ``tls.crt`` and ``tls.key`` (mode 0600) in ``out``; the paths written."""
    out = Path(out)
    if not 1 <= days <= MAX_DAYS:
        raise CertificateError(f"gpushard: --days must be from 1 to {MAX_DAYS}, got {days}")
    for label, value in (("service", service), ("namespace", namespace)):
        # A DNS label, as a Service or namespace name is (ASCII only: "ü" is alphanumeric to str).
        if not _DNS_LABEL.match(value or ""):
            raise CertificateError(f"gpushard: --{label} {value!r} is not a DNS label (lowercase letters, "
                                   "digits and '-', at most 63 characters)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CertificateError(f"gpushard: cannot create the folder {out}: {exc.strerror}; pass --out a folder "
                               "that can be made") from None
    if not out.is_dir():
        raise CertificateError(f"gpushard: {out} is not a folder; pass --out a folder")

    ca_key, ca_cert = make_ca(days=max(CA_DAYS, days))
    names = service_names(service, namespace)
    # The .svc name first: it is the name the API server dials and the certificate's CN.
    ordered = [names[2]] + [n for n in names if n != names[2]] + list(LOCAL_NAMES)
    key, cert = make_serving(ca_key, ca_cert, ordered, list(LOCAL_ADDRESSES), days=days)
    written = []
    for name, data, mode in ((CA_FILE, cert_pem(ca_cert), 0o644), (CERT_FILE, cert_pem(cert), 0o644),
                             (KEY_FILE, key_pem(key), 0o600)):
        path = out / name
        try:
            write_file(path, data, mode)
        except OSError as exc:
            raise CertificateError(f"gpushard: cannot write {path}: {exc.strerror}; pass --out a folder this "
                                   "account may write") from None
        written.append(path)
    return written
