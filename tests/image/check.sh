#!/usr/bin/env bash
# make image-check: build the image from the real Dockerfile on a local Debian base, offline
# from the wheelhouse, then start it as the manifests in deploy/base run it (tests/image).
#
# Needs a Debian or Ubuntu machine with network to its package mirror, and root: it installs
# podman, buildah and mmdebstrap with apt-get when they are missing. Running it again reuses the
# base image ($CHECK_BASE) and rebuilds the image ($CHECK_IMAGE) without the layer cache.
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${CHECK_IMAGE:=localhost/gpushard:check}"
: "${CHECK_BASE:=localhost/gpushard-base:bookworm}"
: "${WHEELHOUSE:=build/wheelhouse}"
: "${PY:=.venv/bin/python}"
# The image's architecture (Debian's name: amd64, arm64). Another than this machine's runs under emulation
# (qemu-user-static, registered with binfmt_misc), which this script sets up.
: "${CHECK_ARCH:=$(dpkg --print-architecture)}"
# What the Dockerfile's final stage needs of its base, named here rather than assumed: python3
# with venv and ensurepip (python:3.11-slim has them; Debian splits them into python3-venv).
# ca-certificates as the official image has them, for the agent's and the webhook's API client.
BASE_PACKAGES=python3,python3-venv,ca-certificates
BASE_SUITE=bookworm

say() { echo "gpushard: image-check: $*"; }
die() { echo "gpushard: image-check: $*" >&2; exit 1; }
started=$SECONDS

[ -d "$WHEELHOUSE" ] && ls "$WHEELHOUSE"/gpushard-*.whl >/dev/null 2>&1 \
  || die "no gpushard wheel in WHEELHOUSE=$WHEELHOUSE; run make wheelhouse first (make image-check does)"

missing=()
for tool in podman buildah mmdebstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    die "${missing[*]} missing; install them (Debian: apt-get install podman buildah mmdebstrap uidmap) and run as root"
  fi
  say "installing podman buildah mmdebstrap with apt-get"
  step=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  mkdir -p build
  if ! { apt-get -q -o DPkg::Lock::Timeout=300 update \
         && apt-get -q -y -o DPkg::Lock::Timeout=300 install --no-install-recommends \
              podman buildah mmdebstrap uidmap crun ca-certificates; } >build/image-check-apt.log 2>&1; then
    tail -20 build/image-check-apt.log >&2
    die "apt-get could not install podman buildah mmdebstrap (above; all of it in build/image-check-apt.log)"
  fi
  say "installed in $((SECONDS - step)) s"
fi
[ "$(id -u)" = 0 ] || die "run as root: buildah runs the image's users (65532, 0) as they are on the host"

# Another architecture: its programs run under qemu-user-static, registered with binfmt_misc (the F flag
# opens the emulator now, so it works inside the image's chroot too).
if [ "$CHECK_ARCH" != "$(dpkg --print-architecture)" ]; then
  qemu=$(dpkg-architecture -a "$CHECK_ARCH" -q DEB_HOST_GNU_CPU 2>/dev/null || echo "$CHECK_ARCH")
  [ "$qemu" = arm64 ] && qemu=aarch64
  mkdir -p build
  # qemu-user-static runs them; mmdebstrap needs arch-test to make a base of another architecture.
  if [ ! -e "/usr/libexec/qemu-binfmt/$qemu-binfmt-P" ] || ! command -v arch-test >/dev/null 2>&1; then
    say "installing qemu-user-static and arch-test with apt-get, to run $CHECK_ARCH programs"
    DEBIAN_FRONTEND=noninteractive apt-get -q -y -o DPkg::Lock::Timeout=300 install --no-install-recommends \
      qemu-user-static arch-test >build/image-check-apt.log 2>&1 \
      || die "apt-get could not install qemu-user-static and arch-test (build/image-check-apt.log)"
  fi
  [ -d /proc/sys/fs/binfmt_misc ] && [ -e /proc/sys/fs/binfmt_misc/register ] \
    || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
    || die "binfmt_misc is not mounted and cannot be; $CHECK_ARCH programs cannot run here"
  if [ ! -e "/proc/sys/fs/binfmt_misc/qemu-$qemu" ]; then
    grep -v '^#' "/usr/lib/binfmt.d/qemu-$qemu.conf" >/proc/sys/fs/binfmt_misc/register \
      || die "cannot register qemu-$qemu with binfmt_misc"
  fi
  say "$CHECK_ARCH programs run under $(qemu-$qemu-static --version | head -1)"
fi

# Storage: podman's default driver (overlay) where the kernel allows it, else vfs (slower, works
# everywhere, including inside another container).
if ! podman info >/dev/null 2>&1; then
  export STORAGE_DRIVER=vfs
  podman info >/dev/null 2>&1 || die "podman does not start with the overlay or the vfs driver: $(podman info 2>&1 | tail -1)"
fi
# chroot isolation: it needs no OCI runtime, rlimits or cgroups, which podman run needs and some
# machines (nested containers, hybrid cgroups) refuse.
export BUILDAH_ISOLATION=chroot
say "podman $(podman version --format '{{.Client.Version}}'), storage $(podman info --format '{{.Store.GraphDriverName}}'), isolation chroot"

# Containers left by an interrupted run.
for c in $(buildah containers --format '{{.ContainerName}}' 2>/dev/null | grep '^gpushard-check-' || true); do
  buildah rm "$c" >/dev/null
done

# The base is reused while it was made from the same suite and packages (its label says which).
BASE_LABEL="gpushard image-check base: Debian $BASE_SUITE minbase for $CHECK_ARCH, $BASE_PACKAGES"
if podman image exists "$CHECK_BASE" \
   && [ "$(podman image inspect --format '{{index .Labels "org.opencontainers.image.description"}}' "$CHECK_BASE")" \
        != "$BASE_LABEL" ]; then
  say "base $CHECK_BASE was made from other packages; making it again"
  podman rmi "$CHECK_BASE" >/dev/null
fi
if podman image exists "$CHECK_BASE"; then
  say "base $CHECK_BASE exists; reused (podman rmi $CHECK_BASE to make it again)"
else
  say "making the base $CHECK_BASE: Debian $BASE_SUITE minbase with $BASE_PACKAGES"
  step=$SECONDS
  work=$(mktemp -d /tmp/gpushard-base.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  mmdebstrap --quiet --variant=minbase --architectures="$CHECK_ARCH" --include="$BASE_PACKAGES" "$BASE_SUITE" \
    "$work/base.tar" \
    || die "mmdebstrap could not make the Debian $BASE_SUITE base (is the Debian mirror reachable?)"
  # An imported tarball has no image config: the PATH and LANG the official python images set,
  # given explicitly, as the Dockerfile's ENV PATH=/opt/gpushard/bin:$PATH extends the base's.
  podman import --quiet --arch "$CHECK_ARCH" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL org.opencontainers.image.description=\"$BASE_LABEL\"" \
    "$work/base.tar" "$CHECK_BASE" >/dev/null
  rm -rf "$work"
  say "base made in $((SECONDS - step)) s"
fi

say "building $CHECK_IMAGE from the Dockerfile, offline from $WHEELHOUSE"
build_started=$SECONDS
previous=$(podman image inspect --format '{{.Id}}' "$CHECK_IMAGE" 2>/dev/null || true)
mkdir -p build
if ! make --no-print-directory image ENGINE=podman IMAGE="$CHECK_IMAGE" PYTHON_IMAGE="$CHECK_BASE" \
    WHEELHOUSE="$WHEELHOUSE" IMAGE_BUILD_FLAGS="--isolation chroot --no-cache --pull=never --platform linux/$CHECK_ARCH" \
    >build/image-check-build.log 2>&1; then
  tail -40 build/image-check-build.log >&2
  die "podman build failed (above; all of it in build/image-check-build.log)"
fi
say "built in $((SECONDS - build_started)) s"
# The image of the previous run, untagged now: removed, so that runs do not pile up images.
if [ -n "$previous" ] && [ "$previous" != "$(podman image inspect --format '{{.Id}}' "$CHECK_IMAGE")" ]; then
  podman rmi "$previous" >/dev/null 2>&1 || true
fi

GPUSHARD_IMAGE="$CHECK_IMAGE" GPUSHARD_IMAGE_BASE="$CHECK_BASE" \
  "$PY" -m pytest -q -rA -s -p no:cacheprovider --timeout 300 tests/image \
  || die "the image does not start as deploy/base runs it (above)"
say "passed in $((SECONDS - started)) s"
