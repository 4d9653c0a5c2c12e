#!/usr/bin/env bash
# Build karta-proxy's image with buildah and no image registry (what CI and
# tests/test_image.py do; docs/image.md). Run as root from anywhere:
#
#   config/image/build.sh [TAG]            (default localhost/karta-proxy:dev)
#
# 1. The base: a Debian bookworm rootfs with Debian's python3, made by mmdebstrap from the
#    Debian mirror and imported with `buildah from scratch` + `buildah commit`. The tarball
#    is cached under $KARTA_IMAGE_CACHE (default ~/.cache/karta-proxy/image), one per day.
#    BASE=<image> skips this and builds on that image instead (it must already be in
#    buildah's local storage: no registry is reached).
# 2. The wheelhouse: the dependencies' wheels (and setuptools/wheel, to build karta-proxy's
#    own) for the base's python3 version, fetched on this host with pip (PyPI, or the
#    host's pip configuration), cached per dependency list and Python version.
# 3. `buildah bud --isolation chroot` on a staged copy of the sources, with PIP_OFFLINE=1:
#    the build stage compiles the native splice with the base's own python3 and Debian's
#    gcc (apt inside the build, from the Debian mirror) and installs only from wheels.
#
# Prints the image's name on the last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
tag="${1:-localhost/karta-proxy:dev}"
suite="${SUITE:-bookworm}"
mirror="${MIRROR:-http://deb.debian.org/debian}"
cache="${KARTA_IMAGE_CACHE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/karta-proxy/image}"
isolation=(--isolation chroot)
mkdir -p "$cache"

log() { echo "build.sh: $*" >&2; }

# -- 1. the base ------------------------------------------------------------------------
base="${BASE:-}"
if [ -z "$base" ]; then
  day="$(date -u +%Y%m%d)"
  base="localhost/karta-base:$suite-$day"
  if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    tarball="$cache/$suite-python3-$day.tar"
    if [ ! -s "$tarball" ]; then
      log "mmdebstrap $suite (minbase + python3) -> $tarball"
      find "$cache" -maxdepth 1 -name "$suite-python3-*.tar" -delete
      mmdebstrap --quiet --variant=minbase --include=python3 --mode=root \
        "$suite" "$tarball.part" "$mirror" >&2
      mv "$tarball.part" "$tarball"
    fi
    log "importing $tarball as $base"
    ctr="$(buildah from scratch)"
    mnt="$(buildah mount "$ctr")"
    tar -C "$mnt" -xf "$tarball"
    buildah umount "$ctr" >/dev/null
    buildah config --cmd /bin/bash "$ctr"
    buildah commit -q --rm "$ctr" "$base" >/dev/null
  fi
fi

# -- 2. the wheelhouse ------------------------------------------------------------------
ctr="$(buildah from -q "$base")"
pyver="$(buildah run "${isolation[@]}" "$ctr" -- python3 -c \
  'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
buildah rm "$ctr" >/dev/null
deps="$(python3 - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    doc = tomllib.load(f)
build = doc["build-system"]["requires"]
print("\n".join([*doc["project"]["dependencies"], *build]))
EOF
)"
key="$(printf '%s\n%s\n' "$pyver" "$deps" | sha256sum | cut -c1-16)"
wheelhouse="$cache/wheelhouse-py$pyver-$key"
if [ ! -f "$wheelhouse/.complete" ]; then
  log "wheels for Python $pyver -> $wheelhouse"
  rm -rf "$wheelhouse"
  mkdir -p "$wheelhouse"
  printf '%s\n' "$deps" > "$wheelhouse/requirements.txt"
  if ! python3 -m pip download -q --only-binary=:all: --python-version "$pyver" \
      --dest "$wheelhouse" -r "$wheelhouse/requirements.txt" >"$wheelhouse/pip.log" 2>&1; then
    cat "$wheelhouse/pip.log" >&2
    exit 1
  fi
  touch "$wheelhouse/.complete"
fi

# -- 3. the image -----------------------------------------------------------------------
ctx="$(mktemp -d "${TMPDIR:-/tmp}/karta-image-ctx.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/config/image/wheelhouse"
cp "$root/pyproject.toml" "$root/setup.py" "$root/README.md" "$ctx/"
tar -C "$root" --exclude=__pycache__ --exclude='*.so' --exclude='*.pyc' -cf - proxy \
  | tar -C "$ctx" -xf -
cp "$here/Containerfile" "$ctx/config/image/"
cp "$wheelhouse"/*.whl "$ctx/config/image/wheelhouse/"
log "buildah bud $tag (base $base, Python $pyver)"
buildah bud "${isolation[@]}" --quiet --layers=false \
  --build-arg "BASE=$base" --build-arg PIP_OFFLINE=1 \
  -f "$ctx/config/image/Containerfile" -t "$tag" "$ctx" >&2
echo "$tag"
