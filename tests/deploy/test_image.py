"""The container image, checked without a container engine: the Dockerfile's rules, and its install steps run for real.

We test:
- the Dockerfile: a pinned base image, no `# syntax=` directive (it would need a registry), a
  wheel built with `pip wheel --no-deps` in the build stage, only that wheel (with the same
  extras) installed into a venv in the final stage, no compilers there, no bytecode written at
  run time, a numeric non-root USER, ENTRYPOINT ["gpushard"] and a default CMD;
- .dockerignore keeps out .venv, .git, certificates and caches, and nothing the build copies;
- the offline build: the final stage installs from the `wheels` stage, which a `wheels` build
  context replaces (make wheelhouse), and needs nothing of its base but python3;
- the image and the manifests agree, for every container of deploy/base and its overlays that
  runs the image: no `command` (the image's ENTRYPOINT runs), arguments that `gpushard` itself
  parses, every path they name (and the agent's kubelet folders) inside a volume the container
  mounts, the non-root user and group the Dockerfile's USER, and a writable TMPDIR where the
  command writes temporary files under a read-only root; each way of disagreeing fails
  (make image-check then starts the image itself with those manifests);
- `make image` says in one `gpushard:` line what is missing (no engine, a docker client whose
  daemon does not answer, a wheelhouse without gpushard's wheel), prefers podman to a docker
  without a daemon, and hands the base image and the wheelhouse to the engine;
- the install steps themselves: the files the Dockerfile copies, built into a wheel, installed
  with its extras into a fresh venv, start `gpushard`, `gpushard serve --help` and
  `gpushard agent --help` and the kubectl plugin `kubectl-gpushard` from that venv alone, with
  the agent's gRPC stubs and NVML bindings.
  No container engine runs here; the test is skipped only when pip cannot reach its index.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
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
from tests.deploy import rendering
from webhook import __version__, cli

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


def _stages(instructions: list[tuple[str, str]] | None = None) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in _instructions() if instructions is None else instructions:
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _copied_sources() -> list[str]:
    (build, _wheels, _final) = _stages()
    sources = []
    for word, args in build:
        if word == "COPY" and "--from" not in args:
            sources += args.split()[:-1]
    return sources


def _extras(text: str) -> set[str]:
    return set(re.findall(r"gpushard[^\s\"']*\[([a-z,]+)\]", text))


def test_dockerfile_rules():
    # A `# syntax=` directive makes BuildKit fetch its frontend from a registry: no offline build.
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE.read_text(), flags=re.M | re.I)
    instructions = _instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in instructions if w == "ARG" and "=" in a}
    base = args["PYTHON_IMAGE"]
    # A tag with a full version, never latest or a floating major version.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base
    build, wheels, final = _stages()
    assert build[0][1].startswith("${PYTHON_IMAGE} AS ") and final[0][1] == "${PYTHON_IMAGE}"
    # Offline builds hand a folder of wheels over as the build context `wheels`, which takes the
    # place of this stage: the final stage must take its wheels from it, at its root.
    assert wheels[0][1] == "scratch AS wheels" and wheels[1:] == [("COPY", "--from=build /wheels /")]
    build_runs = " ".join(a for w, a in build if w == "RUN")
    final_runs = " ".join(a for w, a in final if w == "RUN")
    assert "pip wheel --no-deps" in build_runs
    assert "build-essential" in build_runs and "apt-get" not in final_runs
    assert "python3 -m venv" in final_runs and "--no-index" in final_runs
    assert _extras(build_runs) == _extras(final_runs) == {"agent"}
    assert not [a for w, a in final if w in ("COPY", "ADD")], "the wheels are bind-mounted, never a layer"
    assert "--mount=type=bind,from=wheels,target=/wheels " in final_runs
    # Of its base the final stage needs python3 alone (not `python`, not `pip`), which Debian's
    # own python3 has as well as the official python images (make image-check builds on Debian's).
    commands = [c.split()[0] for c in re.split(r"&&|\|\||;|\|", re.sub(r"--mount=\S+", "", final_runs)) if c.strip()]
    assert not {"python", "pip"} & set(commands), commands
    assert "PYTHONDONTWRITEBYTECODE=1" in " ".join(a for w, a in final if w == "ENV"), \
        "the pods' root filesystems are read-only: Python must not try to write bytecode"
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
                 "webhook/__pycache__", "tests", "build/wheelhouse"):
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


# --- the image and the manifests ----------------------------------------------------------------

# Commands that write temporary files, so need a writable TMPDIR under a read-only root:
# gunicorn's worker heartbeat files (serve), the key pair before it goes into the Secret (certs).
WRITES_TEMPORARY_FILES = {"serve", "certs"}
# Paths the agent uses by default, which the DaemonSet relies on without naming them.
AGENT_DEFAULT_PATHS = ("device_plugin_dir", "pod_resources_socket")


def _final_config(instructions: list[tuple[str, str]]) -> dict:
    """USER, ENTRYPOINT and ENV of the Dockerfile's final stage."""
    final = _stages(instructions)[-1]
    env = {}
    for word, args in final:
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    (user,) = [a for w, a in final if w == "USER"]
    uid, _, gid = user.partition(":")
    (entrypoint,) = [a for w, a in final if w == "ENTRYPOINT"]
    return {"uid": int(uid), "gid": int(gid or uid), "entrypoint": json.loads(entrypoint), "env": env}


def _gpushard_containers(objects: list[dict]) -> list[tuple[str, dict, dict]]:
    """(where, pod spec, container) for every container that runs the gpushard image."""
    out = []
    for obj in objects:
        for spec in rendering.pod_specs(obj):
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                if c["image"].split("@")[0].rsplit(":", 1)[0].endswith("/gpushard") or c["image"] == "gpushard":
                    out.append((f"{obj['kind']} {obj['metadata']['name']}, container {c['name']}", spec, c))
    return out


def _inside(path: str, mounts: list[dict]) -> dict | None:
    for mount in mounts:
        if path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return mount
    return None


def _disagreements(instructions: list[tuple[str, str]], objects: list[dict]) -> list[str]:
    image = _final_config(instructions)
    problems = []
    for where, spec, c in _gpushard_containers(objects):
        if "command" in c:
            problems.append(f"{where}: sets command {c['command']}; the image's ENTRYPOINT {image['entrypoint']} "
                            "must run")
        args = list(c.get("args", []))
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                parsed = cli.build_parser().parse_args(args)
        except SystemExit:
            problems.append(f"{where}: gpushard does not take the arguments {args}: {err.getvalue().strip()}")
            continue
        mounts = c.get("volumeMounts", [])
        paths = [a.split("=", 1)[1] for a in args if "=" in a and a.split("=", 1)[1].startswith("/")]
        paths += [a for a in args if a.startswith("/")]
        if args and args[0] == "agent":
            paths += [getattr(parsed, name) for name in AGENT_DEFAULT_PATHS]
        for path in paths:
            if _inside(path, mounts) is None:
                problems.append(f"{where}: {path} is in no volume it mounts ({[m['mountPath'] for m in mounts]}): "
                                "the image has no such file")
        context = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
        uid = context.get("runAsUser", image["uid"])
        if uid == 0 and context.get("runAsNonRoot"):
            problems.append(f"{where}: runAsNonRoot, yet it runs as root")
        if uid != 0 and uid != image["uid"]:
            problems.append(f"{where}: runs as UID {uid}, the image's USER is {image['uid']}")
        if uid != 0 and context.get("runAsGroup", image["gid"]) != image["gid"]:
            problems.append(f"{where}: runs as GID {context['runAsGroup']}, the image's USER is :{image['gid']}")
        if "fsGroup" in spec.get("securityContext", {}) and spec["securityContext"]["fsGroup"] != image["gid"]:
            problems.append(f"{where}: fsGroup {spec['securityContext']['fsGroup']} is not the image's group "
                            f"{image['gid']}")
        if args and args[0] in WRITES_TEMPORARY_FILES and c.get("securityContext", {}).get("readOnlyRootFilesystem"):
            env = {**image["env"], **{e["name"]: e.get("value", "") for e in c.get("env", [])}}
            tmp = env.get("TMPDIR", "/tmp")
            mount = _inside(tmp, mounts)
            if mount is None or mount.get("readOnly"):
                problems.append(f"{where}: `gpushard {args[0]}` writes temporary files in {tmp}, which is no "
                                "writable volume under its read-only root")
    return problems


def _overlays() -> list[Path]:
    overlays = (ROOT / "deploy" / "overlays").glob("*/kustomization.yaml")
    return [ROOT / "deploy" / "base"] + sorted(p.parent for p in overlays)


@pytest.mark.parametrize("folder", _overlays(), ids=lambda p: p.name)
def test_the_manifests_run_what_the_image_holds(folder):
    objects = rendering.render(folder)
    assert _gpushard_containers(objects), f"{folder}: no container runs the gpushard image"
    assert _disagreements(_instructions(), objects) == []


def _container(objects: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj["spec"]["template"]["spec"]


def _mutations():
    """(what, change to the Dockerfile's instructions, change to the objects, what the message names)."""
    def webhook(objects):
        return _container(objects, "Deployment", "gpushard-webhook")

    def agent(objects):
        return _container(objects, "DaemonSet", "gpushard-agent")

    def arg(spec, old, new):
        args = spec["containers"][0]["args"]
        args[args.index(old)] = new

    def mount(spec, name, path):
        (m,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == name]
        m["mountPath"] = path

    def user(instructions, value):
        return [(w, value if w == "USER" else a) for w, a in instructions]

    same = list
    return [
        ("a path outside its volume", same, lambda o: arg(webhook(o), "--cert=/etc/gpushard/tls/tls.crt",
                                                          "--cert=/etc/gpushard/certs/tls.crt"), "/etc/gpushard/certs"),
        ("a volume moved from the path", same, lambda o: mount(webhook(o), "config", "/config"),
         "/etc/gpushard/config/config.yaml"),
        ("the kubelet's folder elsewhere", same,
         lambda o: mount(agent(o), "device-plugins", "/var/lib/kubelet/plugins"), "/var/lib/kubelet/device-plugins"),
        ("an argument gpushard does not take", same, lambda o: arg(webhook(o), "--workers=1", "--replicas=1"),
         "--replicas=1"),
        ("a subcommand gpushard does not have", same, lambda o: arg(agent(o), "agent", "node-agent"), "node-agent"),
        ("a command instead of the entrypoint", same,
         lambda o: webhook(o)["containers"][0].update(command=["python", "-m", "webhook"]), "ENTRYPOINT"),
        ("another user in the manifest", same,
         lambda o: webhook(o)["securityContext"].update(runAsUser=1000), "UID 1000"),
        ("another group in the manifest", same,
         lambda o: webhook(o)["securityContext"].update(runAsGroup=1000), "GID 1000"),
        ("another user in the Dockerfile", lambda i: user(i, "1000:1000"), lambda o: None, "USER is 1000"),
        ("root where runAsNonRoot and the image's user counts", lambda i: user(i, "0:0"),
         lambda o: [webhook(o)["securityContext"].pop(k) for k in ("runAsUser", "runAsGroup")], "runAsNonRoot"),
        ("no writable /tmp under a read-only root", same,
         lambda o: webhook(o)["containers"][0]["volumeMounts"][-1].update(readOnly=True), "temporary files"),
        ("TMPDIR elsewhere in the Dockerfile",
         lambda i: [*i, ("ENV", "TMPDIR=/var/tmp")], lambda o: None, "/var/tmp"),
    ]


@pytest.mark.parametrize("what, instructions, objects, named", _mutations(), ids=[m[0] for m in _mutations()])
def test_each_way_the_image_and_the_manifests_can_disagree_is_found(what, instructions, objects, named):
    rendered = rendering.render(ROOT / "deploy" / "base")
    objects(rendered)
    problems = _disagreements(instructions(_instructions()), rendered)
    assert problems, what
    assert any(named in p for p in problems), problems


# --- make image says what is missing ------------------------------------------------------------

def _make_image(tmp_path: Path, tools: dict[str, str], *variables: str) -> subprocess.CompletedProcess:
    """`make image` with a PATH of only ``tools`` (name: shell script) and the few commands the recipe uses."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("basename", "ls"):
        (bin_dir / name).symlink_to(shutil.which(name))
    for name, script in tools.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + script)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return subprocess.run([shutil.which("make"), "-s", "--no-print-directory", "-C", str(ROOT), "image", *variables],
                          env=env, capture_output=True, text=True, timeout=60)


DOCKER_WITHOUT_DAEMON = """echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock." >&2
exit 1
"""


def test_make_image_says_when_there_is_no_engine(tmp_path):
    result = _make_image(tmp_path, {})
    assert result.returncode != 0
    assert result.stderr.startswith("gpushard: make image needs docker or podman, and neither is on PATH"), \
        result.stderr


def test_make_image_says_when_docker_has_no_daemon_in_one_line(tmp_path):
    result = _make_image(tmp_path, {"docker": DOCKER_WITHOUT_DAEMON})
    assert result.returncode != 0
    gpushard_lines = [line for line in result.stderr.splitlines() if line.startswith("gpushard:")]
    assert gpushard_lines == ["gpushard: docker is on PATH but its daemon does not answer (not running, or this user "
                              "cannot reach its socket); start it, or build with ENGINE=podman"], result.stderr
    assert "Cannot connect" not in result.stderr + result.stdout


def test_make_image_prefers_podman_to_a_docker_without_daemon(tmp_path):
    result = _make_image(tmp_path, {"docker": DOCKER_WITHOUT_DAEMON, "podman": 'echo "podman $*"\n'},
                         "IMAGE=x:1", "WHEELHOUSE=", "PYTHON_IMAGE=")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["podman", "build", "--build-arg", f"VERSION={__version__}", "-t", "x:1", "."]


def test_make_image_offline_needs_a_wheelhouse_with_gpushard(tmp_path):
    empty = tmp_path / "wheelhouse"
    empty.mkdir()
    result = _make_image(tmp_path, {"podman": 'echo "podman $*"\n'}, f"WHEELHOUSE={empty}")
    assert result.returncode != 0
    assert result.stderr.startswith(f"gpushard: WHEELHOUSE={empty} holds no gpushard wheel"), result.stderr
    (empty / "gpushard-0.1.0-py3-none-any.whl").write_bytes(b"")
    result = _make_image(tmp_path / "again", {"podman": 'echo "podman $*"\n'}, f"WHEELHOUSE={empty}",
                         "PYTHON_IMAGE=base:1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["podman", "build", "--build-arg", f"VERSION={__version__}", "--build-arg",
                                     "PYTHON_IMAGE=base:1", "--build-context",
                                     f"wheels={empty}", "-t", "gpushard:dev", "."]


def test_make_reads_the_package_s_version():
    """The Makefile's VERSION (the image's label, make release's files) is webhook/__init__.py's __version__."""
    done = subprocess.run([shutil.which("make"), "-s", "--no-print-directory", "-C", str(ROOT), "--eval",
                           "print-version: ; @echo $(VERSION)", "print-version"], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == __version__, done.stderr
