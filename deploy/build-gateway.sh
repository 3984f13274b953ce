#!/usr/bin/env bash
# Build the gateway image (tag $LETHE_IMAGE, default lethe-gateway:local) on a machine without a
# registry: base local/python:3.11 (deploy/local-images.sh builds it) and the host's own pip
# configuration (local indexes, wheel folders, CA bundle) mirrored to the build over loopback by
# deploy/pip_mirror.py. With registry access, plain `docker build .` is all you need.
set -euo pipefail
cd "$(dirname "$0")/.."
docker="${DOCKER:-docker}"
image="${LETHE_IMAGE:-lethe-gateway:local}"
port="${PIP_MIRROR_PORT:-18185}"
args="$(mktemp)"
python3 deploy/pip_mirror.py --port "$port" --args "$args" &
mirror=$!
trap 'kill "$mirror" 2>/dev/null; rm -f "$args"' EXIT
for _ in $(seq 50); do [[ -s "$args" ]] && break; sleep 0.1; done
[[ -s "$args" ]] || { echo "pip mirror did not start on port $port" >&2; exit 1; }
build_args=()
while IFS= read -r line; do build_args+=(--build-arg "$line"); done < "$args"
started=$SECONDS
"$docker" build --force-rm --network host -t "$image" \
    --build-arg BASE_IMAGE="${BASE_IMAGE:-local/python:3.11}" --build-arg TORCH_INDEX_URL= \
    "${build_args[@]}" .
echo "built $image in $((SECONDS - started)) s: $("$docker" image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1/1e9}')"
