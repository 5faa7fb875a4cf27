"""Container images made here from busybox-static, written as OCI archives the runtime imports: nothing is pulled.

The runtime tier's pods run these images only. Each is one layer: /bin/busybox with a link per applet
the tests use, and the folders a container runtime expects to mount over. The workload image sets
``NVIDIA_VISIBLE_DEVICES=all`` in its config, as CUDA base images do, so a container that the pod
spec does not override sees what such an image would.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
# Applets the containers' scripts use; each is a link to /bin/busybox.
APPLETS = ("sh", "sleep", "env", "ls", "cat", "echo", "sort", "grep", "stat", "test", "true", "mkdir", "wc", "tr",
           "head", "find", "readlink", "id", "hostname")
FOLDERS = ("dev", "proc", "sys", "etc", "tmp", "run", "var", "var/run")
WORKLOAD = "localhost/gpushard-e2e/busybox:1"
SANDBOX = "localhost/gpushard-e2e/pause:1"
# The sandbox holds the pod's namespaces: it must live until the runtime stops it, and stop on SIGTERM.
SANDBOX_COMMAND = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]


def _layer(busybox: Path) -> bytes:
    """The one layer, as an uncompressed tar with fixed owners and times (the same bytes every run)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("bin", *FOLDERS):
            info = tarfile.TarInfo(folder)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        data = busybox.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, "busybox", 0o777, 0
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/:/bin/sh\n"), ("etc/group", "root:x:0:\n")):
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(raw), 0o644, 0
            tar.addfile(info, io.BytesIO(raw))
    return out.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest.split(':')[1]}")
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))
    return {"digest": digest, "size": len(data)}


def write_archive(path: Path, name: str, command: list[str], env: dict[str, str] | None = None,
                  busybox: Path = BUSYBOX) -> Path:
    """An OCI image-layout archive of ``name`` (registry/repo:tag) that ``ctr images import`` names as such."""
    layer = _layer(busybox)
    compressed = gzip.compress(layer, mtime=0)
    environment = {"PATH": "/bin", **(env or {})}
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": [f"{k}={v}" for k, v in environment.items()], "Cmd": command, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    with tarfile.open(path, "w") as tar:
        layout = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
        info = tarfile.TarInfo("oci-layout")
        info.size, info.mtime = len(layout), 0
        tar.addfile(info, io.BytesIO(layout))
        layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_blob(tar, compressed)}
        config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json",
                       **_blob(tar, json.dumps(config).encode())}
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": config_desc, "layers": [layer_desc]}
        manifest_desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                         **_blob(tar, json.dumps(manifest).encode()),
                         "platform": {"architecture": "amd64", "os": "linux"},
                         # ctr names an imported image by the first; other tools read the second.
                         "annotations": {"io.containerd.image.name": name,
                                         "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}
        index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                            "manifests": [manifest_desc]}).encode()
        info = tarfile.TarInfo("index.json")
        info.size, info.mtime = len(index), 0
        tar.addfile(info, io.BytesIO(index))
    return path


def load_tier_images(containerd, work: Path) -> None:
    """The workload and sandbox images made from busybox, imported before any pod needs them (kind's `load`)."""
    for name, command, env in ((WORKLOAD, ["/bin/sh"], {"NVIDIA_VISIBLE_DEVICES": "all"}),
                               (SANDBOX, SANDBOX_COMMAND, None)):
        archive = write_archive(work / f"{name.rsplit('/', 1)[1].replace(':', '-')}.tar", name, command, env)
        containerd.import_image(archive)
