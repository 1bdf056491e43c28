#!/usr/bin/env bash
# The stand-in for docker/Dockerfile's base image, for tests/test_image.py and .ci/run: no image
# registry is reachable here, so `python:3.11-slim-bookworm` is made from Debian's own packages
# (bookworm's python3 is 3.11) with debootstrap, from the mirror apt already uses, and imported
# into podman under the name the build asks for. Does nothing if that image exists already.
#   bash tests/image_base.sh [IMAGE]     (default localhost/python:3.11-slim-bookworm)
# Needs root, podman and debootstrap (.ci/run installs them). About 1.5 min and 300 MB.
set -euo pipefail
image="${1:-localhost/python:3.11-slim-bookworm}"
if podman image exists "$image"; then
  echo "stand-in base $image: already there"
  exit 0
fi

# The first Debian mirror apt is configured with (deb822 URIs: or one-line `deb URL suite`).
mirror="$( { cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true; } \
  | sed -n -e 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' -e 's/^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]*\)\{0,1\}\([^[:space:]]*\).*/\2/p' \
  | grep -v -e security -e '^$' | head -n 1 || true)"
if [ -z "$mirror" ]; then
  echo "error: no Debian mirror in /etc/apt/sources.list or /etc/apt/sources.list.d/*.sources" >&2
  exit 2
fi

rootfs="$(mktemp -d /var/tmp/stand-in-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
start=$SECONDS
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | podman import --quiet - "$image" >/dev/null
echo "stand-in base $image: debootstrap from $mirror and import in $((SECONDS - start)) s"
