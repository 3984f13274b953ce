#!/usr/bin/env bash
# Create the gateways' shared secrets once (idempotent; an existing file is kept):
#   audit-key.pem  Ed25519 private key that signs the audit log's checkpoints
#   salt.key       32 random bytes keying the HMAC of the KV-cache salts
# in $LETHE_SECRETS_DIR (default deploy/secrets, git-ignored). Compose mounts them as Docker
# secrets at /run/secrets/; the image's user (uid 10001) must own them, with mode 0400: the
# gateway refuses an audit key others can read.
set -euo pipefail
dir="${LETHE_SECRETS_DIR:-$(cd "$(dirname "$0")" && pwd)/secrets}"
owner="${LETHE_SECRETS_OWNER:-10001:10001}"
umask 077
mkdir -p "$dir"
if [[ ! -s "$dir/audit-key.pem" ]]; then
    openssl genpkey -algorithm ed25519 -out "$dir/audit-key.pem"
    echo "created $dir/audit-key.pem"
fi
if [[ ! -s "$dir/salt.key" ]]; then
    head -c 32 /dev/urandom > "$dir/salt.key"
    echo "created $dir/salt.key"
fi
chmod 0400 "$dir/audit-key.pem" "$dir/salt.key"
if [[ "$(id -u)" == 0 ]]; then
    chown "$owner" "$dir/audit-key.pem" "$dir/salt.key"
elif [[ "$(stat -c %u:%g "$dir/audit-key.pem")" != "$owner" ]]; then
    echo "warning: run as root (or chown $owner $dir/*) so that the container user can read the secrets" >&2
fi
