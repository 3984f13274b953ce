#!/usr/bin/env bash
# Build, from scratch and without any registry, the base images that deploy/compose.local.yml
# uses in place of python:3.11-slim, postgres:16 and openpolicyagent/opa:
#
#   local/bookworm     debootstrap --variant=minbase bookworm, imported with `docker import`
#   local/python:3.11  local/bookworm + Debian's python3 (3.11.2) and python3-venv
#   local/postgres:15  local/bookworm + Debian's PostgreSQL 15, with an entrypoint that reads the
#                      same POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB as the postgres image
#
# Idempotent: an image that exists is kept, unless (for the two built ones) its folder under
# deploy/images changed since (the image carries the folder's hash as a label). FORCE=1 rebuilds all. Needs root (debootstrap),
# a running Docker engine and the Debian mirror (DEBIAN_MIRROR, default http://deb.debian.org/debian).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
docker="${DOCKER:-docker}"
step() { printf '\n==> [%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
have() { [[ "${FORCE:-0}" != 1 ]] && "$docker" image inspect "$1" >/dev/null 2>&1; }

step "local/bookworm: debootstrap minbase from $mirror"
if have local/bookworm; then
    echo "    present ($("$docker" image inspect -f '{{.Id}}' local/bookworm | cut -c1-19)); FORCE=1 rebuilds"
else
    command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 1; }
    root="$(mktemp -d /tmp/lethe-bookworm.XXXXXX)"
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase bookworm "$root" "$mirror" | sed -u 's/^/    /'
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    step "local/bookworm: docker import"
    tar -C "$root" -c . | "$docker" import -c 'CMD ["/bin/bash"]' - local/bookworm
    rm -rf "$root"
    trap - EXIT
fi

for image in python:3.11 postgres:15; do
    name="${image%%:*}"
    step "local/$image: docker build deploy/images/$name"
    context="$(cd "$here/images/$name" && cat -- * | sha256sum | cut -c1-16)"
    if have "local/$image" && [[ "$("$docker" image inspect -f '{{index .Config.Labels "lethe.context"}}' "local/$image")" == "$context" ]]; then
        echo "    present and up to date; FORCE=1 rebuilds"
    else
        "$docker" build --force-rm --network host --label "lethe.context=$context" -t "local/$image" \
            "$here/images/$name" 2>&1 | sed -u 's/^/    /'
    fi
done

step "done"
"$docker" image ls "local/*"
