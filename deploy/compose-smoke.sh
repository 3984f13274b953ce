#!/usr/bin/env bash
# `make compose-smoke`: build the images, start the two-replica stack, wait for health, drive it
# from the host with the openai SDK (deploy/two_replicas.py), then `docker-compose down -v`.
# Exits non-zero on any failure and leaves no container of its project behind.
#
#   LETHE_SMOKE_MODE=local     (default) no registry: deploy/local-images.sh, deploy/build-gateway.sh
#                              and deploy/compose.local.yml (Debian PostgreSQL 15, embedded policies)
#   LETHE_SMOKE_MODE=registry  registry images: docker-compose.yml + docker-compose.override.yml (OPA)
#   PY                         a Python with this project and the openai SDK installed
#   LETHE_SMOKE_READY_S        how long a replica may take to turn healthy (default 2400: each start
#                              calibrates the kernel, minutes on a busy 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
PY="${PY:-python3}"
mode="${LETHE_SMOKE_MODE:-local}"
project="${LETHE_SMOKE_PROJECT:-lethe-smoke}"
ready_s="${LETHE_SMOKE_READY_S:-2400}"
case "$mode" in
    local) files=(-f docker-compose.yml -f deploy/compose.local.yml); export LETHE_IMAGE="${LETHE_IMAGE:-lethe-gateway:local}" ;;
    registry) files=(-f docker-compose.yml -f docker-compose.override.yml) ;;
    *) echo "LETHE_SMOKE_MODE must be local or registry, not $mode" >&2; exit 2 ;;
esac
compose=(docker-compose -p "$project" "${files[@]}")
export LETHE_PORT_1="${LETHE_PORT_1:-18186}" LETHE_PORT_2="${LETHE_PORT_2:-18187}"
export LETHE_ADMIN_KEY="lethe-admin-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
export POSTGRES_PASSWORD="$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
LETHE_SECRETS_DIR="$(mktemp -d /tmp/lethe-smoke-secrets.XXXXXX)"
export LETHE_SECRETS_DIR
step() { printf '\n==> [%s +%ss] %s\n' "$(date -u +%H:%M:%S)" "$((SECONDS - started))" "$*"; }

cleanup() {
    local rc=$?
    step "docker-compose down -v"
    if [[ $rc != 0 ]]; then
        "${compose[@]}" logs --no-color --tail 40 gateway-1 gateway-2 2>&1 | tail -80 || true
    fi
    "${compose[@]}" down -v --remove-orphans --timeout 10 >/dev/null 2>&1 || true
    rm -rf "$LETHE_SECRETS_DIR"
    left="$(docker ps -aq --filter "label=com.docker.compose.project=$project")"
    if [[ -n "$left" ]]; then
        echo "FAIL: containers left behind: $left" >&2
        rc=1
    fi
    echo "compose-smoke: $([[ $rc == 0 ]] && echo PASSED || echo FAILED) in $((SECONDS - started)) s (wall)"
    exit "$rc"
}
trap cleanup EXIT

step "images ($mode)"
build_started=$SECONDS
if [[ "$mode" == local ]]; then
    deploy/local-images.sh
    deploy/build-gateway.sh
else
    "${compose[@]}" build
fi
build_s=$((SECONDS - build_started))

step "secrets (audit key, salt) in $LETHE_SECRETS_DIR, mounted as Docker secrets"
deploy/make-secrets.sh

step "docker-compose up"
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true  # a previous run's leftovers
"${compose[@]}" up -d --no-build
up_started=$SECONDS
for service in gateway-1 gateway-2; do
    id="$("${compose[@]}" ps -q "$service")"
    port="$([[ $service == gateway-1 ]] && echo "$LETHE_PORT_1" || echo "$LETHE_PORT_2")"
    until [[ "$(docker inspect -f '{{.State.Health.Status}}' "$id")" == healthy ]]; do
        state="$(docker inspect -f '{{.State.Status}} {{.State.Health.Status}}' "$id")"
        [[ "$state" == running* ]] || { echo "$service is $state" >&2; exit 1; }
        ready="$(curl -s "http://127.0.0.1:$port/readyz" || true)"
        [[ "$ready" != *'"failed"'* ]] || { echo "$service failed to start: $ready" >&2; exit 1; }
        (( SECONDS - up_started < ready_s )) || { echo "$service not healthy after $ready_s s" >&2; exit 1; }
        sleep 2
    done
    echo "    $service healthy after $((SECONDS - up_started)) s"
done
healthy_s=$((SECONDS - up_started))

step "tenant and key (lethe CLI inside gateway-1, on the shared database)"
"${compose[@]}" exec -T gateway-1 lethe tenant create travel
tenant_key="$("${compose[@]}" exec -T gateway-1 lethe key create --tenant travel --user alice --admin | tail -1 | tr -d '\r')"

step "two-replica scenario, from the host"
scenario_started=$SECONDS
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" deploy/two_replicas.py --compose "${compose[*]}" \
    --url1 "http://127.0.0.1:$LETHE_PORT_1" --url2 "http://127.0.0.1:$LETHE_PORT_2" \
    --tenant-key "$tenant_key" --admin-key "$LETHE_ADMIN_KEY"
image="$("${compose[@]}" images -q gateway-1 | head -1)"
printf '\nimages built in %s s; both replicas healthy %s s after up; scenario %s s; gateway image %s\n' \
    "$build_s" "$healthy_s" "$((SECONDS - scenario_started))" \
    "$(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1/1e9}')"
