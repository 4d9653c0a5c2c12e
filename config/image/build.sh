#!/usr/bin/env bash
# Build karta-proxy's image with buildah and no image registry (what CI and
# tests/test_image.py do; docs/deploy.md, "Without an image registry"). Run as root
# from anywhere:
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

# what a failed run leaves behind: a working container, the staged context
ctr=""
ctx=""
cleanup() {
  if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
  if [ -n "$ctx" ]; then rm -rf "$ctx"; fi
}
trap cleanup EXIT

# -- 1. the base ------------------------------------------------------------------------
base="${BASE:-}"
if [ -z "$base" ]; then
  day="$(date -u +%Y%m%d)"
  base="localhost/karta-base:$suite-$day"
  if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    tarball="$cache/$suite-python3-$day.tar"
    if [ ! -f "$tarball" ] || [ ! -s "$tarball" ]; then
      log "mmdebstrap $suite (minbase + python3) -> $tarball"
      rm -rf "$cache/$suite-python3-"*.tar "$cache/.partial.tar"
      # --format=tar: mmdebstrap otherwise picks the format from the file name
      mmdebstrap --quiet --variant=minbase --include=python3 --mode=root --format=tar \
        "$suite" "$cache/.partial.tar" "$mirror" >&2
      mv "$cache/.partial.tar" "$tarball"
    fi
    log "importing $tarball as $base"
    ctr="$(buildah from scratch)"
    mnt="$(buildah mount "$ctr")"
    tar -C "$mnt" -xf "$tarball"
    buildah umount "$ctr" >/dev/null
    buildah config --cmd /bin/bash "$ctr"
    buildah commit -q --rm "$ctr" "$base" >/dev/null
    ctr=""
  fi
fi

# -- 2. the wheelhouse ------------------------------------------------------------------
ctr="$(buildah from -q "$base")"
pyver="$(buildah run "${isolation[@]}" "$ctr" -- python3 -c \
  'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
buildah rm "$ctr" >/dev/null
ctr=""
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
mkdir -p "$ctx/config/image/wheelhouse"
cp "$root/pyproject.toml" "$root/setup.py" "$root/README.md" "$ctx/"
tar -C "$root" --exclude=__pycache__ --exclude='*.so' --exclude='*.pyc' -cf - proxy \
  | tar -C "$ctx" -xf -
cp "$here/Containerfile" "$ctx/config/image/"
cp "$wheelhouse"/*.whl "$ctx/config/image/wheelhouse/"
log "buildah bud $tag (base $base, Python $pyver)"
previous="$(buildah images -q --no-trunc "$tag" 2>/dev/null || true)"
buildah bud "${isolation[@]}" --quiet --layers=false \
  --build-arg "BASE=$base" --build-arg PIP_OFFLINE=1 \
  -f "$ctx/config/image/Containerfile" -t "$tag" "$ctx" >&2
# the image the tag named before, and the bases of earlier days: ~300 MB each
current="$(buildah images -q --no-trunc "$tag")"
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  buildah rmi "$previous" >/dev/null 2>&1 || true
fi
if [ -z "${BASE:-}" ]; then
  buildah images --format '{{.Name}}:{{.Tag}}' | grep -x "localhost/karta-base:$suite-[0-9]*" \
    | grep -vx "$base" | xargs -r buildah rmi >/dev/null 2>&1 || true
fi
echo "$tag"
