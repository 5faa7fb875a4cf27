"""The built image, started as deploy/base runs it: make image-check builds it and runs this module.

Every user, argument, path and mount comes from the manifests of deploy/base, read now, so the
image and the manifests cannot drift apart unnoticed. Containers run with `buildah run
--isolation chroot` (no OCI runtime, rlimits or cgroups needed), sharing the host's network.

We test, in the image named by $GPUSHARD_IMAGE:
- its facts (user, entrypoint, labels, size, layers), printed; `gpushard --version` answers as the
  image's own user;
- it holds no compiler, pip cache or wheel that its base did not have, and no layer beyond the
  final stage's one RUN;
- `gpushard serve` with the webhook Deployment's user, arguments and volumes (the certificate
  Secret's files with its mode and fsGroup, the ConfigMap, the emptyDir, the service account)
  answers /readyz (its view synced over TLS from an API server on the host) and a real
  AdmissionReview over TLS, verified against the Secret's CA; it writes nothing under its root
  filesystem outside those volumes (the Deployment makes it read-only), and SIGTERM ends it with 0;
- `gpushard agent` with the DaemonSet's user, arguments, env and volumes, plus a fake inventory,
  registers every resource with a kubelet on the host through the device-plugin folder mounted
  from the host, answers Allocate and /metrics, publishes its inventory on its Node, writes
  nothing outside its volumes, and SIGTERM ends it with 0 and its sockets removed.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.admission import objects
from tests.agent import fakekubelet
from tests.cluster import kubeobjects
from tests.deploy import rendering
from tests.fakekube import FakeKube
from webhook import __version__, certificates
from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.core import names

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("GPUSHARD_IMAGE", "")
BASE = os.environ.get("GPUSHARD_IMAGE_BASE", "")
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Where the check puts the agent's fake inventory: the one mount that is not in the DaemonSet.
INVENTORY_DIR = "/etc/gpushard-check"
INVENTORY = """
cards:
- {index: 0, uuid: GPU-aaaa, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
- {index: 1, uuid: GPU-bbbb, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559}
"""
NODE_NAME = "image-check-node"
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "make", "ld", "as")


def fact(text: str) -> None:
    print(f"gpushard: image-check: {text}", flush=True)


def sh(*cmd: str, timeout: float = 120) -> str:
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        pytest.fail(f"gpushard: `{' '.join(cmd)}` failed with status {result.returncode}: "
                    f"{(result.stderr or result.stdout).strip()[-2000:]}", pytrace=False)
    return result.stdout


# --- what deploy/base says ------------------------------------------------------------------

@functools.cache
def rendered() -> list[dict]:
    return rendering.render(ROOT / "deploy" / "base")


def find(kind: str, name: str) -> dict:
    for obj in rendered():
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    pytest.fail(f"gpushard: deploy/base has no {kind} {name}", pytrace=False)


def workload(kind: str, name: str, container: str) -> tuple[dict, dict, dict]:
    """(the object, its pod spec, the named container) of a Deployment or DaemonSet."""
    obj = find(kind, name)
    spec = obj["spec"]["template"]["spec"]
    (ctr,) = [c for c in spec["containers"] if c["name"] == container]
    return obj, spec, ctr


def config_map_files(name: str) -> dict[str, str]:
    return dict(find("ConfigMap", name)["data"])


# --- the image ------------------------------------------------------------------------------

@functools.cache
def inspect(image: str) -> dict:
    return json.loads(sh("podman", "image", "inspect", image))[0]


def image_user() -> tuple[int, int]:
    user = inspect(IMAGE)["Config"].get("User", "")
    uid, _, gid = user.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        pytest.fail(f"gpushard: the image's USER is {user!r}; it must be numeric (UID:GID)", pytrace=False)
    return int(uid), int(gid or uid)


def run_as(pod_spec: dict, ctr: dict) -> tuple[int, int]:
    """The UID:GID the kubelet runs ``ctr`` as: the container's securityContext, the pod's, the image's."""
    context = {**pod_spec.get("securityContext", {}), **ctr.get("securityContext", {})}
    uid, gid = image_user()
    if "runAsUser" in context and context["runAsUser"] != uid:
        uid = context["runAsUser"]
        gid = context.get("runAsGroup", 0 if uid == 0 else None)
        if gid is None:
            pytest.fail(f"gpushard: {ctr['name']} runs as UID {uid} without runAsGroup, and the image has no "
                        "/etc/passwd entry to take its group from; set runAsGroup", pytrace=False)
    return uid, context.get("runAsGroup", gid)


class Container:
    """A buildah working container of the image, with its root filesystem mounted on the host."""

    def __init__(self, what: str) -> None:
        self.name = f"gpushard-check-{what}-{os.getpid()}"
        sh("buildah", "from", "--pull-never", "--name", self.name, IMAGE)
        self.root = Path(sh("buildah", "mount", self.name).strip())

    def command(self, user: tuple[int, int], argv: list[str], volumes: list[tuple[str, str, bool]],
                env: dict[str, str] | None = None) -> list[str]:
        cmd = ["buildah", "run", "--isolation", "chroot", "--user", f"{user[0]}:{user[1]}"]
        for key, value in (env or {}).items():
            cmd += ["--env", f"{key}={value}"]
        for host, path, read_only in volumes:
            cmd += ["--volume", f"{host}:{self.resolve(path)}:{'ro' if read_only else 'rw'}"]
        return cmd + [self.name, "--", *argv]

    def resolve(self, path: str) -> str:
        """``path`` with the image's symlinks followed inside its root (/var/run is /run in Debian), as
        runc resolves a mount's destination; buildah's chroot isolation takes it literally."""
        parts, out, hops = [p for p in path.split("/") if p], [], 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                out = out[:-1]
                continue
            link = c_path = self.root.joinpath(*out, part)
            if c_path.is_symlink():
                hops += 1
                assert hops < 40, f"symlink loop resolving {path}"
                target = os.readlink(link)
                if target.startswith("/"):
                    out = []
                parts = [p for p in target.split("/") if p and p != "."] + parts
                continue
            out.append(part)
        return "/" + "/".join(out)

    def close(self) -> None:
        subprocess.run(["buildah", "umount", self.name], capture_output=True)
        subprocess.run(["buildah", "rm", self.name], capture_output=True)


@pytest.fixture
def container():
    made = []

    def make(what: str) -> Container:
        made.append(Container(what))
        return made[-1]

    yield make
    for c in made:
        c.close()


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under a root filesystem (not /proc, /sys, /dev): its type, size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in ("proc", "sys", "dev")]
        for name in [".", *dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.normpath(os.path.relpath(path, root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return out


def written(before: dict, after: dict) -> set[str]:
    return {"/" + p for p in set(before) | set(after) if before.get(p) != after.get(p)}


def baseline(c: Container, user: tuple[int, int], volumes: list, env: dict) -> tuple[dict, set[str]]:
    """The root filesystem before the real command, and what buildah itself touches on every run.

    `true` runs twice with the same user and mounts: the first makes the mount points (as the
    container runtime does); what the second still changes (the mtime of /run, where buildah puts
    .containerenv for the run) is buildah's, never the command's."""
    sh(*c.command(user, ["true"], volumes, env))
    first = snapshot(c.root)
    sh(*c.command(user, ["true"], volumes, env))
    second = snapshot(c.root)
    return second, written(first, second)


def entrypoint_argv(ctr: dict) -> list[str]:
    """What the kubelet starts: the image's ENTRYPOINT with the container's args (no command set)."""
    if "command" in ctr:
        return list(ctr["command"]) + list(ctr.get("args", []))
    return list(inspect(IMAGE)["Config"]["Entrypoint"]) + list(ctr.get("args", []))


def arg_value(args: list[str], flag: str) -> str:
    for arg in args:
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    pytest.fail(f"gpushard: deploy/base passes no {flag}=... in {args}", pytrace=False)


def first_process(pid: int) -> int | None:
    """The container's first process: the first descendant of `buildah run` that is not buildah's own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    queue = list(children.get(pid, []))
    while queue:
        p = queue.pop(0)
        try:
            exe = os.readlink(f"/proc/{p}/exe")
        except OSError:
            continue
        # buildah re-executes itself (from memfds named buildah-chroot-runtime, -exec) before the command.
        if "buildah" not in os.path.basename(exe):
            return p
        queue += children.get(p, [])
    return None


class Started:
    """A command running in a container, logged to a file, stopped as the kubelet stops it (SIGTERM)."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        self.file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def alive(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"gpushard: it exited with status {self.proc.returncode}:\n{self.output()}", pytrace=False)

    def stop(self, timeout: float = 40) -> int:
        if self.proc.poll() is None:
            first = first_process(self.proc.pid)
            os.kill(first if first else self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                pytest.fail(f"gpushard: it did not stop within {timeout}s of SIGTERM:\n{self.output()}",
                            pytrace=False)
        self.file.close()
        return self.proc.returncode


def port_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as exc:
            pytest.fail(f"gpushard: port {port}, which deploy/base has it listen on, is taken on this host ({exc}); "
                        "free it and run make image-check again", pytrace=False)


# --- what the kubelet would mount -----------------------------------------------------------

def host_folder(base: Path, name: str, files: dict[str, bytes], mode: int = 0o644, group: int | None = None) -> Path:
    folder = base / name
    folder.mkdir(parents=True)
    os.chmod(folder, 0o755)
    for key, data in files.items():
        path = folder / key
        path.write_bytes(data)
        os.chmod(path, mode)
        if group is not None:
            os.chown(path, 0, group)
    return folder


def volumes_for(pod_spec: dict, ctr: dict, base: Path, secrets: dict[str, dict[str, bytes]],
                host_paths: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(host path, container path, read-only) for each volumeMount, made the way the kubelet makes it."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    fs_group = pod_spec.get("securityContext", {}).get("fsGroup")
    out = []
    for mount in ctr.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        read_only = bool(mount.get("readOnly"))
        if "secret" in volume:
            name = volume["secret"]["secretName"]
            if name not in secrets:
                pytest.fail(f"gpushard: the check has no contents for Secret {name}", pytrace=False)
            folder = host_folder(base, mount["name"], secrets[name], volume["secret"].get("defaultMode", 0o644),
                                 fs_group)
        elif "configMap" in volume:
            files = {k: v.encode() for k, v in config_map_files(volume["configMap"]["name"]).items()}
            folder = host_folder(base, mount["name"], files, volume["configMap"].get("defaultMode", 0o644), fs_group)
        elif "emptyDir" in volume:
            folder = base / mount["name"]
            folder.mkdir()
            os.chmod(folder, 0o777)  # as the kubelet makes an emptyDir
        elif "hostPath" in volume:
            path, kind = volume["hostPath"]["path"], volume["hostPath"].get("type", "")
            if path in host_paths:
                folder = Path(host_paths[path])
            elif kind in ("DirectoryOrCreate", "FileOrCreate"):
                # The kubelet makes it on a node that lacks it: made empty in this run's scratch root,
                # never the host's own folder (a fresh machine has none, and what one holds is not ours).
                folder = base / "host" / path.lstrip("/")
                if kind == "DirectoryOrCreate":
                    folder.mkdir(parents=True, mode=0o755)
                else:
                    folder.parent.mkdir(parents=True, mode=0o755, exist_ok=True)
                    folder.touch(mode=0o644)
            else:
                # Directory, CharDevice and the like must exist on a node: the host's own (/proc, /dev/null).
                folder = Path(path)
                if not folder.exists():
                    pytest.fail(f"gpushard: hostPath {path} ({kind or 'no type'}) of volume {mount['name']} "
                                "is not on this host; the check cannot stand in for it", pytrace=False)
        else:
            pytest.fail(f"gpushard: volume {mount['name']} is of a kind the check does not emulate: {volume}",
                        pytrace=False)
        out.append((str(folder), mount["mountPath"], read_only))
    return out


# The downward API's pod fields the shipped pods read (the webhook's rank among its Service's pods).
POD_FIELDS = {"metadata.name": "gpushard-webhook-check", "metadata.namespace": "gpushard-system"}


def env_for(ctr: dict) -> dict[str, str]:
    env = {}
    for item in ctr.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[item["name"]] = NODE_NAME
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") in POD_FIELDS:
            env[item["name"]] = POD_FIELDS[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            pytest.fail(f"gpushard: env {item['name']} comes from {item.get('valueFrom')}, which the check does "
                        "not emulate", pytrace=False)
    return env


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """An API server on the host over TLS, reached as a pod reaches it: KUBERNETES_SERVICE_* and the token."""
    folder = tmp_path_factory.mktemp("api")
    ca_key, ca = certificates.make_ca("image-check API CA")
    key, cert = certificates.make_serving(ca_key, ca, ["kubernetes.default.svc"], ["127.0.0.1"])
    (folder / "tls.crt").write_bytes(certificates.cert_pem(cert))
    (folder / "tls.key").write_bytes(certificates.key_pem(key))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    fake = FakeKube()
    fake.server.socket = context.wrap_socket(fake.server.socket, server_side=True)
    fake.start()
    fake.put("nodes", kubeobjects.node(NODE_NAME))
    fake.put("nodes", kubeobjects.node("gpu-a", {0: 100, 1: 100}))
    fake.ca = certificates.cert_pem(ca)
    yield fake
    fake.stop()


def service_account(api, base: Path, pod: dict, namespace: str) -> tuple[list[tuple[str, str, bool]], dict]:
    """The token volume and env the kubelet gives every pod that does not opt out."""
    if pod.get("automountServiceAccountToken") is False:
        return [], {}
    fs_group = pod.get("securityContext", {}).get("fsGroup")
    folder = host_folder(base, "serviceaccount", {"token": b"image-check-token", "ca.crt": api.ca,
                                                  "namespace": namespace.encode()}, 0o644, fs_group)
    return ([(str(folder), SERVICE_ACCOUNT_DIR, True)],
            {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.server.server_address[1])})


# --- the tests ------------------------------------------------------------------------------

def test_the_image_facts_and_its_version_as_its_own_user(container):
    if not IMAGE:
        pytest.fail("gpushard: set GPUSHARD_IMAGE to the image to check (make image-check does)", pytrace=False)
    info = inspect(IMAGE)
    config = info["Config"]
    fact(f"image {IMAGE}: {info['Size'] / 1e6:.0f} MB, {len(info['RootFS']['Layers'])} layers")
    fact(f"user {config.get('User')!r}, entrypoint {config.get('Entrypoint')}, cmd {config.get('Cmd')}, "
         f"workdir {config.get('WorkingDir')!r}")
    for label, value in sorted((config.get("Labels") or {}).items()):
        fact(f"label {label}={value}")
    for entry in info.get("History", []):
        if not entry.get("empty_layer"):
            fact(f"layer {entry.get('created_by', '')[:90]!r}")
    assert (config.get("Labels") or {}).get("org.opencontainers.image.version") == __version__
    c = container("version")
    version = sh(*c.command(image_user(), ["gpushard", "--version"], []))
    assert version.strip() == f"gpushard {__version__}"
    fact(f"`gpushard --version` as {':'.join(map(str, image_user()))}: {version.strip()}")
    # Run on the image's own architecture (under emulation where it is not this machine's).
    machine = sh(*c.command(image_user(), ["gpushard", "version"], []))
    wanted = {"amd64": "x86_64", "arm64": "aarch64"}.get(info.get("Architecture"), info.get("Architecture"))
    assert machine.strip().endswith(f"linux {wanted})"), (info.get("Architecture"), machine)
    fact(f"`gpushard version`, image architecture {info.get('Architecture')}: {machine.strip()}")


def test_nothing_in_the_image_that_the_final_stage_does_not_need(container):
    if not BASE:
        pytest.skip("no base image named (GPUSHARD_IMAGE_BASE)")
    image_layers = inspect(IMAGE)["RootFS"]["Layers"]
    base_layers = inspect(BASE)["RootFS"]["Layers"]
    assert image_layers[:len(base_layers)] == base_layers, "the image is not built on GPUSHARD_IMAGE_BASE"
    # One RUN (the venv) in the final stage: no COPY, no wheels layer.
    assert len(image_layers) == len(base_layers) + 1, f"layers beyond the base: {image_layers[len(base_layers):]}"
    c = container("contents")
    base_root = Path(sh("podman", "image", "mount", BASE).strip())
    try:
        base_wheels = {p.relative_to(base_root) for p in base_root.rglob("*.whl")}
    finally:
        subprocess.run(["podman", "image", "unmount", BASE], capture_output=True)
    wheels = [p for p in c.root.rglob("*.whl") if p.relative_to(c.root) not in base_wheels]
    assert not wheels, f"wheels left in the image: {wheels}"
    assert not (c.root / "wheels").exists()
    caches = [p for p in c.root.rglob(".cache") if p.is_dir()]
    assert not caches, f"caches left in the image: {caches}"
    compilers = [f"/{d}/{n}" for d in ("usr/bin", "usr/local/bin", "bin") for n in COMPILERS
                 if os.path.lexists(c.root / d / n)]
    assert not compilers, f"compilers in the image: {compilers}"
    assert not (c.root / "opt/gpushard/bin/pip").exists(), "pip is left in the venv"
    def size(path: Path) -> int:
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())

    venv = c.root / "opt/gpushard"
    site = next(venv.glob("lib/python3*/site-packages"))
    largest = sorted(((size(p), p.name) for p in site.iterdir() if p.is_dir()), reverse=True)[:6]
    fact(f"no wheels, caches, compilers or pip added; the venv /opt/gpushard holds {size(venv) / 1e6:.0f} MB, "
         f"most in {', '.join(f'{name} {n / 1e6:.0f} MB' for n, name in largest)}")


def test_serve_as_the_deployment_runs_it(container, api, tmp_path):
    deployment, pod, ctr = workload("Deployment", "gpushard-webhook", "webhook")
    (service,) = [o for o in rendered() if o["kind"] == "Service" and o["metadata"]["name"] == "gpushard"]
    namespace = service["metadata"]["namespace"]
    args = ctr["args"]
    # The Secret's files as the certificate Job makes them: `gpushard certs` for the Service.
    certs = tmp_path / "certs"
    subprocess.run([sys.executable, "-m", "webhook.cli", "certs", "--out", str(certs), "--service",
                    service["metadata"]["name"], "--namespace", namespace], check=True, capture_output=True)
    secret = {name: (certs / name).read_bytes() for name in ("ca.crt", "tls.crt", "tls.key")}
    volumes = volumes_for(pod, ctr, tmp_path / "volumes", {"gpushard-tls": secret}, {})
    sa_volumes, sa_env = service_account(api, tmp_path / "volumes", pod, namespace)
    user = run_as(pod, ctr)
    fs_group = pod.get("securityContext", {}).get("fsGroup")
    if fs_group is not None and fs_group != user[1]:
        pytest.fail(f"gpushard: fsGroup {fs_group} differs from runAsGroup {user[1]}; buildah run cannot add "
                    "fsGroup as a supplementary group, so the check cannot run the webhook as the kubelet would",
                    pytrace=False)
    port = int(arg_value(args, "--bind").rsplit(":", 1)[1])
    port_free(port)
    assert ctr["securityContext"].get("readOnlyRootFilesystem"), "the check below assumes a read-only root"

    c = container("serve")
    argv = entrypoint_argv(ctr)
    # The baseline: what buildah itself writes for these mounts (their mount points, /etc/hosts).
    before, noise = baseline(c, user, volumes + sa_volumes, {**env_for(ctr), **sa_env})
    fact(f"serve: {' '.join(argv)} as {user[0]}:{user[1]}, volumes {[v[1] for v in volumes + sa_volumes]}")
    server = Started(c.command(user, argv, volumes + sa_volumes, {**env_for(ctr), **sa_env}), tmp_path / "serve.log")
    try:
        probe = ctr["readinessProbe"]["httpGet"]
        assert probe["scheme"] == "HTTPS"
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        host = f"{service['metadata']['name']}.{namespace}.svc"

        def request(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
            conn = _Connection(host, port, context)
            try:
                conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
                resp = conn.getresponse()
                return resp.status, resp.read()
            finally:
                conn.close()

        deadline = time.monotonic() + 60
        while True:
            server.alive()
            try:
                status, body = request("GET", probe["path"])
                if status == 200 and b"synced" in body and b"not synced" not in body:
                    break
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"gpushard: {probe['path']} did not answer 200 (synced) within 60s:\n{server.output()}",
                            pytrace=False)
            time.sleep(0.2)
        fact(f"serve: GET https://{host}:{port}{probe['path']} -> {status} {body.decode().strip()!r}")

        pod_obj = objects.pod(objects.container("train", "0.5"), name="image-check")
        review = objects.review(pod_obj)
        status, body = request("POST", "/mutate", json.dumps(review).encode())
        assert status == 200, body
        response = objects.response_of(json.loads(body), review["request"]["uid"])
        assert response["allowed"], response
        new = objects.patched(pod_obj, response)
        card = new["metadata"]["annotations"][names.CARD_ANNOTATION]
        fact(f"serve: AdmissionReview over TLS -> allowed, card {card} chosen over the live view")
    finally:
        code = server.stop()
    assert code == 0, f"gpushard serve ended with {code} on SIGTERM:\n{server.output()}"
    wrote = sorted(written(before, snapshot(c.root)) - noise)
    assert not wrote, (f"gpushard: serve wrote under its read-only root filesystem, outside the volumes "
                       f"deploy/base mounts: {wrote[:20]}")
    fact("serve: stopped with 0 on SIGTERM; wrote nothing under its root filesystem outside its volumes")


class _Connection(http.client.HTTPSConnection):
    """HTTPS to 127.0.0.1, verifying the certificate for the Service's name, as the API server does."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=10, context=context)
        self.tls = context

    def connect(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), self.timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)


def test_agent_as_the_daemonset_runs_it(container, api, tmp_path):
    daemonset, pod, ctr = workload("DaemonSet", "gpushard-agent", "agent")
    namespace = daemonset["metadata"]["namespace"]
    settings = yaml.safe_load(config_map_files("gpushard-config")["config.yaml"])
    shares, prefix = settings["resources"]["shares"], settings["resources"]["cardPrefix"]
    # The kubelet's folders on this host: short paths, as unix socket paths must be.
    plugin_dir = fakekubelet.short_tempdir("gsa-plugins-")
    pod_resources = fakekubelet.short_tempdir("gsa-podres-")
    kubelet = fakekubelet.FakeKubelet(plugin_dir).start()
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "inventory.yaml").write_text(INVENTORY)
    try:
        # The kubelet's folders become folders of this host's kubelet (the fake one); /proc and
        # /dev/null are the host's own.
        host_paths = {}
        for volume in pod["volumes"]:
            path = volume.get("hostPath", {}).get("path", "")
            if path == "/var/lib/kubelet/device-plugins":
                host_paths[path] = plugin_dir
            elif path.startswith("/var/lib/kubelet/"):
                host_paths[path] = pod_resources
        assert "/var/lib/kubelet/device-plugins" in host_paths, "the DaemonSet mounts no device-plugin folder"
        volumes = volumes_for(pod, ctr, tmp_path / "volumes", {}, host_paths)
        volumes.append((str(inventory), INVENTORY_DIR, True))
        sa_volumes, sa_env = service_account(api, tmp_path / "volumes", pod, namespace)
        user = run_as(pod, ctr)
        args = ctr["args"]
        metrics_port = int(arg_value(args, "--metrics-port"))
        port_free(metrics_port)
        assert ctr["securityContext"].get("readOnlyRootFilesystem"), "the check below assumes a read-only root"

        c = container("agent")
        argv = entrypoint_argv(ctr) + [f"--fake-inventory={INVENTORY_DIR}/inventory.yaml"]
        env = {**env_for(ctr), **sa_env}
        before, noise = baseline(c, user, volumes + sa_volumes, env)
        fact(f"agent: {' '.join(argv)} as {user[0]}:{user[1]}, device plugins in {plugin_dir} on the host")
        agent = Started(c.command(user, argv, volumes + sa_volumes, env), tmp_path / "agent.log")
        try:
            wanted = {shares, f"{prefix}0", f"{prefix}1"}
            try:
                registered = kubelet.wait_for(wanted, timeout=60)
            except AssertionError as exc:
                agent.alive()
                pytest.fail(f"gpushard: the agent did not register with the kubelet: {exc}\n{agent.output()}",
                            pytrace=False)
            fact(f"agent: registered {sorted(registered)} with the kubelet through the mounted folder")
            with fakekubelet.PluginClient(plugin_dir, registered[f"{prefix}1"].endpoint) as client:
                answer = client.stub.Allocate(pb.AllocateRequest(container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=[f"card-1-{n}" for n in range(3)])]), timeout=10)
            assert dict(answer.container_responses[0].envs)["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbbb"
            published = kubeobjects.wait_for(
                lambda: api.get("nodes", NODE_NAME)["metadata"].get("annotations", {}).get(names.INVENTORY_ANNOTATION),
                timeout=30, what=f"the inventory on Node {NODE_NAME}")
            fact(f"agent: Allocate of card 1 -> GPU-bbbb; inventory published on its Node ({len(json.loads(published))}"
                 " cards)")
            # TLS with the certificate the agent made at its start; from the pod's own loopback (where a
            # port-forward arrives) it asks no token, as deploy/base's agent does.
            unverified = ssl.create_default_context()
            unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE

            def scrape() -> bytes | None:
                # The agent serves its metrics once its plugins registered: later under emulation (arm64).
                try:
                    with urllib.request.urlopen(f"https://127.0.0.1:{metrics_port}/metrics", timeout=10,
                                                context=unverified) as resp:
                        return resp.read() if resp.status == 200 else None
                except OSError:
                    return None
            body = kubeobjects.wait_for(scrape, timeout=60, what=f"the agent's /metrics on :{metrics_port}")
            assert b"gpushard_card_" in body
            fact(f"agent: /metrics answers over TLS on :{metrics_port}")
        finally:
            code = agent.stop()
        assert code == 0, f"gpushard agent ended with {code} on SIGTERM:\n{agent.output()}"
        assert os.listdir(plugin_dir) == [fakekubelet.KUBELET_SOCKET], os.listdir(plugin_dir)
        wrote = sorted(written(before, snapshot(c.root)) - noise)
        assert not wrote, (f"gpushard: the agent wrote under its read-only root filesystem, outside the volumes "
                           f"deploy/base mounts: {wrote[:20]}")
        fact("agent: stopped with 0 on SIGTERM, its sockets removed; wrote only in its volumes")
    finally:
        kubelet.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)
        shutil.rmtree(pod_resources, ignore_errors=True)

