"""The container image, checked without a container engine: the Dockerfile's rules, and its install steps run for real.

We test:
- the Dockerfile: a pinned base image, two stages, a wheel built with `pip wheel --no-deps`
  in the first, only that wheel (with the same extras) installed into a venv in the last,
  no compilers there, a numeric non-root USER, ENTRYPOINT ["gpushard"] and a default CMD;
- .dockerignore keeps out .venv, .git, certificates and caches, and nothing the build copies;
- the install steps themselves: the files the Dockerfile copies, built into a wheel, installed
  with its extras into a fresh venv, start `gpushard`, `gpushard serve --help` and
  `gpushard agent --help` and the kubectl plugin `kubectl-gpushard` from that venv alone, with
  the agent's gRPC stubs and NVML bindings.
  No container engine runs here; the test is skipped only when pip cannot reach its index.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import webhook

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in _instructions():
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _copied_sources() -> list[str]:
    (build, _final) = _stages()
    sources = []
    for word, args in build:
        if word == "COPY" and "--from" not in args:
            sources += args.split()[:-1]
    return sources


def _extras(text: str) -> set[str]:
    return set(re.findall(r"gpushard[^\s\"']*\[([a-z,]+)\]", text))


def test_dockerfile_rules():
    instructions = _instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in instructions if w == "ARG" and "=" in a}
    base = args["PYTHON_IMAGE"]
    # A tag with a full version, never latest or a floating major version.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base
    build, final = _stages()
    assert build[0][1].startswith("${PYTHON_IMAGE} AS ") and final[0][1] == "${PYTHON_IMAGE}"
    build_runs = " ".join(a for w, a in build if w == "RUN")
    final_runs = " ".join(a for w, a in final if w == "RUN")
    assert "pip wheel --no-deps" in build_runs
    assert "build-essential" in build_runs and "apt-get" not in final_runs
    assert "python -m venv" in final_runs and "--no-index" in final_runs
    assert _extras(build_runs) == _extras(final_runs) == {"agent"}
    assert not [a for w, a in final if w in ("COPY", "ADD")], "the wheels are bind-mounted, never a layer"
    (user,) = [a for w, a in final if w == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    (entrypoint,) = [a for w, a in final if w == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["gpushard"]
    (cmd,) = [a for w, a in final if w == "CMD"]
    assert json.loads(cmd)


def _ignored(path: str, patterns: list[str]) -> bool:
    hit = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.replace("**/", "")) \
                or path.startswith(pattern + "/"):
            hit = not negate
    return hit


def test_dockerignore_keeps_secrets_and_caches_out_and_lets_the_sources_in():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in (".venv", ".git", "certs", "certs/tls.key", "x.pem", ".pytest_cache", ".ruff_cache",
                 "webhook/__pycache__", "tests"):
        assert _ignored(path, patterns), path
    for source in _copied_sources():
        assert not _ignored(source, patterns), source
        assert (ROOT / source).exists(), source


def _pip_reaches_index(tmp: Path) -> bool:
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(tmp),
                             "--quiet", "flask>=3"], capture_output=True, text=True, timeout=60)
    return result.returncode == 0


def _run(*cmd: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_install_steps_give_working_entry_points(tmp_path):
    if not _pip_reaches_index(tmp_path / "probe"):
        pytest.skip("pip cannot reach its package index")
    # The build context: exactly what the build stage copies.
    src = tmp_path / "src"
    src.mkdir()
    for source in _copied_sources():
        origin = ROOT / source
        if origin.is_dir():
            shutil.copytree(origin, src / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(origin, src / source)
    wheels = tmp_path / "wheels"
    # The Dockerfile's `pip wheel --no-deps .`; the build backend comes from this venv, not the index.
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                 str(wheels), ".", cwd=src)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("gpushard-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    pip, gpushard = env_dir / "bin/pip", env_dir / "bin/gpushard"
    # --no-compile only saves time here; the image compiles, as its root filesystem is read-only later.
    installed = _run(str(pip), "install", "--quiet", "--no-compile", f"{wheel}[agent]", cwd=tmp_path, timeout=300)
    assert installed.returncode == 0, installed.stderr
    # From tmp_path, so only the installed wheel can answer, never the source tree.
    version = _run(str(gpushard), "--version", cwd=tmp_path)
    assert version.stdout.strip() == f"gpushard {webhook.__version__}"
    for command in ([], ["serve"], ["agent"], ["certs"]):
        result = _run(str(gpushard), *command, "--help", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: gpushard")
    # The kubectl plugin, which kubectl finds on the PATH as `kubectl gpushard`.
    for command in (["status"], ["audit"], ["review"]):
        result = _run(str(env_dir / "bin/kubectl-gpushard"), *command, "--help", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: kubectl gpushard {command[0]}")
    probe = _run(str(env_dir / "bin/python"), "-c",
                 "import pynvml, grpc, gunicorn, flask, kubernetes, cryptography, webhook.installing; "
                 "from webhook.agent.proto import deviceplugin_pb2_grpc; import webhook; print(webhook.__file__)",
                 cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert str(env_dir) in probe.stdout
