"""`gpushard certs --install` against a real local HTTP server that speaks the Kubernetes API.

We test:
- a first run creates a kubernetes.io/tls Secret and gives every webhook its CA, and a real
  TLS handshake with the Secret's certificate verifies against that caBundle for the
  Service's name;
- a second run keeps everything and writes nothing, yet gives a webhook added since then the CA;
- near expiry (and with --force) a new CA and certificate replace the Secret, the caBundle
  trusts both CAs until the next run, and that run drops the old one;
- a missing webhook configuration, a Secret of another type and a refusal by RBAC stop it
  with a `gpushard:` message, before anything is written;
- an API server that cannot be reached stops it with a `gpushard:` message naming its address
  and exit status 3, as `gpushard status` gives, with no traceback and nothing written;
- the command line: `gpushard certs --install` through $KUBECONFIG or --kubeconfig/--context,
  a kubeconfig that is not there, and `certs` without --out.
"""

from __future__ import annotations

import base64
import datetime
import os
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from tests import fakekube
from webhook import installing

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE, SECRET, CONFIG, SERVICE = "gpushard-system", "gpushard-tls", "gpushard", "gpushard"
HOST = f"{SERVICE}.{NAMESPACE}.svc"
WRITES = ("POST", "PUT", "PATCH", "DELETE")


@pytest.fixture
def kube():
    with fakekube.FakeKube() as fake:
        # The webhook configuration exactly as deploy/ ships it: no caBundle yet.
        config = yaml.safe_load((ROOT / "deploy/base/webhook-configuration.yaml").read_text())
        fake.put("mutatingwebhookconfigurations", config)
        yield fake


def _install(kube: fakekube.FakeKube, **kwargs) -> installing.Outcome:
    return installing.install(kube.api_client(), namespace=NAMESPACE, service=SERVICE, secret=SECRET,
                              webhook_config=CONFIG, **kwargs)


def _secret_files(kube: fakekube.FakeKube) -> dict[str, bytes]:
    secret = kube.get("secrets", SECRET, NAMESPACE)
    assert secret["type"] == "kubernetes.io/tls"
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def _bundles(kube: fakekube.FakeKube) -> list[bytes]:
    config = kube.get("mutatingwebhookconfigurations", CONFIG)
    return [base64.b64decode(hook["clientConfig"]["caBundle"]) for hook in config["webhooks"]]


def _writes(kube: fakekube.FakeKube) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _body in kube.requests if method in WRITES]


def _handshake(files: dict[str, bytes], ca_bundle: bytes, tmp_path: Path) -> str:
    """Serve the Secret's certificate on loopback; connect as the API server would, by Service name."""
    (tmp_path / "tls.crt").write_bytes(files["tls.crt"])
    (tmp_path / "tls.key").write_bytes(files["tls.key"])
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client_ctx = ssl.create_default_context(cadata=ca_bundle.decode())
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve_one():
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")

        thread = threading.Thread(target=serve_one, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=HOST) as tls:
                data = tls.recv(2).decode()
        thread.join(timeout=5)
    return data


def test_first_run_creates_the_secret_and_fills_every_ca_bundle(kube, tmp_path):
    outcome = _install(kube)
    assert outcome.secret_action == "created"
    assert outcome.webhooks_updated == ("enforce.gpushard.io", "hide.gpushard.io", "audit.gpushard.io")
    files = _secret_files(kube)
    assert set(files) == {"ca.crt", "tls.crt", "tls.key"}
    assert _bundles(kube) == [files["ca.crt"]] * 3
    assert _handshake(files, files["ca.crt"], tmp_path) == "ok"
    secret = kube.get("secrets", SECRET, NAMESPACE)
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gpushard-certs"
    # The rest of the webhook configuration is untouched.
    config = kube.get("mutatingwebhookconfigurations", CONFIG)
    assert [h["clientConfig"]["service"]["path"] for h in config["webhooks"]] == ["/mutate", "/mutate", "/audit"]
    assert all(line.startswith("gpushard: ") for line in outcome.lines())


def test_second_run_keeps_everything_and_writes_nothing(kube):
    _install(kube)
    before = (_secret_files(kube), _bundles(kube))
    kube.requests.clear()
    outcome = _install(kube)
    assert outcome.secret_action == "kept" and outcome.webhooks_updated == ()
    assert _writes(kube) == []
    assert (_secret_files(kube), _bundles(kube)) == before


def test_a_webhook_added_later_gets_the_ca_of_the_kept_certificate(kube):
    # As when deploy/base replaces the audit-only overlay: a new webhook without a caBundle.
    _install(kube)
    config = kube.get("mutatingwebhookconfigurations", CONFIG)
    del config["webhooks"][0]["clientConfig"]["caBundle"]
    kube.put("mutatingwebhookconfigurations", config)
    kube.requests.clear()
    outcome = _install(kube)
    assert outcome.secret_action == "kept" and outcome.webhooks_updated == ("enforce.gpushard.io",)
    assert [m for m, _ in _writes(kube)] == ["PATCH"]
    ca = _secret_files(kube)["ca.crt"]
    assert _bundles(kube) == [ca] * 3


def test_renewal_near_expiry_trusts_both_cas_until_the_next_run(kube, tmp_path):
    _install(kube, days=365, renew_before=30)
    old = _secret_files(kube)
    soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=340)
    outcome = _install(kube, days=365, renew_before=30, now=soon)
    assert outcome.secret_action == "replaced" and "within 30 days" in outcome.why
    new = _secret_files(kube)
    assert new["ca.crt"] != old["ca.crt"] and new["tls.key"] != old["tls.key"]
    bundle = _bundles(kube)[0]
    assert bundle == new["ca.crt"] + old["ca.crt"]
    # Both the pods still serving the old certificate and those serving the new one verify.
    assert _handshake(old, bundle, tmp_path) == "ok"
    assert _handshake(new, bundle, tmp_path) == "ok"
    outcome = _install(kube)
    assert outcome.secret_action == "kept" and outcome.webhooks_updated
    assert _bundles(kube) == [new["ca.crt"]] * 3


def test_force_replaces_a_good_certificate(kube):
    _install(kube)
    old = _secret_files(kube)
    outcome = _install(kube, force=True)
    assert outcome.secret_action == "replaced" and outcome.why == "--force"
    assert _secret_files(kube)["tls.crt"] != old["tls.crt"]


def test_a_certificate_for_another_service_is_replaced(kube):
    installing.install(kube.api_client(), namespace=NAMESPACE, service="other", secret=SECRET,
                       webhook_config=CONFIG)
    outcome = _install(kube)
    assert outcome.secret_action == "replaced" and HOST in outcome.why
    cert = x509.load_pem_x509_certificate(_secret_files(kube)["tls.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert HOST in names.get_values_for_type(x509.DNSName)


def test_missing_webhook_configuration_stops_before_any_write(kube):
    kube.delete("mutatingwebhookconfigurations", CONFIG)
    kube.requests.clear()
    with pytest.raises(installing.InstallError) as err:
        _install(kube)
    assert str(err.value.code).startswith("gpushard: MutatingWebhookConfiguration gpushard not found")
    assert _writes(kube) == []


def test_secret_of_another_type_stops_before_the_ca_bundle_changes(kube):
    kube.put("secrets", {"metadata": {"name": SECRET, "namespace": NAMESPACE}, "type": "Opaque",
                         "data": {"x": base64.b64encode(b"y").decode()}})
    kube.requests.clear()
    with pytest.raises(installing.InstallError) as err:
        _install(kube)
    assert "type 'Opaque'" in str(err.value.code) and "kubectl -n gpushard-system delete secret" in str(err.value.code)
    assert _writes(kube) == []


def test_rbac_refusal_names_the_rbac_to_apply(kube):
    kube.fail_next.append(403)
    with pytest.raises(installing.InstallError) as err:
        _install(kube)
    assert "(403 Forbidden" in str(err.value.code) and "certs-job.yaml" in str(err.value.code)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kubeconfig_to(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "me"}}]}))
    return path


def test_an_unreachable_api_server_is_named(tmp_path):
    server = f"http://127.0.0.1:{_closed_port()}"
    api = installing.api_client(str(_kubeconfig_to(tmp_path, server)))
    with pytest.raises(installing.InstallError) as err:
        installing.install(api, out=tmp_path / "bundle")
    assert err.value.status == 3
    assert str(err.value.code).startswith(f"gpushard: cannot reach the Kubernetes API at {server}: ")
    assert "connection refused" in str(err.value.code)
    assert not (tmp_path / "bundle").exists()


def test_command_line_unreachable_api_server_exits_3(tmp_path):
    server = f"http://127.0.0.1:{_closed_port()}"
    result = _gpushard("certs", "--install", "--kubeconfig", str(_kubeconfig_to(tmp_path, server)))
    assert result.returncode == 3
    assert result.stderr.startswith(f"gpushard: cannot reach the Kubernetes API at {server} (context c): ")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_days_must_exceed_renew_before(kube):
    with pytest.raises(installing.InstallError) as err:
        _install(kube, days=20, renew_before=30)
    assert str(err.value.code).startswith("gpushard: --days 20")


def _gpushard(*args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run([sys.executable, "-m", "webhook.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_command_line_install_through_a_kubeconfig(kube, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}]}))
    out = tmp_path / "bundle"
    result = _gpushard("certs", "--install", "--out", str(out), kubeconfig=kubeconfig)
    assert result.returncode == 0, result.stderr
    assert "Secret gpushard-system/gpushard-tls created" in result.stdout
    # --out keeps a copy of what went into the cluster.
    assert (out / "ca.crt").read_bytes() == _secret_files(kube)["ca.crt"]
    result = _gpushard("certs", "--install", "--kubeconfig", str(kubeconfig), "--context", "fake")
    assert result.returncode == 0 and "kept" in result.stdout
    result = _gpushard("certs", "--install", "--kubeconfig", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.startswith(f'gpushard: --kubeconfig "{tmp_path / "missing"}": no such file')


def test_command_line_certs_needs_out_or_install(tmp_path):
    result = _gpushard("certs")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("gpushard: certs needs --out DIR, or --install")
