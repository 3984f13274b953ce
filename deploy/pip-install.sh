#!/bin/sh
# `pip install` for the image build. When PIP_CERT_URL is set (a build without direct TLS to the
# package index), fetch that CA bundle for this one command and delete it before the layer ends.
set -eu
# Build arguments left empty must not reach pip as empty settings.
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS; do
    eval "[ -n \"\${$var:-}\" ]" || unset "$var"
done
if [ -n "${PIP_CERT_URL:-}" ]; then
    cert="$(mktemp)"
    trap 'rm -f "$cert"' EXIT
    python3 -c "import sys, urllib.request; open(sys.argv[2], 'wb').write(urllib.request.urlopen(sys.argv[1]).read())" \
        "$PIP_CERT_URL" "$cert"
    export PIP_CERT="$cert"
fi
/opt/lethe/bin/pip install "$@"
