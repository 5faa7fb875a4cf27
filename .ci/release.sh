#!/usr/bin/env bash
# make release: every artifact of one gpushard version, from a clean tree, into dist/gpushard-<version>/:
#   gpushard-<version>.oci.tar           the image for linux/amd64 and linux/arm64, one OCI image index
#   gpushard-<version>.tgz               the Helm chart, packaged with the same version
#   gpushard-<version>-py3-none-any.whl  the wheel, and gpushard-<version>.tar.gz, the sdist
#   gpushard-<version>.<arch>.cdx.json   a CycloneDX bill of materials of each image's contents: its Python
#                                         packages (cyclonedx-py, from the image's own environment) and its
#                                         Debian packages (from its dpkg database), each with its licenses
#   RELEASE-NOTES.md                     the version's section of CHANGELOG.md
#   SHA256SUMS                           the sha256 of each file above
# Each image is built as make image-check builds it (a Debian base made here, offline from a wheelhouse of its
# own architecture), then started as deploy/base runs it (tests/image); arm64 runs under qemu-user-static.
# Needs Debian, root and the package mirrors (as make image-check). RELEASE_ALLOW_DIRTY=1 builds from a tree
# with changes, for a trial; RELEASE_ARCHES="amd64" builds fewer architectures.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${PY:=.venv/bin/python}"
: "${HELM:=.venv/bin/helm}"
: "${RELEASE_ARCHES:=amd64 arm64}"
say() { echo "gpushard: release: $*"; }
die() { echo "gpushard: release: $*" >&2; exit 1; }
started=$SECONDS

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' webhook/__init__.py)
[ -n "$version" ] || die "no __version__ in webhook/__init__.py"
if [ -n "$(git status --porcelain)" ] && [ -z "${RELEASE_ALLOW_DIRTY:-}" ]; then
  die "the tree has changes (git status); commit them first, or set RELEASE_ALLOW_DIRTY=1 for a trial"
fi
grep -q "^## \[$version\]" CHANGELOG.md || die "CHANGELOG.md has no section ## [$version]; write it first"
out="dist/gpushard-$version"
rm -rf "$out"
mkdir -p "$out" build   # build/: the logs of the steps below (a fresh clone has none)
say "gpushard $version from commit $(git rev-parse --short HEAD) into $out"

# The wheel and the sdist.
"$PY" -m build --outdir "$out" . >build/release-python.log 2>&1 || { tail -20 build/release-python.log >&2; die "python -m build failed"; }

# One image per architecture, each started as deploy/base runs it.
manifest="localhost/gpushard:$version"
podman manifest rm "$manifest" >/dev/null 2>&1 || true
podman manifest create "$manifest" >/dev/null
for arch in $RELEASE_ARCHES; do
  machine=$(dpkg-architecture -a "$arch" -q DEB_HOST_GNU_CPU 2>/dev/null)
  image="localhost/gpushard:$version-$arch"
  say "image for linux/$arch ($machine): $image"
  step=$SECONDS
  make --no-print-directory image-check CHECK_ARCH="$arch" CHECK_IMAGE="$image" \
    CHECK_BASE="localhost/gpushard-base:bookworm-$arch" WHEELHOUSE_DIR="build/wheelhouse-$arch" \
    WHEELHOUSE_ARCH="$machine" >"build/release-image-$arch.log" 2>&1 \
    || { tail -40 "build/release-image-$arch.log" >&2; die "the $arch image did not build or start (all of it in build/release-image-$arch.log)"; }
  grep -E "^(gpushard: image-check|.*(fact|version|architecture))" "build/release-image-$arch.log" | tail -5 || true
  say "linux/$arch built and started in $((SECONDS - step)) s"
  podman manifest add "$manifest" "containers-storage:$image" >/dev/null
  mount=$(podman image mount "$image")
  "$PY" .ci/sbom.py --python "$mount/opt/gpushard/bin/python" --root "$mount" --arch "$arch" \
    --version "$version" --out "$out/gpushard-$version.$arch.cdx.json"
  podman image unmount "$image" >/dev/null
done
podman manifest push --all --quiet "$manifest" "oci-archive:$out/gpushard-$version.oci.tar:$version" \
  || die "podman could not write the image index to $out/gpushard-$version.oci.tar"

# The chart, at the same version.
"$HELM" package charts/gpushard --version "$version" --app-version "$version" --destination "$out" >/dev/null

# The release notes: the version's section of the changelog.
awk -v v="## [$version]" 'index($0, v) == 1 {on = 1; print; next} on && /^## \[/ {exit} on {print}' CHANGELOG.md \
  >"$out/RELEASE-NOTES.md"

(cd "$out" && sha256sum -- * | grep -v ' SHA256SUMS$' >SHA256SUMS)
say "done in $((SECONDS - started)) s:"
(cd "$out" && ls -l --block-size=K -- *)
cat <<EOF
gpushard: release: push the image index to your registry, then the chart:
  skopeo copy --all oci-archive:$out/gpushard-$version.oci.tar:$version docker://REGISTRY/gpushard:$version
  helm push $out/gpushard-$version.tgz oci://REGISTRY/charts
EOF
