"""Every exit path of the table in docs/cli.md ("Exit codes"), by running the installed `gpushard` as an operator would.

We test:
- status, audit, top, `replace --once`, `certs --install`, cordon and uncordon against the local API server down,
  refusing the token (401), forbidding the account (403), and accepting connections without ever
  answering: each exits 3 with one `gpushard:` line that names the server and the context, no
  traceback, and each request is tried once (one connection to the silent server), so that
  `--request-timeout` bounds the whole command (a generous wall-time bound, far under the minutes
  that retries took);
- `audit -n NS` with a refused token is 3 as well, naming server and context;
- with the default timeout a silent server costs one 30 s wait, not four;
- bad input is 2: a missing `review --cluster` file, `certs --days 0`, `certs --out` below a
  regular file, a config or a fake inventory that is not UTF-8, $KUBECONFIG naming no file, a
  flag the command lacks (told with that command's usage line);
- a denial (`review`) and a finding (`audit -f`) are 1, a clean review 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import fakekube

ROOT = Path(__file__).resolve().parents[1]
GPUSHARD = Path(sys.executable).with_name("gpushard")
TIMEOUT = "2s"
BOUND_S = 60  # generous: process start-up on a loaded machine, plus one 2 s wait; retries took minutes


def gpushard(*argv: str, env: dict | None = None, timeout: float = 300) -> tuple[int, str, str, float]:
    began = time.monotonic()
    environ = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    done = subprocess.run([str(GPUSHARD), *argv], capture_output=True, text=True, timeout=timeout,
                          env={**environ, **(env or {})}, cwd=ROOT)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def kubeconfig(tmp_path: Path, server: str, token: str | None = None, name: str = "kubeconfig") -> str:
    user = f"{{token: {token}}}" if token else "{}"
    path = tmp_path / name
    path.write_text("apiVersion: v1\nkind: Config\n"
                    f"clusters:\n- name: c\n  cluster: {{server: '{server}'}}\n"
                    f"users:\n- name: u\n  user: {user}\n"
                    "contexts:\n- name: on-call\n  context: {cluster: c, user: u}\ncurrent-context: on-call\n")
    return str(path)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


COMMANDS = {
    "status": ("status",),
    "audit": ("audit",),
    "top": ("top",),
    "replace": ("replace", "--once", "--dry-run"),
    "certs": ("certs", "--install"),
    "cordon": ("cordon", "gpu-1", "0"),
    "uncordon": ("uncordon", "gpu-1", "0"),
}
# What each failure mode says, besides the server and the context.
SAID = {"down": "connection refused", "401": "refused the credentials (401 Unauthorized)",
        "403": "(403 Forbidden", "silent": f"no answer within {TIMEOUT.removesuffix('s')}s"}


@pytest.fixture(scope="module")
def api():
    """One API server that knows only the token "ml-only" (allowed in namespace ml), and one that never answers."""
    with fakekube.FakeKube() as fake, fakekube.SilentServer() as silent:
        fake.tokens = {"ml-only": ("ml",)}
        yield fake, silent


def one_line(err: str) -> str:
    assert err.startswith("gpushard: ") and err.count("\n") == 1, err
    for noise in ("Traceback", "urllib3", "HTTPConnection", "Max retries"):
        assert noise not in err, err
    return err


@pytest.mark.parametrize("mode", ["down", "401", "403", "silent"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_api_that_will_not_serve_exits_3_in_one_line(api, tmp_path, command, mode):
    fake, silent = api
    server = {"down": f"http://127.0.0.1:{closed_port()}", "401": fake.url, "403": fake.url,
              "silent": silent.url}[mode]
    path = kubeconfig(tmp_path, server, {"401": "stolen", "403": "ml-only"}.get(mode))
    before = silent.connections
    code, out, err, took = gpushard(*COMMANDS[command], "--kubeconfig", path, "--request-timeout", TIMEOUT)
    assert code == 3, (out, err)
    line = one_line(err)
    assert server in line and "(context on-call)" in line and SAID[mode] in line, line
    if mode == "silent":
        assert silent.connections - before == 1  # tried once: the timeout bounds the whole command
    assert took < BOUND_S


def test_a_namespace_audit_with_a_refused_token_exits_3_naming_server_and_context(api, tmp_path):
    fake, _silent = api
    code, _out, err, _took = gpushard("audit", "-n", "ml", "--kubeconfig", kubeconfig(tmp_path, fake.url, "stolen"))
    assert code == 3
    assert f"the Kubernetes API at {fake.url} (context on-call) refused the credentials" in one_line(err)


def test_the_default_timeout_waits_once_for_a_silent_server(api, tmp_path):
    _fake, silent = api
    before = silent.connections
    code, _out, err, took = gpushard("status", "--kubeconfig", kubeconfig(tmp_path, silent.url))
    assert code == 3 and "no answer within 30s" in one_line(err)
    assert silent.connections - before == 1
    assert took < 30 + BOUND_S  # four tries took two minutes


# --- bad input: 2 ----------------------------------------------------------------------------------

NOT_UTF8 = b"version: v1\nsharesPerCard: 100 # \xff\xfe\n"


@pytest.mark.parametrize("case", ["review-cluster", "certs-days", "certs-out", "config", "inventory", "kubeconfig-env",
                                  "unknown-flag"])
def test_bad_input_exits_2_with_one_line(tmp_path, case):
    (tmp_path / "file").write_text("a regular file\n")
    (tmp_path / "bad.yaml").write_bytes(NOT_UTF8)
    env = None
    argv: tuple[str, ...]
    said = {"review-cluster": "missing.yaml", "certs-days": "--days must be from 1", "certs-out": "Not a directory",
            "config": "not UTF-8 text", "inventory": "not UTF-8 text", "kubeconfig-env": "$KUBECONFIG names no file",
            "unknown-flag": "unrecognized arguments: --watch"}[case]
    if case == "review-cluster":
        argv = ("review", "--cluster", str(tmp_path / "missing.yaml"), "examples/pod-quarter.yaml")
    elif case == "certs-days":
        argv = ("certs", "--days", "0", "--out", str(tmp_path / "certs"))
    elif case == "certs-out":
        argv = ("certs", "--out", str(tmp_path / "file" / "certs"))
    elif case == "config":
        argv = ("review", "--config", str(tmp_path / "bad.yaml"), "examples/pod-quarter.yaml")
    elif case == "inventory":
        argv = ("agent", "--fake-inventory", str(tmp_path / "bad.yaml"), "--no-publish",
                "--device-plugin-dir", str(tmp_path / "plugins"))
    elif case == "kubeconfig-env":
        argv, env = ("status",), {"KUBECONFIG": str(tmp_path / "gone"), "HOME": str(tmp_path)}
    else:
        argv = ("status", "--watch")
    code, out, err, _took = gpushard(*argv, env=env)
    assert code == 2, (out, err)
    if case == "unknown-flag":
        assert err.startswith("usage: gpushard status ") and said in err
    else:
        assert said in one_line(err) if case != "inventory" else said in err.splitlines()[-1]
        assert "Traceback" not in err


# --- denied and found: 1; clean: 0 -------------------------------------------------------------------

def test_a_denial_or_a_finding_is_1_and_a_clean_review_0():
    assert gpushard("review", "tests/golden/both-forms.fail.yaml")[0] == 1
    assert gpushard("audit", "-f", "tests/golden/both-forms.fail.yaml")[0] == 1
    assert gpushard("review", "examples/pod-quarter.yaml")[0] == 0
