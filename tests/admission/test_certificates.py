"""We test:
- `write_bundle` creates the folder and writes ca.crt, tls.crt and tls.key (0600);
- the serving certificate verifies against the CA for every Service name and for localhost/127.0.0.1,
  and not for another name; it is a leaf for server auth, the CA a CA;
- a real TLS handshake between an ssl server and client that trusts only the CA;
- writing again replaces the files atomically; unwritable places give `gpushard:` errors.
"""

from __future__ import annotations

import datetime
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509
from cryptography.x509 import oid

from webhook import certificates


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_the_bundle_has_three_files_and_a_private_key(tmp_path):
    out = tmp_path / "a" / "b"
    paths = certificates.write_bundle(out, service="hook", namespace="ns", days=30)
    assert [p.name for p in paths] == ["ca.crt", "tls.crt", "tls.key"]
    assert stat.S_IMODE((out / "tls.key").stat().st_mode) == 0o600
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    ca, leaf = _load(out / "ca.crt"), _load(out / "tls.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert oid.ExtendedKeyUsageOID.SERVER_AUTH in leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) >= {
        "hook", "hook.ns", "hook.ns.svc", "hook.ns.svc.cluster.local", "localhost"}
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert datetime.timedelta(days=30) <= lifetime <= datetime.timedelta(days=30, minutes=10)
    assert ca.not_valid_after_utc >= leaf.not_valid_after_utc


def _handshake(folder, server_hostname: str, cafile) -> str:
    """Serve one TLS handshake with the bundle and connect with a client that trusts ``cafile``."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept():
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"hi")
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        client_ctx = ssl.create_default_context(cafile=str(cafile))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
            return tls.recv(2).decode()
    finally:
        thread.join(5)
        listener.close()


@pytest.mark.parametrize("name", ["gpushard.gpushard-system.svc", "gpushard", "gpushard.gpushard-system",
                                  "gpushard.gpushard-system.svc.cluster.local", "localhost", "127.0.0.1"])
def test_a_client_trusting_the_ca_verifies_every_service_name(tmp_path, name):
    certificates.write_bundle(tmp_path)
    assert _handshake(tmp_path, name, tmp_path / "ca.crt") == "hi"


def test_another_name_or_another_ca_fails_verification(tmp_path):
    certificates.write_bundle(tmp_path / "one")
    certificates.write_bundle(tmp_path / "two")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path / "one", "other.gpushard-system.svc", tmp_path / "one" / "ca.crt")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path / "one", "gpushard.gpushard-system.svc", tmp_path / "two" / "ca.crt")


def test_writing_again_replaces_every_file(tmp_path):
    certificates.write_bundle(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    certificates.write_bundle(tmp_path)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert before.keys() == after.keys() and all(before[k] != after[k] for k in before)
    assert stat.S_IMODE((tmp_path / "tls.key").stat().st_mode) == 0o600


def test_an_unwritable_place_is_a_gpushard_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(certificates.CertificateError) as exc:
        certificates.write_bundle(blocker / "sub")
    assert str(exc.value).startswith("gpushard: cannot create the folder")
    with pytest.raises(certificates.CertificateError) as exc:
        certificates.write_bundle(blocker)
    assert str(exc.value).startswith("gpushard:")


@pytest.mark.parametrize("service, namespace", [("Bad_Name", "ns"), ("ok", "-x"), ("", "ns"), ("a" * 64, "ns"),
                                                ("gp\u00fcshard", "ns")])
def test_names_that_are_no_dns_labels_are_refused(tmp_path, service, namespace):
    with pytest.raises(certificates.CertificateError) as exc:
        certificates.write_bundle(tmp_path, service=service, namespace=namespace)
    assert str(exc.value).startswith("gpushard:")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("days", [0, -1, 10_000_000])
def test_lifetimes_out_of_range_are_refused(tmp_path, days):
    with pytest.raises(certificates.CertificateError, match="--days must be from 1 to"):
        certificates.write_bundle(tmp_path, days=days)
